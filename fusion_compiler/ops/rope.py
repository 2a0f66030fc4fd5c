"""Rotary embedding layouts the fused ops implement, in plain torch (the numerical truth).

Both rotate pairs by per-pair angles; ``cos``/``sin`` are ``[tokens, rot / 2]`` (one value per
pair), or tables ``[max_position, rot / 2]`` read at ``positions``:

* interleaved (GPT-J, DeepSeek MLA): pairs are (x0, x1), (x2, x3), ...  The output keeps the
  pairs in place (vLLM, DeepSeek's reference), or with ``deinterleave_output`` puts every pair's
  first value in the first half and second value in the second half, as HF's
  ``apply_rotary_pos_emb_interleave`` does (dot products between q and k are the same).
* neox (rotate-half, the DSA indexer): pairs are (x_i, x_{i + rot/2}).

The math is fp32 on the upcast inputs, rounded once to the input dtype.
"""

from __future__ import annotations

import torch

from ._checks import require_size_eq


def cos_sin_for_tokens(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None):
    """Per-token fp32 cos/sin [T, rot/2]: the tables read at ``positions``, or as given."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    return cos.float(), sin.float()


def _rotate(first: torch.Tensor, second: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return first * cos - second * sin, second * cos + first * sin


def rope_interleaved_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, deinterleave_output: bool = False
) -> torch.Tensor:
    """x [T, ..., rot]; cos/sin [T, rot/2] (fp32, broadcast over the middle dims)."""
    require_size_eq(x.shape[-1], 2 * cos.shape[-1], "rotary dims must be twice the cos/sin width")
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    h = x.float()
    out_even, out_odd = _rotate(h[..., 0::2], h[..., 1::2], cos, sin)
    if deinterleave_output:
        out = torch.cat([out_even, out_odd], dim=-1)
    else:
        out = torch.stack([out_even, out_odd], dim=-1).flatten(-2)
    return out.to(x.dtype)


def rope_neox_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., rot]; cos/sin [T, rot/2]."""
    require_size_eq(x.shape[-1], 2 * cos.shape[-1], "rotary dims must be twice the cos/sin width")
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    h = x.float()
    half = x.shape[-1] // 2
    first, second = _rotate(h[..., :half], h[..., half:], cos, sin)
    return torch.cat([first, second], dim=-1).to(x.dtype)


def _broadcast(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return table.reshape(table.shape[0], *([1] * (x.dim() - 2)), table.shape[-1])
