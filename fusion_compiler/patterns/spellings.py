"""Model-code spellings several families share: plain torch, written as real code writes them."""

from __future__ import annotations

import torch

aten = torch.ops.aten
FP8 = torch.float8_e4m3fn


def act_quant(x, group, ue8m0):
    """DeepSeek inference ``act_quant`` (the contract: ops/fp8_quant.py)."""
    groups = x.float().unflatten(-1, (-1, group))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (groups / scale).clamp(-448.0, 448.0).to(FP8)
    return y.flatten(-2), scale.squeeze(-1)


def write_rows(cache, slots, rows):
    """``cache.view(-1, *cache.shape[2:]).index_put_((slots,), rows)`` as it reaches a post-grad
    graph: a paged cache [blocks, block_size, *row] written at flat slots."""
    flat = cache.reshape(-1, *cache.shape[2:])
    return aten.index_put.default(flat, [slots], rows).reshape(cache.shape)


def as_bytes(t):
    """``t.view(torch.uint8)`` as the DeepSeek reference spells it (model_adapters/
    reference/deepseek_v32.py ``as_bytes``, which says why): a view for one-byte dtypes, shifts of
    a same-width integer view for wider ones."""
    if t.element_size() == 1:
        return t.view(torch.uint8)
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    parts = [(bits >> (8 * i)) & 0xFF for i in range(t.element_size())]
    return torch.stack(parts, dim=-1).to(torch.uint8).flatten(-2)
