"""The add+RMSNorm family on small hand-written modules: every variant, and the near misses.

HF's real model code is covered in test_add_rms_norm_hf.py; these modules isolate one
spelling or one departure each.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fusion_compiler as fc
from fusion_compiler.verify import relative_error

BF16 = torch.bfloat16
HIDDEN = 64


class HFNorm(nn.Module):
    """HF LlamaRMSNorm as DeepSeek/MiniMax write it."""

    def __init__(self, eps=1e-6, dim=-1, weight_last=False):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))
        self.variance_epsilon, self.dim, self.weight_last = eps, dim, weight_last

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(self.dim, keepdim=True)
        x = (x * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)
        return x * self.weight if self.weight_last else self.weight * x


class GemmaNorm(nn.Module):
    """Qwen3.5's x·(1+w) norm."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(HIDDEN))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Block(nn.Module):
    """residual add -> norm -> linear -> residual add -> norm, like two decoder half-layers."""

    def __init__(self, norm1, norm2):
        super().__init__()
        self.norm1, self.norm2, self.proj = norm1, norm2, nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, residual):
        h = x + residual
        a = self.proj(self.norm1(h))
        h2 = a + h
        return self.norm2(h2), h2


def _compile_and_run(module, *inputs, config=None):
    backend = fc.FusionBackend(config or fc.FusionConfig())
    module = module.to(BF16)
    with torch.no_grad():
        expected = module(*[t.clone() for t in inputs])
        actual = torch.compile(module, backend=backend)(*inputs)
    return backend.report, actual, expected


def _inputs(n=2, rows=5):
    return [torch.randn(rows, HIDDEN, dtype=BF16) for _ in range(n)]


@pytest.mark.parametrize(
    "norm1, norm2, variants",
    [
        (HFNorm(), HFNorm(weight_last=True), {"add_rms_norm.hf": 1, "add_rms_norm.hf_weight_last": 1}),
        (nn.RMSNorm(HIDDEN, eps=1e-5), nn.RMSNorm(HIDDEN), {"add_rms_norm.torch": 2}),
        (GemmaNorm(), GemmaNorm(), {"add_rms_norm.gemma": 2}),
    ],
    ids=["hf", "torch_nn", "gemma"],
)
def test_each_spelling_fuses_with_its_residual_add(norm1, norm2, variants):
    if isinstance(norm1, nn.RMSNorm):
        with torch.no_grad():
            for norm in (norm1, norm2):
                norm.weight.add_(0.1 * torch.randn(HIDDEN))
    report, actual, expected = _compile_and_run(Block(norm1, norm2), *_inputs())
    assert report.per_variant() == variants, report.format() + str(report.sites)
    assert report.misses() == []
    for a, e in zip(actual, expected):
        assert relative_error(a, e) < 1e-2


