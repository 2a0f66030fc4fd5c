"""``fusion_compiler::moe_experts_fp8``'s kernels, with FP8 e4m3 expert weights in DeepSeek's
block-scaled format (one fp32 scale per 128 x 128 block) and FP8 activations (one fp32 scale
per 1 x 128 group): up to ``ops/moe_experts_fp8.SMALL_BATCH_MAX_TOKENS`` tokens kernels/
moe_experts.py's two GEMV-style launches (below), above them kernels/moe_experts_grouped.py's
grouped launches (at the end of this file). The op's semantics, quantisation and rounding
points: ``ops/moe_experts_fp8.moe_experts_fp8_reference``.

For pair p = (t, k), e = ids[t, k], x = hidden[t]:

    kernel 1, grid (pair, I block):  each step along H quantises the x groups it covers (on the
                                     fly, per program: x is a few KB, the weights MBs), then
                                     gate / up += sum_kb (sum_k xq wq) * sx[kb] * sw[n // 128, kb]
                                     act = silu(gate) * up (kernels/moe_experts.silu_mul_rounded),
                                     quantised per 1 x 128 group -> act codes [T * k, I] e4m3
                                     and act scales [T * k, ceil(I / 128)] fp32
    kernel 2, grid (token, H block): out[t] = sum_k w[t, k] * FP8 GEMM(act[(t, k)], W_down[e])

A program of kernel 1 covers whole 128-row groups of I (``gate_up_block_n`` a multiple of 128),
so it quantises its act itself: no cross-program amax, no third launch. Each loop step takes
``block_k`` columns of the reduced dim as [groups, group_k] (group_k = min(block_k, 128)), so
``block_k`` is a multiple of 128 or divides 128: a group's scales apply to its partial sum
(sum over the step's columns of the group, exact products of e4m3 values in fp32), and the
scaled partial sums accumulate in fp32 per output row. Where block_k < 128 each step reads the
whole group of x for its scale (kernel 1; from L1) and kernel 2 reads the act scale per step.

Padding ids (outside [0, E)) read nothing and write nothing (kernel 1) and are skipped
(kernel 2), so a token of only padding gets zeros. The combine is in k order, fp32, no atomics:
deterministic. Bit-level FP8 / bf16 casts under Triton's interpreter come from ``_device``.

Launch shapes (``default_config``) are not measured yet: kernel 1 follows the bf16 kernels'
Little's-law target of ~16 KB of weights per step (2 x 128 rows x 64 e4m3), which at one token
gives T * k * I / 128 programs (DeepSeek: 128, about one per SM of an H200, against the bf16
kernel's >= 264); kernel 2 keeps the bf16 kernel's measured 2 warps and 1024-wide steps with 4
rows (the same 4 KB a step as 2 bf16 rows). A GPU sweep should set both.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import INTERPRETER, downcast, fp8_codes, fp8_group_quant, fp8_group_scale, fp8e4nv_to_fp32
from ._device import launch_on_device, store_fp8_as_bytes
from ._device import upcast as _upcast
from .moe_experts import _TL_DTYPES, output_like, silu_mul_rounded
from .moe_experts_grouped import _combine_arrived, _slot_run, _tile_pairs, grouping, launch_combine
from .moe_experts_grouped import default_config as _bf16_grouped_config

KERNEL_VERSION = "moe_experts_fp8-2"

FP8 = torch.float8_e4m3fn
GROUP = 128  # activation groups 1 x 128, weight blocks 128 x 128


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and warps of the two kernels. ``*_block_n``: weight rows per program (I rows of
    gate and of up for kernel 1, a multiple of 128; H rows for kernel 2, a power of two);
    ``*_block_k``: columns of the reduced dim per loop step (H for kernel 1, I for kernel 2), a
    power of two that is a multiple of 128 or divides it; ``warps`` and ``stages`` per kernel."""

    gate_up_block_n: int = 128
    gate_up_block_k: int = 64
    gate_up_warps: int = 4
    down_block_n: int = 4
    down_block_k: int = 1024
    down_warps: int = 2
    gate_up_stages: int = 1
    down_stages: int = 1


