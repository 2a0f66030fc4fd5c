"""Triton device helpers shared by the kernels: dtype casts, FP8 group quant, RoPE pairs.

Everything here is ``@triton.jit`` device code (inlined into the calling kernel); this module
imports only torch and triton, and must be imported after ``TRITON_INTERPRET`` is set to run on CPU.

Casts under Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.6): its fp32 -> bf16 cast
truncates, its bf16 -> fp32 cast mangles subnormals, and its fp32 -> fp8 cast neither rounds to
nearest even (it rounds half up, dropping the carry into the exponent) nor handles subnormals
or NaN.  So under the interpreter ``upcast`` / ``downcast`` / ``to_fp8e4nv`` work on the bit
patterns (integer round-to-nearest-even); on the GPU the native conversions give the same bits
(``cvt.rn.bf16.f32``, ``cvt.rn.satfinite.e4m3x2.f32``) with fewer instructions, so the bit
operations are compiled only under the interpreter (``INTERPRETER_BIT_CASTS``).

FP8 contract (``fusion_compiler.ops.fp8_quant``), per group of values along the last axis:
``amax = max(max|x|, 1e-4)``, ``scale = amax / 448`` (or with ue8m0 the power of two
``2 ** ceil(log2(amax / 448))``), ``y = clamp(x / scale, +-448) -> float8_e4m3fn``; a NaN
anywhere in a group makes the group's scale NaN and so all its outputs NaN.  The GPU's
``max`` drops NaN, so NaN is detected explicitly (a count of ``x != x``).
"""

from __future__ import annotations

import os

import torch

import triton
import triton.language as tl

# The interpreter needs the bit-level conversions below; the GPU's native casts give the
# same bits with fewer instructions on the decode critical path.
INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
INTERPRETER_BIT_CASTS = INTERPRETER

FP8_MAX = tl.constexpr(448.0)
FP8_AMAX_FLOOR = tl.constexpr(1e-4)


# ---------------------------------------------------------------------------------------------
# bf16 / fp16 / fp32 casts
# ---------------------------------------------------------------------------------------------


@triton.jit
def fp32_to_bf16_rtne(v):
    """Round-to-nearest-even fp32 -> bf16 on the bit pattern (interpreter path)."""
    bits = v.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    # NaN: keep sign and payload top bits, force the quiet bit (the add could carry a NaN
    # into the sign bit or turn it into inf).
    rounded = tl.where(v != v, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def upcast(v):
    """Any float -> fp32.  Under the interpreter, bf16 -> fp32 shifts the bits."""
    if v.dtype == tl.bfloat16 and INTERPRETER_BIT_CASTS:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def downcast(v, DTYPE: tl.constexpr):
    """fp32 -> DTYPE (fp16 / bf16 / fp32), round to nearest even."""
    if DTYPE == tl.bfloat16 and INTERPRETER_BIT_CASTS:
        return fp32_to_bf16_rtne(v)
    else:
        return v.to(DTYPE)


@triton.jit
def round_trip(v, DTYPE: tl.constexpr):
    """fp32 value rounded to DTYPE and back: what a later ``x.to(DTYPE).float()`` reads."""
    return upcast(downcast(v, DTYPE))


@triton.jit
def rows_dot_step(acc, w_ptrs, v_ptrs, k0, rows, cols, ROWS, COLS, EVEN: tl.constexpr):
    """One step of a GEMV over whole weight rows: ``acc`` [BLOCK_N, BLOCK_K] plus
    w[rows, k0 + cols] * v[k0 + cols] in fp32 (loads masked to ROWS x COLS unless EVEN); the
    caller sums acc over its last axis once, after the loop."""
    if EVEN:
        v = tl.load(v_ptrs + k0)
        w = tl.load(w_ptrs + k0)
    else:
        in_cols = (k0 + cols) < COLS
        v = tl.load(v_ptrs + k0, mask=in_cols, other=0.0)
        w = tl.load(w_ptrs + k0, mask=(rows[:, None] < ROWS) & in_cols[None, :], other=0.0)
    return acc + upcast(w) * upcast(v)[None, :]


def mma_pad(n: int) -> int:
    """A tile dim that ``mma`` / tl.dot takes: ``n`` padded to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def mma(a, b):
    """a @ b with fp32 accumulation: native half-precision MMA on the GPU, IEEE fp32 (never tf32)
    for fp32 or mixed-dtype operands, and under the interpreter with operands upcast (numpy's
    half-precision matmul would accumulate in half)."""
    if INTERPRETER:
        return tl.dot(upcast(a), upcast(b), input_precision="ieee")
    elif a.dtype == tl.float32 or a.dtype != b.dtype:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def mean_from_sum(total, N: tl.constexpr):
    """``total / N`` rounded correctly, like torch's ``mean`` (plain ``/`` is approximate on
    the GPU, ``div.full.f32``)."""
    return tl.math.div_rn(total, tl.full(total.shape, N, tl.float32))


@triton.jit
def div_rn_by(x, d, TINY_X: tl.constexpr = True):
    """``x / d`` rounded correctly (as ``div_rn``) wherever the quotient is a normal fp32, for
    one divisor ``d`` shared by every lane: q = x * RN(1 / d) is within an ulp of x / d, and one
    correction q + (x - q d) / d, the residual exact in an FMA, rounds it correctly (Markstein's
    theorem: round to nearest, nothing overflowing or underflowing on the way). A handful of
    instructions a lane instead of div.rn's ~20 with its slow-path call: the GQA prologue at
    4096 tokens is bound by instruction issue, and its FP8 cache writes paid for the division
    (bench/NOTES.md, gqa_prologue). The theorem's edges: an infinite q (x / d overflows) and a
    zero result (whose sign the correction can lose) keep q; x below 2**-100 would leave a
    subnormal residual, so with TINY_X it is scaled by 2**64 first and the quotient back (exact
    unless the quotient itself is subnormal). Without TINY_X such x may come out an ulp off a
    quotient below 2**-76: callers that convert to FP8 (0 there, sign kept) skip the scaling.
    The interpreter's fma rounds twice, so there it divides."""
    if INTERPRETER:
        return tl.math.div_rn(x, tl.full(x.shape, 0.0, tl.float32) + d)
    else:
        d = d.to(tl.float32)
        d_inv = tl.math.div_rn(d * 0.0 + 1.0, d)  # once: d is a scalar
        xs = x
        if TINY_X:
            tiny = tl.abs(x) < 7.888609052210118e-31  # 2**-100
            xs = tl.where(tiny, x * 1.8446744073709552e19, x)  # 2**64
        q = xs * d_inv
        corrected = tl.fma(tl.fma(-q, d, xs), d_inv, q)
        corrected = tl.where((corrected == 0.0) | (tl.abs(q) == float("inf")), q, corrected)
        if TINY_X:
            corrected = tl.where(tiny, corrected * 5.421010862427522e-20, corrected)  # 2**-64
        return corrected


