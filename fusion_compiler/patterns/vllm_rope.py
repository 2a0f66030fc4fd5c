"""vLLM's native RoPE as vLLM 0.33 hands it to the post-grad pass -> ``mla_q_prologue``'s
index_q role (NeoX RoPE on the first ``rot`` dims of [T, H, D], the rest passed through).

``get_rope(head_size, ..., is_neox_style=True)`` builds a `RotaryEmbedding`; with
``custom_ops=["none"]`` it runs ``forward_static`` (vllm/model_executor/layers/rotary_embedding/
base.py, ApplyRotaryEmb.forward_static in common.py), seen post-grad on vllm 0.33.0, torch
2.14.0, CPU, per q and per k:

    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, -1)   # aten.index + split
    x = x.view(T, -1, head_size)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, -1)                       # NeoX halves
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)   # .to(x.dtype): none left, see below
    cat((cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1), x_pass), -1).reshape(T, H * D)

The math is in the activation dtype: `_match_cos_sin_cache_dtype` casts the table to the
query's dtype before the gather, so ``.to(x.dtype)`` traces to nothing and no fp32 upcast
appears (unlike the fp32 ``forward_native`` spellings the core families match). The fused op
computes in fp32 and rounds once; Inductor's code for vLLM's graph also computes bf16
pointwise math in fp32, so the two agree to a bf16 rounding.

The K/V cache write is not in this graph: vLLM's `Attention` writes the cache in
``vllm.unified_kv_cache_update(key, value, layer_name)``, which finds the cache and slot mapping
through its forward context (no graph values) and is a splitting op, so gqa_prologue's
norm + RoPE + cache-write site cannot form. This family fuses the RoPE; add_rms_norm's vLLM
variants (vllm_ir.py) fuse the q/k norms before it.

Nothing here imports vLLM; integrations/vllm.py runs this family before the core mla_prologue
family (both anchor on a RoPE rotation, `mla_prologue.is_site`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any

import torch

from ..ops import mla_kv_prologue as kv_ops
from ..ops import mla_q_prologue as q_ops
from . import mla_prologue, prologue_calls
from .prologue_calls import q_prologue
from .registry import Reason, Variant

aten = torch.ops.aten
_NO_END = 2**63 - 1  # a slice to the end


def rope_neox_partial(x, cos, sin):
    """``RotaryEmbedding.forward_static`` for one of q / k, from its head split on: x [T, H, D],
    cos / sin [T, rot/2] in x's dtype."""
    rotary_dim = 2 * cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = torch.chunk(x_rot, 2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated, x_pass), dim=-1)


VARIANTS = (Variant("vllm.rope_neox_partial", rope_neox_partial, {"rope": "halves"}),)

DTYPE_COMBOS = ((torch.bfloat16,),)
_T, _H, _D, _ROT = 2, 2, 32, 16


def example_inputs(variant: Variant, combo) -> list:
    (act,) = combo
    return [torch.randn(_T, _H, _D, dtype=act), torch.randn(_T, _ROT // 2, dtype=act), torch.randn(_T, _ROT // 2, dtype=act)]


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The slice points and chunk widths the tracer's wildcards hid (mla_prologue reads the rest)."""
    facts = mla_prologue.facts_of(nodes, inputs)
    facts["slices"] = set()
    for node in nodes:
        if node.op == "call_function" and node.target is aten.slice.Tensor:
            start, end = (list(node.args[2:4]) + [0, _NO_END])[:2]
            facts["slices"].add((start, min(end, _NO_END)))
    return facts


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    x, cos, sin = values["x"], values["cos"], values["sin"]
    reason = mla_prologue._rope_layout_reason({**values, "slice_steps": values["slice_steps"] - {1}}, "halves")
    if reason:
        return reason
    if cos.dim() != 2 or cos.shape != sin.shape:
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} are not two [tokens, rot/2] halves"
    if x.dim() != 3:
        return f"the rotated tensor {tuple(x.shape)} is not [tokens, heads, head_size]"
    rot, head_size = 2 * cos.shape[-1], x.shape[-1]
    if values["slices"] != {(0, rot), (rot, _NO_END)}:
        return (f"RoPE slices {sorted(values['slices'])} are not the first {rot} dims (cos/sin width) "
                f"of {head_size} and the rest passed through")  # fmt: skip
    if rot >= head_size:
        return f"RoPE covers all {head_size} dims: this variant fuses partial rotary"
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return f"cos/sin are {cos.dtype}, x is {x.dtype}: vLLM matches the table to the query's dtype"
    if x.dtype not in kv_ops.ACT_DTYPES:
        return f"x dtype {x.dtype} is not bf16/fp16/fp32"
    return None


def replacement(variant: Variant, lowering: str):
    if lowering not in ("triton", "inductor"):
        raise ValueError(f"no replacement for lowering {lowering!r}")

    def replace(x, cos, sin):
        return q_prologue(lowering, index_q=x, cos=cos, sin=sin)[1]

    return replace


def _rotated_pieces(anchor: torch.fx.Node) -> list[torch.fx.Node]:
    """The slice / split pieces of x the rotation's products read (casts stripped)."""
    pieces = []
    for mul in anchor.args:
        for operand in getattr(mul, "args", ()):
            operand = mla_prologue._strip(operand)
            if mla_prologue._sliced_from(operand) is not None:
                pieces.append(operand)
    return pieces


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """vLLM's two other RoPE spellings, named (Inductor's FailedMatch text would only say where
    the structure differs): GPT-J pairs, and a rotation over the whole head."""
    found = mla_prologue.explain(anchor)
    if found:
        return found
    for piece in _rotated_pieces(anchor):
        if piece.target is aten.slice.Tensor and len(piece.args) > 4 and piece.args[4] == 2:
            return piece, (
                "RoPE layout is GPT-J pairs (x[..., ::2], x[..., 1::2]: is_neox_style=False), "
                "the vLLM pattern is NeoX halves"
            )
        if piece.target is operator.getitem:  # a NeoX half: chunk(x_rot, 2)
            x_rot = mla_prologue._sliced_from(piece)
            if x_rot.target is not aten.slice.Tensor:
                width = mla_prologue._val(x_rot).shape[-1]
                return x_rot, (
                    f"RoPE covers all {width} dims of the head (full rotary: no x[..., rotary_dim:] "
                    "pass-through), the vLLM pattern is partial rotary"
                )
    return None


# The core family's name and sites (every RoPE rotation), vLLM's spelling, guard and reasons.
FAMILY = dataclasses.replace(
    mla_prologue.FAMILY,
    variants=VARIANTS, dtype_combos=DTYPE_COMBOS, example_inputs=example_inputs, scalars={}, guard=guard,
    replacement=replacement, facts_of=facts_of, explain=explain,
    source_modules=(__name__, prologue_calls.__name__, q_ops.__name__),
)  # fmt: skip

__all__ = ["FAMILY", "VARIANTS", "rope_neox_partial"]