def default_config(tokens: int, top_k: int, hidden: int, intermediate: int) -> LaunchConfig:
    """Launch shape by problem size (unmeasured; see the module docstring): kernel 2's step no
    wider than I's power of two."""
    return LaunchConfig(down_block_k=min(1024, triton.next_power_of_2(max(intermediate, 1))))


def _check_block_k(block_k: int, what: str) -> None:
    if block_k & (block_k - 1) or not (block_k % GROUP == 0 or GROUP % block_k == 0):
        raise ValueError(f"{what} {block_k}: a power of two that is a multiple of {GROUP} or divides it")


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------


@triton.jit
def _step_offsets(k0, GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
    """A loop step's columns as [GROUPS, GROUP_K] offsets and its groups' indices [GROUPS]."""
    g = tl.arange(0, GROUPS)
    cols = k0 + g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    return cols, k0 // 128 + g


@triton.jit
def _x_step(x_row, k0, K: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
    """The e4m3 values (as fp32) [GROUPS, GROUP_K] and scales [GROUPS] of x's step at k0, each
    group's scale from the whole group (its own 128 columns, loaded again where GROUP_K < 128)."""
    whole = (k0 // 128) * 128 + tl.arange(0, GROUPS)[:, None] * 128 + tl.arange(0, 128)[None, :]
    x_whole = _upcast(tl.load(x_row + whole, mask=whole < K, other=0.0))
    scale = fp8_group_scale(x_whole, whole < K, False)
    if GROUP_K == 128:
        codes = fp8_codes(x_whole, scale, whole < K)
    else:
        cols, _ = _step_offsets(k0, GROUPS, GROUP_K)
        codes = fp8_codes(_upcast(tl.load(x_row + cols, mask=cols < K, other=0.0)), scale, cols < K)
    return fp8e4nv_to_fp32(codes), scale


@triton.jit
def _scaled_step(acc, w_ptrs, s_ptrs, v, v_scale, cols, groups, row_ok, K: tl.constexpr, KB: tl.constexpr,
                 EVEN: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N] += sum_g (sum_c w[:, g, c] * v[g, c]) * v_scale[g] * w_scale[:, g]: one step
    of the block-scaled GEMV. ``w_ptrs`` [BLOCK_N, GROUPS, GROUP_K] e4m3, ``s_ptrs`` [BLOCK_N, 1]
    each row's scale row (plus ``groups``); ``v`` [GROUPS, GROUP_K] fp32 e4m3 values."""
    if EVEN:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs + groups[None, :])
    else:
        w = tl.load(w_ptrs, mask=row_ok[:, None, None] & (cols < K)[None, :, :], other=0.0)
        s = tl.load(s_ptrs + groups[None, :], mask=row_ok[:, None] & (groups < KB)[None, :], other=0.0)
    partial = tl.sum(fp8e4nv_to_fp32(w) * v[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
    return acc + tl.sum(partial * s * v_scale[None, :], axis=1)


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, act_ptr, act_scale_ptr,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, KB: tl.constexpr,  # KB: scale columns, ceil(HIDDEN / 128)
    experts, stride_xt, stride_we, stride_wr, stride_se, stride_sr, stride_ap, stride_asp,
    TOP_K: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr, GROUP_K: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    block = tl.program_id(1)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)  # int64: E * 2I * HIDDEN passes 2**31 (DeepSeek)
    if (expert >= 0) & (expert < experts):  # else padding: no weights read, nothing written
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows; up rows INTER + rows
        row_ok = rows < INTER
        cols0, groups0 = _step_offsets(0, GROUPS, GROUP_K)
        gate_ptrs = w_ptr + expert * stride_we + rows[:, None, None] * stride_wr + cols0[None, :, :]
        up_ptrs = gate_ptrs + INTER * stride_wr
        gate_s = ws_ptr + expert * stride_se + (rows // 128)[:, None] * stride_sr
        up_s = ws_ptr + expert * stride_se + ((INTER + rows) // 128)[:, None] * stride_sr
        x_row = x_ptr + token * stride_xt

        gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
        up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in tl.range(0, HIDDEN, GROUPS * GROUP_K, num_stages=STAGES):
            xq, sx = _x_step(x_row, k0, HIDDEN, GROUPS, GROUP_K)
            cols, groups = cols0 + k0, groups0 + k0 // 128
            gate = _scaled_step(gate, gate_ptrs + k0, gate_s, xq, sx, cols, groups, row_ok, HIDDEN, KB, EVEN)
            up = _scaled_step(up, up_ptrs + k0, up_s, xq, sx, cols, groups, row_ok, HIDDEN, KB, EVEN)

        # act (rounded like the bf16 op's) quantised by the program's own 128-row groups.
        act = _upcast(silu_mul_rounded(gate, up, DTYPE))
        act_groups = tl.reshape(act, (BLOCK_N // 128, 128))
        out_rows = block * BLOCK_N + tl.arange(0, BLOCK_N // 128)[:, None] * 128 + tl.arange(0, 128)[None, :]
        codes, scale = fp8_group_quant(act_groups, out_rows < INTER, False)
        store_fp8_as_bytes(act_ptr + pair * stride_ap, out_rows, codes, out_rows < INTER)
        scale_cols = block * (BLOCK_N // 128) + tl.arange(0, BLOCK_N // 128)
        tl.store(act_scale_ptr + pair * stride_asp + scale_cols, scale, mask=scale_cols * 128 < INTER)


@triton.jit
def _down_kernel(
    act_ptr, act_scale_ptr, ids_ptr, weights_ptr, w_ptr, ws_ptr, out_ptr,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, KB: tl.constexpr,  # KB: scale columns, ceil(INTER / 128)
    experts, stride_ap, stride_asp, stride_we, stride_wr, stride_se, stride_sr, stride_ot,
    TOP_K: tl.constexpr, DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr, GROUP_K: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    block = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < HIDDEN
    cols0, groups0 = _step_offsets(0, GROUPS, GROUP_K)
    row_ptrs = rows[:, None, None] * stride_wr + cols0[None, :, :]
    scale_rows = (rows // 128)[:, None] * stride_sr

    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # unrolled: the experts' id / weight loads are independent
        pair = token * TOP_K + k
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if (expert >= 0) & (expert < experts):  # else padding: skipped (its act row was never written)
            weight = _upcast(tl.load(weights_ptr + pair))
            w_ptrs = w_ptr + expert * stride_we + row_ptrs
            s_ptrs = ws_ptr + expert * stride_se + scale_rows
            a_row = act_ptr + pair * stride_ap
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in tl.range(0, INTER, GROUPS * GROUP_K, num_stages=STAGES):
                cols, groups = cols0 + k0, groups0 + k0 // 128
                if EVEN:
                    a = tl.load(a_row + cols)
                    sa = tl.load(act_scale_ptr + pair * stride_asp + groups)
                else:
                    a = tl.load(a_row + cols, mask=cols < INTER, other=0.0)
                    sa = tl.load(act_scale_ptr + pair * stride_asp + groups, mask=groups < KB, other=0.0)
                acc = _scaled_step(acc, w_ptrs + k0, s_ptrs, fp8e4nv_to_fp32(a), sa, cols, groups, row_ok,
                                   INTER, KB, EVEN)  # fmt: skip
            # The expert's GEMM output in the activation dtype, then out.float() * weight, summed in fp32.
            total += _upcast(downcast(acc, DTYPE)) * weight

    out_ptrs = out_ptr + token * stride_ot + rows
    tl.store(out_ptrs, downcast(total, OUT_DTYPE), mask=row_ok)


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------


def _groups(block_k: int) -> tuple[int, int]:
    """(GROUPS, GROUP_K) of a loop step ``block_k`` wide."""
    return max(block_k // GROUP, 1), min(block_k, GROUP)


def launch_gate_up(hidden, top_k_ids, gate_up_proj, gate_up_scale, act, act_scale, config: LaunchConfig) -> None:
    """Kernel 1: ``act`` [T * k, I] e4m3 and ``act_scale`` [T * k, ceil(I / 128)] fp32 of every
    valid (token, k) pair. ``hidden`` and ``top_k_ids`` contiguous."""
    tokens, top_k = top_k_ids.shape
    hidden_size, intermediate = hidden.shape[1], gate_up_proj.shape[1] // 2
    block_n, block_k = config.gate_up_block_n, config.gate_up_block_k
    if block_n % GROUP:
        raise ValueError(f"gate_up_block_n {block_n}: a multiple of {GROUP} (whole act groups a program)")
    _check_block_k(block_k, "gate_up_block_k")
    groups, group_k = _groups(block_k)
    even = hidden_size % block_k == 0 and intermediate % block_n == 0
    grid = (tokens * top_k, triton.cdiv(intermediate, block_n))
    launch_on_device(hidden, lambda: _gate_up_kernel[grid](
        hidden, top_k_ids, gate_up_proj, gate_up_scale, act.view(torch.uint8), act_scale,
        hidden_size, intermediate, triton.cdiv(hidden_size, GROUP),
        gate_up_proj.shape[0], hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), act.stride(0), act_scale.stride(0),
        TOP_K=top_k, DTYPE=_TL_DTYPES[hidden.dtype], BLOCK_N=block_n, GROUPS=groups, GROUP_K=group_k,
        EVEN=even, STAGES=config.gate_up_stages, num_warps=config.gate_up_warps,
    ))  # fmt: skip


def launch_down(act, act_scale, top_k_ids, top_k_weights, down_proj, down_scale, out, config: LaunchConfig) -> None:
    """Kernel 2: ``out`` [T, H] = sum_k w[t, k] * FP8 GEMM(act[(t, k)], down_e). ``act``,
    ``act_scale``, ``top_k_ids`` and ``top_k_weights`` contiguous."""
    tokens, top_k = top_k_ids.shape
    hidden_size, intermediate = down_proj.shape[1], down_proj.shape[2]
    block_n, block_k = config.down_block_n, config.down_block_k
    _check_block_k(block_k, "down_block_k")
    groups, group_k = _groups(block_k)
    even = intermediate % block_k == 0 and hidden_size % block_n == 0
    grid = (tokens, triton.cdiv(hidden_size, block_n))
    launch_on_device(out, lambda: _down_kernel[grid](
        act, act_scale, top_k_ids, top_k_weights, down_proj, down_scale, out,
        hidden_size, intermediate, triton.cdiv(intermediate, GROUP),
        down_proj.shape[0], act.stride(0), act_scale.stride(0), down_proj.stride(0), down_proj.stride(1),
        down_scale.stride(0), down_scale.stride(1), out.stride(0),
        TOP_K=top_k, DTYPE=_TL_DTYPES[out.dtype], OUT_DTYPE=_TL_DTYPES[out.dtype], BLOCK_N=block_n,
        GROUPS=groups, GROUP_K=group_k, EVEN=even, STAGES=config.down_stages, num_warps=config.down_warps,
    ))  # fmt: skip


def _prepare(launcher, hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale, out):
    """The launchers' common start: the op's checks (ValueError), hidden, ids and weights made
    contiguous, ``out`` checked or made (``kernels/moe_experts.output_like``)."""
    from fusion_compiler.ops.moe_experts_fp8 import validate

    validate(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale)
    out = output_like(launcher, hidden, out)
    return hidden.contiguous(), top_k_ids.contiguous(), top_k_weights.contiguous(), out


def small_batch_experts_fp8(
    hidden: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_proj: torch.Tensor,
    down_scale: torch.Tensor,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fusion_compiler::moe_experts_fp8`` (same arguments, the reference's result up to
    summation order and rare FP8 rounding ties) in two launches -> [T, H] in hidden's dtype.
    ``config``: launch shape, ``default_config`` if None. ``out``: where to write (a [T, H]
    tensor like hidden, rows of unit stride; every element is written), a new tensor if None."""
    hidden, top_k_ids, top_k_weights, out = _prepare("small_batch_experts_fp8", hidden, top_k_ids, top_k_weights,
                                                     gate_up_proj, gate_up_scale, down_proj, down_scale, out)  # fmt: skip
    tokens, top_k = top_k_ids.shape
    hidden_size, intermediate = hidden.shape[1], down_proj.shape[2]
    if config is None:
        config = default_config(tokens, top_k, hidden_size, intermediate)
    if tokens == 0 or hidden_size == 0:
        return out
    act = torch.empty(tokens * top_k, intermediate, dtype=FP8, device=hidden.device)
    act_scale = torch.empty(tokens * top_k, triton.cdiv(intermediate, GROUP), dtype=torch.float32,
                            device=hidden.device)  # fmt: skip
    if top_k and intermediate:
        launch_gate_up(hidden, top_k_ids, gate_up_proj, gate_up_scale, act, act_scale, config)
    launch_down(act, act_scale, top_k_ids, top_k_weights, down_proj, down_scale, out, config)
    return out


# ------------------------------------------------------------------------------------------
# Grouped by expert (above ``ops/moe_experts_fp8.SMALL_BATCH_MAX_TOKENS``)
# ------------------------------------------------------------------------------------------
#
# kernels/moe_experts_grouped.py's four launches (its align kernel, or its torch plan past one
# program, and its combine kernel, reused as they are) with FP8 GEMM kernels: a program takes
# slot s's expert, BLOCK_M of its pairs at a time, and steps the reduced dim one 128-group at a
# time, DeepGEMM's promotion: partial = xq [M, 128] @ wq [128, N] (e4m3 tl.dot, fp32), then
# acc += partial * sx[:, None] * sw[None, :]. The gate/up kernel quantises each gathered x tile
# [M, 128] (one group a row) as it goes and covers 128 columns of I, one act group a pair, so it
# writes act quantised; the down kernel writes y rounded to hidden's dtype for the combine.


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Launch shape of the grouped FP8 kernels; the reduced-dim step is one 128-group and the
    gate/up kernel's columns one act group (128), fixed by the format. ``block_m``: pairs a GEMM
    program takes at once (a power of two >= 16); ``down_block_n``: H columns per down program;
    the rest as kernels/moe_experts_grouped.GroupedConfig. Not measured on an H200."""

    block_m: int = 16
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_block_n: int = 128
    down_warps: int = 4
    down_stages: int = 3
    combine_block: int = 1024
    combine_warps: int = 4
    align_max_pairs: int = 16384
    scan_max_pairs: int = 0  # as the bf16 grouped kernels' (scan mode measured slower there)
    scan_chunk: int = 256


def default_grouped_config(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int) -> GroupedConfig:
    """``block_m`` by the average run P / E (16..64), as the bf16 grouped kernels; the combine's
    block no wider than H's power of two."""
    bf16 = _bf16_grouped_config(tokens, top_k, experts, hidden, intermediate)
    return GroupedConfig(block_m=bf16.block_m, combine_block=bf16.combine_block)


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, act_ptr, act_scale_ptr, plan_ptr, ids_ptr, counters_ptr, out_ptr,
    experts, stride_xt, stride_we, stride_wr, stride_se, stride_sr, stride_ap, stride_asp, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, PAIRS: tl.constexpr, TOP_K: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, STAGES: tl.constexpr,
    SCAN: tl.constexpr, P_POW2: tl.constexpr, E_BINS: tl.constexpr, CHUNK: tl.constexpr, K_POW2: tl.constexpr,
    COUNTERS: tl.constexpr,
):  # fmt: skip
    expert, start, end = _slot_run(plan_ptr, ids_ptr, counters_ptr, out_ptr, experts, stride_ot, HIDDEN, PAIRS, TOP_K,
                                   DTYPE, SCAN, P_POW2, E_BINS, K_POW2, COUNTERS)  # fmt: skip
    block = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = block * 128 + tl.arange(0, 128)  # one act group: gate rows n, up rows INTER + n
    k = tl.arange(0, 128)
    n_ok = n < INTER
    gate_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wr + k[:, None]  # [128 (K), 128 (N)]
    up_ptrs = gate_ptrs + INTER * stride_wr
    gate_s = ws_ptr + expert * stride_se + (n // 128) * stride_sr
    up_s = ws_ptr + expert * stride_se + ((INTER + n) // 128) * stride_sr
    m0 = start
    while m0 < end:  # (a while: the interpreter's range takes no loaded bounds)
        pair, m_ok = _tile_pairs(plan_ptr, ids_ptr, expert, m0, end, SCAN, PAIRS, BLOCK_M, CHUNK)
        x_ptrs = x_ptr + (pair // TOP_K)[:, None] * stride_xt + k[None, :]
        gate = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        for k0 in tl.range(0, HIDDEN, 128, num_stages=STAGES):
            k_ok = k0 + k < HIDDEN
            x_ok = m_ok[:, None] & k_ok[None, :]
            xq, sx = fp8_group_quant(_upcast(tl.load(x_ptrs + k0, mask=x_ok, other=0.0)), x_ok, False)
            w_ok = k_ok[:, None] & n_ok[None, :]
            kb = k0 // 128
            sg = tl.load(gate_s + kb, mask=n_ok, other=0.0)
            su = tl.load(up_s + kb, mask=n_ok, other=0.0)
            gate += _fp8_mma(xq, tl.load(gate_ptrs + k0, mask=w_ok, other=0.0)) * sx[:, None] * sg[None, :]
            up += _fp8_mma(xq, tl.load(up_ptrs + k0, mask=w_ok, other=0.0)) * sx[:, None] * su[None, :]
        codes, scale = fp8_group_quant(_upcast(silu_mul_rounded(gate, up, DTYPE)), m_ok[:, None] & n_ok[None, :],
                                       False)  # fmt: skip
        store_fp8_as_bytes(act_ptr, pair[:, None] * stride_ap + n[None, :], codes, m_ok[:, None] & n_ok[None, :])
        tl.store(act_scale_ptr + pair * stride_asp + block, scale, mask=m_ok)
        m0 += BLOCK_M


@triton.jit
def _grouped_down_kernel(
    act_ptr, act_scale_ptr, w_ptr, ws_ptr, y_ptr, plan_ptr, ids_ptr, weights_ptr, out_ptr, counters_ptr,
    experts, stride_ap, stride_asp, stride_we, stride_wr, stride_se, stride_sr, stride_yp, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, PAIRS: tl.constexpr, TOP_K: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    SCAN: tl.constexpr, P_POW2: tl.constexpr, E_BINS: tl.constexpr, CHUNK: tl.constexpr, K_POW2: tl.constexpr,
):  # fmt: skip
    expert, start, end = _slot_run(plan_ptr, ids_ptr, counters_ptr, out_ptr, experts, stride_ot, HIDDEN, PAIRS, TOP_K,
                                   DTYPE, SCAN, P_POW2, E_BINS, K_POW2, 0)  # fmt: skip
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, 128)
    n_ok = n < HIDDEN
    w_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wr + k[:, None]  # [128 (K), BLOCK_N]
    s_ptrs = ws_ptr + expert * stride_se + (n // 128) * stride_sr
    m0 = start
    while m0 < end:  # (a while: the interpreter's range takes no loaded bounds)
        pair, m_ok = _tile_pairs(plan_ptr, ids_ptr, expert, m0, end, SCAN, PAIRS, BLOCK_M, CHUNK)
        a_ptrs = act_ptr + pair[:, None] * stride_ap + k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, INTER, 128, num_stages=STAGES):
            k_ok = k0 + k < INTER
            kb = k0 // 128
            a = tl.load(a_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            sa = tl.load(act_scale_ptr + pair * stride_asp + kb, mask=m_ok, other=0.0)
            sw = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += _fp8_mma(a, w) * sa[:, None] * sw[None, :]
        # The expert's GEMM output in the activation dtype (exact in y's dtype).
        tl.store(y_ptr + pair[:, None] * stride_yp + n[None, :], downcast(acc, DTYPE),
                 mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip
        if SCAN:
            _combine_arrived(y_ptr, ids_ptr, weights_ptr, out_ptr, counters_ptr, pair, m_ok, n, n_ok,
                             experts, stride_yp, stride_ot, TOP_K, K_POW2, DTYPE)  # fmt: skip
        m0 += BLOCK_M


@triton.jit
def _fp8_mma(a, b):
    """a [M, K] @ b [K, N] of e4m3 operands, fp32 accumulation: the native FP8 MMA on the GPU;
    under the interpreter on fp32 values (exact products; the NaN code decoded)."""
    if INTERPRETER:
        return tl.dot(fp8e4nv_to_fp32(a), fp8e4nv_to_fp32(b), input_precision="ieee")
    else:
        return tl.dot(a, b)


def grouped_experts_fp8(
    hidden: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_proj: torch.Tensor,
    down_scale: torch.Tensor,
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fusion_compiler::moe_experts_fp8`` grouped by expert, in two launches up to
    ``config.scan_max_pairs`` pairs and four past it (as ``grouped_experts``); arguments,
    ``config`` and ``out`` as ``small_batch_experts_fp8``."""
    hidden, top_k_ids, top_k_weights, out = _prepare("grouped_experts_fp8", hidden, top_k_ids, top_k_weights,
                                                     gate_up_proj, gate_up_scale, down_proj, down_scale, out)  # fmt: skip
    tokens, top_k = top_k_ids.shape
    experts, hidden_size, intermediate = down_proj.shape
    pairs = tokens * top_k
    c = config or default_grouped_config(tokens, top_k, experts, hidden_size, intermediate)
    if c.block_m < 16 or c.block_m & (c.block_m - 1):
        raise ValueError(f"block_m {c.block_m}: tl.dot takes a power of two >= 16")
    if c.down_block_n < 16 or c.down_block_n & (c.down_block_n - 1):
        raise ValueError(f"down_block_n {c.down_block_n}: tl.dot takes a power of two >= 16")
    if tokens == 0 or hidden_size == 0:
        return out
    if not (pairs and intermediate):  # no GEMM to run: every real pair's y is 0, so is the sum
        return out.zero_()
    dtype, device = hidden.dtype, hidden.device
    y = torch.empty(pairs, hidden_size, dtype=dtype, device=device)
    act = torch.empty(pairs, intermediate, dtype=FP8, device=device)
    act_scale = torch.empty(pairs, triton.cdiv(intermediate, GROUP), dtype=torch.float32, device=device)
    down_blocks = triton.cdiv(hidden_size, c.down_block_n)
    scan, plan, counters, meta = grouping(top_k_ids, experts, down_blocks, c)
    slots = min(experts, pairs)
    launch_on_device(hidden, lambda: _grouped_gate_up_kernel[(slots, triton.cdiv(intermediate, GROUP))](
        hidden, gate_up_proj, gate_up_scale, act.view(torch.uint8), act_scale, plan, top_k_ids, counters, out,
        experts, hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), act.stride(0), act_scale.stride(0), out.stride(0),
        HIDDEN=hidden_size, INTER=intermediate, PAIRS=pairs, TOP_K=top_k, DTYPE=_TL_DTYPES[dtype],
        BLOCK_M=c.block_m, STAGES=c.gate_up_stages, COUNTERS=tokens * down_blocks if scan else 0, **meta,
        num_warps=c.gate_up_warps,
    ))  # fmt: skip
    launch_on_device(hidden, lambda: _grouped_down_kernel[(slots, down_blocks)](
        act, act_scale, down_proj, down_scale, y, plan, top_k_ids, top_k_weights, out, counters,
        experts, act.stride(0), act_scale.stride(0), down_proj.stride(0), down_proj.stride(1),
        down_scale.stride(0), down_scale.stride(1), y.stride(0), out.stride(0),
        HIDDEN=hidden_size, INTER=intermediate, PAIRS=pairs, TOP_K=top_k, DTYPE=_TL_DTYPES[dtype],
        BLOCK_M=c.block_m, BLOCK_N=c.down_block_n, STAGES=c.down_stages, **meta, num_warps=c.down_warps,
    ))  # fmt: skip
    if not scan:
        launch_combine(y, top_k_ids, top_k_weights, out, experts, c.combine_block, c.combine_warps)
    return out
