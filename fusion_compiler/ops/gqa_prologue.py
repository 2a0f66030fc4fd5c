"""GQA attention prologue: q/k RMSNorm + partial NeoX RoPE + paged K/V cache write, one op
(issue 5: MiniMax-M2.5's full-width QK-norm; Qwen3.5's per-head Gemma QK-norm).

    fusion_compiler::gqa_prologue(Tensor q, Tensor k, Tensor v, Tensor q_norm_weight,
        Tensor k_norm_weight, float eps, float weight_offset, bool full_width_norm,
        Tensor cos_sin_cache, Tensor positions, int rotary_dim, Tensor(a!) k_cache,
        Tensor(b!) v_cache, Tensor slots, float k_scale, float v_scale) -> Tensor q_out

Semantics (``gqa_prologue_reference`` is the numerical truth); T tokens, D = head_dim =
``k_cache.shape[-1]``, kv_heads = ``k_cache.shape[-2]``, heads = q.shape[-1] / D:

    q, k, v      [T, heads * D], [T, kv_heads * D], [T, kv_heads * D] (any row stride: the
                 column slices of one fused qkv GEMM output)
    norm(x, w)   RMSNorm in fp32, ``x * rstd * (w + weight_offset)``, rounded once to x.dtype;
                 over the whole row when ``full_width_norm`` (MiniMax: q over 6144, k over 1024,
                 weights [heads * D] and [kv_heads * D]), else per head (Qwen3.5: weights [D],
                 Gemma ``weight_offset`` 1.0)
    rope(x)      NeoX (rotate-half) on each head's first ``rotary_dim`` dims with
                 ``cos | sin = cos_sin_cache[positions]`` ([max_position, rotary_dim] fp32), fp32
                 math, rounded once; dims past rotary_dim pass through
    q_out        rope(norm(q, q_norm_weight))                      [T, heads, D], q.dtype
    k_cache      at flat slot ``slots[t]`` of [num_blocks * block_size, kv_heads, D]:
                 rope(norm(k, k_norm_weight))[t]; v_cache the same with v[t] (no norm, no RoPE).
                 FP8 caches store ``value / scale`` (correctly rounded), clamped to +-448 and
                 rounded to e4m3 (per-tensor k_scale / v_scale); slot -1 writes nothing.

One rounding per norm (the add_rms_norm family's contract): HF's ``weight * x.to(dtype)``
rounds twice, so outputs agree with eager to bf16 tolerance, not bit for bit.

On CUDA the op runs ``kernels/gqa_prologue.py`` (checked under the Triton interpreter; not yet
run on the GPU). No pattern emits it yet.
"""

from __future__ import annotations

import torch

from ._checks import require_dtype, require_shape, require_size_eq, require_slots_in_range
from .rms_norm import rms_norm_reference
from .rope import rope_neox_reference

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FP8_MAX = 448.0
_CACHE_DTYPES = _FLOATS + (torch.float8_e4m3fn,)

_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor q_norm_weight, Tensor k_norm_weight, float eps, float weight_offset, "
    "bool full_width_norm, Tensor cos_sin_cache, Tensor positions, int rotary_dim, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slots, float k_scale, float v_scale) -> Tensor"
)


def _heads(q, k_cache) -> tuple[int, int, int]:
    head_dim, kv_heads = k_cache.shape[-1], k_cache.shape[-2]
    if q.shape[-1] % head_dim:
        raise ValueError(f"q width {q.shape[-1]} is not a multiple of head_dim {head_dim}")
    return q.shape[-1] // head_dim, kv_heads, head_dim


