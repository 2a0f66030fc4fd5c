"""The add+RMSNorm family on HF transformers' own model code (tiny random configs).

Every RMSNorm module the HF module tree runs in a decode step must fuse, counted per
layer, through the registered `"fusion_compiler"` backend; outputs match eager.
"""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler._compat import TORCH_VERSION
from fusion_compiler.model_adapters import get_adapter, make_decode_step, rms_norm_sites
from fusion_compiler.fx.module_paths import layer_of
from fusion_compiler.verify import relative_error

FAMILY = "add_rms_norm"


def _skip_if_torch_cannot_compile(name: str) -> None:
    if name == "qwen3.5" and TORCH_VERSION < (2, 13):
        # Stock Inductor alone aborts the same way ("corrupted double-linked list"):
        # a torch 2.11 CPU bug, not ours. bench/NOTES.md.
        pytest.skip("torch < 2.13 CPU Inductor crashes compiling tiny Qwen3.5")


class Compiled:
    def __init__(self, name: str):
        _skip_if_torch_cannot_compile(name)
        adapter = get_adapter(name)
        self.model = adapter.build_hf(size="tiny", layers=adapter.default_layers, dtype=torch.bfloat16)
        self.kinds = adapter.layer_kinds(self.model.config)
        self.sites = rms_norm_sites(self.model)
        torch._dynamo.reset()
        compiled = torch.compile(
            self.model,
            backend="fusion_compiler",
            # This file is about the norm family alone: every RMSNorm module fuses as a norm.
            # (With mla_prologue on, DeepSeek's kv_a_layernorm joins the kv site instead, and with
            # gqa_prologue on, MiniMax's and Qwen3.5's q/k norms join the attention prologue, and
            # with gdn on, Qwen3.5's gated linear_attn.norm joins its GDN site, or with
            # gated_rms_norm on, fuses whole with its gate (tests/patterns/test_gated_rms_norm.py);
            # routing is tests/patterns/test_moe_routing.py's.)
            options={"expected": {FAMILY: self.sites}, "strict": True,
                     "families": {"gqa_prologue": "off", "mla_prologue": "off", "moe_routing": "off", "gdn": "off",
                                  "gated_rms_norm": "off"}},
        )
        self.eager = make_decode_step(self.model).run(self.model)
        self.fused = make_decode_step(self.model).run(compiled)
        self.report = fc.last_report()


_CACHE: dict[str, Compiled] = {}


@pytest.fixture(scope="module", params=["deepseek-v3.2", "minimax-m2.5", "qwen3.5"])
def compiled(request):
    if request.param not in _CACHE:
        _CACHE[request.param] = Compiled(request.param)
    return _CACHE[request.param]


def test_every_rms_norm_module_fuses(compiled):
    assert compiled.report.per_module(FAMILY) == compiled.sites
    assert compiled.report.misses() == [], compiled.report.format()
    assert len(compiled.report.graphs) == 1  # no graph breaks


def test_counts_per_layer_match_the_module_tree(compiled):
    expected: dict = {}
    for path, count in compiled.sites.items():
        expected[layer_of(path)] = expected.get(layer_of(path), 0) + count
    assert compiled.report.per_layer(FAMILY) == expected
    assert set(expected) == {None, *range(len(compiled.kinds))}


def test_residual_adds_fuse_with_their_norms(compiled):
    """Each decoder layer's post_attention_layernorm takes the residual add with it."""
    post = [
        s for s in compiled.report.sites if s.module and s.module.endswith("post_attention_layernorm")
    ]
    assert post and all(s.variant.startswith("add_rms_norm.") for s in post)


def test_outputs_match_eager(compiled):
    # Logits after every layer of a bf16 model: the fused norm rounds once where HF rounds
    # twice, and a flipped top-k choice in the router moves logits further; stock Inductor
    # lands 0.5-1% from eager on these models too.
    assert relative_error(compiled.fused, compiled.eager) < 2e-2


def test_per_layer_counts_by_kind():
    """Qwen3.5: linear-attention layers hold 3 norms, the full-attention layer 4; the
    others 4 per layer. Checked against what the HF module tree runs."""
    qwen = _CACHE.get("qwen3.5") or Compiled("qwen3.5")
    per_layer = qwen.report.per_layer(FAMILY)
    for i, kind in enumerate(qwen.kinds):
        assert per_layer[i] == (4 if kind == "full_attention" else 3), (i, kind)


class _Norms(torch.nn.Module):
    """Two of an HF norm module, as two layers: ``layers.{i}.norm``, a gate where it takes one."""

    def __init__(self, make, gated: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"norm": make()}) for _ in range(2))
        self.gated = gated

    def forward(self, x, gate):
        for layer in self.layers:
            x = x + (layer["norm"](x, gate) if self.gated else layer["norm"](x))
        return x


def _hf_norm(model_type: str, cls: str):
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return lambda: getattr(module, cls)(64)


@pytest.mark.parametrize("model_type, cls, gated, reason", [
    ("cohere", "CohereLayerNorm", False,
     "the norm subtracts the mean of x before normalising (a LayerNorm, not an RMSNorm)"),
    ("bamba", "BambaRMSNormGated", True,
     "the norm normalises x · silu(gate), the gate applied before the norm (Mamba2's gated RMSNorm), where the fused "
     "norms take x and gated_rms_norm gates after the norm"),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", True,
     "the norm normalises x · silu(gate), the gate applied before the norm (Mamba2's gated RMSNorm), where the fused "
     "norms take x and gated_rms_norm gates after the norm"),
])  # fmt: skip
def test_norms_that_are_not_rms_norms_of_x_say_what_they_are(model_type, cls, gated, reason):
    """HF norm modules no variant takes: one miss per module, its reason one sentence about the
    model's math (not a matcher's node names); gated_rms_norm claims none; the model runs as written."""
    norms = _Norms(_hf_norm(model_type, cls), gated).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    x, gate = (torch.randn(1, 3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    backend = fc.FusionBackend(fc.FusionConfig(
        default_lowering="off", families={FAMILY: "triton", "gated_rms_norm": "triton"}, horizontal_merge=False,
        merge_projections=False, skinny_gemm=False, decode_attention=False, dsa_topk_mask=False))  # fmt: skip
    torch._dynamo.reset()
    with torch.no_grad():
        eager = norms(x, gate)
        fused = torch.compile(norms, backend=backend)(x, gate)
    report = backend.report
    assert report.per_variant() == {}
    assert [(m.family, m.module, m.reason) for m in report.misses()] == [
        (FAMILY, f"layers.{i}.norm", reason) for i in range(2)
    ]
    assert relative_error(fused, eager) < 1e-2  # Inductor's own kernels, rounding apart from eager's
