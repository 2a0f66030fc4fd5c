"""Fusion families, by name. Each module holds one family's variants, guard and replacement."""

from .add_rms_norm import FAMILY as ADD_RMS_NORM
from .mla_prologue import FAMILY as MLA_PROLOGUE

FAMILIES = {family.name: family for family in (MLA_PROLOGUE, ADD_RMS_NORM)}
