"""MoE routing on HF transformers' own routers and on near misses.

- MiniMax-M2.5 (sigmoid + correction bias) and Qwen3.5 (softmax): every router in a tiny
  model fuses, counted per layer against the adapter's expectations (strict), and the fused
  routing returns eager's experts and weights.
- DeepSeek V3.2 (grouped sigmoid + bias, renormalised with +1e-20, x routed_scaling_factor):
  the same, with n_group / topk_group / top_k / eps / scale read from the graph.
- Near misses: softmax scores with a sigmoid-style bias; the bias added to the gathered
  weights instead of the choice; top-k larger than the experts the group mask leaves; a
  group count that does not divide the experts (guard).
"""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import get_adapter
from fusion_compiler.verify import relative_error
from hf_fixtures import default_decode_run

FAMILY = "moe_routing"


def _assert_same_routing(fused, eager):
    """Same experts per token (as sets: HF asks for unsorted top-k) with the same weights."""
    (w_f, ids_f), (w_e, ids_e) = fused, eager
    assert torch.equal(ids_f.sort(-1).values, ids_e.sort(-1).values)
    by_id_f = torch.zeros(ids_f.shape[0], 1024, dtype=torch.float32).scatter(1, ids_f, w_f.float())
    by_id_e = torch.zeros(ids_e.shape[0], 1024, dtype=torch.float32).scatter(1, ids_e, w_e.float())
    torch.testing.assert_close(by_id_f, by_id_e, rtol=1e-2 if w_f.dtype != torch.float32 else 1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name, variant",
    [("minimax-m2.5", "sigmoid_bias"), ("qwen3.5", "softmax"), ("deepseek-v3.2", "sigmoid_bias_grouped")],
)
def test_hf_router_fuses_and_routes_like_eager(name, variant):
    model = get_adapter(name).build_hf(size="tiny", layers=1 if name != "qwen3.5" else 4, dtype=torch.bfloat16)
    layer = model.model.layers[0]
    moe = layer.mlp
    gate = moe.gate
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16)
    args = (hidden, moe.e_score_correction_bias) if hasattr(moe, "e_score_correction_bias") else (hidden,)
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        _, w_e, ids_e = gate(*args)
        # The gate returns its logits: they must stay, so the GEMM form cannot match and the
        # routing fuses from the logits.
        _, w_f, ids_f = torch.compile(gate, backend=backend)(*args)
    assert backend.report.per_variant() == {variant: 1}
    assert w_f.dtype == w_e.dtype and ids_f.dtype == ids_e.dtype
    _assert_same_routing((w_f, ids_f), (w_e, ids_e))


@pytest.mark.parametrize("name", ["minimax-m2.5", "qwen3.5", "deepseek-v3.2"])
def test_every_router_of_the_model_fuses(name):
    from fusion_compiler._compat import TORCH_VERSION

    if name == "qwen3.5" and TORCH_VERSION < (2, 13):
        pytest.skip("torch < 2.13 CPU Inductor crashes compiling tiny Qwen3.5 (stock too)")
    layers = get_adapter(name).default_layers
    run = default_decode_run(name)  # strict against the adapter's expected sites
    assert len(run.expected[FAMILY]) == layers  # every layer is MoE
    report = run.report
    assert report.missing_expected() == []
    assert report.per_module(FAMILY) == run.expected[FAMILY]
    # The MoE block drops the router logits, so every router fuses with its GEMM. (Qwen's
    # shared-expert gate does not join here: at 1 token on CPU, Inductor's mem-bound-mm pass
    # turns its [1, H] x [H, 1] GEMM into mul + sum; test_hf_qwen_moe_block_fuses_its_shared_gate.)
    gemm_form = {"deepseek-v3.2": "sigmoid_bias_grouped+fp32_gemm", "minimax-m2.5": "sigmoid_bias+gemm",
                 "qwen3.5": "softmax+gemm"}  # fmt: skip
    from fusion_compiler.patterns.moe_routing import VARIANTS

    routing_variants = {v.name for v in VARIANTS}
    fused_routers = {v: n for v, n in report.per_variant().items() if v in routing_variants}
    assert fused_routers == {gemm_form[name]: layers}
    assert relative_error(run.fused, run.eager) < 2e-2


