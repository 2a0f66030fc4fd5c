"""Scatter rows at slots where -1 marks a padding row, as one functional ``index_put``.

A padding row cannot be left out of the scatter without a data-dependent shape (a host sync),
so it must write somewhere. It writes the first live row's slot with that row's own value, so
the scatter holds only identical duplicates and its result does not depend on which of them
lands last; with no live row, every row writes slot 0 with the value it already holds. Writing
a padding row's clamped slot (0) back with its old value instead races with a live row that
writes slot 0 in the same step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def padded_scatter_rows(
    slots: torch.Tensor, rows: torch.Tensor, read: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, rows) to scatter: ``targets`` >= 0 per row, ``rows`` with every padding row
    replaced. ``read(targets)`` returns the destination's current rows at ``targets`` (one
    element here). ``rows`` must already be in the destination's dtype."""
    live = slots >= 0
    first = live.int().argmax().view(1)  # the first live row; 0 when none is (a tensor: no host read)
    targets = torch.where(live, slots, slots.index_select(0, first)).clamp(min=0)
    column = (-1, *([1] * (rows.dim() - 1)))
    first_target = targets.index_select(0, first)
    fill = torch.where(live.index_select(0, first).view(column), rows.index_select(0, first), read(first_target))
    return targets, torch.where(live.view(column), rows, fill)
