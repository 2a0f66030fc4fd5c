"""Fused (residual add +) RMSNorm forward, optionally gated: one Triton kernel and its launcher.

Semantics (the reference is ``fusion_compiler.ops.rms_norm``; this file must match it):

    sum  = x + residual                      # rounded to x.dtype, like eager ``x + residual``
    h    = sum.float()                       # or x.float() without residual
    rstd = rsqrt(mean(h * h, dim=-1) + eps)
    y    = h * rstd * (weight.float() + weight_offset)
    y    = y * silu(gate.float())            # the gated norm (Qwen3.5 GDN's output norm) only
    out  = y.to(out.dtype)

``weight_offset=1.0`` gives the Gemma / Qwen3.5 ``x * (1 + w)`` norm.  The norm is always
over the last dim; leading dims are collapsed into rows.

bf16 conversions: under Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.6), every
bf16 -> fp32 load goes through a bit shift (``_device.upcast``) and every fp32 -> bf16 store
through an integer round-to-nearest-even (``_device.fp32_to_bf16_rtne``; helpers shared with
the other kernels in ``_device.py``), because the interpreter truncates
fp32 -> bf16, mangles bf16 subnormals and adds bf16 values as raw uint16; that is what lets
the CPU tests check the residual sum bit-exactly against eager ``x + residual``.  On the GPU
the native casts give the same bits, and the bit operations cost ~30% at decode shapes
(bench/NOTES.md), so they are compiled only under the interpreter.
The sum itself is formed in fp32 and rounded once: for bf16/fp16 inputs the fp32 sum is
rounded from the exact one and the second rounding is innocuous (24 >= 2*p + 2), so the
result equals eager's correctly rounded add.

This module imports only torch and triton.  Set ``TRITON_INTERPRET=1`` *before* importing it
to run the kernel on CPU tensors.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ._device import downcast as _downcast
from ._device import upcast as _upcast

# Bump whenever the kernel or its launch table changes: the compiler hashes it into the
# Inductor cache key.
KERNEL_VERSION = "rms_norm-5"

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Launch table keyed by BLOCK_N = next_power_of_2(N):  (rows per program, num_warps).
# Measured with kernel rms_norm-1 (bit-level casts on the GPU too; rms_norm-3 is faster at
# small shapes, see bench/NOTES.md) on an H200 (torch 2.11, triton 3.6), bf16 x, CUDA-graph replay
# (triton.testing.do_bench_cudagraph), with residual for N >= 512.  Times are per call;
# the alternatives tried are in brackets.  Rule that came out of it: for many short rows
# pack rows until a program moves ~16 elements per thread (2048 on 4 warps); for long rows
# one row per program with ~16 elements per thread, rounded towards more warps for decode.
_LAUNCH_TABLE: dict[int, tuple[int, int]] = {
    # Tiny rows (N <= 64): 65536 rows 7.7 us, 4.4 TB/s  [(32,4) 7.6, (16,2) 7.9].
    64: (16, 4),
    # Per-head q/k norm, head_dim 128 (M = tokens x heads): 262144 rows 35 us, 3.8 TB/s
    # [(8,4) 38.5, (4,4) 51, (1,4) 160 us]; one row per program is 4.5x slower.
    128: (16, 4),
    # Per-head norm, head_dim 256 (Qwen3.5 Gemma q/k norm): 131072 rows 35 us, 3.8 TB/s
    # [(4,4) 38, (1,4) 82, (4,8) 59 us].
    256: (8, 4),
    # DeepSeek kv_a 512: 16 rows 1.7 us [(4,4) 1.9, (8,4) 2.3]; at 4096+ rows all within 8%.
    512: (2, 4),
    # MiniMax k-norm 1024: best at 16 rows (1.7 us) and 32768 rows (4.1 TB/s)
    # [(2,4) 2.0 / 67 us, (1,2) 2.0 / 68 us vs 65.5 us].
    1024: (1, 4),
    # DeepSeek q_a_layernorm 1536: 16 rows 1.9 us, 4096 rows 14.5 us [(1,4) 2.0 / 15.5].
    2048: (1, 8),
    # Qwen 4096, MiniMax 3072: 1 token 2.3 us, 256 tokens 3.2 us [(1,4) 2.5 / 3.5,
    # (1,16) 2.3 / 3.3]; (1,16) is 3% faster only at 4096 tokens. With HBM-rotated inputs
    # 256 x 4096 (1,16) is 4.31 us vs Inductor 3.87 (1.11x), worse than (1,8)'s 1.085x
    # (bench/results/archive/kernels_h200_4096_1x16_rejected.json; bench/NOTES.md, rms_norm).
    4096: (1, 8),
    # DeepSeek 7168, MiniMax q-norm 6144: best at 1/16/256/4096 tokens (3.0, 3.1, 4.7,
    # 60.5 us = 3.9 TB/s) [(1,8) 3.3 / 61.4, (1,32) 3.0 / 62.4].
    8192: (1, 16),
    # 4096 rows 134 us, 4.0 TB/s [(1,32) same, (1,8) 160 us]: the row still fits in registers.
    16384: (1, 16),
}
# Rows wider than this are processed in chunks of _LOOP_BLOCK_N (two passes over the row,
# the second one re-reading x/residual from memory) instead of holding the row in registers.
# N = 32768: 16 rows 9.7 us, 2048 rows 186 us [4096-wide chunks on 8 warps: 11.5 / 198 us].
_MAX_SINGLE_TILE_BLOCK_N = 16384
_LOOP_BLOCK_N = 8192
_LOOP_NUM_WARPS = 16


@dataclasses.dataclass(frozen=True)
class RmsNormConfig:
    """The launch policy; the defaults are the shipped one (the table above). ``rows`` /
    ``warps`` None: the table's entry for the row's BLOCK_N (looped: one row a program and
    ``_LOOP_NUM_WARPS``); ``loop_block_n``: every row in chunks this wide (two passes), None:
    only rows wider than ``_MAX_SINGLE_TILE_BLOCK_N``, in ``_LOOP_BLOCK_N`` chunks. Benches time
    other launches through it."""

    rows: int | None = None
    warps: int | None = None
    loop_block_n: int | None = None


DEFAULT_CONFIG = RmsNormConfig()


def launch_config(n: int, config: RmsNormConfig = DEFAULT_CONFIG) -> tuple[int, int, int, bool]:
    """(BLOCK_N, rows_per_program, num_warps, looped) for a row of ``n`` elements."""
    block_n = triton.next_power_of_2(max(int(n), 1))
    if config.loop_block_n is not None or block_n > _MAX_SINGLE_TILE_BLOCK_N:
        chunk = _LOOP_BLOCK_N if config.loop_block_n is None else config.loop_block_n
        return chunk, 1, _LOOP_NUM_WARPS if config.warps is None else config.warps, True
    block_n = max(block_n, 64)  # smaller rows use the 64 entry (masked)
    rows, warps = _LAUNCH_TABLE[block_n]
    rows = rows if config.rows is None else config.rows
    warps = warps if config.warps is None else config.warps
    return block_n, rows, warps, False


@triton.jit
def _load_row_tile(X, R, SUM, rows, cols, mask, stride_x, stride_r, stride_sum,
                   HAS_RESIDUAL: tl.constexpr, STORE_SUM: tl.constexpr):
    """Load x (+ residual, rounded to x.dtype, optionally stored) and return it in fp32."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        s = _downcast(_upcast(x) + _upcast(r), X.dtype.element_ty)
        if STORE_SUM:
            tl.store(SUM + rows[:, None] * stride_sum + cols[None, :], s, mask=mask)
        return _upcast(s)
    else:
        return _upcast(x)


