"""Helpers the kernel tests share: where kernels run, poisoned outputs with guard slabs, and
the comparisons that allow a rounding tie."""

from __future__ import annotations

import os

import pytest
import torch

FP8 = torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def skip_unless_kernels_can_run() -> None:
    """Call at module level, before importing a kernel: Triton needs CUDA or its interpreter
    (tests/conftest.py turns the interpreter on when there is no CUDA)."""
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)


def poisoned(shape, dtype):
    """Output poisoned with NaN (0xFF for FP8) and one guard slab on each side of dim 0."""
    if shape == (0,):
        return None, torch.empty(0, dtype=dtype, device=DEVICE)
    buf = torch.empty((shape[0] + 2,) + tuple(shape[1:]), dtype=dtype, device=DEVICE)
    if dtype == FP8:
        buf.view(torch.uint8).fill_(0xFF)
    else:
        buf.fill_(float("nan"))
    return buf, buf[1:-1]


def assert_guards_untouched(buf):
    if buf is None:
        return
    for guard in (buf[0], buf[-1]):
        if buf.dtype == FP8:
            assert bool((guard.view(torch.uint8) == 0xFF).all()), "wrote outside the output"
        else:
            assert bool(torch.isnan(guard).all()), "wrote outside the output"


def _few(n: int) -> int:
    """Elements allowed to differ (see the module docstring): at most 1%, at least 2."""
    return max(2, n // 100)


def assert_fp8_close(out, ref, what):
    """FP8 codes equal, except a few one code apart (a rounding tie flipped upstream)."""
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    a, b = out.contiguous().view(torch.uint8).long(), ref.contiguous().view(torch.uint8).long()
    diff = a != b
    n_diff = int(diff.sum())
    assert n_diff <= _few(a.numel()), f"{what}: {n_diff} of {a.numel()} FP8 codes differ"
    # Same sign bit and adjacent magnitudes (e4m3fn codes are monotonic in magnitude).
    near = ((a ^ b) & 0x80 == 0) & ((a & 0x7F) - (b & 0x7F)).abs().le(1)
    assert bool(near[diff].all()), f"{what}: FP8 codes differ by more than one step"
