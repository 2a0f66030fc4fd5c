"""Fusion families, by name. Each module holds one family's variants, guard and replacement."""

from .add_rms_norm import FAMILY as ADD_RMS_NORM
from .gated_rms_norm import FAMILY as GATED_RMS_NORM
from .gdn import FAMILY as GDN
from .gqa_prologue import FAMILY as GQA_PROLOGUE
from .mla_prologue import FAMILY as MLA_PROLOGUE
from .moe_routing import FAMILY as MOE_ROUTING

FAMILIES = {family.name: family for family in (GQA_PROLOGUE, MLA_PROLOGUE, MOE_ROUTING, GDN, GATED_RMS_NORM, ADD_RMS_NORM)}
