"""Everything of DeepSeek V3.2 attention between the q-side GEMMs and attention/indexer scoring.

    fusion_compiler::mla_q_prologue(
        Tensor? q_pe, Tensor? q_other, bool deinterleave_rope,
        Tensor? index_q, Tensor? index_weights, float index_weights_scale,
        bool index_q_fp8, bool ue8m0,
        Tensor? cos, Tensor? sin, Tensor? positions)
      -> (Tensor q_out, Tensor index_q_out, Tensor index_weights_out)

Two independent roles, each present when its input is given:

* q role (``q_pe`` [T, H, rot], the rope part of q_b's output): interleaved (GPT-J) RoPE, then
  ``q_out = cat([q_other, roped q_pe], -1)`` [T, H, D_other + rot].  ``q_other`` is HF's
  q_nope, or a serving engine's absorbed ``q_nope @ W_UK`` [T, H, kv_rank]; without it q_out is
  the roped q_pe alone.  ``deinterleave_rope``: HF's output layout (``rope.py``).
* index_q role (``index_q`` [T, Hi, D], from the indexer's wq_b): NeoX RoPE of the first rot
  dims.  With ``index_q_fp8``: FP8 quant with one scale per head (group D, ``fp8_quant.py``),
  ``index_q_out`` fp8 and ``index_weights_out = index_weights.float() * index_weights_scale *
  q_scale`` [T, Hi] fp32 (the q scale folded into the head weights, as DeepGEMM's logits
  kernel and DeepSeek's ``fp8_index`` take it).  Without: ``index_q_out`` in index_q's dtype and,
  if ``index_weights`` is given, ``index_weights_out = index_weights.float() * index_weights_scale``.

``cos``/``sin``: [T, rot/2], or tables read at ``positions``.  Absent outputs are empty [0].
"""

from __future__ import annotations

import torch

from . import rope
from ._checks import require_dtype, require_last_dim_contiguous, require_same_device, require_shape, require_size_eq
from .fp8_quant import FP8_DTYPE, fp8_group_quant_reference
from .mla_kv_prologue import ACT_DTYPES, _check_rope

_SCHEMA = (
    "(Tensor? q_pe, Tensor? q_other, bool deinterleave_rope, "
    "Tensor? index_q, Tensor? index_weights, float index_weights_scale, bool index_q_fp8, bool ue8m0, "
    "Tensor? cos, Tensor? sin, Tensor? positions) "
    "-> (Tensor q_out, Tensor index_q_out, Tensor index_weights_out)"
)
_ARG_NAMES = (
    "q_pe", "q_other", "deinterleave_rope", "index_q", "index_weights", "index_weights_scale",
    "index_q_fp8", "ue8m0", "cos", "sin", "positions",
)  # fmt: skip


def _validate(args: dict) -> None:
    q_pe, q_other, index_q, weights = args["q_pe"], args["q_other"], args["index_q"], args["index_weights"]
    like = q_pe if q_pe is not None else index_q
    if like is None:
        raise ValueError("mla_q_prologue: no role given (q_pe and index_q are both None)")
    tokens = like.shape[0]
    require_same_device({k: v for k, v in args.items() if isinstance(v, torch.Tensor)}, like)
    _check_rope(args["cos"], args["sin"], args["positions"], tokens)
    rot = 2 * args["cos"].shape[-1]
    if q_pe is not None:
        require_dtype(q_pe, ACT_DTYPES, "q_pe")
        require_shape(q_pe, (tokens, None, rot), "q_pe")
        require_last_dim_contiguous(q_pe, "q_pe")
        if q_other is not None:
            require_dtype(q_other, (q_pe.dtype,), "q_other")
            require_shape(q_other, (tokens, q_pe.shape[1], None), "q_other")
            require_last_dim_contiguous(q_other, "q_other")
    elif q_other is not None:
        raise ValueError("q_other given without q_pe")
    if index_q is not None:
        require_dtype(index_q, ACT_DTYPES, "index_q")
        if index_q.dim() != 3:
            raise ValueError(f"index_q must be [tokens, heads, dim], got shape {tuple(index_q.shape)}")
        require_size_eq(index_q.shape[0], tokens, "index_q tokens")
        require_last_dim_contiguous(index_q, "index_q")
        if isinstance(index_q.shape[-1], int) and rot > index_q.shape[-1]:
            raise ValueError(f"rotary dims {rot} exceed index_q's head dim {index_q.shape[-1]}")
        if weights is not None:
            require_dtype(weights, ACT_DTYPES, "index_weights")
            require_shape(weights, (tokens, index_q.shape[1]), "index_weights")
        elif args["index_q_fp8"]:
            raise ValueError("index_q_fp8 folds the q scales into index_weights: give index_weights")
    elif weights is not None:
        raise ValueError("index_weights given without index_q")