@pytest.mark.parametrize(
    "name, variant",
    [("minimax-m2.5", "sigmoid_bias+gemm"), ("qwen3.5", "softmax+gemm"), ("deepseek-v3.2", "sigmoid_bias_grouped+fp32_gemm")],
)
def test_hf_router_without_its_logits_fuses_its_gemm(name, variant):
    model = get_adapter(name).build_hf(size="tiny", layers=1 if name != "qwen3.5" else 4, dtype=torch.bfloat16)
    moe = model.model.layers[0].mlp
    hidden = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16)
    extra = (moe.e_score_correction_bias,) if hasattr(moe, "e_score_correction_bias") else ()

    def route(x):
        return moe.gate(x, *extra)[1:]

    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        eager = route(hidden)
        fused = torch.compile(route, backend=backend)(hidden)
    assert backend.report.per_variant() == {variant: 1}
    _assert_same_routing(fused, eager)


def test_grouped_routing_reads_its_constants_from_the_graph():
    adapter = get_adapter("deepseek-v3.2")
    model = adapter.build_hf(size="tiny", layers=1, dtype=torch.bfloat16)
    gate = model.model.layers[0].mlp.gate
    assert (gate.num_group, gate.topk_group, gate.top_k, gate.routed_scaling_factor) == (4, 2, 4, 2.5)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        _, w_e, ids_e = gate(x)
        _, w_f, ids_f = torch.compile(gate, backend=backend)(x)
    assert backend.report.per_variant() == {"sigmoid_bias_grouped": 1}
    _assert_same_routing((w_f, ids_f), (w_e, ids_e))
    assert torch.allclose(w_f.sum(-1), torch.full((3,), 2.5), rtol=1e-5)  # renormalised, then scaled


