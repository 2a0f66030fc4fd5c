"""Shared device helpers (fusion_compiler/kernels/_device.py) against torch, where they replace
a plain instruction by a cheaper exact sequence.

``div_rn_by`` has two branches: on the GPU, ``x * RN(1 / d)`` and one FMA correction
(Markstein); under the interpreter (``TRITON_INTERPRET=1``, the CPU tier) a plain ``div_rn``,
because the interpreter's ``fma`` rounds twice (``x * y`` to fp32, then ``+ z``).  So a CPU run
of ``div_rn_by`` checks only ``div_rn``.  The correction's arithmetic is checked on CPU by
running the GPU branch's own source under the interpreter with its ``fma`` replaced by one that
rounds once (``_fma_rounded_once``, itself checked against exact rational arithmetic on the
inputs where a double rounding would show).  The GPU tier runs the branch as compiled.
"""

from __future__ import annotations

import os
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from tests.kernel_fixtures import DEVICE, HAS_CUDA, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fusion_compiler.kernels import _device  # noqa: E402
from fusion_compiler.kernels._device import div_rn_by  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _div_by_kernel(X, OUT, D, n, BLOCK: tl.constexpr, TINY_X: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.load(D)  # a scalar tensor, as the callers' scales are (a plain float arg is a Python float under the interpreter)
    tl.store(OUT + i, div_rn_by(tl.load(X + i, mask=i < n, other=1.0), d, TINY_X), mask=i < n)


def _divide(x: torch.Tensor, d: float, tiny_x: bool = True) -> torch.Tensor:
    out = torch.full_like(x, float("nan"))
    d = torch.tensor([d], dtype=torch.float32, device=x.device)
    _div_by_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, d, x.numel(), BLOCK=1024, TINY_X=tiny_x)
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


DIVISORS = [0.05, 0.02, 1.0, 3.0, 1.0e-3, 7.389, 1.0e30, 1.0e-30]


def _check_quotients(x: torch.Tensor, got: torch.Tensor, d: float, tiny_x: bool = True) -> None:
    want = _correctly_rounded(x, d).to(x.device)
    # fp32 subnormal results: the GPU may flush them differently from the fp64 route; every
    # caller clamps and converts to FP8, where they are 0 either way, so compare them as values.
    subnormal = want.abs() < 2**-126
    # Without TINY_X, x below 2**-100 may come out an ulp off (its residual is subnormal): a
    # quotient below 2**-76 as documented for the callers' divisors (FP8 scales >= 1e-4 / 448),
    # any quotient for a divisor below 2**-24 (e.g. 1e-30: x ~ 1e-37 gives q ~ 1e-7).
    small = want.abs() < 2**-76 if d >= 2**-24 else torch.ones_like(subnormal)
    edge = ~subnormal & (x.abs() < 2**-100) & small if not tiny_x else torch.zeros_like(subnormal)
    exact = ~subnormal & ~edge
    _assert_bits_equal(got[exact], want[exact])
    assert bool((got[subnormal].abs() < 2**-126).all()), "a subnormal quotient came out normal"
    ulps = (got[edge].view(torch.int32).long() - want[edge].view(torch.int32).long()).abs()
    assert bool((ulps <= 1).all()), f"an edge quotient is {int(ulps.max())} ulps off"


@pytest.mark.parametrize("d", DIVISORS)
def test_div_rn_by_is_correctly_rounded(d):
    """Bit-equal to the correctly rounded quotient (its fp64 rounding), zeros' signs, overflow to
    infinity and subnormal results included, on 65k values a divisor, for the branch this device
    compiles: on the GPU Markstein's correction; under the interpreter (the CPU tier) plain
    ``div_rn`` only -- the correction is checked on CPU by
    ``test_correction_branch_is_correctly_rounded_with_a_single_rounding_fma``."""
    gen = torch.Generator().manual_seed(int(d * 1e6) % 2**31)
    x = _values(1 << 16, gen)
    _check_quotients(x, _divide(x, d), d)


# ---------------------------------------------------------------------------------------------
# The GPU branch's arithmetic, run under the interpreter
# ---------------------------------------------------------------------------------------------


