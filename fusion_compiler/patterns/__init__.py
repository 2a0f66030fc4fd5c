"""Fusion families, by name, in the pipeline's order (stages.STAGES). Each family's module holds
its variants, guard and replacement; its folds sit beside it."""

from ..stages import FAMILY, of_kind, stage_module

FAMILIES = {stage.name: stage_module(stage).FAMILY for stage in of_kind(FAMILY)}
assert all(name == family.name for name, family in FAMILIES.items()), "a family module's FAMILY is the row's name"
