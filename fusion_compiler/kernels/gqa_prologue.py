"""GQA attention prologue (q/k RMSNorm, or none, + partial NeoX or GPT-J RoPE + K/V cache
write): one Triton kernel and its launcher. Semantics: ``fusion_compiler.ops.gqa_prologue`` (its
reference must match).

Design: three programs per token (q; k and its cache write; v's cache write) hold the token's rows
as [heads, lanes] tiles (rows addressed by token and head strides, so Qwen3.5's q inside its [q |
gate] head rows is read in place). A head row is three pieces (``_pieces``): the two rotary halves
side by side, so lane i of one is the NeoX partner of lane i of the other and a pair rotates in
place, and the pass-through lanes (GPT-J's interleaved RoPE, the ``ROPE_PAIRS`` constexpr: the
even and the odd rotary lanes, pair i at lanes 2i and 2i + 1 turning by angle i). A full-width
norm's rstd is one reduction over the token's rows first; a per-head norm's one reduction over a
whole-row tile; without norm weights (an attention with no q/k norms) the ``NORM`` constexpr
drops both and the weight reads. q goes to ``q_out``; k and v go to their cache rows at the
token's slot (slot -1: nothing), FP8 caches as ``value / scale`` (correctly rounded:
``_device.div_rn_by``) clamped to +-448 and rounded to e4m3. Both
cache layouts (paged [blocks, block_size, kv_heads, D] and HF's heads-first static cache) are one
addressing with the launcher's (block, row, head) strides. cos / sin rows (any float dtype, any
row stride) are read at ``positions[t]``, or at row ``t % rows`` without positions (HF's [1, S]
position_ids broadcast over the batch). Rounding follows the op's flags: ``ROUND_NORMALIZED``
rounds ``x * rstd`` before the weight multiply, ``ROUND_ROPE`` each RoPE product and sum (HF's
bf16 ops; those launches compile without FMA contraction, ``_rotated``), so the values match
eager's bits, not only its tolerance.

Why this shape (H200; bench/NOTES.md, gqa_prologue). At 4096 tokens the kernel is bound by
instruction issue, not HBM, so every lane is loaded and normed once (the rotary halves side by
side, no gathered partner tile) and the FP8 cache divides by its scale as a multiply and one FMA
correction (``_device.div_rn_by``), not div.rn: MiniMax bf16 ~88%, Qwen3.5 85%, the FP8 cache
~80% of HBM at 4096 tokens, ~3.2 us at one token. Many tokens want many programs with few
registers each, so above ``WHOLE_TILES_UP_TO`` tokens a program walks its rows in head blocks
(whole tiles of a token's rows reached 30-43% of HBM there); k's and v's tiles are sized by the
kv heads, not q's (q-sized k / v tiles cost 2x at one token with an FP8 cache). A
tensor-parallel norm's means of squares come in as inputs (``variance / divisor``, correctly
rounded): ``_variance_kernel`` computes them on the other side of that all-reduce.

This module imports only torch and triton; set ``TRITON_INTERPRET=1`` before
importing it to run on CPU tensors.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import div_rn_by, downcast, launch_on_device, round_trip, store_fp8_as_bytes
from ._device import to_fp8e4nv_clamped, upcast

KERNEL_VERSION = "gqa_prologue-16"
# Up to this many tokens a program takes its rows as one tile (few programs: each program's
# latency is the time); above, ~BLOCK_LANES_* lanes a block (many programs: registers per program
# decide how many are in flight). H200 (bench/NOTES.md, gqa_prologue), MiniMax bf16 / Qwen3.5 /
# MiniMax FP8: whole tiles 4.3 / 3.9 / 4.5 us at 1 token against 6.3 / 6.9 / 6.3 in blocks;
# blocks of 1024 lanes 58 / 64 / 53% of HBM at 4096 tokens against whole tiles' 35 / 40 / 30%.
# Lanes a block at 4096 tokens and 4 warps, this kernel's pieces: 2048 best for MiniMax's
# full-width norm (bf16 / FP8 89.4 / 80.5%), 1024 for Qwen3.5's per-head norm (86.6 and 85.3% in
# two runs against 77.4-79.2% at 2048). Benches and tests time other sizes through
# GqaPrologueConfig.
WHOLE_TILES_UP_TO = 256
BLOCK_LANES_FULL_WIDTH_NORM = 2048
BLOCK_LANES_PER_HEAD_NORM = 1024
# Grid order. (tokens, 3) starts every token's q program before any k / v program, so at 4096
# tokens the k / v programs (FP8: norm, RoPE, a correctly rounded division and the e4m3
# conversion per lane, few bytes) run last, in a tail with little memory traffic in flight.
# Interleaved (3 * tokens, role fastest) mixes them. H200 at 4096 tokens, 2048 lanes
# (bench/gqa_prologue.py --sweep-lanes; bench/NOTES.md, gqa_prologue), tokens order ->
# interleaved: MiniMax's full-width norm (its q programs read their rows twice) bf16 63.8 ->
# 68.0%, FP8 58.8 -> 60.1%; Qwen3.5's per-head norm 67.7 -> 64.0% (alike at 1024 lanes). So
# ``interleave_roles``: interleaved for a full-width norm in head blocks
# (GqaPrologueConfig.interleave_roles None); the sweep forces either order through it.


def num_warps_for(lanes: int) -> int:
    """Warps of a program whose q tile (one block of heads) has ``lanes`` lanes."""
    return 8 if lanes >= 4096 else 4


@dataclasses.dataclass(frozen=True)
class GqaPrologueConfig:
    """The launch policy; the defaults are the shipped one (the tables above). Programs take
    whole tiles up to ``whole_tiles_up_to`` tokens, above it head blocks of about
    ``block_lanes_full_width_norm`` / ``block_lanes_per_head_norm`` lanes by the norm;
    ``interleave_roles`` None: by shape (:func:`interleave_roles`); ``kv_one_program``: k's
    program also caches v (two roles a token; timed, not shipped); ``warps`` None:
    :func:`num_warps_for` of the q tile."""

    whole_tiles_up_to: int = WHOLE_TILES_UP_TO
    block_lanes_full_width_norm: int = BLOCK_LANES_FULL_WIDTH_NORM
    block_lanes_per_head_norm: int = BLOCK_LANES_PER_HEAD_NORM
    interleave_roles: bool | None = None
    kv_one_program: bool = False
    warps: int | None = None


DEFAULT_CONFIG = GqaPrologueConfig()


def interleave_roles(tokens: int, full_width_norm: bool, config: GqaPrologueConfig = DEFAULT_CONFIG) -> bool:
    """Whether the grid runs a token's roles side by side (the grid-order table above)."""
    if config.interleave_roles is not None:
        return config.interleave_roles
    return bool(full_width_norm) and tokens > config.whole_tiles_up_to