class GroupedRouter(torch.nn.Module):
    """DeepSeek's grouped routing with its constants as parameters (HF's code, functional)."""

    def __init__(self, experts=16, groups=4, topk_group=1, top_k=6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, 32))
        self.register_buffer("bias", 0.1 * torch.randn(experts))
        self.experts, self.groups, self.topk_group, self.top_k = experts, groups, topk_group, top_k

    def forward(self, x):
        scores = torch.nn.functional.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.bias
        group_scores = choice.view(-1, self.groups, self.experts // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
        mask = mask.unsqueeze(-1).expand(-1, self.groups, self.experts // self.groups).reshape(-1, self.experts)
        choice = choice.masked_fill(~mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * 2.5, ids


def _compile_router(router):
    """(report, eager outputs, fused outputs) for 5 tokens through a small router."""
    x = torch.randn(5, 32)
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        eager = router(x)
        fused = torch.compile(router, backend=backend)(x)
    return backend.report, eager, fused


def test_top_k_beyond_the_unmasked_experts_does_not_match():
    report, eager, fused = _compile_router(GroupedRouter(topk_group=2, top_k=10))  # 2 groups of 4 left, 10 asked
    assert report.per_variant() == {}
    [miss] = report.misses(FAMILY)
    assert "larger than the 8 experts left unmasked" in miss.reason, miss.reason
    # Experts picked among the -inf ties are unspecified; their weights' sum is not.
    torch.testing.assert_close(fused[0].sum(-1), eager[0].sum(-1))


def test_grouped_router_within_the_unmasked_experts_matches():
    report, eager, fused = _compile_router(GroupedRouter(topk_group=2, top_k=6))
    assert report.per_variant() == {"sigmoid_bias_grouped+fp32_gemm": 1}  # fp32 model: its GEMM needs no casts
    _assert_same_routing(fused, eager)


def test_guard_declines_groups_that_do_not_divide_the_experts():
    from fusion_compiler.patterns import moe_routing

    variant = next(v for v in moe_routing.VARIANTS if v.name == "sigmoid_bias_grouped")
    values = {
        "logits": torch.randn(2, 16), "bias": torch.randn(16), "top_k": 2, "n_group": 3, "topk_group": 1,
        "renorm_eps": 1e-20, "scale": 1.0, "group_top": 2, "topk_dims": {-1}, "reduce_dims": {(-1,)},
        "graph_top_k": 2, "graph_n_group": 3, "graph_topk_group": 1,
    }  # fmt: skip
    reason = moe_routing.guard(values, variant)
    assert reason is not None and "do not divide" in reason
    values["n_group"] = values["graph_n_group"] = 4
    assert moe_routing.guard(values, variant) is None


class Router(torch.nn.Module):
    def __init__(self, spelling, experts=16, hidden=32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))
        self.register_buffer("bias", 0.1 * torch.randn(experts))
        self.spelling = spelling

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        if self.spelling == "softmax_with_bias":  # softmax where the bias-corrected sigmoid is expected
            scores = torch.softmax(logits.float(), dim=-1)
            _, ids = torch.topk(scores + self.bias, 4, dim=-1)
            weights = scores.gather(1, ids)
        elif self.spelling == "bias_after_gather":  # the bias moves the weights, not the choice
            scores = torch.sigmoid(logits.float())
            _, ids = torch.topk(scores, 4, dim=-1)
            weights = (scores + self.bias).gather(1, ids)
        else:
            scores = torch.sigmoid(logits.float())
            _, ids = torch.topk(scores + self.bias, 4, dim=-1)
            weights = scores.gather(1, ids)
        return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("spelling, variants", [("sigmoid_bias", {"sigmoid_bias+fp32_gemm": 1}), ("softmax_with_bias", {}), ("bias_after_gather", {})])
def test_near_misses_do_not_match(spelling, variants):
    report, eager, fused = _compile_router(Router(spelling))
    assert report.per_variant() == variants
    if not variants:
        [miss] = report.misses(FAMILY)
        assert miss.reason
    _assert_same_routing(fused, eager)


class OnlineSoftmaxRouter(torch.nn.Module):
    """Qwen's routing as a CUDA graph reaches our pass: Inductor has already turned the softmax
    into its online form (prims.prepare_softmax_online), which CPU graphs never show."""

    def __init__(self, experts=16, hidden=32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        top, total = torch.ops.prims.prepare_softmax_online(logits, 1)
        probs = torch.exp(logits - top) / total
        values, ids = torch.topk(probs, 4, dim=-1)
        return values / values.sum(-1, keepdim=True), ids


def test_online_softmax_of_a_router_fuses():
    import torch._inductor.inductor_prims  # noqa: F401 - registers prepare_softmax_online

    report, eager, fused = _compile_router(OnlineSoftmaxRouter())
    assert report.per_variant() == {"softmax+fp32_gemm": 1}  # fp32 model: its GEMM needs no casts
    _assert_same_routing(fused, eager)


def test_online_softmax_without_a_top_k_keeps_its_online_form():
    import torch._inductor.inductor_prims  # noqa: F401
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusion_compiler.fx.canonicalize import canonicalize

    def attention_like(scores, v):
        top, total = torch.ops.prims.prepare_softmax_online(scores, 1)
        return (torch.exp(scores - top) / total) @ v

    gm = make_fx(attention_like)(torch.randn(4, 8), torch.randn(8, 3))
    canonicalize(gm.graph)
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.prims.prepare_softmax_online.default in targets
    assert torch.ops.aten.amax.default not in targets


class SharedExpertBlock(torch.nn.Module):
    """Qwen3.5's routing + shared expert, written out; ``gate_bias`` makes the gate an affine
    layer, which the shared-gate form must not take (the router still fuses with its GEMM)."""

    def __init__(self, gate_bias=False, experts=16, hidden=32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))
        self.shared = torch.nn.Linear(hidden, hidden, bias=False)
        self.shared_gate = torch.nn.Linear(hidden, 1, bias=gate_bias)

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        values, ids = torch.topk(probs, 4, dim=-1)
        values = (values / values.sum(-1, keepdim=True)).to(logits.dtype)
        shared = torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return values, ids, shared


@pytest.mark.parametrize("gate_bias, variant", [(False, "softmax+gemm+shared_gate"), (True, "softmax+fp32_gemm")])
def test_shared_expert_gate_fuses_into_the_router(gate_bias, variant):
    report, eager, fused = _compile_router(SharedExpertBlock(gate_bias))
    assert report.per_variant() == {variant: 1}  # fp32 model: "gemm" and "fp32_gemm" trace alike
    _assert_same_routing(fused[:2], eager[:2])
    torch.testing.assert_close(fused[2], eager[2], rtol=1e-5, atol=1e-6)


def test_hf_qwen_moe_block_fuses_its_shared_gate():
    """HF's Qwen3_5MoeSparseMoeBlock at 3 tokens: router GEMM, routing and the shared-expert gate
    in one op (and the routed experts in another); the block's output equals eager's."""
    model = get_adapter("qwen3.5").build_hf(size="tiny", layers=4, dtype=torch.bfloat16)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        eager = block(x)
        fused = torch.compile(block, backend=backend)(x)
    assert backend.report.per_variant() == {"softmax+gemm+shared_gate": 1, "grouped_mm": 1}
    assert relative_error(fused, eager) < 1e-2
