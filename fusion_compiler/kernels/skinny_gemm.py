"""Skinny GEMM ``y [M, N] = x [M, K] @ w [N, K]^T`` for decode-sized M: one Triton kernel that
streams the weight rows once, in place of cuBLAS's split-K GEMM plus its reduce kernel.

At decode sizes (M of a few tokens) a projection is a weight read: Qwen3.5's out_proj at one
token is 64 MiB of weight for 8 K multiply-adds a row. cuBLAS picks a split-K kernel and a
second reduce kernel for these shapes and reads the weight at 33-87% of the H200's copy
bandwidth (bench/NOTES.md, "Skinny GEMM"). Here each program owns ``BLOCK_N`` whole weight rows
and walks K in ``BLOCK_K`` steps into a 2-D fp32 accumulator reduced once at the end, so a row
is one long contiguous stream and no partial sums leave the program: one launch, no reduce
kernel. The token is the fastest grid axis, so the programs of the M tokens that read the same
rows run at about the same time and the repeats come from L2 (HBM reads the weight once; L2
serves it M times, which is why this is for small M only: ``MAX_TOKENS``).

Launch shape by the Little's-law argument the experts kernels use (moe_experts.py): at
~4.2 TB/s and ~1 us of latency the H200 needs ~4 MB of loads in flight; 2 rows x 1024 at 2
warps (4 KB a step, thousands of programs) is the thin shape that won every H200 sweep of the
experts' down kernel; at M = 1 here the best of seven shapes was within 0-8% of it on every
projection, and no one shape was best on all (bench/NOTES.md, "Skinny GEMM"). Callers pass
another :class:`SkinnyConfig` to time other shapes.

The grid is one-dimensional, ``tokens x row blocks`` programs with the token fastest: CUDA
allows 2**31 - 1 programs on the x axis but only 65,535 on y and z, and an lm_head at one row
is ``vocab / BLOCK_N`` row blocks (129,280 to 248,320 rows: 64k-124k programs).
:func:`launch_plan` is a pure function of the shapes, so its limits are testable at real widths
without a launch; :func:`supports` declines what the plan cannot launch.

Numerics: fp32 accumulation in the kernel's tree order (cuBLAS sums in its own order), rounded
once to the output dtype (x's), as cuBLAS rounds a bf16 GEMM. The weight may be a narrower float
than x (bf16 / fp16 weights, fp32 x: ``x @ w.float().t()``, an exact widening done in
registers). Under ``TRITON_INTERPRET=1`` (set before importing) it runs on CPU tensors with the
bit-exact bf16 casts of ``_device``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import downcast, launch_on_device, rows_dot_step

KERNEL_VERSION = "skinny_gemm-3"

# The largest M the kernel takes (the op falls back to torch.mm above it): L2 serves each weight
# byte M times. H200 (bench/skinny_gemm_check.py, results/skinny_gemm_h200_session14.json; eight
# real projections, weights from HBM): at M = 1 1.01-1.40x cuBLAS's split-K + reduce (one kernel,
# 41-89% of the copy bandwidth); at 2 0.78-1.31x, at 4 0.49-0.86x, at 8 0.29-0.52x.
MAX_TOKENS = 1
_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_WIDENED_FROM = {torch.float32: (torch.bfloat16, torch.float16)}  # weight dtypes read under an fp32 x
GRID_X_MAX = 2**31 - 1  # CUDA's limit on a grid's x dimension (y and z: 65,535)
INT32_MAX = 2**31 - 1  # x and y offsets are int32 (the weight's are int64)


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """The launch shape: ``block_n`` weight rows a program, ``block_k`` columns a step (capped at
    K's next power of two), ``warps`` a program; ``max_tokens`` rows at most."""

    block_n: int = 2
    block_k: int = 1024
    warps: int = 2
    max_tokens: int = MAX_TOKENS


DEFAULT_CONFIG = SkinnyConfig()


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    grid: tuple[int]
    block_n: int
    block_k: int
    warps: int


def launch_plan(tokens: int, n: int, k: int, config: SkinnyConfig = DEFAULT_CONFIG) -> LaunchPlan:
    """The launch for ``[tokens, k] @ [n, k]^T``: one program per (row block, token)."""
    block_k = min(config.block_k, triton.next_power_of_2(max(k, 1)))
    return LaunchPlan((tokens * triton.cdiv(n, config.block_n),), config.block_n, block_k, config.warps)


def decline_reason(
    tokens: int, n: int, k: int, row_stride_x: int, row_stride_y: int, config: SkinnyConfig = DEFAULT_CONFIG
) -> str | None:
    """Why :func:`launch_plan` cannot run these shapes (None: it can). Pure: CPU tests check it
    at real widths without launching."""
    if not 0 < tokens <= config.max_tokens:
        return f"{tokens} rows: the kernel takes 1 to {config.max_tokens}"
    if k < 1:
        return "K is 0"
    plan = launch_plan(tokens, n, k, config)
    if plan.grid[0] > GRID_X_MAX:
        return f"{plan.grid[0]} programs exceed CUDA's grid limit {GRID_X_MAX}"
    if (tokens - 1) * row_stride_x + k > INT32_MAX or (tokens - 1) * row_stride_y + n > INT32_MAX:
        return "x or the output needs offsets past int32"
    return None


@triton.jit
def _skinny_gemm_kernel(
    X, W, Y, N, TOKENS,
    K: tl.constexpr,  # constexpr: a known trip count (and the interpreter needs it)
    stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    m = pid % TOKENS  # the token is the fastest axis: the M programs of one row block run together
    rows = (pid // TOKENS) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]  # int64: N * K can pass 2**31
    x_ptrs = X + m * stride_xm + cols
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = rows_dot_step(acc, w_ptrs, x_ptrs, k0, rows, cols, N, K, EVEN_N and EVEN_K)
    y = downcast(tl.sum(acc, axis=1), Y.dtype.element_ty)
    if EVEN_N:
        tl.store(Y + m * stride_ym + rows, y)
    else:
        tl.store(Y + m * stride_ym + rows, y, mask=rows < N)


def supports(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig = DEFAULT_CONFIG) -> bool:
    """Whether ``skinny_gemm`` takes these: 2-D floats, the weight's dtype x's or a half-precision
    one under fp32 x, unit stride along K, and shapes :func:`launch_plan` can launch
    (:func:`decline_reason`)."""
    return (
        x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
        and x.dtype in _DTYPES and weight.dtype in (x.dtype,) + _WIDENED_FROM.get(x.dtype, ())
        and x.stride(1) == 1 and weight.stride(1) == 1
        and decline_reason(x.shape[0], weight.shape[0], x.shape[1], x.stride(0), weight.shape[0], config) is None
    )  # fmt: skip


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, config: SkinnyConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """``x @ weight.T`` in x's dtype ([M, K] x [N, K] -> [M, N], the weight widened to x's dtype
    exactly); ``out`` (contiguous rows) if given.
    No host syncs: a CUDA graph captures it."""
    if not supports(x, weight, config):
        raise ValueError(
            f"skinny_gemm: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight {tuple(weight.shape)} "
            f"{weight.dtype} stride {weight.stride()} not supported (M <= {config.max_tokens}, unit stride along K, "
            "a launchable grid)"
        )
    tokens, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    plan = launch_plan(tokens, n, k, config)
    launch_on_device(x, lambda: _skinny_gemm_kernel[plan.grid](
        x, weight, out, n, tokens, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, EVEN_N=n % plan.block_n == 0, EVEN_K=k % plan.block_k == 0,
        num_warps=plan.warps,
    ))  # fmt: skip
    return out