@triton.jit
def _silu_gate(G, rows, cols, mask, stride_g):
    """silu(gate) of a tile, in fp32 (the gated norm's factor)."""
    g = _upcast(tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0))
    return g * tl.sigmoid(g)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_fwd_kernel(
    X, R, W, OUT, SUM, G,
    M,
    stride_x, stride_r, stride_out, stride_sum, stride_g,
    eps, weight_offset,
    N: tl.constexpr,  # the row width: a model constant; full tiles go unmasked
    INDEX64: tl.constexpr,  # row offsets can pass 2**31 elements (long prefill batches)
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,  # 1: whole row in registers; else cdiv(N, BLOCK_N) chunks
):
    # NUM_CHUNKS is a constexpr (recompiles per chunk count, only for N > 16384) because the
    # interpreter cannot loop over range(0, N, BLOCK_N) with a runtime N.
    pid = tl.program_id(0)
    if INDEX64:
        rows = pid.to(tl.int64) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    else:
        rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    row_mask = rows < M
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        # The weight load (and the gated norm's gate load) is issued before the reduction:
        # after it, its DRAM round trip would sit on the critical path of a one-row decode
        # launch (measured for the weight: +0.8 us at 1 token x 7168 against Inductor, which
        # loads every input up front; the gate follows the same rule, not yet timed).
        w = _upcast(tl.load(W + cols, mask=col_mask, other=0.0)) + weight_offset
        if HAS_GATE:
            gate = _silu_gate(G, rows, cols, mask, stride_g)
        h = _load_row_tile(X, R, SUM, rows, cols, mask, stride_x, stride_r, stride_sum,
                           HAS_RESIDUAL, True)
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        y = h * rstd[:, None] * w[None, :]
        if HAS_GATE:
            y = y * gate
        tl.store(OUT + rows[:, None] * stride_out + cols[None, :],
                 _downcast(y, OUT.dtype.element_ty), mask=mask)
    else:
        # Pass 1: sum of squares (and the residual sum) chunk by chunk.
        acc = tl.zeros([ROWS_PER_PROGRAM, BLOCK_N], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < N)[None, :]
            h = _load_row_tile(X, R, SUM, rows, cols, mask, stride_x, stride_r, stride_sum,
                               HAS_RESIDUAL, True)
            acc += h * h
        rstd = tl.math.rsqrt(tl.sum(acc, axis=1) / N + eps)
        # Pass 2: re-read x (+ residual) rather than SUM, so there is no read-after-write
        # between threads through global memory; the rounded sum is recomputed bit-identically.
        for chunk in range(NUM_CHUNKS):
            cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            h = _load_row_tile(X, R, SUM, rows, cols, mask, stride_x, stride_r, stride_sum,
                               HAS_RESIDUAL, False)
            w = _upcast(tl.load(W + cols, mask=col_mask, other=0.0)) + weight_offset
            y = h * rstd[:, None] * w[None, :]
            if HAS_GATE:
                y = y * _silu_gate(G, rows, cols, mask, stride_g)
            tl.store(OUT + rows[:, None] * stride_out + cols[None, :],
                     _downcast(y, OUT.dtype.element_ty), mask=mask)


