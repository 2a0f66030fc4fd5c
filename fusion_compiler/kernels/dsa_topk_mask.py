"""DeepSeek V3.2's DSA indexer at decode, scores to the sparse top-k mask: two Triton kernels and
their launcher. Semantics: ``fusion_compiler.ops.dsa_topk_mask`` (its reference is the truth).

    q [B, S, H, D], k [B, T, D]   any strides, fp16 / bf16 / fp32 (k may differ from q)
    weights [B, S, H]             any float dtype, used as ``weights.float() * weight_scale``
    mask                          None, or [B, S, T] bool (True = may attend) or float additive,
                                  any strides (an expanded view with stride 0 too)
    score[b, s, t] = sum_h w[b, s, h] * relu(scale * q[b, s, h] . k[b, t])       fp32
                     bool mask False -> -inf; additive mask added
    keep[b, s, t]  = t is among the min(topk, T) largest scores of row (b, s), ties at the k-th
                     score going to the lower t; and (bool mask) mask[b, s, t]

Launch 1, ``_score_kernel``, grid (B * S, cdiv(T, BLOCK_T)): a program loads its row's q as an
[H_PAD, D_PAD] tile (H padded to a power of two >= 16 for ``tl.dot``, D to a power of two,
both masked), the head weights (0 on pad heads) and a K tile, computes the [H_PAD, BLOCK_T]
dot products with fp32 accumulation (bf16 / fp16 tensor cores; fp32 operands as IEEE fp32,
never tf32), ``max(x * scale, 0)``, the weighted sum over heads, applies the mask and stores
the fp32 scores to a workspace [B * S, T] (``torch.empty``: no host syncs, capturable in a
CUDA graph).

Launch 2, ``_select_kernel``, one program per row: the k-th largest score, exactly, by a radix
select on order-preserving uint32 keys of the fp32 scores (``key = bits ^ 0x80000000`` for
non-negative floats, ``~bits`` for negative ones, after ``+ 0.0`` so -0.0 and +0.0 share a
key; -inf, the masked positions, has the smallest key of any non-NaN score). From the most
significant end, RADIX_BITS bits a pass: with the higher bits of the threshold fixed in
``prefix``, a pass counts the keys >= ``prefix | d << shift`` for every digit d (a [BLOCK, NB]
compare and one sum) and keeps the largest d whose count is still >= k. The count at d + 1
is the number of keys above the threshold's bits so far, so after the last pass ``above =
count(key > thr)`` comes for free. Then every key > thr is kept and, of the keys == thr, the
first ``k - above`` in t order (an exclusive ``tl.cumsum`` of the equal flags, with a carried
offset across chunks). keep = selected & allowed is written as bytes through a uint8 view of
the bool output.

Rows of up to ``SELECT_ROW_MAX`` (4096) keys stay in registers (``SINGLE``: one load, 2-bit
digits, 16 passes); longer rows are read from the workspace in chunks of ``SELECT_BLOCK``
(1024) every pass (4-bit digits: 8 passes plus the writing one, all hitting L2). With
``topk >= T`` nothing is scored: keep is the bool mask (or all True), written by the select
kernel alone. ``select_fwd`` launches the select alone on given scores (tests use it).

Launch parameters are not tuned on the GPU yet (``score_config`` / ``select_config``): BLOCK_T
64 (32 when 64 gives fewer than 132 programs), 4 warps, for bf16 / fp16; fp32 or mixed
operands take ``tl.dot``'s FMA path, where ptxas (sm_90, H 64 / D 128) spills with 4 warps and
fits in 128 registers with 8, BLOCK_T 64. The select uses 8 warps (179 registers for the
4096-key register row, no spills). Each score program reloads its row's q (16 KiB at H 64 /
D 128, from L2) for one K tile of the same size, and rows of one batch with S > 1 each read
that batch's K.

NaN scores get no special handling (a positive NaN ranks above +inf, a negative one below
-inf). The kernel sums each dot product in another order than the reference, so a position
whose score is within rounding of the k-th may swap with its neighbour in the ranking.

Under Triton's interpreter (``TRITON_INTERPRET=1``): bf16 loads go through ``_device.upcast``
and ``tl.dot`` operands are upcast to fp32 (numpy's half-precision matmul would accumulate in
half), which is what the GPU's MMA computes (exact products, fp32 sums). The interpreter cannot
take a loop bound from a runtime value (it turns every assigned value into a 1-element tensor,
and ``range`` needs ``__index__``), so there the chunk count comes as a constexpr
(``INTERP_CHUNKS``), passed straight into ``_select_row``; on the GPU it is a runtime argument.
Its ``~`` on uint32 fails (it builds all-ones from Python's -1), so keys flip by XOR. Bool
tensors are read and written through uint8 views (0 / 1 bytes).

This module imports only torch and triton; set ``TRITON_INTERPRET=1`` before importing it to
run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import INTERPRETER, launch_on_device, mma, mma_pad, upcast

# Bump whenever the kernels or their launch configuration change (hashed into cache keys).
KERNEL_VERSION = "dsa_topk_mask-1"

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TARGET_PROGRAMS = 132  # SMs of an H200
BLOCK_T = 64
SMALL_BLOCK_T = 32
SELECT_ROW_MAX = 4096  # rows up to this many keys are selected in registers
SELECT_MIN_ROW_BLOCK = 1024  # smallest register-row block (fewer compiled variants)
SELECT_BLOCK = 1024  # chunk of the looped select
SINGLE_RADIX_BITS = 2
LOOP_RADIX_BITS = 4
_SCORE_WARPS = 4
_FP32_SCORE_WARPS = 8
_SELECT_WARPS = 8

MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2


@triton.jit
def _score_kernel(
    Q, K, W, MASK, WS,
    S, T, scale, weight_scale,
    stride_qb, stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kd,
    stride_wb, stride_ws, stride_wh,
    stride_mb, stride_ms, stride_mt,
    H: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    MASK_KIND: tl.constexpr,  # 0 none, 1 bool (uint8 view), 2 additive float
):  # fmt: skip
    row = tl.program_id(0)  # b * S + s
    tile = tl.program_id(1)
    b = (row // S).to(tl.int64)
    s = (row % S).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    in_t = t < T
    t64 = t.to(tl.int64)
    h_ok = h < H
    d_ok = d < D
    q = tl.load(Q + b * stride_qb + s * stride_qs + h[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    w = upcast(tl.load(W + b * stride_wb + s * stride_ws + h * stride_wh, mask=h_ok, other=0.0)) * weight_scale
    kt = tl.load(K + b * stride_kb + t64[None, :] * stride_kt + d[:, None] * stride_kd,
                 mask=d_ok[:, None] & in_t[None, :], other=0.0)  # fmt: skip
    x = tl.maximum(mma(q, kt) * scale, 0.0)  # [H_PAD, BLOCK_T]
    score = tl.sum(w[:, None] * x, axis=0)  # [BLOCK_T]
    m_ptr = MASK + b * stride_mb + s * stride_ms + t64 * stride_mt
    if MASK_KIND == 1:
        allowed = tl.load(m_ptr, mask=in_t, other=0)
        score = tl.where(allowed != 0, score, float("-inf"))
    elif MASK_KIND == 2:
        score = score + upcast(tl.load(m_ptr, mask=in_t, other=0.0))
    tl.store(WS + row.to(tl.int64) * T + t64, score, mask=in_t)


@triton.jit
def _keys(ws_row, t, valid):
    """Order-preserving uint32 keys of the scores at ``t``; 0 (below every score) off the row."""
    v = tl.load(ws_row + t, mask=valid, other=0.0) + 0.0  # -0.0 -> +0.0
    bits = v.to(tl.uint32, bitcast=True)
    keys = bits ^ tl.where(bits >= 0x80000000, 0xFFFFFFFF, 0x80000000)
    return tl.where(valid, keys, 0)


@triton.jit
def _digit_counts(keys, prefix, SHIFT: tl.constexpr, RADIX_BITS: tl.constexpr):
    """[NB] counts of keys >= ``prefix | d << SHIFT`` for each digit d (d = 0 unused)."""
    dg = tl.arange(0, 1 << RADIX_BITS).to(tl.uint32)
    cand = prefix | (dg << SHIFT)
    return tl.sum((keys[:, None] >= cand[None, :]).to(tl.int32), axis=0)


@triton.jit
def _pick_digit(counts, prefix, above, k_sel, SHIFT: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The threshold's digit at SHIFT: the largest d >= 1 with count >= k (counts do not grow
    with d), else 0. Returns the new (prefix, above): above counts the keys whose bits so far
    exceed the threshold's, i.e. the count at d + 1 (or the previous one when d is the top)."""
    NB: tl.constexpr = 1 << RADIX_BITS
    dg = tl.arange(0, NB)
    digit = tl.sum(((counts >= k_sel) & (dg >= 1)).to(tl.int32), axis=0)
    nxt = tl.sum(tl.where(dg == digit + 1, counts, 0), axis=0)
    above = tl.where(digit + 1 < NB, nxt, above)
    return prefix | (digit.to(tl.uint32) << SHIFT), above