def _validate(q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm, cos_sin_cache, positions,
              rotary_dim, k_cache, v_cache, slots, k_scale, v_scale) -> tuple[int, int, int]:  # fmt: skip
    for name, t in (("q", q), ("k", k), ("v", v), ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        require_dtype(t, _FLOATS, name)
    require_dtype(k_cache, _CACHE_DTYPES, "k_cache")
    require_dtype(v_cache, _CACHE_DTYPES, "v_cache")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must be [blocks, block_size, kv_heads, D] alike, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    heads, kv_heads, head_dim = _heads(q, k_cache)
    tokens = q.shape[0]
    require_shape(k, (tokens, kv_heads * head_dim), "k")
    require_shape(v, (tokens, kv_heads * head_dim), "v")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads evenly")
    if full_width_norm:
        require_shape(q_norm_weight, (heads * head_dim,), "q_norm_weight")
        require_shape(k_norm_weight, (kv_heads * head_dim,), "k_norm_weight")
    else:
        require_shape(q_norm_weight, (head_dim,), "q_norm_weight")
        require_shape(k_norm_weight, (head_dim,), "k_norm_weight")
    if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
    require_size_eq(cos_sin_cache.shape[-1], rotary_dim, "cos_sin_cache width must be rotary_dim (cos | sin)")
    require_shape(positions, (tokens,), "positions")
    require_shape(slots, (tokens,), "slots")
    if not (eps > 0 and k_scale > 0 and v_scale > 0):
        raise ValueError(f"eps, k_scale and v_scale must be > 0, got {eps}, {k_scale}, {v_scale}")
    return heads, kv_heads, head_dim


def _norm(x, weight, eps, weight_offset, full_width, heads, head_dim):
    if full_width:
        return rms_norm_reference(x, weight, eps, weight_offset).view(x.shape[0], heads, head_dim)
    return rms_norm_reference(x.reshape(x.shape[0], heads, head_dim), weight, eps, weight_offset)


def _rope(x, cos, sin, rotary_dim):
    return torch.cat([rope_neox_reference(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


def _write(cache, slots, rows, scale):
    flat = cache.view(-1, *cache.shape[2:])
    keep = slots >= 0
    values = rows[keep]
    if cache.dtype == torch.float8_e4m3fn:
        values = (values.double() / scale).float().clamp(-FP8_MAX, FP8_MAX)  # division rounded once
    flat[slots[keep]] = values.to(cache.dtype)


def gqa_prologue_reference(q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm, cos_sin_cache,
                           positions, rotary_dim, k_cache, v_cache, slots, k_scale, v_scale):  # fmt: skip
    """Plain torch, any device; writes the caches in place and returns q_out."""
    heads, kv_heads, head_dim = _validate(
        q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm, cos_sin_cache, positions,
        rotary_dim, k_cache, v_cache, slots, k_scale, v_scale,
    )  # fmt: skip
    require_slots_in_range(slots, k_cache.shape[0] * k_cache.shape[1])
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    q_out = _rope(_norm(q, q_norm_weight, eps, weight_offset, full_width_norm, heads, head_dim), cos, sin, rotary_dim)
    k_out = _rope(_norm(k, k_norm_weight, eps, weight_offset, full_width_norm, kv_heads, head_dim), cos, sin, rotary_dim)
    _write(k_cache, slots, k_out, k_scale)
    _write(v_cache, slots, v.reshape(v.shape[0], kv_heads, head_dim), v_scale)
    return q_out.contiguous()


@torch.library.custom_op("fusion_compiler::gqa_prologue", mutates_args=("k_cache", "v_cache"), schema=_SCHEMA)
def _op(*args):
    return gqa_prologue_reference(*args)


@_op.register_fake
def _fake(*args):
    heads, _, head_dim = _validate(*args)
    q = args[0]
    return q.new_empty((q.shape[0], heads, head_dim))


@_op.register_kernel("cuda")
def _cuda(*args):
    from fusion_compiler.kernels.gqa_prologue import gqa_prologue_fwd

    heads, _, head_dim = _validate(*args)
    q = args[0]
    q_out = torch.empty((q.shape[0], heads, head_dim), dtype=q.dtype, device=q.device)
    gqa_prologue_fwd(*args, q_out)
    return q_out
