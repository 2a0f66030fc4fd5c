"""Reference-only kernel: only the reference layers (model_adapters/reference/paged_kv.py) use it.

GQA decode attention straight from a paged KV cache: the split-KV flash-decoding kernel of
``decode_attention.py`` with its K/V rows gathered through each token's slot list, no dense copy
(``fusion_compiler_ref::paged_decode_attention`` on CUDA; not a compiler op, no family's kernel:
not in ``_KERNEL_MODULES``). Semantics: ``fusion_compiler.model_adapters.reference.paged_kv``
(``paged_decode_attention_reference``).

    q [T, H, D]; k_cache [blocks, block_size, Hkv, D], v_cache [..., Hkv, Dv] (bf16 / fp16 /
    fp32 like q, or FP8 e4m3 with per-tensor scales); context_slots [T, C] flat slot ids
    (block * block_size + offset), context_valid [T, C] bool
    out[t, h] = softmax(q[t, h] . K[t, h // G]^T * D^-0.5, -inf where not valid) @ V[t, h // G]
    with K[t, kvh][c] = k_cache.view(-1, Hkv, D)[context_slots[t, c], kvh] * k_scale (V alike)

Design: ``decode_attention``'s, with a row of the grid being a token t instead of a batch entry.
One program per (token, kv head, split) holds the G query heads of its kv head as a
[G_PAD, D_PAD] tile and walks its share of the C context positions in tiles of BLOCK_S: it
loads the tile's slots and valid flags, then gathers the valid positions' K rows (their D
elements are contiguous: one row per slot, read once for all G heads) and V rows; invalid
positions (context_valid False, or past C) load nothing and score -inf. The online softmax
(``softmax_step``), the program's prologue and epilogue, the split rule (``num_splits``: the
row count is T, aiming at TARGET_PROGRAMS, 2 a SM), the fp32 workspace and ``_combine_kernel``
are the dense kernel's. A slot below 0 at a valid position reads slot 0, as the op's ``clamp(min=0)`` does; a slot past the
cache is out of bounds (the op's gather would fail there too; no check, no host sync).

FP8 caches: the e4m3 bytes are converted to q's dtype (every e4m3 value is exact in bf16 / fp16
/ fp32) and fed to the same MMAs; k_scale is folded into the score scale (``D^-0.5 * k_scale``)
and v_scale multiplies the fp32 accumulator before it is written (the combine is linear in
acc), so the result is the fp32-dequantised reference's up to the accumulation order and the
rounding of p to the V operand's dtype, as in the dense kernel. Output fp32 [T, H, Dv] (any
strides; the op returns fp32).

Under the interpreter (``TRITON_INTERPRET=1``, CPU tests) the loop count is a constexpr as in
the dense kernel, and the FP8 code 0x7F (NaN), which triton 3.6's interpreter decodes as 480,
is mapped to NaN explicitly; every other code it decodes exactly.

This module imports only torch and triton; set ``TRITON_INTERPRET=1`` before importing it to
run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import INTERPRETER, downcast, launch_on_device, mma, mma_pad
from .decode_attention import (
    _NUM_WARPS,
    block_s_for,
    combine,
    p_operand,
    program_end,
    program_start,
    softmax_step,
    split_plan,
    split_workspace,
)

KERNEL_VERSION = "paged_decode_attention-2"

FP8 = torch.float8_e4m3fn
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Head sizes the tiles were sized for (D_PAD up to 256: Qwen3.5's full attention); a larger
# [G_PAD, D_PAD] tile would spill registers.
MAX_HEAD_DIM = 256
# Programs to aim for: 2 per SM of an H200. A paged tile waits on its slots before its K rows
# (two dependent loads, where the dense kernel has one), so more programs keep more in flight:
# H200 (bench/diagnostics/paged_attention_check.py --split-factors), MiniMax 48 / 8 heads at 1
# token 17.9 -> 16.4 us (17 -> 33 splits), at 8 tokens 68.9 -> 48.6 us (3 -> 6); Qwen3.5 32 / 2
# unchanged (its splits are capped by the tiles at 1 token; 39.6 -> 40.6 us at 8).
TARGET_PROGRAMS = 2 * 132


@triton.jit
def _cache_operand(x, DTYPE: tl.constexpr):
    """A loaded K / V tile as an MMA operand of DTYPE: FP8 codes converted (exactly), other
    dtypes as they are (then DTYPE already)."""
    if x.dtype == tl.float8e4nv:
        if INTERPRETER:
            nan = (x.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F  # decoded as +-480 there
            return downcast(tl.where(nan, float("nan"), x.to(tl.float32)), DTYPE)
        else:
            return x.to(DTYPE)
    else:
        return x


@triton.jit
def _paged_tile(q, k_base, v_base, slots_base, valid_base, tile, C, scale, m_i, l_i, acc,
                stride_ks, stride_kd, stride_vs, stride_vd, stride_cs, stride_cv,
                D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                BLOCK_S: tl.constexpr):  # fmt: skip
    """One BLOCK_S tile of context positions through their slots; returns the new (m, l, acc)."""
    c = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    in_c = c < C
    # Slots and flags are loaded independently (not the slots under the flags: one dependent
    # load less before the K/V gathers); a masked position's slot is never dereferenced.
    keep = tl.load(valid_base + c * stride_cv, mask=in_c, other=0) != 0
    slot = tl.maximum(tl.load(slots_base + c * stride_cs, mask=in_c, other=0), 0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    kt = tl.load(k_base + d[:, None] * stride_kd + slot[None, :] * stride_ks,
                 mask=(d < D)[:, None] & keep[None, :], other=0.0)  # fmt: skip
    x = mma(q, _cache_operand(kt, q.dtype)) * scale  # [G_PAD, BLOCK_S] fp32
    m_new, alpha, p, l_i = softmax_step(x, keep, m_i, l_i)
    vt = tl.load(v_base + slot[:, None] * stride_vs + dv[None, :] * stride_vd,
                 mask=keep[:, None] & (dv < DV)[None, :], other=0.0)  # fmt: skip
    vt = _cache_operand(vt, q.dtype)
    acc = acc * alpha[:, None] + mma(p_operand(p, vt.dtype), vt)
    return m_new, l_i, acc


@triton.jit
def _paged_split_kernel(
    Q, K, V, SLOTS, VALID, OUT, WS_ACC, WS_ML,
    C, tiles_per_split, scale, v_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,  # the cache viewed as [slots, Hkv, D]
    stride_vs, stride_vh, stride_vd,
    stride_st, stride_sc, stride_vt, stride_vc,  # context_slots, context_valid
    stride_ot, stride_oh, stride_od,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr,  # write (m, l, acc) to the workspace, else out directly
    INTERP_TILES: tl.constexpr,  # tiles_per_split, under the interpreter only
):  # fmt: skip
    t, kvh, heads, q, m_i, l_i, acc = program_start(Q, stride_qt, stride_qh, stride_qd,
                                                    H_KV, G, D, G_PAD, D_PAD, DV_PAD)  # fmt: skip
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    slots_base = SLOTS + t * stride_st
    valid_base = VALID + t * stride_vt
    first = tl.program_id(1) * tiles_per_split
    # The interpreter needs a constexpr loop bound (inline: an assignment would make it a
    # tensor there); the GPU takes it at run time (no recompile as the context grows). Only the
    # last split can run past C (masked: no bytes move).
    for i in range(0, INTERP_TILES if INTERPRETER else tiles_per_split):
        m_i, l_i, acc = _paged_tile(q, k_base, v_base, slots_base, valid_base, first + i, C, scale, m_i, l_i, acc,
                                    stride_ks, stride_kd, stride_vs, stride_vd, stride_sc, stride_vc,
                                    D, DV, D_PAD, DV_PAD, BLOCK_S)  # fmt: skip
    program_end(acc * v_scale, m_i, l_i, t, heads, OUT, WS_ACC, WS_ML, stride_ot, stride_oh, stride_od,
                H_KV * G, G, DV, G_PAD, DV_PAD, SPLIT)  # fmt: skip


def unsupported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_slots: torch.Tensor,
                context_valid: torch.Tensor) -> str | None:  # fmt: skip
    """Why the kernel cannot run these arguments (None if it can): shapes and dtypes only."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4 or context_slots.dim() != 2:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k_cache, v_cache, context_slots))
        return f"q [T, H, D], caches [blocks, block_size, Hkv, D], context_slots [T, C] expected, got {shapes}"
    tokens, heads, d = q.shape
    kv_heads, dv = v_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d or kv_heads == 0 or heads % kv_heads:
        return f"shapes do not fit: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    if tuple(context_valid.shape) != (tokens, context_slots.shape[1]) or context_slots.shape[0] != tokens:
        return f"context_slots / context_valid must be [{tokens}, C], got {tuple(context_slots.shape)}, " \
               f"{tuple(context_valid.shape)}"  # fmt: skip
    if context_slots.dtype not in (torch.int32, torch.int64) or context_valid.dtype != torch.bool:
        return f"context_slots must be int32 / int64 and context_valid bool, got {context_slots.dtype}, " \
               f"{context_valid.dtype}"  # fmt: skip
    if q.dtype not in QUERY_DTYPES or any(c.dtype not in (q.dtype, FP8) for c in (k_cache, v_cache)):
        return f"q must be fp16 / bf16 / fp32 and each cache q's dtype or FP8 e4m3, got {q.dtype}, " \
               f"{k_cache.dtype}, {v_cache.dtype}"  # fmt: skip
    if max(d, dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM}, got D {d}, Dv {dv}"
    if context_slots.shape[1] == 0:
        return "an empty context (C = 0)"
    return None


