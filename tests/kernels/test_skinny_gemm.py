"""The skinny GEMM kernel (``x @ w.T`` for M <= MAX_TOKENS) against a float64 reference.

CPU tier: the launcher runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py). Fresh
random inputs, the output poisoned with NaN and guarded by a slab on each side; ragged N and K
(the masked path) and even ones (the unmasked path); bf16 within a few bf16 ulps (the kernel and
the reference round once, from sums in different orders), fp32 within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_fixtures import DEVICE, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.kernels import skinny_gemm as K  # noqa: E402


def _inputs(m, n, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype).to(DEVICE)
    return x, w


def _check(out, x, w):
    ref = (x.double() @ w.double().t()).to(out.dtype).double()
    tol = dict(rtol=1e-5, atol=1e-5) if out.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), **tol)


@pytest.mark.parametrize(
    "m, n, k, block_k",
    [(1, 64, 256, 64), (2, 37, 100, 32), (3, 16, 130, 64), (4, 5, 64, 64), (1, 1, 48, 1024)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_float64(m, n, k, block_k, dtype):
    # Several K steps at test sizes; above the shipped MAX_TOKENS too (the bench times it there).
    config = K.SkinnyConfig(block_k=block_k, max_tokens=4)
    x, w = _inputs(m, n, k, dtype, seed=m * 1000 + n + k)
    buf, out = poisoned((m, n), dtype)
    K.skinny_gemm(x, w, out, config=config)
    assert_guards_untouched(buf)
    assert not torch.isnan(out).any()
    _check(out, x, w)


@pytest.mark.parametrize("m, n, k", [(1, 64, 256), (1, 37, 100)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_widened_weight_matches_float64(m, n, k, weight_dtype):
    """fp32 x, half-precision weight (``x @ w.float().t()``): the weight widened in registers,
    an fp32 output within fp32 rounding of float64."""
    x, _ = _inputs(m, n, k, torch.float32, seed=n + k)
    _, w = _inputs(m, n, k, weight_dtype, seed=n + k + 1)
    assert K.supports(x, w) and not K.supports(x.to(weight_dtype), w.float())  # never a narrowing
    buf, out = poisoned((m, n), torch.float32)
    K.skinny_gemm(x, w, out)
    assert_guards_untouched(buf)
    _check(out, x, w)


def test_strided_activation_rows():
    """x as a column slice of a wider row (unit stride along K, row stride > K)."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(K.MAX_TOKENS, 200, generator=gen).bfloat16().to(DEVICE)
    x = wide[:, 10:138]
    w = (torch.randn(24, 128, generator=gen) * 0.1).bfloat16().to(DEVICE)
    _check(K.skinny_gemm(x, w), x, w)


def test_supports_only_small_m_and_unit_stride():
    x, w = _inputs(K.MAX_TOKENS + 1, 8, 32, torch.bfloat16, seed=1)
    assert not K.supports(x, w)
    assert K.supports(x[: K.MAX_TOKENS], w)
    assert not K.supports(x[:1], w[:, :16])  # shapes disagree
    assert not K.supports(x[:1, ::2], w[:, :16])  # K stride 2
    assert not K.supports(x[:1], w.float())  # a weight wider than x
    with pytest.raises(ValueError, match="not supported"):
        K.skinny_gemm(x, w)


def test_kernel_version_registered():
    assert KERNEL_VERSIONS["merge_projections"] == K.KERNEL_VERSION == "skinny_gemm-3"


# Real vocabularies (DeepSeek V3.2, MiniMax-M2.5, Qwen3.5) and 2**18: an lm_head at one row.
REAL_VOCABULARIES = (129_280, 200_064, 248_320, 262_144)


@pytest.mark.parametrize("vocab", REAL_VOCABULARIES)
def test_lm_head_plan_fits_the_grid_at_real_vocabularies(vocab):
    """The 2-D grid ``(tokens, cdiv(N, 2))`` put 100k-124k programs on y (CUDA's limit: 65,535):
    real vocabularies crashed with 'invalid argument'. The plan is 1-D, every row covered once."""
    plan = K.launch_plan(1, vocab, 6144)
    assert len(plan.grid) == 1 and plan.grid[0] * plan.block_n >= vocab > (plan.grid[0] - 1) * plan.block_n
    assert K.decline_reason(1, vocab, 6144, 6144, vocab) is None


@given(
    tokens=st.integers(1, 16),
    n=st.integers(1, 1 << 20),
    k=st.integers(1, 1 << 15),
    block_n=st.sampled_from((1, 2, 4, 8)),
)
@settings(max_examples=200, deadline=None)  # launch arithmetic, no kernel: 200 take 0.2 s, in either profile
def test_plan_covers_every_row_and_token_within_limits(tokens, n, k, block_n):
    """Pure launch arithmetic, odd widths included: each program is one (row block, token), all
    blocks x tokens covered, the grid within CUDA's x limit whenever the plan is accepted."""
    config = K.SkinnyConfig(block_n=block_n, max_tokens=16)
    plan = K.launch_plan(tokens, n, k, config)
    blocks = -(-n // block_n)
    assert plan.grid == (tokens * blocks,)
    assert plan.block_k <= config.block_k and plan.block_k >= min(k, config.block_k)
    reason = K.decline_reason(tokens, n, k, k, n, config)
    assert (reason is None) == (plan.grid[0] <= K.GRID_X_MAX and (tokens - 1) * max(k, n) + max(k, n) <= K.INT32_MAX)


def test_plan_declines_past_the_grid_and_int32_offsets():
    config = K.SkinnyConfig(block_n=1, max_tokens=4)
    assert "grid limit" in K.decline_reason(2, 2**30 + 1, 64, 64, 2**30 + 1, config)
    assert "int32" in K.decline_reason(2, 64, 64, 2**31, 64, config)  # x rows 2**31 elements apart
    assert "rows" in K.decline_reason(5, 64, 64, 64, 64, config)

