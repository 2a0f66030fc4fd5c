"""The skinny GEMM kernel (``x @ w.T`` for M <= MAX_TOKENS) against a float64 reference.

CPU tier: the launcher runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py). Fresh
random inputs, the output poisoned with NaN and guarded by a slab on each side; ragged N and K
(the masked path) and even ones (the unmasked path); bf16 within a few bf16 ulps (the kernel and
the reference round once, from sums in different orders), fp32 within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

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
def test_matches_float64(monkeypatch, m, n, k, block_k, dtype):
    monkeypatch.setattr(K, "_BLOCK_K", block_k)  # several K steps at test sizes
    monkeypatch.setattr(K, "MAX_TOKENS", 4)  # the kernel is right above the shipped threshold too (the bench times it there)
    x, w = _inputs(m, n, k, dtype, seed=m * 1000 + n + k)
    buf, out = poisoned((m, n), dtype)
    K.skinny_gemm(x, w, out)
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
    assert KERNEL_VERSIONS["merge_projections"] == K.KERNEL_VERSION == "skinny_gemm-2"