@triton.jit
def _allowed(m_row, t, valid, stride_mt, MASK_BOOL: tl.constexpr):
    if MASK_BOOL:
        return tl.load(m_row + t * stride_mt, mask=valid, other=0) != 0
    else:
        return valid


@triton.jit
def _store_kept(keys, t, valid, prefix, need, seen, m_row, o_row, stride_mt, stride_ot, MASK_BOOL: tl.constexpr):
    """keep for one chunk of a row: keys above the threshold ``prefix``, and keys equal to it
    while fewer than ``need`` came before them (``seen`` in earlier chunks); (& allowed).
    Returns the chunk's count of keys equal to the threshold."""
    eq = (valid & (keys == prefix)).to(tl.int32)
    rank = seen + tl.cumsum(eq, axis=0) - eq
    sel = valid & ((keys > prefix) | ((eq != 0) & (rank < need)))
    t64 = t.to(tl.int64)
    keep = sel & _allowed(m_row, t64, valid, stride_mt, MASK_BOOL)
    tl.store(o_row + t64 * stride_ot, keep.to(tl.uint8), mask=valid)
    return tl.sum(eq, axis=0)


@triton.jit
def _select_kernel(
    WS, MASK, KEEP,
    S, T, k_sel, num_chunks,
    stride_mb, stride_ms, stride_mt,
    stride_ob, stride_os, stride_ot,
    BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr,
    MASK_BOOL: tl.constexpr,  # MASK is a uint8 view of a bool mask (else unused)
    ALL: tl.constexpr,  # topk >= T: keep = allowed, no scores
    SINGLE: tl.constexpr,  # T <= BLOCK: the row stays in registers
    INTERP_CHUNKS: tl.constexpr,  # num_chunks, under the interpreter only
):  # fmt: skip
    row = tl.program_id(0)  # b * S + s
    b = (row // S).to(tl.int64)
    s = (row % S).to(tl.int64)
    # The chunk count is passed straight into the helper: under the interpreter an assigned
    # value becomes a tensor, which ``range`` cannot take.
    _select_row(WS + row.to(tl.int64) * T, MASK + b * stride_mb + s * stride_ms, KEEP + b * stride_ob + s * stride_os,
                T, k_sel, INTERP_CHUNKS if INTERPRETER else num_chunks, stride_mt, stride_ot,
                BLOCK, RADIX_BITS, MASK_BOOL, ALL, SINGLE)  # fmt: skip


@triton.jit
def _select_row(ws_row, m_row, o_row, T, k_sel, n_chunks, stride_mt, stride_ot,
                BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, MASK_BOOL: tl.constexpr,
                ALL: tl.constexpr, SINGLE: tl.constexpr):  # fmt: skip
    """One row of the select (see ``_select_kernel``)."""
    offs = tl.arange(0, BLOCK)
    PASSES: tl.constexpr = 32 // RADIX_BITS
    if ALL:
        for c in range(0, n_chunks):
            t = c * BLOCK + offs
            valid = t < T
            t64 = t.to(tl.int64)
            keep = _allowed(m_row, t64, valid, stride_mt, MASK_BOOL)
            tl.store(o_row + t64 * stride_ot, keep.to(tl.uint8), mask=valid)
    elif SINGLE:
        valid = offs < T
        keys = _keys(ws_row, offs, valid)
        prefix = tl.full([], 0, tl.uint32)
        above = tl.full([], 0, tl.int32)
        for p in tl.static_range(PASSES):  # digits from the most significant
            counts = _digit_counts(keys, prefix, 32 - RADIX_BITS * (p + 1), RADIX_BITS)
            prefix, above = _pick_digit(counts, prefix, above, k_sel, 32 - RADIX_BITS * (p + 1), RADIX_BITS)
        need = k_sel - above  # how many keys equal to the threshold to keep, lowest t first
        _store_kept(keys, offs, valid, prefix, need, 0, m_row, o_row, stride_mt, stride_ot, MASK_BOOL)
    else:
        prefix = tl.full([], 0, tl.uint32)
        above = tl.full([], 0, tl.int32)
        for p in tl.static_range(PASSES):
            counts = tl.zeros([1 << RADIX_BITS], tl.int32)
            for c in range(0, n_chunks):
                t = c * BLOCK + offs
                counts += _digit_counts(_keys(ws_row, t, t < T), prefix, 32 - RADIX_BITS * (p + 1), RADIX_BITS)
            prefix, above = _pick_digit(counts, prefix, above, k_sel, 32 - RADIX_BITS * (p + 1), RADIX_BITS)
        need = k_sel - above
        seen = tl.full([], 0, tl.int32)  # keys equal to the threshold in earlier chunks
        for c in range(0, n_chunks):
            t = c * BLOCK + offs
            valid = t < T
            seen += _store_kept(_keys(ws_row, t, valid), t, valid, prefix, need, seen, m_row, o_row, stride_mt,
                                stride_ot, MASK_BOOL)  # fmt: skip


def score_config(rows: int, keys: int, half: bool) -> tuple[int, int]:
    """(BLOCK_T, warps) of the score kernel. Half-precision operands: 64 key positions, or 32
    where 64 gives fewer than ~1 program per SM, 4 warps. fp32 (or mixed) operands take the
    FMA path of ``tl.dot``: 64 positions and 8 warps, the variant ptxas (sm_90, H 64 / D 128)
    fits without spills."""
    if not half:
        return BLOCK_T, _FP32_SCORE_WARPS
    if rows * triton.cdiv(keys, BLOCK_T) < TARGET_PROGRAMS:
        return SMALL_BLOCK_T, _SCORE_WARPS
    return BLOCK_T, _SCORE_WARPS


def select_config(keys: int) -> tuple[int, int, bool]:
    """(block, radix bits, single) of the select kernel for rows of ``keys`` scores."""
    if keys <= SELECT_ROW_MAX:
        return max(SELECT_MIN_ROW_BLOCK, triton.next_power_of_2(keys)), SINGLE_RADIX_BITS, True
    return SELECT_BLOCK, LOOP_RADIX_BITS, False


def _check_mask_keep(mask, keep, shape, device) -> None:
    if tuple(keep.shape) != shape or keep.dtype != torch.bool:
        raise ValueError(f"keep must be {list(shape)} bool, got {tuple(keep.shape)} {keep.dtype}")
    if mask is not None:
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask must be {list(shape)}, got {tuple(mask.shape)}")
        if mask.dtype != torch.bool and mask.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"mask dtype {mask.dtype} not supported (bool, fp16, bf16, fp32)")
    for name, t in (("mask", mask), ("keep", keep)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")


def _mask_args(mask):
    """(pointer tensor or None, (stride_b, stride_s, stride_t), kind); bool masks as uint8 views."""
    if mask is None:
        return None, (0, 0, 0), MASK_NONE
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), mask.stride(), MASK_BOOL
    return mask, mask.stride(), MASK_ADD


