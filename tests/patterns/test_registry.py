"""patterns/registry.py's contract with Inductor: a lowering that cannot take a site declines it.

A match the guard accepts has its replacement traced on the site's fake values before Inductor
takes it. What a fused op's argument checks raise there (ValueError: a width, a dtype, a layout
its kernel cannot take) becomes the miss's reason, in the op's words; anything else raised is a
bug of ours, declined all the same with a reason naming the exception. The compile goes on with
the model's own ops, and strict mode raises ``MissedSiteError`` for the expected site.

Forced here on two RMSNorms of a small module (the op's ``_validate`` made to refuse one width
with a ValueError and the other with a KeyError); the real case, DeepSeek V3.2 with a 64-wide
latent, is in test_mla_prologue.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fusion_compiler as fc
from fusion_compiler.ops import rms_norm as rms_norm_ops
from fusion_compiler.verify import relative_error

WIDE, NARROW = 64, 32


class _Norm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class _TwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.wide, self.proj, self.narrow = _Norm(WIDE), nn.Linear(WIDE, NARROW), _Norm(NARROW)

    def forward(self, x):
        return self.narrow(self.proj(self.wide(x)))


def _refusing_validate(real):
    def validate(x, *args):
        if x.shape[-1] == WIDE:
            raise ValueError(f"x width {WIDE} does not fit the kernel's tile (forced)")
        if x.shape[-1] == NARROW:
            raise KeyError("forced bug")
        return real(x, *args)

    return validate


def _compile(module, x, **config):
    backend = fc.FusionBackend(fc.FusionConfig(**config))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(module, backend=backend)(x)
    return backend.report, got


def test_a_site_the_lowering_cannot_take_is_a_reported_miss_and_strict_raises(monkeypatch):
    monkeypatch.setattr(rms_norm_ops, "_validate", _refusing_validate(rms_norm_ops._validate))
    module = _TwoNorms().to(torch.bfloat16)
    x = torch.randn(3, WIDE, dtype=torch.bfloat16)
    with torch.no_grad():
        want = module(x)

    report, got = _compile(module, x)
    assert report.count("add_rms_norm") == 0, report.format()
    misses = {m.module: m for m in report.misses("add_rms_norm")}
    assert set(misses) == {"wide", "narrow"}, report.format()
    assert misses["wide"].reason == (
        f"rms_norm.hf: the fused op does not take this site: x width {WIDE} does not fit the kernel's tile (forced)"
    )
    bug = misses["narrow"].reason
    assert "add_rms_norm replacement raised KeyError" in bug and "a bug" in bug and "forced bug" in bug, bug
    assert relative_error(got, want) < 1e-2  # the model's own ops ran (as Inductor compiles them)

    with pytest.raises(fc.MissedSiteError) as raised:
        _compile(module, x, strict=True, expected={"add_rms_norm": {"wide": 1}})
    assert "add_rms_norm at wide" in str(raised.value) and "does not fit the kernel's tile" in str(raised.value)


def test_the_check_traces_the_replacement_inductor_then_copies(monkeypatch):
    """The check's trace of the replacement and Inductor's own trace right after it are one
    trace: per site the search's re-trace and the replacement, each once (registry._SITE_TRACES)."""
    from fusion_compiler import _compat

    traced = []
    real = _compat.trace_like_post_grad

    def counting(fn, args, **kwargs):
        traced.append(getattr(fn, "__name__", fn))
        return real(fn, args, **kwargs)

    module = _Norm(WIDE).to(torch.bfloat16)
    x = torch.randn(3, WIDE, dtype=torch.bfloat16)
    _compile(module, x)  # the variants traced (once per process) first
    monkeypatch.setattr(_compat, "trace_like_post_grad", counting)
    report, got = _compile(module, x)
    assert report.per_variant() == {"rms_norm.hf": 1}, report.format()
    assert len(traced) == 2, traced  # the search's re-trace and one replacement trace
    with torch.no_grad():
        assert relative_error(got, module(x)) < 1e-2
