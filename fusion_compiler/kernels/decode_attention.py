"""GQA single-query ("decode") attention, split-KV flash decoding: two Triton kernels and
their launcher. Semantics: ``fusion_compiler.ops.decode_attention`` (its reference must match).

    q [B, H, 1, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv]   any strides, H = G * Hkv
    out[b, h] = softmax(q[b, h] . k[b, h // G]^T * scale (+ mask[b]))  @  v[b, h // G]

Design: one program per (batch, kv head, split) (grid ``(B * Hkv, splits)``) holds *all* G
query heads of its kv head as a [G_PAD, D_PAD] tile (G padded to >= 16 for ``tl.dot``), so
every K/V byte is read once, not G times as after HF's ``repeat_kv``. It walks its share of
the sequence (``tiles_per_split`` tiles of BLOCK_S positions) with an online softmax: scores
[G_PAD, BLOCK_S] = q @ K^T (fp32 accumulation), times scale, plus the mask (bool: -inf where
False; float: added), running max m and sum l in fp32, acc [G_PAD, DV_PAD] += p @ V with p
rounded to V's dtype (the tensor-core operand). D and Dv are padded to powers of two and
masked (DeepSeek's expanded MLA: D 192, Dv 128).

With one split the program writes ``acc / l`` straight into ``out``. With more, each split
writes its (m, l, acc) to an fp32 workspace (``torch.empty``: no host syncs, capturable in a
CUDA graph) and ``_combine_kernel`` (one program per (batch, query head)) rescales and sums
them. The split count depends on shapes only (``num_splits``): about one program per SM of the
H200 (132), at least 2 tiles a split, no empty split.

``skip_masked`` (the op's ``sparse_mask``, set by the pattern wherever there is a mask): each
split program first scans its share of the mask for the first and last position it keeps
(``_kept_tiles``) and walks only the tiles between them, so a static cache's unwritten tail is
never visited; inside that range each tile reads its mask first and loads no K / V row the mask
rules out (bool False, additive -inf; a finfo.min entry is loaded, for the fully masked row
below), so DeepSeek V3.2's top 2048 of a 4096-token cache read half its bytes. The range is the
loop's bounds, not a branch in it: a per-tile branch kept Triton 3.6 from pipelining the K / V
loads (bench/NOTES.md section 6). Off, the K load does not wait on the mask load; with it, each
K / V predicate is a byte load of the mask. Timed on the H100, kernel alone
(bench/diagnostics/decode_attention_sparse.py, S 4096): 1.45-1.47x where DSA's top-k keeps half
the rows, 1.15-1.99x where half the rows are a cache's unwritten tail, 0.94-1.14x where none is
masked.

Fully masked rows: every split has m = -inf, l = 0, so the result is 0 / 0 = NaN, like
``scaled_dot_product_attention``'s. A ``finfo.min`` additive mask (HF's) is added in natural
units, as the reference does, so a row masked that way everywhere averages v like eager.

Under Triton's interpreter (``TRITON_INTERPRET=1``): bf16 loads go through ``_device.upcast``
and stores through ``downcast``; ``tl.dot`` operands are upcast to fp32 (numpy's half-precision
matmul would accumulate in half) after rounding p to V's dtype, which is what the GPU's
bf16 / fp16 MMA computes (exact products, fp32 sums). The interpreter cannot take a loop bound
from a runtime value (each scalar is a 1-element array, and ``range`` needs ``__index__``), so
there the loop counts come as constexprs (``INTERP_TILES`` / ``INTERP_BLOCKS``); on the GPU
they are runtime arguments, so a growing S does not recompile.

Launch parameters (H200, bf16, S 4096, CUDA-graph replay; MiniMax H 48 / Hkv 8 / D 128,
Qwen3.5 32 / 2 / 256, DeepSeek's expanded MLA 128 / 128 / 192 -> 128; B 1, 8, 64): BLOCK_S 64
for every D (32 for D 256 was 5-50% slower: Qwen3.5 B 1 14.6 us against 9.5), 4 warps (2 and 8
within a few %, 8 slower at B 1), Triton's default stages. Splits swept as
``min(cdiv(tiles, MIN_TILES), cdiv(TARGET, B * Hkv))``: MIN_TILES 2 / TARGET 132 came within
1% of the per-shape best on average (worst 8%, MiniMax B 64), where 1 / 264 (2 programs per SM)
was 8% (worst 21%) off. Times with it: MiniMax B 1 / 8 / 64 8.7 / 40 / 265-287 us (the last
3.7 TB/s of K/V), Qwen3.5 9.5 / 23.5 / 135 us, DeepSeek 83 / 596 / 4713 us (4.1 TB/s); HF's
repeat_kv + sdpa (bf16 additive mask) took 139 / 1005 / 7838 us on MiniMax, 190 / 1363 / 10780
on Qwen3.5, 132 / 695 / 5386 on DeepSeek (no repeat there: G = 1).

The paged variant (``paged_decode_attention.py``: K/V rows gathered through a slot list, FP8
caches) reuses the program's pieces: ``program_start``, ``softmax_step``, ``p_operand``,
``program_end``, and on the host ``split_plan``, ``split_workspace`` and ``combine``.

This module imports only torch and triton; set ``TRITON_INTERPRET=1`` before importing it to
run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import INTERPRETER, downcast, launch_on_device, mma, mma_pad, round_trip, upcast

KERNEL_VERSION = "decode_attention-3"

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Programs to aim for: ~1 per SM of an H200 (132 SMs); each split takes at least MIN_TILES tiles.
TARGET_PROGRAMS = 132
MIN_TILES_PER_SPLIT = 2
BLOCK_S = 64
# Mask positions one step of the skip's tile-range scan reads.
_SCAN = 1024
# Splits the combine kernel folds per step.
_SPLIT_BLOCK = 16
_NUM_WARPS = 4
_LOG2E = tl.constexpr(1.4426950408889634)

MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2


def block_s_for(d: int, dv: int) -> int:
    """Sequence positions per tile (64 for every head size measured, D up to 256)."""
    return BLOCK_S


def num_splits(batch: int, kv_heads: int, seq_len: int, block_s: int,
               target: int = TARGET_PROGRAMS) -> tuple[int, int]:  # fmt: skip
    """(splits, tiles_per_split) for a grid of ``batch * kv_heads`` rows, about ``target``
    programs; shapes only."""
    tiles = triton.cdiv(seq_len, block_s)
    splits = max(1, min(triton.cdiv(tiles, MIN_TILES_PER_SPLIT), triton.cdiv(target, batch * kv_heads)))
    per_split = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, per_split), per_split


@triton.jit
def p_operand(p, DTYPE: tl.constexpr):
    """The softmax weights as the P @ V operand: rounded to V's dtype (kept fp32 under the
    interpreter, which then multiplies in fp32)."""
    if INTERPRETER:
        return round_trip(p, DTYPE)
    else:
        return downcast(p, DTYPE)


@triton.jit
def softmax_step(x, valid, m_i, l_i):
    """The online softmax over one tile of fp32 scores x [G_PAD, BLOCK_S] (-inf where not
    ``valid`` [BLOCK_S]): returns (new max, the factor alpha that rescales the old sum and
    accumulator, the tile's weights p, the new sum)."""
    x = tl.where(valid[None, :], x, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(x, axis=1))
    # All -inf so far: subtract 0 instead, so exp gives 0, not exp(-inf + inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - m_safe) * _LOG2E)
    p = tl.exp2((x - m_safe[:, None]) * _LOG2E)
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _mask_tile(m_base, s, in_s, stride_ms, MASK_KIND: tl.constexpr, INF_RULES_OUT: tl.constexpr):
    """(the tile's positions that count, the additive mask's fp32 values or 0.0); an additive
    -inf rules a position out only with ``INF_RULES_OUT`` (the softmax gives it weight 0 either way)."""
    valid = in_s
    bias = 0.0
    if MASK_KIND == 1:
        valid = in_s & (tl.load(m_base + s * stride_ms, mask=in_s, other=0) != 0)
    elif MASK_KIND == 2:
        bias = upcast(tl.load(m_base + s * stride_ms, mask=in_s, other=0.0))
        if INF_RULES_OUT:
            valid = in_s & (bias != float("-inf"))
    return valid, bias


@triton.jit
def _tile(q, k_base, v_base, m_base, tile, S, scale, m_i, l_i, acc,
          stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
          D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
          BLOCK_S: tl.constexpr, MASK_KIND: tl.constexpr, SKIP_MASKED: tl.constexpr):  # fmt: skip
    """One BLOCK_S tile of the online softmax; returns the new (m, l, acc)."""
    s = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    in_s = s < S
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    # SKIP_MASKED reads the mask first: a position it rules out (bool False, additive -inf) has
    # weight exactly 0, so its K / V rows are not loaded. Otherwise K's load waits on nothing.
    if SKIP_MASKED:
        valid, bias = _mask_tile(m_base, s, in_s, stride_ms, MASK_KIND, True)
        rows = valid
    else:
        rows = in_s
    kt = tl.load(k_base + d[:, None] * stride_kd + s[None, :] * stride_ks,
                 mask=(d < D)[:, None] & rows[None, :], other=0.0)  # fmt: skip
    x = mma(q, kt) * scale  # [G_PAD, BLOCK_S] fp32
    if not SKIP_MASKED:
        valid, bias = _mask_tile(m_base, s, in_s, stride_ms, MASK_KIND, False)
    if MASK_KIND == 2:
        x = x + bias[None, :]
    m_new, alpha, p, l_i = softmax_step(x, valid, m_i, l_i)
    vt = tl.load(v_base + s[:, None] * stride_vs + dv[None, :] * stride_vd,
                 mask=rows[:, None] & (dv < DV)[None, :], other=0.0)  # fmt: skip
    acc = acc * alpha[:, None] + mma(p_operand(p, vt.dtype), vt)
    return m_new, l_i, acc


@triton.jit
def _kept_step(m_base, s, end, stride_ms, lo, hi, MASK_KIND: tl.constexpr):
    """One step of ``_kept_tiles``: the positions ``s`` the mask keeps, folded into (lo, hi)."""
    valid, _ = _mask_tile(m_base, s, s < end, stride_ms, MASK_KIND, True)
    return tl.minimum(lo, tl.where(valid, s, 2147483647)), tl.maximum(hi, tl.where(valid, s, -1))


@triton.jit
def _kept_tiles(m_base, first, count, S, scans, stride_ms, MASK_KIND: tl.constexpr, BLOCK_S: tl.constexpr,
                SCAN: tl.constexpr, INTERP_SCANS: tl.constexpr):  # fmt: skip
    """[lo, hi): the tiles of the split's ``count`` from ``first`` that lie between the first and
    the last position the mask keeps (lo == hi where it keeps none), read ``SCAN`` positions a
    step in ``scans`` steps. The tiles outside are ruled out whole (a static cache's unwritten tail): the tile loop
    does not visit them, so it keeps no branch that would stop Triton from pipelining its loads."""
    start = first * BLOCK_S
    end = tl.minimum((first + count) * BLOCK_S, S)
    j = tl.arange(0, SCAN)
    lo = tl.full([SCAN], 2147483647, tl.int32)
    hi = tl.full([SCAN], -1, tl.int32)
    if INTERPRETER:
        for c in range(0, INTERP_SCANS):
            lo, hi = _kept_step(m_base, start + c * SCAN + j, end, stride_ms, lo, hi, MASK_KIND)
    else:
        for c in range(0, scans):
            lo, hi = _kept_step(m_base, start + c * SCAN + j, end, stride_ms, lo, hi, MASK_KIND)
    last = tl.max(hi, axis=0)
    tile_lo = tl.where(last >= 0, tl.min(lo, axis=0) // BLOCK_S, first)
    tile_hi = tl.where(last >= 0, last // BLOCK_S + 1, first)
    return tile_lo, tile_hi


@triton.jit
def program_start(Q, stride_qb, stride_qh, stride_qd, H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  G_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr):  # fmt: skip
    """A split program of grid ``(rows * H_KV, splits)``: its (row b, kv head, query heads
    [G_PAD]) as int64, its [G_PAD, D_PAD] query tile (padding 0) and the empty (m, l, acc)."""
    pid = tl.program_id(0)
    b = (pid // H_KV).to(tl.int64)
    kvh = (pid % H_KV).to(tl.int64)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * G + g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=(g < G)[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    return b, kvh, heads, q, m_i, l_i, acc


@triton.jit
def program_end(acc, m_i, l_i, b, heads, OUT, WS_ACC, WS_ML, stride_ob, stride_oh, stride_od,
                H: tl.constexpr, G: tl.constexpr, DV: tl.constexpr, G_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                SPLIT: tl.constexpr):  # fmt: skip
    """A split program's result: (m, l, acc) into the workspace for ``_combine_kernel``, or with
    one split ``acc / l`` straight into OUT[b, heads] (in OUT's dtype)."""
    g_ok = tl.arange(0, G_PAD) < G
    dv = tl.arange(0, DV_PAD)
    if SPLIT:
        splits = tl.num_programs(1)
        row = (b * H + heads) * splits + tl.program_id(1)  # [G_PAD]
        tl.store(WS_ACC + row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None] & (dv < DV)[None, :])
        tl.store(WS_ML + row * 2, m_i, mask=g_ok)
        tl.store(WS_ML + row * 2 + 1, l_i, mask=g_ok)
    else:
        o = acc / l_i[:, None]  # fully masked: 0 / 0 = NaN, like sdpa
        tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + dv[None, :] * stride_od,
                 downcast(o, OUT.dtype.element_ty), mask=g_ok[:, None] & (dv < DV)[None, :])  # fmt: skip


@triton.jit
def _split_kernel(
    Q, K, V, MASK, OUT, WS_ACC, WS_ML,
    S, tiles_per_split, scans, scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_mb, stride_ms,
    stride_ob, stride_oh, stride_od,
    H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    MASK_KIND: tl.constexpr,  # 0 none, 1 bool (uint8 view), 2 additive float
    SKIP_MASKED: tl.constexpr,  # load no K / V row the mask rules out (read the mask first)
    SPLIT: tl.constexpr,  # write (m, l, acc) to the workspace, else out directly
    SCAN: tl.constexpr,  # mask positions a step of _kept_tiles reads (SKIP_MASKED)
    INTERP_TILES: tl.constexpr,  # tiles_per_split, under the interpreter only
    INTERP_SCANS: tl.constexpr,  # scans, under the interpreter only
):  # fmt: skip
    b, kvh, heads, q, m_i, l_i, acc = program_start(Q, stride_qb, stride_qh, stride_qd,
                                                    H_KV, G, D, G_PAD, D_PAD, DV_PAD)  # fmt: skip
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m_base = MASK + b * stride_mb
    first = tl.program_id(1) * tiles_per_split
    # Only the last split can run past S (masked: its loads move no bytes). With SKIP_MASKED the
    # loop runs over the tiles between the first and the last position the mask keeps.
    lo, hi = first, first + tiles_per_split
    if SKIP_MASKED:
        lo, hi = _kept_tiles(m_base, first, tiles_per_split, S, scans, stride_ms, MASK_KIND, BLOCK_S, SCAN,
                             INTERP_SCANS)  # fmt: skip
    if INTERPRETER:
        for i in range(0, INTERP_TILES):
            if (first + i >= lo) & (first + i < hi):
                m_i, l_i, acc = _tile(q, k_base, v_base, m_base, first + i, S, scale, m_i, l_i, acc,
                                      stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                      D, DV, D_PAD, DV_PAD, BLOCK_S, MASK_KIND, SKIP_MASKED)  # fmt: skip
    else:
        for t in range(lo, hi):
            m_i, l_i, acc = _tile(q, k_base, v_base, m_base, t, S, scale, m_i, l_i, acc,
                                  stride_ks, stride_kd, stride_vs, stride_vd, stride_ms,
                                  D, DV, D_PAD, DV_PAD, BLOCK_S, MASK_KIND, SKIP_MASKED)  # fmt: skip
    program_end(acc, m_i, l_i, b, heads, OUT, WS_ACC, WS_ML, stride_ob, stride_oh, stride_od,
                H_KV * G, G, DV, G_PAD, DV_PAD, SPLIT)  # fmt: skip


@triton.jit
def _combine_kernel(
    WS_ACC, WS_ML, OUT,
    splits, split_blocks,
    stride_ob, stride_oh, stride_od,
    H: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
    INTERP_BLOCKS: tl.constexpr,  # split_blocks, under the interpreter only
):  # fmt: skip
    row = tl.program_id(0)  # b * H + h
    b = (row // H).to(tl.int64)
    h = row % H
    j = tl.arange(0, SPLIT_BLOCK)
    dv = tl.arange(0, DV_PAD)
    ml = WS_ML + row.to(tl.int64) * splits * 2
    ws = WS_ACC + row.to(tl.int64) * splits * DV
    # Pass 1: the global max over splits.
    m_run = tl.full([SPLIT_BLOCK], float("-inf"), tl.float32)
    if INTERPRETER:
        for blk in range(0, INTERP_BLOCKS):
            sj = blk * SPLIT_BLOCK + j
            m_run = tl.maximum(m_run, tl.load(ml + sj * 2, mask=sj < splits, other=float("-inf")))
    else:
        for blk in range(0, split_blocks):
            sj = blk * SPLIT_BLOCK + j
            m_run = tl.maximum(m_run, tl.load(ml + sj * 2, mask=sj < splits, other=float("-inf")))
    m_g = tl.max(m_run, axis=0)  # -inf for a fully masked row: the weights below become NaN
    # Pass 2: weights exp(m_s - m_g), summed l and acc.
    l_run = tl.zeros([SPLIT_BLOCK], tl.float32)
    acc = tl.zeros([DV_PAD], tl.float32)
    if INTERPRETER:
        for blk in range(0, INTERP_BLOCKS):
            l_run, acc = _combine_block(ml, ws, blk * SPLIT_BLOCK + j, dv, splits, m_g, l_run, acc, DV)
    else:
        for blk in range(0, split_blocks):
            l_run, acc = _combine_block(ml, ws, blk * SPLIT_BLOCK + j, dv, splits, m_g, l_run, acc, DV)
    o = acc / tl.sum(l_run, axis=0)
    tl.store(OUT + b * stride_ob + h * stride_oh + dv * stride_od, downcast(o, OUT.dtype.element_ty), mask=dv < DV)


@triton.jit
def _combine_block(ml, ws, sj, dv, splits, m_g, l_run, acc, DV: tl.constexpr):
    ok = sj < splits
    m_s = tl.load(ml + sj * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(ml + sj * 2 + 1, mask=ok, other=0.0)
    w = tl.where(ok, tl.exp2((m_s - m_g) * _LOG2E), 0.0)
    a = tl.load(ws + sj[:, None] * DV + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
    return l_run + w * l_s, acc + tl.sum(w[:, None] * a, axis=0)


def split_plan(rows: int, kv_heads: int, seq_len: int, block_s: int, splits: int | None,
               target: int = TARGET_PROGRAMS) -> tuple[int, int]:  # fmt: skip
    """(splits, tiles_per_split): ``num_splits``'s, or ``splits`` (a test's) clamped to the tile
    count with no empty split."""
    if splits is None:
        return num_splits(rows, kv_heads, seq_len, block_s, target)
    tiles = triton.cdiv(seq_len, block_s)
    per_split = triton.cdiv(tiles, max(1, min(splits, tiles)))
    return triton.cdiv(tiles, per_split), per_split


def split_workspace(rows_heads: int, splits: int, dv: int, out: torch.Tensor):
    """(acc, m/l) fp32 workspaces for ``rows_heads`` (row, query head) pairs; with one split
    none is needed (``out`` is passed in their place, never dereferenced)."""
    if splits == 1:
        return out, out
    ws_acc = torch.empty((rows_heads * splits * dv,), dtype=torch.float32, device=out.device)
    ws_ml = torch.empty((rows_heads * splits * 2,), dtype=torch.float32, device=out.device)
    return ws_acc, ws_ml


def combine(ws_acc, ws_ml, out: torch.Tensor, out_strides, rows: int, heads: int, dv: int, splits: int) -> None:
    """Launch ``_combine_kernel``: out[row, head, :Dv] (strides ``out_strides``) from the splits'
    (m, l, acc) in the workspace (``program_end``'s layout)."""
    split_blocks = triton.cdiv(splits, _SPLIT_BLOCK)
    _combine_kernel[(rows * heads,)](
        ws_acc, ws_ml, out,
        splits, split_blocks,
        *out_strides,
        H=heads, DV=dv, DV_PAD=mma_pad(dv), SPLIT_BLOCK=_SPLIT_BLOCK,
        INTERP_BLOCKS=split_blocks if INTERPRETER else 0,
        num_warps=_NUM_WARPS,
    )  # fmt: skip


def _mask_args(mask: torch.Tensor | None, batch: int, seq_len: int, like: torch.Tensor):
    """(pointer tensor, stride_b, stride_s, kind) for a mask broadcastable to [B, 1, 1, S]."""
    if mask is None:
        return like, 0, 0, MASK_NONE
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1 or mask.shape[0] not in (1, batch) \
            or mask.shape[3] != seq_len:  # fmt: skip
        raise ValueError(f"mask must be [{batch} or 1, 1, 1, {seq_len}], got {tuple(mask.shape)}")
    stride_b = mask.stride(0) if mask.shape[0] > 1 else 0
    stride_s = mask.stride(3) if seq_len > 1 else 0
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), stride_b, stride_s, MASK_BOOL
    if mask.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"mask dtype {mask.dtype} not supported (bool, fp16, bf16, fp32)")
    return mask, stride_b, stride_s, MASK_ADD


def decode_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    splits: int | None = None,
    block_s: int | None = None,
    skip_masked: bool = False,
) -> None:
    """Launch decode attention; writes ``out`` [B, H, 1, Dv] (any strides) in q's dtype.

    q [B, H, 1, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] in one of fp16 / bf16 / fp32, any
    strides; mask None, bool or additive float, [B or 1, 1, 1, S], any strides. ``splits``
    (default ``num_splits``) and ``block_s`` (default ``block_s_for``) are for tests.
    ``skip_masked``: read the mask before K and load no K / V row it rules out (for a mask
    that rules rows out: DSA's top-k, a static cache's tail; each K / V load then waits on a
    mask load).
    No host syncs; with splits > 1 the fp32 workspace comes from ``torch.empty``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q [B, H, 1, D], k, v [B, Hkv, S, D] expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    batch, heads, _, d = q.shape
    _, kv_heads, seq_len, dv = v.shape
    if tuple(k.shape) != (batch, kv_heads, seq_len, d) or v.shape[0] != batch or heads % kv_heads:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if tuple(out.shape) != (batch, heads, 1, dv) or out.dtype != q.dtype:
        raise ValueError(f"out must be [{batch}, {heads}, 1, {dv}] {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one of fp16 / bf16 / fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if seq_len == 0:
        raise ValueError("decode attention needs at least one key (S >= 1)")
    if batch * heads == 0:
        return
    group = heads // kv_heads
    m_ptr, stride_mb, stride_ms, mask_kind = _mask_args(mask, batch, seq_len, q)
    block_s = block_s or block_s_for(d, dv)
    splits, per_split = split_plan(batch, kv_heads, seq_len, block_s, splits)
    split = splits > 1
    ws_acc, ws_ml = split_workspace(batch * heads, splits, dv, out)
    skip = bool(skip_masked) and mask_kind != MASK_NONE
    scans = triton.cdiv(per_split * block_s, _SCAN) if skip else 0

    def _launch():
        _split_kernel[(batch * kv_heads, splits)](
            q, k, v, m_ptr, out, ws_acc, ws_ml,
            seq_len, per_split, scans, float(scale),
            q.stride(0), q.stride(1), q.stride(3),
            k.stride(0), k.stride(1), k.stride(2), k.stride(3),
            v.stride(0), v.stride(1), v.stride(2), v.stride(3),
            stride_mb, stride_ms,
            out.stride(0), out.stride(1), out.stride(3),
            H_KV=kv_heads, G=group, D=d, DV=dv,
            G_PAD=mma_pad(group), D_PAD=mma_pad(d), DV_PAD=mma_pad(dv), BLOCK_S=block_s, MASK_KIND=mask_kind,
            SKIP_MASKED=skip, SPLIT=split, SCAN=_SCAN,
            INTERP_TILES=per_split if INTERPRETER else 0, INTERP_SCANS=scans if INTERPRETER else 0,
            num_warps=_NUM_WARPS,
        )  # fmt: skip
        if split:
            combine(ws_acc, ws_ml, out, (out.stride(0), out.stride(1), out.stride(3)), batch, heads, dv, splits)

    launch_on_device(q, _launch)