def paged_decode_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: float,
    v_scale: float,
    context_slots: torch.Tensor,
    context_valid: torch.Tensor,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    block_s: int | None = None,
) -> torch.Tensor:
    """Launch paged decode attention; returns ``out`` (allocated if None: fp32 [T, H, Dv]).

    Arguments as the module docstring (any strides; each cache must be viewable as [slots, Hkv,
    D], as ``k_cache.view(-1, Hkv, D)`` is). ``splits`` (default ``num_splits`` for T rows)
    and ``block_s`` (default ``block_s_for``) are for tests. No host syncs; with splits > 1 the
    fp32 workspace comes from ``torch.empty`` (capturable in a CUDA graph).
    """
    reason = unsupported(q, k_cache, v_cache, context_slots, context_valid)
    if reason is not None:
        raise ValueError(f"paged decode attention: {reason}")
    tokens, heads, d = q.shape
    kv_heads, dv = v_cache.shape[2], v_cache.shape[3]
    ctx = context_slots.shape[1]
    if out is None:
        out = torch.empty((tokens, heads, dv), dtype=torch.float32, device=q.device)
    elif tuple(out.shape) != (tokens, heads, dv) or out.dtype != torch.float32:
        raise ValueError(f"out must be [{tokens}, {heads}, {dv}] fp32, got {tuple(out.shape)} {out.dtype}")
    if tokens * heads == 0:
        return out
    k_rows = k_cache.view(-1, kv_heads, d)
    v_rows = v_cache.view(-1, kv_heads, dv)
    group = heads // kv_heads
    block_s = block_s or block_s_for(d, dv)
    splits, per_split = split_plan(tokens, kv_heads, ctx, block_s, splits, TARGET_PROGRAMS)
    split = splits > 1
    ws_acc, ws_ml = split_workspace(tokens * heads, splits, dv, out)
    valid = context_valid.view(torch.uint8)

    def _launch():
        _paged_split_kernel[(tokens * kv_heads, splits)](
            q, k_rows, v_rows, context_slots, valid, out, ws_acc, ws_ml,
            ctx, per_split, float(d**-0.5 * k_scale), float(v_scale),
            q.stride(0), q.stride(1), q.stride(2),
            k_rows.stride(0), k_rows.stride(1), k_rows.stride(2),
            v_rows.stride(0), v_rows.stride(1), v_rows.stride(2),
            context_slots.stride(0), context_slots.stride(1), valid.stride(0), valid.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            H_KV=kv_heads, G=group, D=d, DV=dv,
            G_PAD=mma_pad(group), D_PAD=mma_pad(d), DV_PAD=mma_pad(dv), BLOCK_S=block_s, SPLIT=split,
            INTERP_TILES=per_split if INTERPRETER else 0,
            num_warps=_NUM_WARPS,
        )  # fmt: skip
        if split:
            combine(ws_acc, ws_ml, out, (out.stride(0), out.stride(1), out.stride(2)), tokens, heads, dv, splits)

    launch_on_device(q, _launch)
    return out
