"""The moe_experts stage (patterns/moe_experts.py) on HF's real code, and its near misses.

* HF's three models (tiny, bf16, their default ``grouped_mm`` experts): one site per MoE layer,
  matched, as the shared strict decode run expects (tests/hf_fixtures.py).
* HF's ``MiniMaxM2Experts`` module alone, compiled through our backend: ``grouped_mm`` and
  ``batched_mm`` both fuse, and the fused output equals the op's float64 reference from the same
  bf16 inputs (1e-2) and eager HF (1e-2), with HF's expert-parallel sentinel ids (>= E) in the
  routing (they contribute nothing in both).
* Near misses, each with its reason: a GELU-gated expert (HF's ``_apply_gate`` overridden), the
  experts' weights stored transposed (``is_transposed``), and a combine that keeps fp32. HF's
  ``eager`` experts break the graph at every expert: no site, and none expected.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler as fc
from fusion_compiler.model_adapters import get_adapter
from fusion_compiler.model_adapters.base import experts_sites
from fusion_compiler.ops.moe_experts import moe_experts_reference
from fusion_compiler.verify import relative_error
from hf_fixtures import default_decode_run

TOKENS, TOP_K = 5, 2


@pytest.mark.parametrize("name", ["deepseek-v3.2", "minimax-m2.5", "qwen3.5"])
def test_hf_models_fuse_their_experts_once_per_moe_layer(name):
    run = default_decode_run(name)
    expected = run.expected["moe_experts"]
    assert expected and all(path.endswith("mlp.experts") for path in expected)
    assert run.report.per_module("moe_experts") == expected, run.report.format()
    assert not run.report.misses("moe_experts")
    assert relative_error(run.fused, run.eager) < 2e-2


def _hf_experts(implementation: str, seed: int = 0) -> torch.nn.Module:
    """HF's MiniMaxM2Experts from the tiny MiniMax config (8 experts, H 256, I 128), bf16."""
    model = get_adapter("minimax-m2.5").build_hf(size="tiny", layers=1, dtype=torch.bfloat16, seed=seed,
                                                experts_implementation=implementation)  # fmt: skip
    experts = model.model.layers[0].mlp.experts
    assert experts_sites(model) == ({"model.layers.0.mlp.experts": 1} if implementation != "eager" else {})
    return experts


def _routing(experts: torch.nn.Module, seed: int, sentinel: bool = False):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, experts.gate_up_proj.shape[2], generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    if sentinel:  # HF's expert-parallel padding: an id past the last expert, weight 0
        ids[1, 0], weights[1, 0] = experts.num_experts, 0.0
    return hidden, ids, weights


def _compile(module: torch.nn.Module, *args):
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(module, backend=backend, fullgraph=True)(*args)
    return out, backend.report


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_hf_experts_fuse_and_match_float64(implementation):
    experts = _hf_experts(implementation)
    hidden, ids, weights = _routing(experts, seed=1, sentinel=True)
    with torch.no_grad():
        eager = experts(hidden, ids, weights)
    fused, report = _compile(experts, hidden, ids, weights)
    [site] = report.sites
    assert (site.family, site.status, site.variant) == ("moe_experts", "matched", implementation)
    exact = moe_experts_reference(hidden.double(), ids, weights.double(), experts.gate_up_proj.double(),
                                  experts.down_proj.double())  # fmt: skip
    assert relative_error(fused, exact) < 1e-2
    assert relative_error(fused, eager) < 1e-2


def test_hf_eager_experts_are_no_site():
    """HF's eager experts loop over ``nonzero``'s experts: the graph breaks; nothing is reported."""
    experts = _hf_experts("eager")
    hidden, ids, weights = _routing(experts, seed=2)
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(experts, backend=backend)(hidden, ids, weights)
    assert report_families(backend.report) == set()


def report_families(report) -> set:
    return {s.family for s in report.sites if s.family == "moe_experts"}


class GeluExperts(torch.nn.Module):
    """HF's grouped_mm experts with a GELU-gated MLP (as a model overriding ``_apply_gate``)."""

    def __init__(self, base: torch.nn.Module):
        super().__init__()
        self.inner = base
        base._apply_gate = lambda gate_up: (lambda gate, up: F.gelu(gate) * up)(*gate_up.chunk(2, dim=-1))

    def forward(self, *args):
        return self.inner(*args)