def mla_q_prologue_reference(
    q_pe=None, q_other=None, deinterleave_rope=False,
    index_q=None, index_weights=None, index_weights_scale=1.0, index_q_fp8=False, ue8m0=False,
    cos=None, sin=None, positions=None,
):  # fmt: skip
    _validate(dict(locals()))
    like = q_pe if q_pe is not None else index_q
    # Distinct empties: a custom op's outputs may not alias each other.
    q_out, index_q_out, weights_out = (like.new_empty(0) for _ in range(3))
    cos_t, sin_t = rope.cos_sin_for_tokens(cos, sin, positions)
    rot = 2 * cos_t.shape[-1]
    if q_pe is not None:
        q_out = rope.rope_interleaved_reference(q_pe, cos_t, sin_t, deinterleave_rope)
        if q_other is not None:
            q_out = torch.cat([q_other, q_out], dim=-1)
    if index_q is not None:
        q = torch.cat([rope.rope_neox_reference(index_q[..., :rot], cos_t, sin_t), index_q[..., rot:]], dim=-1)
        if index_q_fp8:
            index_q_out, scale = fp8_group_quant_reference(q, q.shape[-1], ue8m0)
            weights_out = index_weights.float() * index_weights_scale * scale.squeeze(-1)
        else:
            index_q_out = q
            if index_weights is not None:
                weights_out = index_weights.float() * index_weights_scale
    return q_out, index_q_out, weights_out


# Every argument's default (the reference's): what a call that names only its roles passes.
DEFAULTS = dict(zip(_ARG_NAMES, mla_q_prologue_reference.__defaults__))


def output_shapes(args: dict):
    q_pe, q_other, index_q = args["q_pe"], args["q_other"], args["index_q"]
    like = q_pe if q_pe is not None else index_q
    none = ((0,), like.dtype)
    q_out = index_q_out = weights_out = none
    if q_pe is not None:
        width = q_pe.shape[-1] + (q_other.shape[-1] if q_other is not None else 0)
        q_out = ((q_pe.shape[0], q_pe.shape[1], width), q_pe.dtype)
    if index_q is not None:
        index_q_out = (tuple(index_q.shape), FP8_DTYPE if args["index_q_fp8"] else index_q.dtype)
        if args["index_weights"] is not None:
            weights_out = ((index_q.shape[0], index_q.shape[1]), torch.float32)
    return q_out, index_q_out, weights_out


@torch.library.custom_op("fusion_compiler::mla_q_prologue", mutates_args=(), schema=_SCHEMA)
def _op(*args):
    return mla_q_prologue_reference(*args)


@_op.register_fake
def _fake(*args):
    named = dict(zip(_ARG_NAMES, args))
    _validate(named)
    like = named["q_pe"] if named["q_pe"] is not None else named["index_q"]
    return tuple(like.new_empty(shape, dtype=dtype) for shape, dtype in output_shapes(named))


@_op.register_kernel("cuda")
def _cuda(*args):
    from fusion_compiler.kernels.mla_q_prologue import mla_q_prologue_fwd

    named = dict(zip(_ARG_NAMES, args))
    _validate(named)
    like = named["q_pe"] if named["q_pe"] is not None else named["index_q"]
    outs = tuple(torch.empty(shape, dtype=dtype, device=like.device) for shape, dtype in output_shapes(named))
    mla_q_prologue_fwd(named, *outs)
    return outs


def mla_q_prologue(**kwargs):
    """Keyword front end of ``torch.ops.fusion_compiler.mla_q_prologue`` with the reference's defaults."""
    unknown = set(kwargs) - set(_ARG_NAMES)
    if unknown:
        raise TypeError(f"unknown arguments {sorted(unknown)}")
    args = {**DEFAULTS, **kwargs}
    return torch.ops.fusion_compiler.mla_q_prologue(*(args[n] for n in _ARG_NAMES))
