"""ops/padding_slots.py: a functional scatter whose padding rows (-1) leave every slot as a loop
over the live rows alone would."""

import pytest
import torch

from fusion_compiler.ops.padding_slots import padded_scatter_rows


def _loop(dest: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = dest.clone()
    for slot, row in zip(slots.tolist(), rows):
        if slot >= 0:
            out[slot] = row
    return out


@pytest.mark.parametrize(
    "slots", [[0, -1, 3], [-1, 0, 3], [5, 2, -1, -1], [-1, -1, -1], [-1, 4, 0, -1], [1, 2, 3]]
)
def test_scatter_equals_a_loop_over_live_rows(slots):
    gen = torch.Generator().manual_seed(len(slots))
    dest = torch.randn(6, 2, 3, generator=gen).to(torch.bfloat16)
    rows = torch.randn(len(slots), 2, 3, generator=gen).to(torch.bfloat16)
    slots = torch.tensor(slots)
    targets, written = padded_scatter_rows(slots, rows, lambda t: dest[t])
    assert bool((targets >= 0).all())
    out = torch.ops.aten.index_put.default(dest, [targets], written)
    assert torch.equal(out.view(torch.int16), _loop(dest, slots, rows).view(torch.int16))


def test_padding_rows_only_duplicate_a_live_rows_write():
    """Every padding row's (target, row) equals some live row's, so no duplicate conflicts."""
    slots = torch.tensor([-1, 0, -1, 2])
    rows = torch.arange(4.0)[:, None].expand(4, 3).contiguous()
    targets, written = padded_scatter_rows(slots, rows, lambda t: torch.full((1, 3), -7.0))
    assert targets.tolist() == [0, 0, 0, 2]
    assert written[:, 0].tolist() == [1.0, 1.0, 1.0, 3.0]