def _grouped_form(hidden, ids, weights, gate_up, down, *, transposed=False, keep_fp32=False):
    """HF's grouped_mm experts written out (sort, gather, two grouped GEMMs, unsort, sum)."""
    tokens, top_k = ids.shape
    sorted_ids, order = torch.sort(ids.reshape(-1))
    offsets = torch.cumsum(torch.histc(sorted_ids.float(), bins=gate_up.shape[0], min=0, max=gate_up.shape[0] - 1),
                           dim=0, dtype=torch.int32)  # fmt: skip
    gate_up_t = gate_up if transposed else gate_up.transpose(-2, -1)
    gate, up = torch._grouped_mm(hidden[order // top_k], gate_up_t, offs=offsets).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)
    out = out * weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    total = out[inverse].view(tokens, top_k, -1).sum(dim=1)
    return total if keep_fp32 else total.to(hidden.dtype)


class WrittenOut(torch.nn.Module):
    def __init__(self, base: torch.nn.Module, **kwargs):
        super().__init__()
        self.gate_up, self.down, self.kwargs = base.gate_up_proj, base.down_proj, kwargs
        if kwargs.get("transposed"):  # stored [E, H, 2I], read without a transpose
            self.gate_up = torch.nn.Parameter(base.gate_up_proj.detach().transpose(1, 2).contiguous())

    def forward(self, hidden, ids, weights):
        return _grouped_form(hidden, ids, weights, self.gate_up, self.down, **self.kwargs)


def test_written_out_grouped_form_fuses():
    """The same math written out by hand (not HF's function) is the same site."""
    experts = _hf_experts("grouped_mm")
    _, report = _compile(WrittenOut(experts), *_routing(experts, seed=3))
    assert [(s.status, s.variant) for s in report.sites] == [("matched", "grouped_mm")]


@pytest.mark.parametrize("make, reason", [
    (lambda e: GeluExperts(e), "is not SiLU"),
    (lambda e: WrittenOut(e, transposed=True), "is_transposed"),
    (lambda e: WrittenOut(e, keep_fp32=True), "stays torch.float32"),
], ids=["gelu-gate", "transposed-weights", "fp32-combine"])  # fmt: skip
def test_near_misses_are_reported_with_their_reason(make, reason):
    experts = _hf_experts("grouped_mm")
    module = make(experts)
    hidden, ids, weights = _routing(experts, seed=4)
    with torch.no_grad():
        eager = module(hidden, ids, weights)
    out, report = _compile(module, hidden, ids, weights)
    [site] = report.sites
    assert site.status == "missed" and reason in site.reason, site
    assert site.stopped_at and site.chain, site  # the report names where the site left the spelling
    assert torch.equal(out, eager) or relative_error(out, eager) < 1e-2  # the site runs as written


# Neighbouring HF MoE models, no adapter of ours: tiny configs of transformers' own classes.
_ZOO_CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=64, tie_word_embeddings=False)  # fmt: skip


def _zoo_model(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **_ZOO_CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe"])
def test_neighbouring_hf_moe_models_fuse_with_no_code_of_theirs(model_type):
    """The same math in other models' code (each its own ``*Experts`` class, HF's default
    ``grouped_mm``): one site, matched, expected from the module tree; logits within 1e-2."""
    model = _zoo_model(model_type)
    ids = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(ids).logits
    out, report = _compile(model, ids)
    assert [(s.status, s.variant) for s in report.sites if s.family == "moe_experts"] == [("matched", "grouped_mm")]
    assert report.per_module("moe_experts") == experts_sites(model) == {"model.layers.0.mlp.experts": 1}
    assert relative_error(out.logits, eager) < 1e-2


def test_gpt_oss_experts_are_one_miss_with_its_reason():
    """gpt-oss stores its experts transposed, with biases and a clamped gate: one miss per layer
    (not one per GEMM), in words; not expected; the model still compiles and runs as written."""
    model = _zoo_model("gpt_oss")
    ids = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager = model(ids).logits
    out, report = _compile(model, ids)
    [site] = [s for s in report.sites if s.family == "moe_experts"]
    assert site.status == "missed" and "is_transposed" in site.reason
    assert site.stopped_at.startswith("arg") and "[stopped at None]" not in report.format()  # the stored weight
    assert experts_sites(model) == {}
    assert relative_error(out.logits, eager) < 1e-2
