"""Skinny GEMM ``y [M, N] = x [M, K] @ w [N, K]^T`` for decode-sized M: one Triton kernel that
streams the weight rows once, in place of cuBLAS's split-K GEMM plus its reduce kernel.

At decode sizes (M of a few tokens) a projection is a weight read: Qwen3.5's out_proj at one
token is 64 MiB of weight for 8 K multiply-adds a row. cuBLAS picks a split-K kernel and a
second reduce kernel for these shapes and reads the weight at ~3.2 TB/s on the H200 (session 14
profile, bench/NOTES.md). Here each program owns ``BLOCK_N`` whole weight rows and walks K in
``BLOCK_K`` steps into a 2-D fp32 accumulator reduced once at the end, so a row is one long
contiguous stream and no partial sums leave the program: one launch, no reduce kernel. The
token is the fastest grid axis, so the programs of the M tokens that read the same rows run at
about the same time and the repeats come from L2 (HBM reads the weight once; L2 serves it M
times, which is why this is for small M only: ``MAX_TOKENS``).

Launch shape by the Little's-law argument the experts kernels use (model_adapters/
experts_kernel.py): at ~4.2 TB/s and ~1 us of latency the H200 needs ~4 MB of loads in
flight; 2 rows x 1024 at 2 warps (4 KB a step, thousands of programs) is the thin shape that
won every H200 sweep of the experts' down kernel; at M = 1 here the best of seven shapes was
within 0-8% of it on every projection, and no one shape was best on all (session 14).
``_BLOCK_N`` / ``_BLOCK_K`` / ``_WARPS`` override it for bench/skinny_gemm_check.py.

Numerics: fp32 accumulation in the kernel's tree order (cuBLAS sums in its own order), rounded
once to the output dtype (x's), as cuBLAS rounds a bf16 GEMM. The weight may be a narrower float
than x (bf16 / fp16 weights, fp32 x: ``x @ w.float().t()``, an exact widening done in
registers). Under ``TRITON_INTERPRET=1`` (set before importing) it runs on CPU tensors with the
bit-exact bf16 casts of ``_device``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import downcast, launch_on_device, rows_dot_step

KERNEL_VERSION = "skinny_gemm-2"

# The largest M the kernel takes (the op falls back to torch.mm above it): L2 serves each weight
# byte M times. H200, session 14 (bench/skinny_gemm_check.py, results/skinny_gemm_h200_session14.json;
# eight real projections, weights from HBM): at M = 1 1.01-1.40x cuBLAS's split-K + reduce (one
# kernel, 41-89% of the copy bandwidth); at 2 0.78-1.31x, at 4 0.49-0.86x, at 8 0.29-0.52x.
MAX_TOKENS = 1
_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_WIDENED_FROM = {torch.float32: (torch.bfloat16, torch.float16)}  # weight dtypes read under an fp32 x
_BLOCK_N = 2
_BLOCK_K = 1024
_WARPS = 2


@triton.jit
def _skinny_gemm_kernel(
    X, W, Y, N,
    K: tl.constexpr,  # constexpr: a known trip count (and the interpreter needs it)
    stride_xm, stride_wn, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
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


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_gemm`` takes these: 2-D floats, the weight's dtype x's or a half-precision
    one under fp32 x, unit stride along K, M <= MAX_TOKENS."""
    return (
        x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
        and x.dtype in _DTYPES and weight.dtype in (x.dtype,) + _WIDENED_FROM.get(x.dtype, ())
        and 0 < x.shape[0] <= MAX_TOKENS and x.stride(1) == 1 and weight.stride(1) == 1
    )  # fmt: skip


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` in x's dtype ([M, K] x [N, K] -> [M, N], the weight widened to x's dtype
    exactly); ``out`` (contiguous rows) if given.
    No host syncs: a CUDA graph captures it."""
    if not supports(x, weight):
        raise ValueError(
            f"skinny_gemm: x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight {tuple(weight.shape)} "
            f"{weight.dtype} stride {weight.stride()} not supported (M <= {MAX_TOKENS}, unit stride along K)"
        )
    tokens, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n, block_k = _BLOCK_N, min(_BLOCK_K, triton.next_power_of_2(k))
    grid = (tokens, triton.cdiv(n, block_n))
    launch_on_device(x, lambda: _skinny_gemm_kernel[grid](
        x, weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0,
        num_warps=_WARPS,
    ))  # fmt: skip
    return out