# ---------------------------------------------------------------------------------------------
# FP8 (float8_e4m3fn)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _fp32_to_e4m3fn_bits(v):
    # Bit-level RTNE fp32 -> e4m3fn code (uint32), for |v| <= 448 or NaN (callers clamp).
    # e4m3fn: bias 7, 3 mantissa bits, normals from 2**-6, subnormals m * 2**-9, 0x7F NaN.
    bits = v.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: round the 23-bit mantissa to 3 bits (ties to even), then rebias the
    # exponent from 127 to 7 (a carry out of the mantissa bumps the exponent, as it should).
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Below 2**-6: the code is |v| * 2**9 rounded to an integer (exact scaling; adding 2**23
    # rounds to an integer, ties to even, in fp32 arithmetic).
    is_normal = mag >= 0x3C800000  # 2**-6
    scaled = tl.where(is_normal, 0.0, mag.to(tl.float32, bitcast=True) * 512.0)  # no NaN casts
    sub = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(is_normal, normal, sub)
    code = tl.where(v != v, 0x7F, code)
    return code | sign


@triton.jit
def to_fp8e4nv(v):
    """fp32 (already clamped to +-448, or NaN) -> float8_e4m3fn, round to nearest even."""
    if INTERPRETER_BIT_CASTS:
        return _fp32_to_e4m3fn_bits(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def to_fp8e4nv_clamped(v):
    """fp32 -> float8_e4m3fn of v clamped to +-448 (NaN stays NaN), round to nearest even. On
    the GPU the conversion itself clamps (``cvt.rn.satfinite``: beyond +-448, infinities
    included, to +-448), so no min / max a lane."""
    if INTERPRETER_BIT_CASTS:
        return to_fp8e4nv(tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX))
    else:
        return v.to(tl.float8e4nv)


@triton.jit
def pow2_ceil(x):
    """Smallest power of two >= x, for positive normal fp32 x (inf stays inf).

    Exact, on the bits (DeepGEMM's ``fast_log2_ceil``).  The reference's fp32
    ``exp2(ceil(log2(x)))`` agrees except for x within ~2**-20 above a power of two, where
    fp32 log2 rounds onto the integer and picks the lower power.  With bf16/fp16 activations
    (the quant inputs are rounded to them first) amax / 448 never lands that close to a power
    of two; with fp32 ones it does with probability ~2**-20 per group.
    """
    bits = x.to(tl.uint32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent += ((bits & 0x7FFFFF) != 0).to(tl.uint32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_group_scale(y, mask, UE8M0: tl.constexpr):
    """The fp32 scale [R] of each row (one group) of fp32 ``y`` [R, C] (``mask``: real lanes):
    max(amax, 1e-4) / 448 (correctly rounded), ue8m0's power of two, NaN if the group has one."""
    a = tl.where(mask, tl.abs(y), 0.0)
    nans = tl.sum((mask & (y != y)).to(tl.int32), axis=1)
    amax = tl.maximum(tl.max(a, axis=1), FP8_AMAX_FLOOR)
    scale = tl.math.div_rn(amax, FP8_MAX)
    if UE8M0:
        scale = pow2_ceil(scale)
    return tl.where(nans > 0, float("nan"), scale)


@triton.jit
def fp8_codes(y, scale, mask):
    """float8e4nv codes of fp32 ``y`` [R, C] with one scale per row (``scale`` [R]):
    clamp(y / scale, +-448), IEEE division (plain ``/`` is approximate on the GPU) so the codes
    match x / scale; masked lanes give 0 codes."""
    q = tl.math.div_rn(y, scale[:, None])
    q = tl.clamp(q, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    q = tl.where(mask, q, 0.0)
    return to_fp8e4nv(q)


@triton.jit
def fp8_group_quant(y, mask, UE8M0: tl.constexpr):
    """FP8 quant of fp32 ``y`` [R, C], one group per row (axis 1); ``mask`` marks real lanes.

    Returns (float8e4nv codes [R, C], fp32 scales [R]).  Masked lanes give 0 codes.
    """
    scale = fp8_group_scale(y, mask, UE8M0)
    return fp8_codes(y, scale, mask), scale


@triton.jit
def fp8e4nv_to_fp32(x):
    """float8e4nv -> fp32, exact. Triton 3.6's interpreter decodes the NaN code 0x7F as +-480,
    so there it is mapped to NaN explicitly."""
    if INTERPRETER:
        nan = (x.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F
        return tl.where(nan, float("nan"), x.to(tl.float32))
    else:
        return x.to(tl.float32)


@triton.jit
def store_fp32_at_byte(base_u8, byte_offsets, v, mask):
    """Store fp32 ``v`` into a uint8 buffer at ``byte_offsets`` (4-byte aligned offsets)."""
    tl.store((base_u8 + byte_offsets).to(tl.pointer_type(tl.float32)), v, mask=mask)


@triton.jit
def store_fp8_as_bytes(base_u8, offsets, codes, mask):
    """Store float8e4nv ``codes`` into a uint8 buffer."""
    tl.store(base_u8 + offsets, codes.to(tl.uint8, bitcast=True), mask=mask)


# ---------------------------------------------------------------------------------------------
# RoPE: every lane d of a rotary span computes its own output from its value x[d], the value
# of its pair partner x[partner(d)] and the pair's angle cos/sin[pair(d)].  Partners are
# gathered (second load of the same cache lines), which keeps rows that are also normed in
# the kernel (index_k) elementwise: the partner's normed value is recomputed bit-identically.
# ---------------------------------------------------------------------------------------------


@triton.jit
def rope_interleaved_lanes(d):
    """GPT-J pairs (2i, 2i+1): (partner index, pair index, is-first-of-pair) of lane d."""
    return d ^ 1, d // 2, (d & 1) == 0


@triton.jit
def rope_neox_lanes(d, HALF: tl.constexpr):
    """NeoX pairs (i, i + HALF) for d < 2 * HALF (other lanes: partner = d, pair 0)."""
    first = d < HALF
    rotary = d < 2 * HALF
    partner = tl.where(first, d + HALF, tl.where(rotary, d - HALF, d))
    pair = tl.where(first, d, tl.where(rotary, d - HALF, 0))
    return partner, pair, first


@triton.jit
def rotate(x, xp, c, s, first):
    """fp32 pair rotation: first' = first*cos - second*sin, second' = second*cos + first*sin."""
    return tl.where(first, x * c - xp * s, x * c + xp * s)


@triton.jit
def interleaved_out_index(d, pair, HALF: tl.constexpr, DEINTERLEAVE: tl.constexpr):
    """Output position of lane d: in place, or HF's de-interleaved [firsts | seconds]."""
    if DEINTERLEAVE:
        return pair + (d & 1) * HALF
    else:
        return d


def launch_on_device(like: torch.Tensor, launch) -> None:
    """Run `launch()` with `like`'s CUDA device current (Triton launches on the current one)."""
    if like.device.type == "cuda":
        with torch.cuda.device(like.device):
            launch()
    else:
        launch()
