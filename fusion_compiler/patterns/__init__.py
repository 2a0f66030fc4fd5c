"""Fusion families, by name. Each module holds one family's variants, guard and replacement."""

from .add_rms_norm import FAMILY as ADD_RMS_NORM

FAMILIES = {family.name: family for family in (ADD_RMS_NORM,)}
