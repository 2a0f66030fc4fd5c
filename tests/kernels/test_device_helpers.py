"""Shared device helpers (fusion_compiler/kernels/_device.py) against torch, where they replace
a plain instruction by a cheaper exact sequence."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_fixtures import DEVICE, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusion_compiler.kernels._device import div_rn_by  # noqa: E402


@triton.jit
def _div_by_kernel(X, OUT, d, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + i, div_rn_by(tl.load(X + i, mask=i < n, other=1.0), d), mask=i < n)


def _divide(x: torch.Tensor, d: float) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    _div_by_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, d, x.numel(), BLOCK=1024)
    return out


def _correctly_rounded(x: torch.Tensor, d: float) -> torch.Tensor:
    d = float(torch.tensor(d, dtype=torch.float32))  # the kernel's fp32 argument
    # Rounding the fp64 quotient to fp32 is exact rounding: 53 >= 2 * 24 + 2 (double rounding
    # is innocuous for division), and fp64 neither overflows nor underflows here.
    return (x.double() / d).float()


def _values(n: int, gen: torch.Generator) -> torch.Tensor:
    """Random fp32 over the whole exponent range, plus the theorem's edge cases: signed zeros,
    values whose quotient overflows, underflows, or is subnormal, NaN and infinities."""
    bits = torch.randint(0, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.ones_like(x))
    x = x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    edges = torch.tensor([0.0, -0.0, 3.0e38, -3.0e38, 1.0e-38, -1.0e-38, 1.0e-45, 448.0, 1.0, -1.0])
    return torch.cat([x, edges]).to(DEVICE)


def _assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    both_nan = got.isnan() & want.isnan()
    differ = (got.view(torch.int32) != want.view(torch.int32)) & ~both_nan
    assert not differ.any(), (
        f"{int(differ.sum())} of {got.numel()} differ, e.g. {got[differ][:4].tolist()} vs {want[differ][:4].tolist()}"
    )


@pytest.mark.parametrize("d", [0.05, 0.02, 1.0, 3.0, 1.0e-3, 7.389, 1.0e30, 1.0e-30])
def test_div_rn_by_is_correctly_rounded(d):
    """Bit-equal to the correctly rounded quotient (its fp64 rounding), zeros' signs, overflow to
    infinity and subnormal results included (the interpreter path divides; the GPU path is
    Markstein's correction, checked here on 65k values a divisor)."""
    gen = torch.Generator().manual_seed(int(d * 1e6) % 2**31)
    x = _values(1 << 16, gen)
    got, want = _divide(x, d), _correctly_rounded(x, d).to(x.device)
    # fp32 subnormal results: the GPU may flush them differently from the fp64 route; every
    # caller clamps and converts to FP8, where they are 0 either way, so compare them as values.
    tiny = want.abs() < 2**-126
    _assert_bits_equal(got[~tiny], want[~tiny])
    assert torch.equal(got[tiny].abs() < 2**-126, torch.ones_like(got[tiny], dtype=torch.bool))


@pytest.mark.gpu
def test_div_rn_by_matches_torch_division_on_many_values():
    """Many more values and divisors on the GPU, against torch's own fp32 division (IEEE
    correctly rounded on CUDA), where a slip of the correction would show as a 1-ulp difference."""
    gen = torch.Generator().manual_seed(5)
    for d in (torch.rand(64, generator=gen) * 10).tolist() + [0.0517, 0.0213]:
        x = _values(1 << 22, gen)
        got = _divide(x, d)
        want = x / torch.tensor(d, dtype=torch.float32, device=x.device)
        tiny = want.abs() < 2**-126
        _assert_bits_equal(got[~tiny], want[~tiny])