def _rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """[M, N] view of an input with unit stride on the last dim; copies only if needed.

    ``view(-1, N)`` succeeds without a copy whenever the leading dims can be collapsed
    (contiguous tensors, row slices, ...); otherwise, or if the last dim is strided, the
    input is made contiguous (one extra copy, still capturable in a CUDA graph).
    """
    if t.stride(-1) != 1 and n > 1:
        t = t.contiguous()
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.contiguous().view(-1, n)


def _rows_view_out(t: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """[M, N] view of an output; outputs are written in place, so no copy is allowed."""
    if t.stride(-1) != 1 and n > 1:
        raise ValueError(f"{name} must have a unit stride on its last dim, got strides {t.stride()}")
    try:
        return t.view(-1, n)
    except RuntimeError:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
            f"[M, {n}] rows without a copy"
        ) from None


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    config: RmsNormConfig | None = None,
) -> None:
    """Launch the fused (residual add +) RMSNorm kernel; writes ``out`` (and ``sum_out``).

    Args:
        x: [..., N] fp16/bf16/fp32.  Viewed as [M, N] rows: no copy when the last dim is
            contiguous and the leading dims collapse into one stride, else ``x.contiguous()``.
        weight: [N], fp16/bf16/fp32 (applied in fp32 as ``weight + weight_offset``).
        eps, weight_offset: python floats (passed to the kernel as fp32 scalars).
        out: same shape as x, any of fp16/bf16/fp32; written in place, so it must be viewable
            as [M, N] with unit last-dim stride.
        residual / sum_out: both or neither.  residual has x's shape and dtype; sum_out
            (same shape and dtype) receives ``x + residual`` rounded to x.dtype.
        gate: x's shape, fp16/bf16/fp32; the output is multiplied by ``silu(gate)`` in fp32.
        config: the launch policy (``RmsNormConfig``); None: the shipped one.
    ``out`` and ``sum_out`` must not overlap the inputs.  No host syncs: safe to call during
    CUDA-graph capture once the kernel has been compiled (one warm-up call per config).
    """
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dim, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight must have shape [{n}], got {tuple(weight.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"out must have shape {tuple(x.shape)}, got {tuple(out.shape)}")
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        if t.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} not supported (fp16, bf16, fp32)")
    if (residual is None) != (sum_out is None):
        raise ValueError("residual and sum_out must be given together")
    if residual is not None:
        for name, t in (("residual", residual), ("sum_out", sum_out)):
            if t.shape != x.shape or t.dtype != x.dtype:
                raise ValueError(
                    f"{name} must match x ({tuple(x.shape)}, {x.dtype}), "
                    f"got ({tuple(t.shape)}, {t.dtype})"
                )
    if gate is not None:
        if gate.shape != x.shape or gate.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"gate must have x's shape {tuple(x.shape)} and dtype fp16/bf16/fp32, "
                             f"got ({tuple(gate.shape)}, {gate.dtype})")  # fmt: skip
    tensors = [x, weight, out] + ([residual, sum_out] if residual is not None else [])
    tensors += [gate] if gate is not None else []
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"all tensors must be on {x.device}, got {[str(t.device) for t in tensors]}")
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps must be finite and > 0, got {eps}")

    if x.numel() == 0:
        return

    x2 = _rows_view(x, n)
    out2 = _rows_view_out(out, n, "out")
    if residual is not None:
        r2 = _rows_view(residual, n)
        s2 = _rows_view_out(sum_out, n, "sum_out")
    else:
        # Dummies: never dereferenced when HAS_RESIDUAL is False.
        r2, s2 = x2, out2
    g2 = _rows_view(gate, n) if gate is not None else x2  # a dummy without a gate
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]

    block_n, rows, num_warps, looped = launch_config(n, DEFAULT_CONFIG if config is None else config)
    grid = (triton.cdiv(m, rows),)

    def _launch():
        _rms_norm_fwd_kernel[grid](
            x2, r2, weight, out2, s2, g2,
            m,
            x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0), g2.stride(0),
            float(eps), float(weight_offset),
            N=n,
            INDEX64=m * max(x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0), g2.stride(0), n) >= 2**31,
            HAS_RESIDUAL=residual is not None,
            HAS_GATE=gate is not None,
            BLOCK_N=block_n,
            ROWS_PER_PROGRAM=rows,
            NUM_CHUNKS=triton.cdiv(n, block_n) if looped else 1,
            num_warps=num_warps,
        )

    if x.device.type == "cuda":
        # Launch on x's device even if another device is current.
        with torch.cuda.device(x.device):
            _launch()
    else:
        _launch()