def heads_per_block(
    tokens: int, heads: int, d_pad: int, full_width_norm: bool, config: GqaPrologueConfig = DEFAULT_CONFIG
) -> int:
    """Heads one program takes at a time, for rows of ``heads`` heads (q's, or k's and v's)."""
    most = triton.next_power_of_2(heads)
    if tokens <= config.whole_tiles_up_to:
        return most
    lanes = config.block_lanes_full_width_norm if full_width_norm else config.block_lanes_per_head_norm
    return max(1, min(most, lanes // d_pad))


@triton.jit
def _normed(x, W, w_index, mask, rstd, weight_offset, OUT_DTYPE: tl.constexpr, ROUND_NORMALIZED: tl.constexpr):
    """x * rstd * (w + weight_offset) rounded to OUT_DTYPE, back in fp32; with ROUND_NORMALIZED
    x * rstd is rounded first (HF's ``weight * x.to(dtype)``)."""
    w = upcast(tl.load(W + w_index, mask=mask, other=0.0)) + weight_offset
    normalized = x * rstd
    if ROUND_NORMALIZED:
        normalized = round_trip(normalized, OUT_DTYPE)
    return round_trip(normalized * w, OUT_DTYPE)


@triton.jit
def _rotated(n1, n2, c, s, OUT_DTYPE: tl.constexpr, ROUND_ROPE: tl.constexpr):
    """The NeoX pair (n1, n2) rotated by (c, s), rounded to OUT_DTYPE: once, or with ROUND_ROPE
    every product and sum (HF's ``x * cos + rotate_half(x) * sin`` on OUT_DTYPE tensors). The
    roundings alone do not survive compilation: LLVM narrows each ``fptrunc(fmul(fpext a, fpext
    b))`` of half-precision values to a half-precision multiply (exact: fp32 holds the product)
    and the NVPTX backend then contracts multiply and subtract into ``fma.rn.bf16``, one product
    unrounded; so ROUND_ROPE launches compile without FMA contraction (``gqa_prologue_fwd``)."""
    if ROUND_ROPE:
        out1 = round_trip(round_trip(n1 * c, OUT_DTYPE) - round_trip(n2 * s, OUT_DTYPE), OUT_DTYPE)
        out2 = round_trip(round_trip(n2 * c, OUT_DTYPE) + round_trip(n1 * s, OUT_DTYPE), OUT_DTYPE)
    else:
        out1 = round_trip(n1 * c - n2 * s, OUT_DTYPE)
        out2 = round_trip(n2 * c + n1 * s, OUT_DTYPE)
    return out1, out2


@triton.jit
def _full_width_rstd(X, stride_h, heads, eps, HB: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     N_BLOCKS: tl.constexpr):
    """1 / rms over all of a token's heads, summed HB heads at a time (unrolled: every block's
    load in flight at once, not one DRAM round trip a block)."""
    d = tl.arange(0, D_PAD)[None, :]
    acc = tl.zeros([HB, D_PAD], dtype=tl.float32)
    for block in tl.static_range(N_BLOCKS):
        h = block * HB + tl.arange(0, HB)[:, None]
        x = upcast(tl.load(X + h * stride_h + d, mask=(h < heads) & (d < D), other=0.0))
        acc += x * x
    return tl.math.rsqrt(tl.sum(tl.sum(acc, axis=1), axis=0) / (heads * D) + eps)


@triton.jit
def _given_rstd(VAR, t, stride_var, divisor, eps):
    """1 / rms from a given mean of squares: VAR[t] / divisor (correctly rounded, as the graph's
    fp32 division)."""
    var = tl.load(VAR + t * stride_var)
    return tl.math.rsqrt(tl.math.div_rn(var, tl.full(var.shape, 0.0, tl.float32) + divisor) + eps)


@triton.jit
def _token_rstd(X, stride_h, heads, VAR, t, stride_var, divisor, eps, HB: tl.constexpr, D: tl.constexpr,
                D_PAD: tl.constexpr, N_BLOCKS: tl.constexpr, FULL_WIDTH: tl.constexpr, HAS_VARIANCE: tl.constexpr):
    """A full-width norm's 1 / rms for token t: from the given mean of squares (tensor
    parallelism) or summed over the rows; 0.0 (unused) for a per-head norm."""
    rstd = 0.0
    if HAS_VARIANCE:
        rstd = _given_rstd(VAR, t, stride_var, divisor, eps)
    elif FULL_WIDTH:
        rstd = _full_width_rstd(X, stride_h, heads, eps, HB, D, D_PAD, N_BLOCKS)
    return rstd


@triton.jit
def _pieces(D: tl.constexpr, ROT: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
            ROPE_PAIRS: tl.constexpr):
    """A head row's lanes as three pieces: the rotary halves [0, ROT/2) and [ROT/2, ROT) (lane i
    of one is the NeoX partner of lane i of the other; ROPE_PAIRS: the even and the odd rotary
    lanes, GPT-J's pairs) and the pass-through lanes [ROT, D): (first, second, pass, half lanes
    in range, pass lanes in range), each [1, width]; pair i is element i of first and second."""
    first = tl.arange(0, HALF_PAD)[None, :]
    rest = ROT + tl.arange(0, PASS_PAD)[None, :]
    if ROPE_PAIRS:
        return 2 * first, 2 * first + 1, rest, first < ROT // 2, rest < D
    return first, first + ROT // 2, rest, first < ROT // 2, rest < D


@triton.jit
def _norm_rope(X, stride_h, h, W, COS, SIN, cos_row, sin_row, heads, full_rstd, eps, weight_offset,
               D: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
               FULL_WIDTH: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr,
               ROUND_NORMALIZED: tl.constexpr, ROUND_ROPE: tl.constexpr, ROPE_PAIRS: tl.constexpr):
    """rope(norm(x)) of heads ``h`` ([HB, 1]) of one token's rows at X (head stride stride_h), as
    the three ``_pieces`` in fp32 (rounded values). Full width: the token's rstd is given.
    Without NORM (an attention with no q/k norms) rope(x): no reduction, no weight read.
    Holding the rotary halves side by side, every lane is loaded and normed once and a NeoX pair
    rotates in place. A second full-width tile of each lane's partner would double the norm work
    on the rotary lanes and carry a dead tile over the rest, and at 4096 tokens the kernel is
    bound by instruction issue (bench/NOTES.md, gqa_prologue). ROPE_PAIRS: GPT-J's pairs, the
    even and the odd rotary lanes (loads at stride 2)."""
    first, second, rest, half_ok, rest_ok = _pieces(D, ROT, HALF_PAD, PASS_PAD, ROPE_PAIRS)
    rows = X + h * stride_h
    half_mask, rest_mask = (h < heads) & half_ok, (h < heads) & rest_ok
    x1 = upcast(tl.load(rows + first, mask=half_mask, other=0.0))
    x2 = upcast(tl.load(rows + second, mask=half_mask, other=0.0))
    x3 = upcast(tl.load(rows + rest, mask=rest_mask, other=0.0))
    # Without NORM the rows go to RoPE as loaded. With it, this order keeps the normed launches'
    # SASS (bench/results/sass_offline_snapshot.json): loading cos / sin before the norm shifts
    # their registers and instruction counts.
    if NORM:
        if FULL_WIDTH:
            rstd = full_rstd
            w_row = h * D
        else:  # per head: summed over the whole row as one tile (one reduction, not one a piece)
            d = tl.arange(0, D_PAD)[None, :]
            x = upcast(tl.load(rows + d, mask=(h < heads) & (d < D), other=0.0))
            rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            w_row = 0 * h
        x1 = _normed(x1, W, w_row + first, half_mask, rstd, weight_offset, OUT_DTYPE, ROUND_NORMALIZED)
        x2 = _normed(x2, W, w_row + second, half_mask, rstd, weight_offset, OUT_DTYPE, ROUND_NORMALIZED)
    if ROPE_PAIRS:  # pair i's angle is column i
        angle = first // 2
    else:
        angle = first
    c = upcast(tl.load(COS + cos_row + angle, mask=half_ok, other=1.0))
    s = upcast(tl.load(SIN + sin_row + angle, mask=half_ok, other=0.0))
    out1, out2 = _rotated(x1, x2, c, s, OUT_DTYPE, ROUND_ROPE)
    if NORM:
        x3 = _normed(x3, W, w_row + rest, rest_mask, rstd, weight_offset, OUT_DTYPE, ROUND_NORMALIZED)
    return out1, out2, x3


@triton.jit
def _write_cache(CACHE, CACHE_U8, value, h, lanes, lane_ok, slot, kv_heads, scale, stride_blk, stride_off, stride_h,
                 BLOCK_SIZE: tl.constexpr, FP8_CACHE: tl.constexpr):
    """Lanes ``lanes`` ([1, width]) of heads ``h`` ([HB, 1]) of one token's cache row at
    ``slot`` (-1: nothing)."""
    mask = (h < kv_heads) & lane_ok & (slot >= 0)
    slot = tl.maximum(slot, 0)
    offsets = (slot // BLOCK_SIZE) * stride_blk + (slot % BLOCK_SIZE) * stride_off + h * stride_h + lanes
    if FP8_CACHE:
        codes = to_fp8e4nv_clamped(div_rn_by(value, scale, False))  # below 2**-76: FP8 zeros either way
        store_fp8_as_bytes(CACHE_U8, offsets, codes, mask)
    else:
        tl.store(CACHE + offsets, downcast(value, CACHE.dtype.element_ty), mask=mask)


@triton.jit
def _cache_v_rows(V, t, stride_vt, stride_vh, slot, V_CACHE, V_CACHE_U8, kv_heads, v_scale, stride_vc_blk,
                  stride_vc_off, stride_vc_h, HB_KV: tl.constexpr, KV_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr, V_FP8: tl.constexpr):
    """Token t's v rows into the cache at ``slot``, HB_KV heads at a time."""
    d = tl.arange(0, D_PAD)[None, :]
    for block in range(KV_BLOCKS):
        h = block * HB_KV + tl.arange(0, HB_KV)[:, None]
        v = upcast(tl.load(V + t * stride_vt + h * stride_vh + d, mask=(h < kv_heads) & (d < D), other=0.0))
        _write_cache(V_CACHE, V_CACHE_U8, v, h, d, d < D, slot, kv_heads, v_scale, stride_vc_blk, stride_vc_off,
                     stride_vc_h, BLOCK_SIZE, V_FP8)


@triton.jit
def _gqa_prologue_kernel(
    Q, K, V, QW, KW, COS, SIN, POS, SLOTS, K_CACHE, V_CACHE, K_CACHE_U8, V_CACHE_U8, Q_OUT, Q_VAR, K_VAR,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qo, stride_cos, stride_sin,
    stride_kc_blk, stride_kc_off, stride_kc_h, stride_vc_blk, stride_vc_off, stride_vc_h, stride_qvar, stride_kvar,
    heads, kv_heads, cos_rows, eps, weight_offset, k_scale, v_scale, variance_divisor,
    HB_Q: tl.constexpr, HB_KV: tl.constexpr, Q_BLOCKS: tl.constexpr, KV_BLOCKS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    ROT: tl.constexpr, HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FULL_WIDTH: tl.constexpr, NORM: tl.constexpr, HAS_VARIANCE: tl.constexpr, HAS_POSITIONS: tl.constexpr, K_FP8: tl.constexpr,
    V_FP8: tl.constexpr, INTERLEAVED: tl.constexpr, KV_ONE_PROGRAM: tl.constexpr,
    ROUND_NORMALIZED: tl.constexpr, ROUND_ROPE: tl.constexpr, ROPE_PAIRS: tl.constexpr,
):
    # Program (t, role): role 0 ropes q, role 1 ropes and caches k, role 2 caches v, each HB_*
    # heads at a time (a full-width norm sums all of them first, then re-reads them).
    # INTERLEAVED: a 1-D grid with the role varying fastest, so the GPU starts q, k and v
    # programs side by side instead of every q program first and the small k / v ones last.
    # KV_ONE_PROGRAM: role 1 also caches v (two roles a token).
    ROLES: tl.constexpr = 2 if KV_ONE_PROGRAM else 3
    if INTERLEAVED:
        pid = tl.program_id(0).to(tl.int64)
        t, role = pid // ROLES, pid % ROLES
    else:
        t, role = tl.program_id(0).to(tl.int64), tl.program_id(1)
    first, second, rest, half_ok, rest_ok = _pieces(D, ROT, HALF_PAD, PASS_PAD, ROPE_PAIRS)
    if role == 2:
        _cache_v_rows(V, t, stride_vt, stride_vh, tl.load(SLOTS + t).to(tl.int64), V_CACHE, V_CACHE_U8, kv_heads,
                      v_scale, stride_vc_blk, stride_vc_off, stride_vc_h, HB_KV, KV_BLOCKS, BLOCK_SIZE, D, D_PAD, V_FP8)
    else:
        if HAS_POSITIONS:
            row = tl.load(POS + t).to(tl.int64)
        else:  # one row per token, or per position of a sequence repeated over the batch
            row = t % cos_rows
        cos_row, sin_row = row * stride_cos, row * stride_sin
        if role == 0:
            X = Q + t * stride_qt
            full_rstd = _token_rstd(X, stride_qh, heads, Q_VAR, t, stride_qvar, variance_divisor, eps,
                                    HB_Q, D, D_PAD, Q_BLOCKS, FULL_WIDTH, HAS_VARIANCE)
            for block in range(Q_BLOCKS):
                h = block * HB_Q + tl.arange(0, HB_Q)[:, None]
                q1, q2, q3 = _norm_rope(X, stride_qh, h, QW, COS, SIN, cos_row, sin_row, heads, full_rstd, eps,
                                        weight_offset, D, D_PAD, ROT, HALF_PAD, PASS_PAD, FULL_WIDTH, NORM,
                                        Q.dtype.element_ty, ROUND_NORMALIZED, ROUND_ROPE, ROPE_PAIRS)
                out = Q_OUT + t * stride_qo + h * D
                out_dtype = Q_OUT.dtype.element_ty
                tl.store(out + first, downcast(q1, out_dtype), mask=(h < heads) & half_ok)
                tl.store(out + second, downcast(q2, out_dtype), mask=(h < heads) & half_ok)
                tl.store(out + rest, downcast(q3, out_dtype), mask=(h < heads) & rest_ok)
        else:
            X = K + t * stride_kt
            slot = tl.load(SLOTS + t).to(tl.int64)
            full_rstd = _token_rstd(X, stride_kh, kv_heads, K_VAR, t, stride_kvar, variance_divisor, eps,
                                    HB_KV, D, D_PAD, KV_BLOCKS, FULL_WIDTH, HAS_VARIANCE)
            for block in range(KV_BLOCKS):
                h = block * HB_KV + tl.arange(0, HB_KV)[:, None]
                k1, k2, k3 = _norm_rope(X, stride_kh, h, KW, COS, SIN, cos_row, sin_row, kv_heads, full_rstd, eps,
                                        weight_offset, D, D_PAD, ROT, HALF_PAD, PASS_PAD, FULL_WIDTH, NORM,
                                        K.dtype.element_ty, ROUND_NORMALIZED, ROUND_ROPE, ROPE_PAIRS)
                _write_cache(K_CACHE, K_CACHE_U8, k1, h, first, half_ok, slot, kv_heads, k_scale, stride_kc_blk,
                             stride_kc_off, stride_kc_h, BLOCK_SIZE, K_FP8)
                _write_cache(K_CACHE, K_CACHE_U8, k2, h, second, half_ok, slot, kv_heads, k_scale, stride_kc_blk,
                             stride_kc_off, stride_kc_h, BLOCK_SIZE, K_FP8)
                _write_cache(K_CACHE, K_CACHE_U8, k3, h, rest, rest_ok, slot, kv_heads, k_scale, stride_kc_blk,
                             stride_kc_off, stride_kc_h, BLOCK_SIZE, K_FP8)
            if KV_ONE_PROGRAM:
                _cache_v_rows(V, t, stride_vt, stride_vh, slot, V_CACHE, V_CACHE_U8, kv_heads, v_scale,
                              stride_vc_blk, stride_vc_off, stride_vc_h, HB_KV, KV_BLOCKS, BLOCK_SIZE, D, D_PAD, V_FP8)


def _paged_strides(cache: torch.Tensor, heads_first: bool) -> tuple[int, int, int, int]:
    """(block stride, row stride, head stride, block_size) of either cache layout."""
    if heads_first:  # [blocks, kv_heads, block_size, D]
        return cache.stride(0), cache.stride(2), cache.stride(1), cache.shape[2]
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.shape[1]


def gqa_prologue_fwd(q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm, cos, sin, positions,
                     k_cache, v_cache, slots, k_scale, v_scale, cache_heads_first, q_variance, k_variance,
                     variance_divisor, round_normalized, round_rope_products, q_out,
                     config: GqaPrologueConfig | None = None, interleaved_rope: bool = False) -> None:  # fmt: skip
    """Launch the kernel: writes ``q_out`` [T, heads, D] and the caches in place. Arguments as
    the op's (already validated there; its last, ``interleaved_rope``, by keyword); q/k/v,
    cos/sin and the caches need unit stride along their last dim, the norm weights and q_out are
    contiguous. ``config`` None: the shipped launch policy. No host syncs."""
    config = DEFAULT_CONFIG if config is None else config
    tokens, heads, head_dim = q.shape
    if tokens == 0:
        return
    kv_heads = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on its last dim, got {t.stride()}")
    norm = q_norm_weight is not None
    if not (q_out.is_contiguous() and (not norm or (q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()))):
        raise ValueError("q_out and the norm weights must be contiguous")
    # Without a norm the kernel never reads the weights: q stands in for both pointers.
    q_w, k_w = (q_norm_weight, k_norm_weight) if norm else (q, q)
    fp8 = torch.float8_e4m3fn
    d_pad = triton.next_power_of_2(head_dim)
    rot = 2 * cos.shape[-1]
    hb_q = heads_per_block(tokens, heads, d_pad, full_width_norm, config)
    hb_kv = heads_per_block(tokens, kv_heads, d_pad, full_width_norm, config)
    kc_blk, kc_off, kc_h, block_size = _paged_strides(k_cache, cache_heads_first)
    vc_blk, vc_off, vc_h, _ = _paged_strides(v_cache, cache_heads_first)

    def _u8(cache):
        return cache.view(torch.uint8) if cache.dtype == fp8 else cache

    has_variance = q_variance is not None
    # Without variances the kernel never reads them: any fp32-free pointer stands in (stride 0).
    q_var, k_var = (q_variance, k_variance) if has_variance else (slots, slots)

    roles = 2 if config.kv_one_program else 3
    interleaved = interleave_roles(tokens, full_width_norm, config)
    warps = num_warps_for(hb_q * d_pad) if config.warps is None else config.warps
    grid = (roles * tokens,) if interleaved else (tokens, roles)

    def _launch():
        _gqa_prologue_kernel[grid](
            q, k, v, q_w, k_w, cos, sin, slots if positions is None else positions, slots,
            k_cache, v_cache, _u8(k_cache), _u8(v_cache), q_out, q_var, k_var,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
            cos.stride(0), sin.stride(0), kc_blk, kc_off, kc_h, vc_blk, vc_off, vc_h, q_var.stride(0), k_var.stride(0),
            heads, kv_heads, max(1, cos.shape[0]), float(eps), float(weight_offset), float(k_scale), float(v_scale),
            float(variance_divisor),
            HB_Q=hb_q, HB_KV=hb_kv, Q_BLOCKS=triton.cdiv(heads, hb_q), KV_BLOCKS=triton.cdiv(kv_heads, hb_kv), D=head_dim,
            D_PAD=d_pad, ROT=rot, HALF_PAD=triton.next_power_of_2(rot // 2),
            PASS_PAD=triton.next_power_of_2(max(1, head_dim - rot)), BLOCK_SIZE=block_size,
            FULL_WIDTH=bool(full_width_norm), NORM=norm, HAS_VARIANCE=has_variance, HAS_POSITIONS=positions is not None,
            K_FP8=k_cache.dtype == fp8, V_FP8=v_cache.dtype == fp8, INTERLEAVED=interleaved,
            KV_ONE_PROGRAM=config.kv_one_program, ROUND_NORMALIZED=bool(round_normalized),
            ROUND_ROPE=bool(round_rope_products), ROPE_PAIRS=bool(interleaved_rope), num_warps=warps,
            # HF's rounded RoPE products: no FMA may fuse one into the sum (``_rotated``). The
            # serving layout (fp32 RoPE, rounded once) keeps contraction: at 4096 tokens the
            # kernel is bound by instruction issue (bench/NOTES.md, gqa_prologue).
            enable_fp_fusion=not round_rope_products,
        )

    launch_on_device(q, _launch)


@triton.jit
def _mean_square(X, width, BLOCK: tl.constexpr, N_BLOCKS: tl.constexpr):
    """Mean of squares of the ``width`` values at X, BLOCK lanes at a time, rounded correctly."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for block in range(N_BLOCKS):
        i = block * BLOCK + tl.arange(0, BLOCK)
        x = upcast(tl.load(X + i, mask=i < width, other=0.0))
        acc += x * x
    total = tl.sum(acc, axis=0)
    return tl.math.div_rn(total, tl.full(total.shape, 0.0, tl.float32) + width)


@triton.jit
def _variance_kernel(Q, K, OUT, stride_q, stride_k, q_width, k_width, BLOCK: tl.constexpr,
                     Q_BLOCKS: tl.constexpr, K_BLOCKS: tl.constexpr):
    """Program (t, side): the mean of squares of row t of q (side 0) or k (side 1) into OUT[t, side]."""
    t, side = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if side == 0:
        tl.store(OUT + 2 * t, _mean_square(Q + t * stride_q, q_width, BLOCK, Q_BLOCKS))
    else:
        tl.store(OUT + 2 * t + 1, _mean_square(K + t * stride_k, k_width, BLOCK, K_BLOCKS))


# Lanes a program sums at a time: 6144 / tp wide q rows in a few steps, k's 1024 / tp in one.
# Not measured: the block width the prologue's head blocks found best (bench/NOTES.md, gqa_prologue).
_VARIANCE_LANES = 1024


def gqa_prologue_variance_fwd(q, k, out) -> None:
    """Launch ``_variance_kernel``: out [T, 2] fp32 contiguous <- the means of squares of q's
    and k's rows (both [T, width] with unit stride along the width). No host syncs."""
    tokens = q.shape[0]
    if tokens == 0:
        return
    for name, t in (("q", q), ("k", k)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on its last dim, got {t.stride()}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    block = min(_VARIANCE_LANES, triton.next_power_of_2(max(q.shape[1], k.shape[1])))

    def _launch():
        _variance_kernel[(tokens, 2)](q, k, out, q.stride(0), k.stride(0), q.shape[1], k.shape[1], BLOCK=block,
                                      Q_BLOCKS=triton.cdiv(q.shape[1], block), K_BLOCKS=triton.cdiv(k.shape[1], block))

    launch_on_device(q, _launch)