def _launch_select(ws, mask, topk, keep, select_block, radix_bits) -> None:
    """The select launch: ``ws`` fp32 [B * S, T] contiguous masked scores (unused when
    topk >= T) -> ``keep``."""
    batch, seq, keys = keep.shape
    if select_block is None:
        select_block, radix, single = select_config(keys)
    else:
        single = keys <= select_block
        radix = SINGLE_RADIX_BITS if single else LOOP_RADIX_BITS
    radix = radix_bits or radix
    if radix not in (1, 2, 4) or select_block < 16 or select_block & (select_block - 1):
        raise ValueError(f"radix_bits must be 1, 2 or 4 and select_block a power of two >= 16, got {radix}, "
                         f"{select_block}")  # fmt: skip
    m_ptr, m_strides, mask_kind = _mask_args(mask)
    keep_u8 = keep.view(torch.uint8)
    num_chunks = triton.cdiv(keys, select_block)
    k_sel = min(topk, keys)
    _select_kernel[(batch * seq,)](
        keep_u8 if ws is None else ws, keep_u8 if m_ptr is None else m_ptr, keep_u8,
        seq, keys, k_sel, num_chunks,
        *m_strides, *keep.stride(),
        BLOCK=select_block, RADIX_BITS=radix, MASK_BOOL=mask_kind == MASK_BOOL, ALL=k_sel == keys, SINGLE=single,
        INTERP_CHUNKS=num_chunks if INTERPRETER else 0,
        num_warps=_SELECT_WARPS,
    )  # fmt: skip