def test_norm_without_residual_fuses_alone():
    class Alone(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = HFNorm()

        def forward(self, x):
            return self.norm(x) * 2

    report, actual, expected = _compile_and_run(Alone(), *_inputs(1))
    assert report.per_variant() == {"rms_norm.hf": 1}
    assert relative_error(actual, expected) < 1e-2


def _single_miss(report):
    assert report.count() == 0, report.format()
    (miss,) = report.misses()
    return miss


def test_near_miss_eps_stored_as_tensor():
    class TensorEps(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = HFNorm()
            self.register_buffer("eps", torch.tensor(1e-6))

        def forward(self, x):
            self.norm.variance_epsilon = self.eps
            return self.norm(x)

    report, actual, expected = _compile_and_run(TensorEps(), *_inputs(1))
    miss = _single_miss(report)
    assert "eps is a tensor" in miss.reason
    assert miss.module == "norm"
    assert relative_error(actual, expected) < 1e-2


def test_near_miss_norm_over_a_non_last_dim():
    class OverRows(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = HFNorm(dim=-2)

        def forward(self, x):
            return self.norm(x)

    x = torch.randn(3, 7, HIDDEN, dtype=BF16)
    report, actual, expected = _compile_and_run(OverRows(), x)
    miss = _single_miss(report)
    assert "not the last dim" in miss.reason and miss.stopped_at.startswith("mean")
    assert relative_error(actual, expected) < 1e-2


def test_near_miss_sum_consumed_in_a_form_the_fused_op_cannot_supply():
    """The fp32 upcast of the residual sum feeds the norm *and* a statistic: the fused
    op returns the bf16 sum, not its fp32 upcast, so the site must not fuse."""

    class SumStats(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN))

        def forward(self, x, residual):
            h32 = (x + residual).to(torch.float32)
            normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * normed.to(x.dtype), h32.abs().amax(-1)

    report, actual, expected = _compile_and_run(SumStats(), *_inputs())
    miss = _single_miss(report)
    assert "also used by" in miss.reason and "does not return" in miss.reason
    for a, e in zip(actual, expected):
        assert relative_error(a, e) < 1e-2


def test_near_miss_broadcasting_add_fuses_norm_but_not_add():
    """A bias-like add broadcasts: not a residual the fused op can take; the norm alone fuses."""

    class BiasThenNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = HFNorm()
            self.bias = nn.Parameter(torch.randn(HIDDEN))

        def forward(self, x):
            return self.norm(x + self.bias)

    report, actual, expected = _compile_and_run(BiasThenNorm(), *_inputs(1))
    assert report.per_variant() == {"rms_norm.hf": 1}
    assert relative_error(actual, expected) < 1e-2


def test_training_graph_miss_says_rsqrt_is_saved_for_backward():
    module = Block(HFNorm(), HFNorm())
    backend = fc.FusionBackend()
    out = torch.compile(module.to(BF16), backend=backend)(*_inputs())
    assert out[0].requires_grad
    assert backend.report.count() == 0
    assert all("also used by" in m.reason for m in backend.report.misses()), backend.report.format()


def test_dynamic_token_dim_one_graph_no_baked_sizes():
    """One compiled graph serves 1, 3 and 8 tokens; the fused op's arguments hold no sizes."""
    graphs = []

    class Spy(fc.FusionPass):
        def __call__(self, graph):
            super().__call__(graph)
            graphs.append(graph)

    module = Block(HFNorm(), GemmaNorm()).to(BF16)
    backend = fc.FusionBackend()
    compiled = torch.compile(module, backend=backend)
    original_pass = fc.backend.FusionPass
    fc.backend.FusionPass = Spy
    try:
        for i, rows in enumerate((3, 1, 8)):
            x, residual = _inputs(rows=rows)
            if i == 0:
                torch._dynamo.decorators.mark_unbacked(x, 0)
                torch._dynamo.decorators.mark_unbacked(residual, 0)
            with torch.no_grad():
                actual = compiled(x, residual)
                expected = module(x, residual)
            assert actual[0].shape == (rows, HIDDEN)
            for a, e in zip(actual, expected):
                assert relative_error(a, e) < 1e-2
    finally:
        fc.backend.FusionPass = original_pass
    assert backend.compiles == 1
    assert backend.report.count() == 2
    fused = [n for n in graphs[0].nodes if str(n.target).startswith("fusion_compiler.")]
    assert len(fused) == 2
    for node in fused:
        for arg in node.args:
            assert not isinstance(arg, (int, list, tuple)) or isinstance(arg, bool), (node, arg)


def test_inductor_lowering_replaces_with_canonical_math():
    config = fc.FusionConfig(families={"add_rms_norm": "inductor"})
    report, actual, expected = _compile_and_run(Block(HFNorm(), GemmaNorm()), *_inputs(), config=config)
    assert report.count() == 2
    for a, e in zip(actual, expected):
        assert relative_error(a, e) < 1e-2


def test_off_lowering_leaves_graph_alone():
    config = fc.FusionConfig(families={"add_rms_norm": "off"})
    report, _, _ = _compile_and_run(Block(HFNorm(), HFNorm()), *_inputs(), config=config)
    assert report.sites == []



def test_norm_without_a_weight_is_a_miss_explained_by_the_matcher():
    """No weight multiply: no variant applies; the report carries the matcher's account, as one
    sentence: the closest variant, and what the model has where it left that variant."""

    class Unweighted(nn.Module):
        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) + 1

    report, actual, expected = _compile_and_run(Unweighted(), *_inputs(1))
    miss = _single_miss(report)
    assert miss.reason.startswith("closest variant "), miss.reason
    assert f"at {miss.stopped_at} the model has " in miss.reason and "where the pattern expects " in miss.reason
    assert "CallFunction(" not in miss.reason
    assert relative_error(actual, expected) < 1e-2


def test_repeated_sites_trace_each_pattern_once(monkeypatch):
    """Four identical half-layers (one shape): Inductor's per-match re-traces of the search and
    the replacement are traced once and copied for the other sites (registry._SITE_TRACES), and
    every site still fuses with eager's outputs. A 61-layer model otherwise pays each trace 61
    times."""
    from fusion_compiler import _compat

    traced = []
    real = _compat.trace_like_post_grad

    def counting(fn, args, **kwargs):
        traced.append(fn)
        return real(fn, args, **kwargs)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block(HFNorm(), HFNorm()) for _ in range(2))

        def forward(self, x, residual):
            for block in self.blocks:
                x, residual = block(x, residual)
            return x, residual

    module = Stack()
    _compile_and_run(module, *_inputs())  # variants registered (traced once per process) first
    monkeypatch.setattr(_compat, "trace_like_post_grad", counting)
    torch._dynamo.reset()
    report, actual, expected = _compile_and_run(module, *_inputs())
    assert report.per_variant() == {"add_rms_norm.hf": 4}, report.format()
    assert len(traced) == 2, traced  # one search re-trace, one replacement, for all four sites
    for a, e in zip(actual, expected):
        assert relative_error(a, e) < 1e-2
