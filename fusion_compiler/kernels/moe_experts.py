"""The ``moe_experts`` stage's small-batch kernels (``fusion_compiler::moe_experts`` on CUDA up
to ``ops/moe_experts.SMALL_BATCH_MAX_TOKENS`` tokens; above, kernels/moe_experts_grouped.py):
two Triton GEMV-style kernels that read each chosen (token, k) pair's expert weights once, with
no sort. The op's semantics and rounding points: ``ops/moe_experts.moe_experts_reference``.

For pair p = (t, k), e = ids[t, k] (int64 or int32), x = hidden[t] (gate_up_proj [E, 2I, H]:
gate rows, then up rows, HF's layout; down_proj [E, H, I]):

    kernel 1, grid (pair, I block):  gate = W_gate[e] @ x, up = W_up[e] @ x   (fp32 accumulation)
                                     act[p] = silu(gate) * up                 -> buffer [T * k, I]
    kernel 2, grid (token, H block): out[t] = sum_k w[t, k] * (W_down[e] @ act[(t, k)])

A pair whose id is outside [0, E) (-1 padding, or HF's expert-parallel sentinel >= E) is
padding: kernel 1 reads no weights and writes nothing for it, kernel 2 skips it (the number of
experts is a kernel argument), so a token with only padding pairs gets zeros.

Rounding is the reference's (HF's ``grouped_mm`` / ``batched_mm`` experts), where every GEMM
returns the activation dtype: gate and up are rounded to it, ``F.silu(gate)`` is computed in
fp32 and rounded, the product ``silu * up`` is formed in fp32 and rounded; each expert's down
output is rounded, then ``out.float() * weight`` and the sum over k are fp32 (here in k order,
no atomics: deterministic), and the total is rounded to hidden's dtype once.

Bandwidth: at 1..16 tokens the experts' weights are the whole cost (MiniMax at one token: 8
experts x 3 x 1536 x 3072 x 2 B = 226 MB). Each program streams [BLOCK_N rows x BLOCK_K] tiles
of contiguous weight rows (e.g. 256 bf16 = 512 B a row) into a 2-D fp32 accumulator that is
reduced once at the end; the pair / token is the fastest grid axis, so pairs that share an
expert read the same rows at about the same time (L2). ``default_config`` sizes the tiles and
grids for an H200 (132 SMs); every choice is a launcher argument so a GPU sweep
(bench/diagnostics/experts_check.py) can try others.

No host sync, no data-dependent shapes: a CUDA graph captures it. Under Triton's interpreter
(``TRITON_INTERPRET=1``, set before importing this module) it runs on CPU tensors, with the
bit-exact bf16 casts of ``kernels/_device.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import downcast as _downcast
from ._device import launch_on_device, rows_dot_step
from ._device import upcast as _upcast

KERNEL_VERSION = "moe_experts-1"

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# The default launch (``default_config``), by the Little's-law argument: at ~4.2 TB/s and ~1 us
# of HBM latency an H200 needs ~4 MB of loads in flight, ~32 KB per SM. A program has one tile
# in flight per loop step (no software pipelining of plain loads), so: >= ~2 programs per SM
# (_TARGET_PROGRAMS), each moving ~16 KB of weights per step (_TILE_ELEMENTS: gate + up tiles
# for kernel 1, one tile for kernel 2), BLOCK_K a power of two dividing the reduced dim where
# one does (no half-masked last step), at least 64 wide (128 B of bf16 per row).
_TARGET_PROGRAMS = 2 * 132
_MAX_BLOCK_N = 16
_TILE_ELEMENTS = {"gate_up": 4096}
# The down kernel: 2 rows x 1024 wide at 2 warps was the best or within 2% of it in every H200
# sweep (bench/diagnostics/experts_check.py; MiniMax / Qwen3.5 / DeepSeek at 1 and 8 tokens:
# e.g. DeepSeek at 1 token 56.3 µs against 69.6 for the first default, 16 x 512 at 4 warps;
# MiniMax's I 1536 with a masked half step, 21.3 against 22.0 for 4 x 512).
_DOWN_BLOCK_N = 2
_DOWN_BLOCK_K = 1024
_DOWN_WARPS = 2


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and warps of the two kernels. ``block_n``: weight rows per program (I rows
    of gate and of up for kernel 1, H rows for kernel 2); ``block_k``: elements per row per loop
    step along the reduced dim (H for kernel 1, I for kernel 2); powers of two; ``warps`` and
    ``stages`` per kernel."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 256
    gate_up_warps: int = 4
    down_block_n: int = 8
    down_block_k: int = 512
    down_warps: int = 4
    # ``num_stages`` of the loop over the reduced dim (``tl.range``): 1 none; > 1 lets Triton's
    # software pipeliner keep that many weight tiles in flight, where it takes plain loads.
    gate_up_stages: int = 1
    down_stages: int = 1


def _block_n_for(programs_per_block: int, rows: int) -> int:
    """Largest power of two <= _MAX_BLOCK_N (and <= rows' power of two) giving >= _TARGET_PROGRAMS
    programs, or 4 when none does."""
    block = min(_MAX_BLOCK_N, triton.next_power_of_2(rows))
    while block > 4 and programs_per_block * triton.cdiv(rows, block) < _TARGET_PROGRAMS:
        block //= 2
    return block


def _block_k_for(dim: int, block_n: int, elements: int) -> int:
    """~``elements / block_n`` wide (>= 64, <= dim's power of two), preferring a power of two
    that divides ``dim``."""
    cap = min(max(64, elements // block_n), triton.next_power_of_2(dim))
    block = cap
    while block > 64 and dim % block:
        block //= 2
    return block if dim % block == 0 else cap


def default_config(tokens: int, top_k: int, hidden: int, intermediate: int) -> LaunchConfig:
    """Launch shape by problem size: kernel 1 sized by ``_TARGET_PROGRAMS`` / ``_TILE_ELEMENTS``,
    kernel 2 the measured ``_DOWN_*`` shape; e.g. MiniMax (H 3072, I 1536, top 8) at 1 token:
    kernel 1 16 x 256 tiles (768 programs), kernel 2 2 x 1024 at 2 warps (1536 programs)."""
    gate_up_n = _block_n_for(tokens * top_k, intermediate)
    return LaunchConfig(
        gate_up_block_n=gate_up_n,
        gate_up_block_k=_block_k_for(hidden, gate_up_n, _TILE_ELEMENTS["gate_up"]),
        down_block_n=_DOWN_BLOCK_N,
        down_block_k=min(_DOWN_BLOCK_K, triton.next_power_of_2(intermediate)),
        down_warps=_DOWN_WARPS,
    )


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------


@triton.jit
def silu_mul_rounded(gate_acc, up_acc, DTYPE: tl.constexpr):
    """The op's act from fp32 GEMM sums: gate and up rounded to DTYPE (the GEMMs' outputs),
    F.silu(gate) in fp32 rounded, the product in fp32 rounded (returned in DTYPE)."""
    gate = _upcast(_downcast(gate_acc, DTYPE))
    up = _upcast(_downcast(up_acc, DTYPE))
    silu = _upcast(_downcast(tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), DTYPE))
    return _downcast(silu * up, DTYPE)


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, act_ptr,
    HIDDEN: tl.constexpr, INTER: tl.constexpr,  # constexpr: known trip counts (and the interpreter needs them)
    experts, stride_xt, stride_we, stride_wr, stride_ap,
    TOP_K: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    block = tl.program_id(1)
    token = pair // TOP_K
    expert = tl.load(ids_ptr + pair).to(tl.int64)  # int64: E * 2I * HIDDEN passes 2**31 (DeepSeek)
    if (expert >= 0) & (expert < experts):  # else padding: no weights read, nothing written
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        gate_ptrs = w_ptr + expert * stride_we + rows[:, None] * stride_wr + cols[None, :]
        up_ptrs = gate_ptrs + INTER * stride_wr
        x_ptrs = x_ptr + token * stride_xt + cols

        gate_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        up_acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=STAGES):
            if EVEN_N and EVEN_K:
                x = tl.load(x_ptrs + k0)
                wg = tl.load(gate_ptrs + k0)
                wu = tl.load(up_ptrs + k0)
            else:
                col_ok = (k0 + cols) < HIDDEN
                tile_ok = (rows[:, None] < INTER) & col_ok[None, :]
                x = tl.load(x_ptrs + k0, mask=col_ok, other=0.0)
                wg = tl.load(gate_ptrs + k0, mask=tile_ok, other=0.0)
                wu = tl.load(up_ptrs + k0, mask=tile_ok, other=0.0)
            xf = _upcast(x)[None, :]
            gate_acc += _upcast(wg) * xf
            up_acc += _upcast(wu) * xf

        act = silu_mul_rounded(tl.sum(gate_acc, axis=1), tl.sum(up_acc, axis=1), DTYPE)
        act_ptrs = act_ptr + pair * stride_ap + rows
        if EVEN_N:
            tl.store(act_ptrs, act)
        else:
            tl.store(act_ptrs, act, mask=rows < INTER)


@triton.jit
def _down_kernel(
    act_ptr, ids_ptr, weights_ptr, w_ptr, out_ptr,
    HIDDEN: tl.constexpr, INTER: tl.constexpr,  # constexpr: known trip counts (and the interpreter needs them)
    experts, stride_ap, stride_we, stride_wr, stride_ot,
    TOP_K: tl.constexpr, DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    block = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ptrs = rows[:, None] * stride_wr + cols[None, :]

    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # unrolled: the experts' id / weight loads are independent
        pair = token * TOP_K + k
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if (expert >= 0) & (expert < experts):  # else padding: skipped (its act row was never written)
            weight = _upcast(tl.load(weights_ptr + pair))
            w_ptrs = w_ptr + expert * stride_we + row_ptrs
            a_ptrs = act_ptr + pair * stride_ap + cols
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in tl.range(0, INTER, BLOCK_K, num_stages=STAGES):
                acc = rows_dot_step(acc, w_ptrs, a_ptrs, k0, rows, cols, HIDDEN, INTER, EVEN_N and EVEN_K)
            # The expert's GEMM output in the activation dtype, then out.float() * weight, summed in fp32.
            total += _upcast(_downcast(tl.sum(acc, axis=1), DTYPE)) * weight

    out_ptrs = out_ptr + token * stride_ot + rows
    if EVEN_N:
        tl.store(out_ptrs, _downcast(total, OUT_DTYPE))
    else:
        tl.store(out_ptrs, _downcast(total, OUT_DTYPE), mask=rows < HIDDEN)


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------


def supports(
    hidden: torch.Tensor, top_k_ids: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor
) -> bool:
    """Whether ``small_batch_experts`` takes these tensors: float weights in hidden's dtype, rows
    contiguous (unit stride on the last dim), int64 or int32 ids, consistent shapes."""
    return (
        hidden.dtype in _TL_DTYPES
        and gate_up_proj.dtype == hidden.dtype
        and down_proj.dtype == hidden.dtype
        and top_k_ids.dtype in (torch.int64, torch.int32)
        and gate_up_proj.dim() == 3
        and down_proj.dim() == 3
        and gate_up_proj.shape[2] == hidden.shape[1]
        and gate_up_proj.shape[1] % 2 == 0
        and tuple(down_proj.shape) == (gate_up_proj.shape[0], hidden.shape[1], gate_up_proj.shape[1] // 2)
        and gate_up_proj.stride(2) == 1
        and down_proj.stride(2) == 1
    )


def launch_gate_up(hidden, top_k_ids, gate_up_proj, act, block_n, block_k, num_warps, stages) -> None:
    """Kernel 1: ``act`` [T * k, I] = silu(gate) * up of every (token, k) pair. ``hidden`` and
    ``top_k_ids`` contiguous."""
    tokens, top_k = top_k_ids.shape
    hidden_size = hidden.shape[1]
    intermediate = gate_up_proj.shape[1] // 2
    grid = (tokens * top_k, triton.cdiv(intermediate, block_n))
    launch_on_device(hidden, lambda: _gate_up_kernel[grid](
        hidden, top_k_ids, gate_up_proj, act,
        hidden_size, intermediate,
        gate_up_proj.shape[0], hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0),
        TOP_K=top_k, DTYPE=_TL_DTYPES[act.dtype],
        BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=intermediate % block_n == 0, EVEN_K=hidden_size % block_k == 0, STAGES=stages,
        num_warps=num_warps,
    ))  # fmt: skip


def launch_down(act, top_k_ids, top_k_weights, down_proj, out, block_n, block_k, num_warps, stages) -> None:
    """Kernel 2: ``out`` [T, H] = sum_k w[t, k] * down_e(act[(t, k)]). ``act``, ``top_k_ids``
    and ``top_k_weights`` contiguous."""
    tokens, top_k = top_k_ids.shape
    hidden_size, intermediate = down_proj.shape[1], down_proj.shape[2]
    grid = (tokens, triton.cdiv(hidden_size, block_n))
    launch_on_device(out, lambda: _down_kernel[grid](
        act, top_k_ids, top_k_weights, down_proj, out,
        hidden_size, intermediate,
        down_proj.shape[0], act.stride(0), down_proj.stride(0), down_proj.stride(1), out.stride(0),
        TOP_K=top_k, DTYPE=_TL_DTYPES[act.dtype], OUT_DTYPE=_TL_DTYPES[out.dtype],
        BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=hidden_size % block_n == 0, EVEN_K=intermediate % block_k == 0, STAGES=stages,
        num_warps=num_warps,
    ))  # fmt: skip


def small_batch_experts(
    hidden: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fusion_compiler::moe_experts`` (same arguments, the reference's result up to summation
    order) in two launches: hidden [T, H], ids / weights [T, k], gate_up_proj [E, 2I, H],
    down_proj [E, H, I] -> [T, H] in hidden's dtype. ``config``: launch shape, ``default_config``
    by size if None. ``out``: where to write (a [T, H] tensor in hidden's dtype, rows of unit
    stride; every element is written), a new tensor if None."""
    hidden, top_k_ids, top_k_weights, out = prepare(
        "small_batch_experts", hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj, out
    )
    tokens, top_k = top_k_ids.shape
    hidden_size, intermediate = hidden.shape[1], down_proj.shape[2]
    if config is None:
        config = default_config(tokens, top_k, hidden_size, intermediate)
    if tokens == 0 or hidden_size == 0:
        return out
    act = torch.empty(tokens * top_k, intermediate, dtype=hidden.dtype, device=hidden.device)
    if top_k and intermediate:
        c = config
        launch_gate_up(hidden, top_k_ids, gate_up_proj, act,
                       c.gate_up_block_n, c.gate_up_block_k, c.gate_up_warps, c.gate_up_stages)  # fmt: skip
    launch_down(act, top_k_ids, top_k_weights, down_proj, out,
                config.down_block_n, config.down_block_k, config.down_warps, config.down_stages)  # fmt: skip
    return out


def prepare(launcher: str, hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj, out):
    """The launchers' common start: ValueError unless ``supports``; hidden, ids and weights made
    contiguous; ``out`` checked against hidden ([T, H], its dtype and device, unit stride along
    H) or a new tensor like hidden."""
    if not supports(hidden, top_k_ids, gate_up_proj, down_proj):
        raise ValueError(
            f"{launcher}: hidden {tuple(hidden.shape)} {hidden.dtype}, ids {top_k_ids.dtype}, "
            f"gate_up_proj {tuple(gate_up_proj.shape)} {gate_up_proj.dtype} stride {gate_up_proj.stride()}, "
            f"down_proj {tuple(down_proj.shape)} {down_proj.dtype} stride {down_proj.stride()} not supported"
        )
    return hidden.contiguous(), top_k_ids.contiguous(), top_k_weights.contiguous(), output_like(launcher, hidden, out)


def output_like(launcher: str, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against hidden ([T, H], its dtype and device, unit stride along H; else
    ValueError), or a new tensor like hidden."""
    if out is None:
        return torch.empty_like(hidden)
    if out.shape != hidden.shape or out.dtype != hidden.dtype or out.device != hidden.device:
        raise ValueError(f"{launcher}: out {tuple(out.shape)} {out.dtype} {out.device} is not like hidden "
                         f"{tuple(hidden.shape)} {hidden.dtype} {hidden.device}")  # fmt: skip
    if out.shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"{launcher}: out's rows must have unit stride, got strides {out.stride()}")
    return out