def select_fwd(
    scores: torch.Tensor,
    mask: torch.Tensor | None,
    topk: int,
    keep: torch.Tensor,
    *,
    select_block: int | None = None,
    radix_bits: int | None = None,
) -> None:
    """The select kernel alone: ``keep`` [B, S, T] from fp32 ``scores`` [B, S, T] (contiguous,
    already masked; keep_from_scores's semantics). ``mask`` only adds ``& mask`` when bool."""
    if scores.dim() != 3 or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"scores must be contiguous fp32 [B, S, T], got {tuple(scores.shape)} {scores.dtype}")
    _check_mask_keep(mask, keep, tuple(scores.shape), scores.device)
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")
    if keep.numel() == 0:
        return
    launch_on_device(scores, lambda: _launch_select(scores, mask, topk, keep, select_block, radix_bits))


def dsa_topk_mask_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    weight_scale: float,
    topk: int,
    keep: torch.Tensor,
    *,
    block_t: int | None = None,
    select_block: int | None = None,
    radix_bits: int | None = None,
) -> None:
    """Launch the DSA top-k mask; fills ``keep`` [B, S, T] bool (any strides).

    Shapes and dtypes as in the module docstring. ``block_t`` (default ``score_config``),
    ``select_block`` (rows longer than it loop over chunks of it; default ``select_config``)
    and ``radix_bits`` (1, 2 or 4) are for tests. No host syncs; the fp32 score workspace
    comes from ``torch.empty``.
    """
    if q.dim() != 4 or k.dim() != 3 or weights.dim() != 3:
        raise ValueError(f"q [B, S, H, D], k [B, T, D], weights [B, S, H] expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(weights.shape)}")  # fmt: skip
    batch, seq, heads, dim = q.shape
    keys = k.shape[1]
    if k.shape[0] != batch or k.shape[2] != dim or tuple(weights.shape) != (batch, seq, heads):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)}")
    for name, t in (("q", q), ("k", k), ("weights", weights)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported (fp16, bf16, fp32)")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, expected {q.device} (q's)")
    _check_mask_keep(mask, keep, (batch, seq, keys), q.device)
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")
    rows = batch * seq
    if rows == 0 or keys == 0:
        return
    if block_t is not None and (block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
    half = q.dtype == k.dtype and q.dtype != torch.float32
    default_block_t, score_warps = score_config(rows, keys, half)
    block_t = block_t or default_block_t
    m_ptr, m_strides, mask_kind = _mask_args(mask)
    # topk >= T keeps every (allowed) position: no scores needed.
    ws = None if topk >= keys else torch.empty((rows, keys), dtype=torch.float32, device=q.device)

    def _launch():
        if ws is not None:
            _score_kernel[(rows, triton.cdiv(keys, block_t))](
                q, k, weights, ws if m_ptr is None else m_ptr, ws,
                seq, keys, float(scale), float(weight_scale),
                *q.stride(), *k.stride(), *weights.stride(), *m_strides,
                H=heads, D=dim, H_PAD=mma_pad(heads),
                D_PAD=mma_pad(dim), BLOCK_T=block_t, MASK_KIND=mask_kind,
                num_warps=score_warps,
            )  # fmt: skip
        _launch_select(ws, mask, topk, keep, select_block, radix_bits)

    launch_on_device(q, _launch)
