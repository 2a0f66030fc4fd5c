"""DeepSeek V3.2 MLA q prologue: q_pe RoPE + concat with q_other, indexer q NeoX RoPE (+ FP8
quant with the q scales folded into the head weights), as one Triton launch.

The contract is ``fusion_compiler.ops.mla_q_prologue`` (its reference is the numerical truth;
this file must match it).  Grid ``(tokens, q_programs + index_q_programs)``: a token's heads are
split over several programs (``*_HEADS_PER_PROGRAM`` heads each, a ``[heads, dim]`` tile), so
that one token's 128 x 576 q values are not on one SM.  Program ids below ``n_q_programs`` run
the q role, the rest the index_q role; an absent role gets no programs.

* q: ``out[t, h, :D_other] = q_other[t, h]`` (a copy), ``out[t, h, D_other:]`` = interleaved
  RoPE of ``q_pe[t, h]`` (pairs in place, or HF's de-interleaved layout).
* index_q: NeoX RoPE of the first rot dims of each head, rounded to index_q's dtype; stored as
  is, or FP8 with one scale per (token, head) and ``weights_out = w * w_scale * scale``.

No host syncs: the launcher reads shapes and strides only.  This module imports only torch and
triton; set ``TRITON_INTERPRET=1`` before importing it to run the kernel on CPU tensors.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import (
    launch_on_device,
    downcast,
    fp8_group_quant,
    interleaved_out_index,
    rope_interleaved_lanes,
    rope_neox_lanes,
    rotate,
    upcast,
)

# Bump whenever the kernel or its launch choices change (hashed into the Inductor cache key).
KERNEL_VERSION = "mla_q_prologue-2"

# A program holds about this many lanes ([heads, dim] tile, dims padded to powers of two):
# Launch table, measured on an H200 (torch 2.11, triton 3.6) at DeepSeek V3.2 widths (128 q heads
# x (512 + 64), 64 index heads x 128, FP8 index q), CUDA-graph replays, bench/diagnostics/mla_q_sweep.py
# (bench/results/mla_q_sweep_h200.json). (q lanes, index_q lanes, warps) -> us at 1/64/256/4096
# tokens:
#   (2048, 1024, 4): 2.65 / 12.3 / 35.9 / 546   (the first, untuned choice)
#   (2048, 1024, 8): 2.11 / 10.5 / 33.5 / 513
#   (9216, 2048, 8): 2.62 /  9.3 / 27.2 / 393   (79% of the 4.2 TB/s copy bandwidth)
# Few tokens want many small programs (one token cannot fill the GPU otherwise); many tokens want
# 16 q heads and 16 index heads per program.  Keyed on tokens, known at launch (no sync).
_FEW_TOKENS = 16
_LAUNCH = {"few": (2048, 1024, 8), "many": (9216, 2048, 8)}


@dataclasses.dataclass(frozen=True)
class MlaQPrologueConfig:
    """The launch: about ``q_lanes`` / ``index_q_lanes`` lanes a program for the q / index_q
    roles, ``warps`` a program; each None: the table's entry for the token count (``_LAUNCH``,
    the shipped policy). bench/diagnostics/mla_q_sweep.py times other launches through it."""

    q_lanes: int | None = None
    index_q_lanes: int | None = None
    warps: int | None = None


DEFAULT_CONFIG = MlaQPrologueConfig()


@triton.jit
def _q_role(t, prog, QPE, QOTHER, QOUT, s_pe_t, s_pe_h, s_ot_t, s_ot_h, s_out_t, s_out_h,
            cos_row, sin_row, H,
            HPP: tl.constexpr, HAS_OTHER: tl.constexpr, D_OTHER: tl.constexpr,
            OTHER_BLOCK: tl.constexpr, ROT: tl.constexpr, ROT_BLOCK: tl.constexpr,
            DEINTERLEAVE: tl.constexpr):
    h = prog * HPP + tl.arange(0, HPP)[:, None]
    hmask = h < H
    out_row = QOUT + t * s_out_t + h * s_out_h
    if HAS_OTHER:
        o = tl.arange(0, OTHER_BLOCK)[None, :]
        omask = hmask & (o < D_OTHER)
        v = tl.load(QOTHER + t * s_ot_t + h * s_ot_h + o, mask=omask)
        tl.store(out_row + o, v, mask=omask)
    d = tl.arange(0, ROT_BLOCK)[None, :]
    rmask = d < ROT
    mask = hmask & rmask
    partner, pair, first = rope_interleaved_lanes(d)
    pe_row = QPE + t * s_pe_t + h * s_pe_h
    x = upcast(tl.load(pe_row + d, mask=mask, other=0.0))
    xp = upcast(tl.load(pe_row + partner, mask=mask, other=0.0))
    c = upcast(tl.load(cos_row + pair, mask=rmask, other=0.0))
    s = upcast(tl.load(sin_row + pair, mask=rmask, other=0.0))
    y = downcast(rotate(x, xp, c, s, first), QOUT.dtype.element_ty)
    out_d = D_OTHER + interleaved_out_index(d, pair, ROT // 2, DEINTERLEAVE)
    tl.store(out_row + out_d, y, mask=mask)


@triton.jit
def _index_q_role(t, prog, IQ, IW, IQ_OUT, IW_OUT, s_iq_t, s_iq_h, s_iqo_t, s_iqo_h,
                  s_iw_t, s_iw_h, s_iwo_t, s_iwo_h, w_scale, cos_row, sin_row, HI,
                  HPP: tl.constexpr, D: tl.constexpr, D_BLOCK: tl.constexpr,
                  ROT: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
                  HAS_WEIGHTS: tl.constexpr):
    h1 = prog * HPP + tl.arange(0, HPP)
    h = h1[:, None]
    hmask = h < HI
    d = tl.arange(0, D_BLOCK)[None, :]
    mask = hmask & (d < D)
    rotary = d < ROT
    partner, pair, first = rope_neox_lanes(d, ROT // 2)
    row = IQ + t * s_iq_t + h * s_iq_h
    x = upcast(tl.load(row + d, mask=mask, other=0.0))
    xp = upcast(tl.load(row + partner, mask=mask, other=0.0))
    c = upcast(tl.load(cos_row + pair, mask=rotary, other=0.0))
    s = upcast(tl.load(sin_row + pair, mask=rotary, other=0.0))
    # Lanes past rot pass through (upcast + downcast of the same dtype is exact).
    q = downcast(tl.where(rotary, rotate(x, xp, c, s, first), x), IQ.dtype.element_ty)
    out_ptr = IQ_OUT + t * s_iqo_t + h * s_iqo_h + d
    h1mask = h1 < HI
    if HAS_WEIGHTS:
        w = upcast(tl.load(IW + t * s_iw_t + h1 * s_iw_h, mask=h1mask, other=0.0)) * w_scale
    if FP8:
        codes, scale = fp8_group_quant(upcast(q), mask, UE8M0)
        tl.store(out_ptr, codes, mask=mask)
        tl.store(IW_OUT + t * s_iwo_t + h1 * s_iwo_h, w * scale, mask=h1mask)
    else:
        tl.store(out_ptr, q, mask=mask)
        if HAS_WEIGHTS:
            tl.store(IW_OUT + t * s_iwo_t + h1 * s_iwo_h, w, mask=h1mask)


@triton.jit
def _mla_q_prologue_kernel(
    QPE, QOTHER, QOUT, s_pe_t, s_pe_h, s_ot_t, s_ot_h, s_out_t, s_out_h, H, n_q_programs,
    IQ, IW, IQ_OUT, IW_OUT, s_iq_t, s_iq_h, s_iqo_t, s_iqo_h, s_iw_t, s_iw_h, s_iwo_t, s_iwo_h,
    w_scale, HI,
    COS, SIN, POS, s_cos, s_sin,
    HAS_Q: tl.constexpr, HAS_OTHER: tl.constexpr, D_OTHER: tl.constexpr,
    OTHER_BLOCK: tl.constexpr, Q_HPP: tl.constexpr, DEINTERLEAVE: tl.constexpr,
    HAS_INDEX_Q: tl.constexpr, IQ_D: tl.constexpr, IQ_BLOCK: tl.constexpr,
    IQ_HPP: tl.constexpr, IQ_FP8: tl.constexpr, UE8M0: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    ROT: tl.constexpr, ROT_BLOCK: tl.constexpr, HAS_POS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    prog = tl.program_id(1)
    if HAS_POS:
        angle_row = tl.load(POS + t).to(tl.int64)
    else:
        angle_row = t
    cos_row = COS + angle_row * s_cos
    sin_row = SIN + angle_row * s_sin
    if HAS_Q:
        if prog < n_q_programs:
            _q_role(t, prog, QPE, QOTHER, QOUT, s_pe_t, s_pe_h, s_ot_t, s_ot_h, s_out_t, s_out_h,
                    cos_row, sin_row, H, Q_HPP, HAS_OTHER, D_OTHER, OTHER_BLOCK, ROT, ROT_BLOCK,
                    DEINTERLEAVE)
    if HAS_INDEX_Q:
        if prog >= n_q_programs:
            _index_q_role(t, prog - n_q_programs, IQ, IW, IQ_OUT, IW_OUT, s_iq_t, s_iq_h,
                          s_iqo_t, s_iqo_h, s_iw_t, s_iw_h, s_iwo_t, s_iwo_h, w_scale,
                          cos_row, sin_row, HI, IQ_HPP, IQ_D, IQ_BLOCK, ROT, IQ_FP8, UE8M0,
                          HAS_WEIGHTS)


def _prev_power_of_2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def heads_per_program(heads: int, lanes_per_head: int, lanes_per_program: int) -> int:
    """Power-of-two heads per program: about ``lanes_per_program`` lanes, at most all heads."""
    hpp = _prev_power_of_2(max(lanes_per_program // max(lanes_per_head, 1), 1))
    return max(1, min(hpp, triton.next_power_of_2(max(heads, 1))))


def launch_config(q_heads: int, d_other: int, rot: int, index_heads: int, index_dim: int, tokens: int = 1,
                  config: MlaQPrologueConfig = DEFAULT_CONFIG):
    """Block sizes, heads per program and program counts (0 heads: role absent)."""
    q_lanes, iq_lanes, warps = _LAUNCH["few" if tokens <= _FEW_TOKENS else "many"]
    q_lanes = config.q_lanes or q_lanes
    iq_lanes = config.index_q_lanes or iq_lanes
    warps = config.warps or warps
    other_block = triton.next_power_of_2(d_other) if d_other else 1
    rot_block = triton.next_power_of_2(max(rot, 2))
    iq_block = triton.next_power_of_2(max(index_dim, 2))
    q_hpp = heads_per_program(q_heads, (other_block if d_other else 0) + rot_block, q_lanes)
    iq_hpp = heads_per_program(index_heads, iq_block, iq_lanes)
    return dict(
        OTHER_BLOCK=other_block, ROT_BLOCK=rot_block, IQ_BLOCK=iq_block,
        Q_HPP=q_hpp, IQ_HPP=iq_hpp,
        n_q_programs=triton.cdiv(q_heads, q_hpp) if q_heads else 0,
        n_index_q_programs=triton.cdiv(index_heads, iq_hpp) if index_heads else 0,
        num_warps=warps,
    )


def _check_out(t: torch.Tensor, shape: tuple, dtype: torch.dtype, name: str) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype}, got {tuple(t.shape)} {t.dtype}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride on its last dim, got {t.stride()}")


def mla_q_prologue_fwd(named: dict, q_out: torch.Tensor, index_q_out: torch.Tensor,
                       index_weights_out: torch.Tensor, config: MlaQPrologueConfig | None = None) -> None:
    """Launch the q prologue on validated arguments (``named``: the op's argument names).

    Outputs come from ``ops.mla_q_prologue.output_shapes``; an absent output is an empty
    tensor and is not written.  ``config`` None: the shipped launch table.  No host syncs:
    safe under CUDA-graph capture once compiled.
    """
    config = DEFAULT_CONFIG if config is None else config
    q_pe, q_other, index_q = named["q_pe"], named["q_other"], named["index_q"]
    weights = named["index_weights"]
    cos, sin, positions = named["cos"], named["sin"], named["positions"]
    like = q_pe if q_pe is not None else index_q
    tokens = like.shape[0]
    has_q = q_pe is not None
    has_iq = index_q is not None
    if tokens == 0 or not (has_q or has_iq):
        return
    rot = 2 * cos.shape[1]
    fp8 = bool(named["index_q_fp8"])
    has_weights = has_iq and weights is not None

    q_heads = q_pe.shape[1] if has_q else 0
    d_other = q_other.shape[2] if (has_q and q_other is not None) else 0
    index_heads = index_q.shape[1] if has_iq else 0
    index_dim = index_q.shape[2] if has_iq else 0
    cfg = launch_config(q_heads, d_other, rot, index_heads, index_dim, tokens, config)
    if has_q:
        _check_out(q_out, (tokens, q_heads, d_other + rot), q_pe.dtype, "q_out")
    if has_iq:
        _check_out(index_q_out, index_q.shape, torch.float8_e4m3fn if fp8 else index_q.dtype,
                   "index_q_out")
        if has_weights:
            _check_out(index_weights_out, (tokens, index_heads), torch.float32,
                       "index_weights_out")
    n_programs = cfg["n_q_programs"] + cfg["n_index_q_programs"]
    if n_programs == 0:
        return

    def ptr(t):  # absent tensors: any valid pointer, never dereferenced
        return like if t is None or t.numel() == 0 else t

    def strides(t, n=2):
        return tuple(t.stride())[:n] if t is not None and t.numel() > 0 else (0,) * n

    grid = (tokens, n_programs)

    def _launch():
        _mla_q_prologue_kernel[grid](
            ptr(q_pe), ptr(q_other), ptr(q_out), *strides(q_pe), *strides(q_other),
            *strides(q_out), q_heads, cfg["n_q_programs"],
            ptr(index_q), ptr(weights), ptr(index_q_out), ptr(index_weights_out),
            *strides(index_q), *strides(index_q_out), *strides(weights),
            *strides(index_weights_out), float(named["index_weights_scale"]), index_heads,
            ptr(cos), ptr(sin), ptr(positions), cos.stride(0), sin.stride(0),
            HAS_Q=has_q, HAS_OTHER=d_other > 0, D_OTHER=d_other,
            OTHER_BLOCK=cfg["OTHER_BLOCK"], Q_HPP=cfg["Q_HPP"],
            DEINTERLEAVE=bool(named["deinterleave_rope"]),
            HAS_INDEX_Q=has_iq, IQ_D=index_dim, IQ_BLOCK=cfg["IQ_BLOCK"],
            IQ_HPP=cfg["IQ_HPP"], IQ_FP8=fp8, UE8M0=bool(named["ue8m0"]),
            HAS_WEIGHTS=has_weights,
            ROT=rot, ROT_BLOCK=cfg["ROT_BLOCK"], HAS_POS=positions is not None,
            num_warps=cfg["num_warps"],
            # No FMA contraction: RoPE's ``x * cos - y * sin`` rounds each product like the
            # reference, so the outputs are bit-identical to it (memory-bound: no cost).
            enable_fp_fusion=False,
        )

    launch_on_device(like, _launch)
