"""FusionPass machinery: expectations and strict mode, verify, uuid, logging, config errors."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch
import torch.nn as nn

import fusion_compiler as fc
from fusion_compiler.ops import rms_norm as rms_norm_ops
from fusion_compiler.passes.fusion_pass import pass_uuid
from fusion_compiler.module_paths import layer_of, normalize_module_path

BF16 = torch.bfloat16


class Norm(nn.Module):
    def __init__(self, eps=1e-6, tensor_eps=False):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(32))
        self.eps = torch.tensor(eps) if tensor_eps else eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, tensor_eps=False):
        super().__init__()
        self.input_layernorm = Norm(tensor_eps=tensor_eps)
        self.mlp = nn.Linear(32, 32)
        self.post_attention_layernorm = Norm()

    def forward(self, x):
        h = x + self.mlp(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class Stack(nn.Module):
    def __init__(self, broken_layer=None):
        super().__init__()
        self.layers = nn.ModuleList(Layer(tensor_eps=(i == broken_layer)) for i in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


EXPECTED = {
    "add_rms_norm": {f"layers.{i}.{name}": 1 for i in range(3) for name in ("input_layernorm", "post_attention_layernorm")}
}


def _run(model, config):
    backend = fc.FusionBackend(config)
    x = torch.randn(4, 32, dtype=BF16)
    with torch.no_grad():
        out = torch.compile(model.to(BF16), backend=backend)(x)
    return backend, out


def test_expected_vs_found_per_layer():
    backend, _ = _run(Stack(), fc.FusionConfig(expected=EXPECTED))
    report = backend.report
    assert report.per_layer("add_rms_norm") == {0: 2, 1: 2, 2: 2}
    assert report.expected_per_layer("add_rms_norm") == {0: 2, 1: 2, 2: 2}
    assert report.missing_expected() == []


def test_strict_raises_naming_the_missing_site_and_its_reason():
    with pytest.raises(Exception, match=r"layers\.1\.input_layernorm.*eps is a tensor"):
        _run(Stack(broken_layer=1), fc.FusionConfig(expected=EXPECTED, strict=True))


def test_without_strict_the_miss_is_reported_not_raised():
    backend, _ = _run(Stack(broken_layer=1), fc.FusionConfig(expected=EXPECTED))
    assert backend.report.missing_expected() == [("add_rms_norm", "layers.1.input_layernorm", 1, 0)]
    assert backend.report.per_layer("add_rms_norm") == {0: 2, 1: 1, 2: 2}
    (miss,) = backend.report.misses()
    assert miss.layer == 1 and "eps is a tensor" in miss.reason


def test_one_log_line_per_compile_summarises_matches(caplog):
    with caplog.at_level(logging.INFO, logger="fusion_compiler"):
        _run(Stack(), fc.FusionConfig())
    lines = [r.getMessage() for r in caplog.records if r.name == "fusion_compiler"]
    assert lines == ["fusion_compiler graph 0: add_rms_norm 6/6 sites fused"]


def test_verify_passes_on_a_correct_rewrite():
    backend, _ = _run(Stack(), fc.FusionConfig(verify=True))
    assert backend.report.count() == 6


def test_verify_raises_naming_sites_when_the_fused_op_is_wrong():
    op = torch.ops.fusion_compiler.add_rms_norm.default
    custom_op = rms_norm_ops._add_rms_norm_op

    def wrong(x, residual, weight, eps, weight_offset, out_dtype):
        out, total = rms_norm_ops.add_rms_norm_reference(x, residual, weight, eps, weight_offset, out_dtype)
        return out * 1.5, total

    custom_op.register_kernel("cpu")(wrong)
    try:
        with pytest.raises(fc.VerificationError, match=r"add_rms_norm\.hf at layers\.\d\.post_attention_layernorm"):
            _run(Stack(), fc.FusionConfig(verify=True))
    finally:
        custom_op.register_kernel("cpu")(rms_norm_ops.add_rms_norm_reference)
    assert op is torch.ops.fusion_compiler.add_rms_norm.default


def test_uuid_is_stable_and_covers_the_config():
    a = pass_uuid(fc.FusionConfig())
    assert a == pass_uuid(fc.FusionConfig(strict=True, verify=True))  # neither changes the graph
    assert a != pass_uuid(fc.FusionConfig(families={"add_rms_norm": "inductor"}))
    assert fc.FusionPass(fc.FusionConfig()).uuid() == a


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"families": {"rope": "triton"}}, "unknown fusion families"),
        ({"families": {"add_rms_norm": "cuda"}}, "lowering 'cuda'"),
        ({"default_lowering": "fast"}, "lowering 'fast'"),
        ({"verify_rtol": 0}, "verify_rtol"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fc.FusionConfig(**kwargs)


def test_backend_is_registered_as_an_entry_point():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("fusion_compiler") == "fusion_compiler.backend:fusion_backend"
    assert "fusion_compiler" in torch._dynamo.list_backends(exclude_tags=())


def test_named_backend_compiles_and_reports():
    model = Stack().to(BF16)
    x = torch.randn(4, 32, dtype=BF16)
    with torch.no_grad():
        out = torch.compile(model, backend="fusion_compiler")(x)
        expected = model(x)
    assert fc.last_report().count() == 6
    assert (out.float() - expected.float()).norm() / expected.float().norm() < 1e-2


@pytest.mark.parametrize(
    "raw, path, layer",
    [
        ("L['self'].model.layers.0.input_layernorm", "model.layers.0.input_layernorm", 0),
        ("L['self']._modules['model']._modules['layers'][12].self_attn", "model.layers.12.self_attn", 12),
        ("L['self'].model.norm", "model.norm", None),
    ],
)
def test_module_paths_parse_from_nn_module_stack(raw, path, layer):
    assert normalize_module_path(raw) == path
    assert layer_of(path) == layer


def test_compile_returns_the_model_with_its_report():
    model = Stack().to(BF16)
    compiled = fc.compile(model, fc.FusionConfig(expected=EXPECTED, strict=True))
    with torch.no_grad():
        compiled(torch.randn(4, 32, dtype=BF16))
    assert compiled.fusion_report.count() == 6
    assert compiled.fusion_backend.compiles == 1