def _fma_rounded_once(x, y, z):
    """fp32 ``x * y + z`` with one rounding (numpy arrays): the product is exact in fp64 (24 + 24
    bits), the fp64 sum's error is exact (TwoSum), and rounding that sum to odd before fp32
    rounds once in effect (53 >= 24 + 2 bits)."""
    a, b, c = (np.asarray(v, dtype=np.float64) for v in np.broadcast_arrays(x, y, z))
    p = a * b
    with np.errstate(all="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        odd = (s.view(np.int64) & 1) == 1
        toward = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
        s = np.where(np.isfinite(s) & (err != 0) & ~odd, toward, s)
        return s.astype(np.float32)


def _fp32(v: Fraction) -> np.float32:
    """Round an exact rational to the nearest fp32, ties to even (normal range only)."""
    f = float(v)  # nearest fp64; then step to the fp32 neighbours and compare exactly
    lo = np.float32(f)
    if Fraction(float(lo)) > v:
        lo = np.nextafter(lo, np.float32(-np.inf))
    hi = np.nextafter(lo, np.float32(np.inf))
    dlo, dhi = v - Fraction(float(lo)), Fraction(float(hi)) - v
    if dlo != dhi:
        return lo if dlo < dhi else hi
    return lo if int(lo.view(np.int32)) % 2 == 0 else hi


def test_single_rounding_fma_is_exact_where_double_rounding_is_not():
    """The stand-in fma against exact rationals: random triples, and triples whose exact result
    sits 2**-36 of an ulp beside an fp32 tie, where rounding through fp64 first goes wrong."""
    rng = random.Random(3)
    triples = []
    for _ in range(400):
        triples.append(tuple(np.float32(rng.uniform(-4, 4) * 2.0 ** rng.randint(-20, 20)) for _ in range(3)))
    for _ in range(400):
        c = np.float32(rng.uniform(1, 2) * 2.0 ** rng.randint(-30, 30)) * rng.choice([-1, 1])
        half_ulp = float(np.spacing(np.abs(c))) / 2
        # a * b = +-half_ulp * (1 -+ 2**-36) exactly: (1 - 2**-18)(1 + 2**-18) = 1 - 2**-36
        a = np.float32(half_ulp * (1 - 2.0**-18) * rng.choice([-1, 1]))
        b = np.float32((1 + 2.0**-18) * rng.choice([-1, 1]))
        triples.append((a, b, np.float32(c)))
    x, y, z = (np.array(col, dtype=np.float32) for col in zip(*triples))
    got = _fma_rounded_once(x, y, z)
    want = np.array([_fp32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))
                     for a, b, c in triples], dtype=np.float32)  # fmt: skip
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), int((got != want).sum())
    naive = (x.astype(np.float64) * y + z).astype(np.float32)
    assert (naive != want).sum() > 50, "the near-tie triples no longer exercise double rounding"


@pytest.fixture
def gpu_branch_under_the_interpreter(monkeypatch):
    """div_rn_by's GPU branch (``INTERPRETER`` false) with the interpreter's fma rounding once;
    yields the list of fma calls made (so a test can tell the branch ran)."""
    from triton.runtime import interpreter

    calls = []

    def create_fma(x, y, z):
        calls.append(x.data.shape)
        return interpreter.TensorHandle(_fma_rounded_once(x.data, y.data, z.data), z.dtype.scalar)

    monkeypatch.setattr(_device, "INTERPRETER", tl.constexpr(False))
    monkeypatch.setattr(interpreter.interpreter_builder, "create_fma", create_fma)
    yield calls


@pytest.mark.skipif(not INTERPRETED, reason="the GPU runs this branch compiled (tests above)")
@pytest.mark.parametrize("tiny_x", [True, False])
@pytest.mark.parametrize("d", DIVISORS)
def test_correction_branch_is_correctly_rounded_with_a_single_rounding_fma(d, tiny_x, gpu_branch_under_the_interpreter):
    """The GPU branch's source (reciprocal, FMA residual, one correction, the zero / overflow /
    tiny-x edges), run on CPU: bit-equal to the correctly rounded quotient wherever the GPU
    test requires it."""
    gen = torch.Generator().manual_seed(int(d * 1e6) % 2**31 + tiny_x)
    x = _values(1 << 14, gen)
    got = _divide(x, d, tiny_x)
    _check_quotients(x, got, d, tiny_x)
    assert len(gpu_branch_under_the_interpreter) == 2 * triton.cdiv(x.numel(), 1024), "not the FMA branch"
    d32 = np.float32(d)
    if np.frexp(d32)[0] != 0.5:  # 1 / d inexact: some quotients need the correction
        with np.errstate(over="ignore"):
            uncorrected = torch.from_numpy(x.cpu().numpy() * (np.float32(1) / d32))
        want = _correctly_rounded(x, d).cpu()
        finite = torch.isfinite(want) & (want.abs() >= 2**-126)
        assert bool((uncorrected != want)[finite].any()), "no value here needs the correction"


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
