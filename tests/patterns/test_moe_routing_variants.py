"""MoE routing by its math on HF transformers' own MoE blocks, and the near misses of each variant.

Each case is two of HF's MoE blocks (``layers.0`` and ``layers.1``) at tiny widths with one
routing option set: strict against one site per block's router, fused by the named variant, and
the blocks' output equal to eager's within bf16 rounding, on random router weights and biases.

- ``norm_topk_prob=False`` (HF's default for Qwen3-MoE and OLMoE; an option of Qwen3-Next,
  DeepSeek V3 and GLM-4-MoE): no renormalisation.
- ``n_group=1`` (GLM-4.5, Kimi K2): DeepSeek's grouped code without groups, whose one-group
  mask Inductor has rewritten into a compare; ``topk_group=1`` of 4 groups: the same compare,
  the mask copied before its reshape.
- ``routed_scaling_factor`` 1 and 2.5; Mixtral's weights, kept in fp32.
- Neighbouring HF routers with no code of theirs: GraniteMoE's and gpt-oss's top-k of the logits
  then a softmax over those k fuse (against float64 too); Ernie 4.5's softmax + correction bias,
  renormalised by ``clamp(sum, min=1e-12)``, fuses as ``softmax_bias`` (its router kept in fp32
  as HF loads it too; against float64; the clamp proved inert below k / E); PhiMoE's sparsemixer
  is declined in one sentence; Laguna's router (sigmoid + a bf16 correction bias, the weights
  gathered at ``gather(-1, ids)``) fuses with its GEMM, and from its soft-capped logits
  (``moe_router_logit_softcapping``) without it.
- Routers whose math is the fused routing's with a scale, no code of theirs: HY-V3's and AfMoE's
  sigmoid + correction bias, no groups, weights over ``sum + 1e-20`` and scaled, fuse as
  ``sigmoid_bias_renorm_eps`` (HY-V3's fp32 GEMM, AfMoE's bf16 GEMM cast to fp32; LFM2-MoE's in
  fp32 too), LongCat-Flash's softmax + correction bias, scaled, not renormalised, as
  ``softmax_bias_unnormalised``; against eager and float64, in bf16 and fp32. LFM2-MoE's bf16
  router (its sigmoid and weights in bf16) stays a miss, in one sentence.
- The one-group mask's three graphs: HF's scatter (Inductor's rewrite off), torch 2.11's rewrite
  (an int64 compare: the H200's GLM-4.5 routing was a miss on it) and 2.13's (cast back) are one
  graph after canonicalize; the cases with the rewrite off fuse by the same variant.
- Near misses: softmax over the tokens; the weights gathered from the biased choice (sigmoid or
  softmax scores); a clamp min the renormalisation could reach (k / E); scores that are neither
  sigmoid nor softmax; one group kept of several, groups scored by their best expert alone; the
  scaled routes one step off (no eps: ``sigmoid_bias`` as before, the scale outside; an eps and no
  scale; sigmoid not renormalised; softmax renormalised; a scale that is a tensor).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.ops import moe_route as route_ops
from fusion_compiler.verify import relative_error

FAMILY = "moe_routing"
_TINY = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=64)  # fmt: skip
_GROUPED = dict(_TINY, n_routed_experts=16, num_local_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip
_SOFTMAX = dict(_TINY, num_experts=8, num_local_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=32)

# (HF model, its MoE block class, config, the variant that must fuse every block's router)
CASES = {
    "qwen3_moe-no-renorm": ("qwen3_moe", "Qwen3MoeSparseMoeBlock", dict(_SOFTMAX, norm_topk_prob=False),
                            "softmax_unnormalised+gemm"),
    "qwen3_next-no-renorm": ("qwen3_next", "Qwen3NextSparseMoeBlock", dict(_SOFTMAX, norm_topk_prob=False),
                             "softmax_unnormalised+gemm+shared_gate"),
    "mixtral": ("mixtral", "MixtralSparseMoeBlock", _SOFTMAX, "softmax_fp32_weights+gemm"),
    "deepseek_v3-no-renorm": ("deepseek_v3", "DeepseekV3MoE", dict(_GROUPED, norm_topk_prob=False),
                              "sigmoid_bias_grouped_unnormalised+fp32_gemm"),
    "glm4_moe-n_group-1": ("glm4_moe", "Glm4MoeMoE", dict(_GROUPED, n_group=1, topk_group=1),
                           "sigmoid_bias_n_group_1+fp32_gemm"),
    "deepseek_v3-topk_group-1": ("deepseek_v3", "DeepseekV3MoE", dict(_GROUPED, topk_group=1),
                                 "sigmoid_bias_topk_group_1+fp32_gemm"),
    "deepseek_v3-n_group-1-no-renorm-scale-1": (
        "deepseek_v3", "DeepseekV3MoE",
        dict(_GROUPED, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0),
        "sigmoid_bias_n_group_1_unnormalised+fp32_gemm"),
}  # fmt: skip


def _config_only(**changes) -> fc.FusionConfig:
    """Routing alone: no other family or graph pass, so each compile traces only its patterns."""
    return fc.FusionConfig(default_lowering="off", families={FAMILY: "triton"}, horizontal_merge=False,
                           merge_projections=False, skinny_gemm=False, decode_attention=False,
                           dsa_topk_mask=False, **changes)  # fmt: skip


class Blocks(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.layers:
            y = block(x)
            x = x + (y[0] if isinstance(y, tuple) else y)  # gpt-oss's block returns (out, router scores)
        return x


def _hf_blocks(model_type: str, block_class: str, fields: dict, layers: int = 2) -> Blocks:
    import importlib

    from transformers import AutoConfig

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config = AutoConfig.for_model(model_type, **fields)
    config._experts_implementation = "grouped_mm"  # transformers' default in a model: no graph break
    gen = torch.Generator().manual_seed(0)
    blocks = Blocks([getattr(module, block_class)(config) for _ in range(layers)])
    with torch.no_grad():
        for name, p in blocks.named_parameters():
            # Router logits spread over a few units, so no two experts' scores are near a tie.
            router = name.endswith(("gate.weight", "router.weight", "classifier.weight"))
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if router else 0.05))
        for name, b in blocks.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return blocks.to(torch.bfloat16).eval()  # PhiMoE's sparsemixer samples in training


@functools.cache
def _compiled(case: str):
    """(report, eager output, fused output) of a case, compiled once per module."""
    model_type, block_class, fields, _ = CASES[case]
    expected = {FAMILY: {f"layers.{i}.gate": 1 for i in range(2)}}
    return _compiled_blocks(_hf_blocks(model_type, block_class, fields), fields, strict=True, expected=expected)


def _compiled_blocks(blocks: Blocks, fields: dict, **config):
    backend = fc.FusionBackend(_config_only(**config))
    x = torch.randn(1, 3, fields["hidden_size"], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = blocks(x)
        fused = torch.compile(blocks, backend=backend)(x)
    return backend.report, eager, fused


@pytest.mark.parametrize("case", list(CASES))
def test_every_hf_router_of_the_variant_fuses_and_routes_like_eager(case):
    report, eager, fused = _compiled(case)
    variant = CASES[case][3]
    assert report.missing_expected() == []
    assert report.per_module(FAMILY) == {"layers.0.gate": 1, "layers.1.gate": 1}
    assert {v: n for v, n in report.per_variant().items() if v.startswith(("softmax", "sigmoid"))} == {variant: 2}
    assert relative_error(fused, eager) < 1e-2


@pytest.mark.parametrize("case", ["glm4_moe-n_group-1", "deepseek_v3-topk_group-1"])
def test_one_group_mask_left_as_a_scatter_fuses_by_the_same_variant(case):
    """torch 2.11's Inductor rewrites ``zeros_like(s).scatter_(1, idx, 1)`` at lowering, so the
    graph our pass sees still holds the scatter; 2.13's rewrites it in the joint graph. With that
    rewrite off, the pass's own canonical form must meet the same pattern."""
    model_type, block_class, fields, variant = CASES[case]
    expected = {FAMILY: {f"layers.{i}.gate": 1 for i in range(2)}}
    with torch._inductor.config.patch(optimize_scatter_upon_const_tensor=False):
        report, eager, fused = _compiled_blocks(_hf_blocks(model_type, block_class, fields), fields,
                                                strict=True, expected=expected)  # fmt: skip
    assert report.missing_expected() == []
    assert _routing_variants(report) == {variant: 2}
    assert relative_error(fused, eager) < 1e-2


def _masked_choice(spelling: str):
    """The one-group mask of HF's grouped routing in three graphs: the scatter as written (Inductor's
    rewrite off), torch 2.11's rewrite (an int64 compare) and 2.13's (the compare cast back)."""

    def masked(scores, group_scores, group_idx):
        if spelling == "scatter":
            mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
        else:
            hit = group_idx.expand(group_scores.shape) == torch.arange(1).view(1, 1)
            mask = torch.where(hit, 1, 0)
            mask = mask.to(group_scores.dtype) if spelling == "torch_2_13" else mask
        score_mask = mask.unsqueeze(-1).expand(-1, 1, 16).reshape(-1, 16)
        return scores.masked_fill(~score_mask.bool(), float("-inf"))

    return masked


def _expression(graph: torch.fx.Graph) -> str:
    """The output as one expression of the inputs: equal for the same computation, whatever the
    order of the nodes."""

    def text(arg) -> str:
        if isinstance(arg, (list, tuple)):
            return "[" + ", ".join(map(text, arg)) + "]"
        if not isinstance(arg, torch.fx.Node):
            return repr(arg)
        if arg.op == "placeholder":
            return f"input{list(graph.nodes).index(arg)}"
        kwargs = "".join(f", {key}={text(value)}" for key, value in arg.kwargs.items())
        return f"{arg.target}({', '.join(map(text, arg.args))}{kwargs})"

    return text(graph.output_node().args[0])


def test_one_group_mask_is_one_graph_whatever_torch_made_of_the_scatter():
    from fusion_compiler import _compat
    from fusion_compiler.fx.canonicalize import canonicalize

    args = (torch.randn(3, 16), torch.randn(3, 1), torch.zeros(3, 1, dtype=torch.long))
    graphs = {}
    for spelling in ("scatter", "torch_2_11", "torch_2_13"):
        gm = _compat.trace_like_post_grad(_masked_choice(spelling), args)
        canonicalize(gm.graph)
        gm.graph.eliminate_dead_code()
        graphs[spelling] = _expression(gm.graph)
    assert graphs["scatter"] == graphs["torch_2_11"] == graphs["torch_2_13"]
    assert "scatter" not in graphs["scatter"]
    assert graphs["scatter"].count("convert_element_type") == 1  # the .bool(): the cast back is gone


def _compile_router(router, tokens=5, hidden=32):
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    backend = fc.FusionBackend(_config_only())
    torch._dynamo.reset()
    with torch.no_grad():
        eager = router(x)
        fused = torch.compile(router, backend=backend)(x)
    return backend.report, eager, fused


class NearMiss(torch.nn.Module):
    """A router one step off a variant's math (the logits are returned, so it routes from them)."""

    def __init__(self, spelling, experts=16, hidden=32, seed=3):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, generator=gen))
        self.register_buffer("bias", 0.1 * torch.randn(experts, generator=gen))
        self.spelling = spelling

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        if self.spelling == "softmax_over_tokens":  # Qwen3-MoE's unnormalised routing, softmax on dim 0
            probs = torch.softmax(logits, dtype=torch.float, dim=0)
            values, ids = torch.topk(probs, 4, dim=-1)
            return logits, values.to(logits.dtype), ids
        if self.spelling.startswith("softmax_bias"):  # Ernie 4.5's routing, one step off
            scores = torch.softmax(logits, dim=1, dtype=torch.float)
            choice = scores + self.bias
            _, ids = torch.topk(choice, 4, dim=-1)
            # "softmax_bias_biased_weights": the weights gathered from the biased choice;
            # "softmax_bias_clamp_binds": a clamp min of k / E, which the top 4 of 16 can reach.
            weights = torch.gather(choice if self.spelling.endswith("biased_weights") else scores, dim=-1, index=ids)
            floor = 4 / 16 if self.spelling.endswith("clamp_binds") else 1e-12
            return logits, weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=floor), ids
        if self.spelling == "softplus_scores":  # MiniMax's routing math on softplus scores
            scores = torch.nn.functional.softplus(logits)
            _, ids = torch.topk(scores + self.bias, 4, dim=-1, sorted=False)
            weights = scores.gather(1, ids)
            return logits, weights / weights.sum(dim=-1, keepdim=True), ids
        scores = logits.sigmoid()
        choice = scores + self.bias
        groups = 1 if self.spelling == "biased_weights" else 4
        # "group_by_best": one group of 4 kept, groups scored by their best expert, not their best 2.
        group_top = 1 if self.spelling == "group_by_best" else 2
        group_scores = choice.view(-1, groups, 16 // groups).topk(group_top, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=1, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, 16 // groups).reshape(-1, 16)
        ids = torch.topk(choice.masked_fill(~score_mask.bool(), float("-inf")), k=4, dim=-1, sorted=False)[1]
        # "biased_weights": DeepSeek's n_group 1 routing, its weights gathered from the biased choice.
        weights = (choice if self.spelling == "biased_weights" else scores).gather(1, ids)
        return logits, weights * 2.5, ids


@pytest.mark.parametrize("spelling, reason", [
    # Softmax's reductions are wildcards in the pattern; the re-trace at the site's dims is not.
    ("softmax_over_tokens", "softmax_unnormalised matches at getitem in structure, but Inductor did not take it"),
    # The ids feed a gather of the biased choice, outside every pattern (sigmoid, then softmax scores).
    ("biased_weights", "is read by gather, output: outside the pattern"),
    ("softplus_scores", "the router scores its logits as softplus(logits); the fused routing takes sigmoid or softmax"),
    ("softmax_bias_biased_weights", "is read by gather, output: outside the pattern"),
    ("softmax_bias_clamp_binds", "softmax_bias: the router renormalises by clamp(sum, min=0.25), which binds where the "
                                 "top 4 of 16 softmax scores sum below it (their least sum is 4/16); the fused routing "
                                 "renormalises by the sum alone"),
    # One group of 4 kept, each scored by its best expert: the group top-k's k is a wildcard, the
    # re-trace at the site's literals is not.
    ("group_by_best", "sigmoid_bias_topk_group_1_unnormalised matches at mul in structure, but Inductor did not "
                      "take it"),
])  # fmt: skip
def test_near_misses_do_not_match_and_say_why(spelling, reason):
    report, eager, fused = _compile_router(NearMiss(spelling))
    assert report.per_variant() == {}
    [miss] = report.misses(FAMILY)
    assert reason in miss.reason, miss.reason
    (logits_f, w_f, ids_f), (logits_e, w_e, ids_e) = fused, eager
    torch.testing.assert_close(logits_f, logits_e)
    # Unsorted top-k: the same experts with the same weights, in any order.
    order_f, order_e = ids_f.sort(-1), ids_e.sort(-1)
    assert torch.equal(order_f.values, order_e.values)
    torch.testing.assert_close(w_f.gather(1, order_f.indices), w_e.gather(1, order_e.indices))


# Neighbouring HF routers, no code of theirs: (model, MoE block, config, router's module name,
# the variant that must fuse both blocks' routers, or the reason both are declined with).
_ERNIE = dict(_SOFTMAX, moe_num_experts=8, moe_k=2, moe_num_shared_experts=0)
_LONGCAT = dict(_TINY, n_routed_experts=4, zero_expert_num=4, num_experts_per_tok=2, expert_ffn_hidden_size=32)
_LFM2_BF16 = ("the router weights its top-k experts by their unbiased sigmoid scores over their sum + 1e-06, times 1, "
              "all in bfloat16 (the sigmoid of its bfloat16 logits), with no expert groups: the fused routing divides "
              "an ungrouped sigmoid router's weights, in fp32, by their plain sum (MiniMax-M2's) or by their sum + an "
              "eps and then scales them (HY-V3's)")  # fmt: skip
ZOO = {
    # Top-k of the logits, softmax over those k: softmax -> top-k -> renormalise, one more spelling.
    "granitemoe": ("granitemoe", "GraniteMoeMoE", _SOFTMAX, "router", "softmax_of_top_logits+gemm", None),
    # The same in the logits' dtype; the router GEMM has a bias (addmm): fused from the logits.
    "gpt_oss": ("gpt_oss", "GptOssMLP", _SOFTMAX, "router", "softmax_of_top_logits_in_dtype", None),
    "phimoe": ("phimoe", "PhimoeSparseMoeBlock", _SOFTMAX, "router", None,
               "the router picks its experts one at a time by max over the logits, weighting each by a softmax over "
               "the experts within its jitter threshold (PhiMoE's sparsemixer), not by a top-k of sigmoid or softmax "
               "scores"),
    # Softmax + a correction bias for the choice, the unbiased scores renormalised by clamp(sum, 1e-12).
    "ernie4_5_moe": ("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", _ERNIE, "gate", "softmax_bias+fp32_gemm", None),
    # Sigmoid + a correction bias (bf16, cast up in the graph), weights gathered at gather(-1, ids).
    "laguna": ("laguna", "LagunaSparseMoeBlock", _SOFTMAX, "gate", "sigmoid_bias+gemm", None),
    # The same on soft-capped logits, tanh(logits / c) * c: the cap stays Inductor's, the routing fuses.
    "laguna_softcap": ("laguna", "LagunaSparseMoeBlock", dict(_SOFTMAX, moe_router_logit_softcapping=30.0), "gate",
                       "sigmoid_bias", None),
    # Sigmoid + a correction bias, no groups, the weights over sum + 1e-20 and scaled: HY-V3's fp32 GEMM
    # (router_scaling_factor 2.826), AfMoE's bf16 GEMM cast to fp32 (route_scale 1, its default).
    "hy_v3": ("hy_v3", "HYV3MoE", _SOFTMAX, "gate", "sigmoid_bias_renorm_eps+fp32_gemm", None),
    "afmoe": ("afmoe", "AfmoeSparseMoeBlock", _SOFTMAX, "router", "sigmoid_bias_renorm_eps+gemm", None),
    # Softmax + a correction bias added as a [1, E] row, the unbiased scores times 6, not renormalised.
    "longcat_flash": ("longcat_flash", "LongcatFlashMoE", _LONGCAT, "router", "softmax_bias_unnormalised+fp32_gemm",
                      None),
    # HY-V3's routing math (eps 1e-6) with the sigmoid and the weights in bf16: a precision apart.
    "lfm2_moe": ("lfm2_moe", "Lfm2MoeSparseMoeBlock", dict(_SOFTMAX, use_expert_bias=True), "gate", None, _LFM2_BF16),
}  # fmt: skip


def _routing_variants(report) -> dict[str, int]:
    return {v: n for v, n in report.per_variant().items() if v.startswith(("softmax", "sigmoid"))}


@functools.cache
def _compiled_zoo(case: str):
    model_type, block_class, fields, _, _, _ = ZOO[case]
    return _compiled_blocks(_hf_blocks(model_type, block_class, fields), fields)


@pytest.mark.parametrize("case", list(ZOO))
def test_neighbouring_hf_routers_fuse_or_say_why_in_one_sentence(case):
    """One site per block's router: fused by the named variant, or declined with the sentence."""
    report, eager, fused = _compiled_zoo(case)
    _, _, _, router, variant, reason = ZOO[case]
    modules = [f"layers.{i}.{router}" for i in range(2)]
    if variant:
        assert report.per_module(FAMILY) == dict.fromkeys(modules, 1)
        assert _routing_variants(report) == {variant: 2}
    else:
        assert _routing_variants(report) == {}
        assert [(m.module, m.reason) for m in report.misses(FAMILY)] == [(m, reason) for m in modules]
    assert relative_error(fused, eager) < 1e-2


def test_ernie_router_kept_in_fp32_fuses_with_its_gemm():
    """HF loads Ernie 4.5's ``gate.weight`` and ``moe_statics`` in fp32 whatever the model's dtype
    (``_keep_in_fp32_modules_strict``): only the bf16 hidden states are upcast for the router GEMM."""
    blocks = _hf_blocks("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", _ERNIE)
    for block in blocks.layers:
        block.gate.float()
    assert {p.dtype for n, p in blocks.named_parameters() if ".gate." in n} == {torch.float32}
    report, eager, fused = _compiled_blocks(blocks, _ERNIE, strict=True,
                                            expected={FAMILY: {f"layers.{i}.gate": 1 for i in range(2)}})  # fmt: skip
    assert report.missing_expected() == []
    assert _routing_variants(report) == {"softmax_bias+fp32_gemm": 2}
    assert relative_error(fused, eager) < 1e-2


def _ernie_float64(router, x):
    """HF Ernie 4.5's routing in float64: (weights, ids, each token's gap in the biased choice
    between its k-th and (k+1)-th experts)."""
    scores = torch.nn.functional.linear(x.double(), router.weight.double()).softmax(dim=-1)
    choice, ids = (scores + router.moe_statics.e_score_correction_bias.double().squeeze()).topk(router.top_k + 1)
    ids = ids[:, : router.top_k]
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True).clamp(min=router.norm_min), ids, choice[:, -2] - choice[:, -1]


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_ernie_softmax_bias_routes_like_float64(gate_dtype):
    """HF's ``Ernie4_5_MoeTopKRouter`` (fp32 as HF loads it, or cast to bf16 with the model) on
    bf16 tokens, fused from its logits (it returns them), against eager and its math in float64
    on fresh random weights: the same experts in the same order, weights within bf16 rounding."""
    from transformers import AutoConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    # ERNIE-4.5-21B-A3B's routing: 6 of 64 experts.
    fields = dict(_ERNIE, num_experts=64, moe_num_experts=64, num_experts_per_tok=6, moe_k=6)
    router = Ernie4_5_MoeTopKRouter(AutoConfig.for_model("ernie4_5_moe", **fields))
    assert (router.num_experts, router.top_k, router.norm_min) == (64, 6, 1e-12)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.5)
        router.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 64, generator=gen) * 0.01)
    router = router.to(gate_dtype)
    x = torch.randn(9, _ERNIE["hidden_size"], generator=gen).to(torch.bfloat16)
    backend = fc.FusionBackend(_config_only())
    torch._dynamo.reset()
    with torch.no_grad():
        _, w, ids = torch.compile(router, backend=backend)(x)
        _, w_eager, ids_eager = router(x)
    assert _routing_variants(backend.report) == {"softmax_bias": 1}
    w64, ids64, gap = _ernie_float64(router, x)
    assert gap.min() > 1e-4  # no near tie: fp32 rounding cannot swap the k-th expert
    assert torch.equal(ids, ids64) and torch.equal(ids, ids_eager)
    assert w.dtype == w_eager.dtype == torch.bfloat16
    torch.testing.assert_close(w, w_eager, atol=0, rtol=2**-8)  # one bf16 rounding apart at most
    torch.testing.assert_close(w.double(), w64, atol=0, rtol=2**-8)


@pytest.mark.parametrize("experts, top_k", [(8, 2), (60, 7), (64, 6), (160, 8)])
def test_clamped_renormalisation_below_k_over_e_is_the_ops_plain_one(experts, top_k):
    """Ernie's ``w / clamp(w.sum(), min)`` with any min below k / E, against the op's ``w / w.sum()``
    (``moe_route_reference``, scoring softmax, renorm_eps 0): the k best of E softmax scores sum to
    at least k / E, so the clamp never binds and the two are the same fp32 arithmetic, bit for bit,
    even at the largest min below k / E and on uniform logits (each score 1/E, the least sum); both
    within fp32 rounding of float64."""
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.cat([torch.randn(64, experts, generator=gen) * 3, torch.zeros(1, experts),
                        torch.full((1, experts), 7.25)])  # fmt: skip
    bias = torch.randn(experts, generator=gen) * 1e-3
    weights, ids = route_ops.moe_route_reference(logits, bias, top_k, 1, 1, 1, True, 0.0, 1.0, torch.float32)
    scores = torch.softmax(logits, dim=1, dtype=torch.float)
    _, hf_ids = torch.topk(scores + bias, top_k, dim=-1)
    assert torch.equal(ids, hf_ids)
    for floor in (1e-12, math.nextafter(top_k / experts, 0)):
        hf = scores.gather(1, ids) / torch.clamp(scores.gather(1, ids).sum(-1, keepdim=True), min=floor)
        assert torch.equal(weights, hf), floor
    w64 = logits.double().softmax(-1).gather(1, ids)
    torch.testing.assert_close(weights.double(), w64 / w64.sum(-1, keepdim=True), atol=0, rtol=1e-6)


@pytest.mark.parametrize("model_type, router_class, variant", [
    ("granitemoe", "GraniteMoeTopKRouter", "softmax_of_top_logits"),
    ("gpt_oss", "GptOssTopKRouter", "softmax_of_top_logits_in_dtype"),
])  # fmt: skip
def test_top_logits_softmax_routes_like_float64(model_type, router_class, variant):
    """The fused routing of a top-k-then-softmax router against the HF router in float64, on
    fresh random weights and tokens: the same experts, weights within bf16 rounding."""
    import importlib

    from transformers import AutoConfig

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    router = getattr(module, router_class)(AutoConfig.for_model(model_type, **_SOFTMAX))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in router.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    router = router.to(torch.bfloat16)
    x = torch.randn(7, _SOFTMAX["hidden_size"], generator=gen).to(torch.bfloat16)
    backend = fc.FusionBackend(_config_only())
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(router, backend=backend)(x)
        ref = router.double()(x.double())
    assert _routing_variants(backend.report) == {variant: 1}
    (w, ids), (w64, ids64) = _weights_ids(model_type, out), _weights_ids(model_type, ref)
    order, order64 = ids.sort(-1), ids64.sort(-1)
    assert torch.equal(order.values, order64.values)
    torch.testing.assert_close(w.gather(1, order.indices).double(), w64.gather(1, order64.indices), atol=8e-3, rtol=0)


def _weights_ids(model_type: str, out) -> tuple:
    """(weights, ids) of a router's outputs: GraniteMoE returns (ids, weights, logits), gpt-oss
    (logits, weights, ids)."""
    return (out[1], out[0]) if model_type == "granitemoe" else (out[1], out[2])


class TopLogitsNearMiss(torch.nn.Module):
    """GraniteMoE's router one step off: its top-k logits weighted by a sigmoid, not a softmax."""

    def __init__(self, experts=8, hidden=32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden, generator=torch.Generator().manual_seed(5)))

    def forward(self, x):
        values, ids = torch.nn.functional.linear(x, self.weight).float().topk(2, dim=-1)
        return torch.sigmoid(values).type_as(x), ids


def test_top_logits_weighted_by_another_function_is_a_miss_that_names_it():
    report, eager, fused = _compile_router(TopLogitsNearMiss())
    assert report.per_variant() == {}
    [miss] = report.misses(FAMILY)
    assert miss.reason == ("the router weights the top k of its raw logits as sigmoid(logits); the fused routing "
                           "weights them by a softmax over those k")  # fmt: skip
    torch.testing.assert_close(fused, eager)


# HF routers whose math is the fused routing's with a scale: model -> (router class, config, its router
# weight, scoring, renorm eps (None: not renormalised), the scale's attribute, whether it takes the bias).
_SCALED = dict(_TINY, num_experts=32, num_local_experts=32, num_experts_per_tok=4)
SCALED_ROUTERS = {
    "hy_v3": ("HYV3TopKRouter", _SCALED, "weight", "sigmoid", 1e-20, "router_scaling_factor", True),
    "afmoe": ("AfmoeTokenChoiceRouter", dict(_SCALED, route_scale=2.5), "gate.weight", "sigmoid", 1e-20, "route_scale",
              True),
    "longcat_flash": ("LongcatFlashTopkRouter", dict(_LONGCAT, n_routed_experts=24, zero_expert_num=8,
                                                     num_experts_per_tok=4), "classifier.weight", "softmax", None,
                      "routed_scaling_factor", False),
    "lfm2_moe": ("Lfm2MoeTopKRouter", dict(_SCALED, use_expert_bias=True, routed_scaling_factor=1.5), "weight",
                 "sigmoid", 1e-6, "routed_scaling_factor", True),
}  # fmt: skip


class _RoutingOnly(torch.nn.Module):
    """An HF router (with ``bias`` passed in, where it takes one), returning its weights and ids (its
    logits dead, as in the MoE blocks: the GEMM forms match) or, ``keep_logits``, all it returns
    (the logits too: fused from them)."""

    def __init__(self, router, bias, keep_logits):
        super().__init__()
        self.router, self.keep_logits = router, keep_logits
        self.register_buffer("bias", bias)

    def forward(self, x):
        out = self.router(x) if self.bias is None else self.router(x, self.bias)
        return out if self.keep_logits else out[-2:]


def _scaled_router(model_type: str, dtype: torch.dtype, keep_logits: bool):
    """HF's router at tiny widths in ``dtype``, random weights and correction bias (fp32, as HF
    keeps HY-V3's, AfMoE's and LFM2-MoE's; LongCat-Flash's own buffer cast with the router), and
    9 tokens in ``dtype`` ([1, 9, H]; LFM2-MoE's block hands its router [9, H])."""
    import importlib

    from transformers import AutoConfig

    cls, fields, *_, takes_bias = SCALED_ROUTERS[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    router = getattr(module, cls)(AutoConfig.for_model(model_type, **fields))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in router.parameters():  # logits spread over a few units: no near ties
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        for b in router.buffers():  # LongCat-Flash's own correction bias
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    bias = torch.randn(32, generator=gen) * 0.1 if takes_bias else None
    x = torch.randn(1, 9, fields["hidden_size"], generator=gen).to(dtype)
    x = x.view(9, -1) if model_type == "lfm2_moe" else x
    return _RoutingOnly(router.to(dtype), bias, keep_logits), x


def _scaled_float64(model_type: str, module: _RoutingOnly, x):
    """The HF router's math in float64 after its GEMM (AfMoE's and LFM2-MoE's in the weight's
    dtype, HY-V3's and LongCat-Flash's in fp32, as HF rounds them): (weights, ids, each token's gap
    in the biased choice between its k-th and (k+1)-th experts)."""
    _, _, weight, scoring, eps, scale, takes_bias = SCALED_ROUTERS[model_type]
    router = module.router
    w = router.get_parameter(weight)
    x = x.view(-1, x.shape[-1])
    in_weight_dtype = model_type in ("afmoe", "lfm2_moe")
    logits = torch.nn.functional.linear(x, w).double() if in_weight_dtype else x.double() @ w.double().t()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    bias = module.bias if takes_bias else router.e_score_correction_bias
    choice, ids = (scores + bias.double()).topk(router.top_k + 1)
    weights = scores.gather(1, ids[:, :-1])
    if eps is not None:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * getattr(router, scale), ids[:, :-1], choice[:, -2] - choice[:, -1]


@pytest.mark.parametrize("model_type, dtype, keep_logits, variant", [
    ("hy_v3", torch.bfloat16, False, "sigmoid_bias_renorm_eps+fp32_gemm"),
    ("hy_v3", torch.float32, False, "sigmoid_bias_renorm_eps+fp32_gemm"),
    ("hy_v3", torch.bfloat16, True, "sigmoid_bias_renorm_eps"),  # its logits returned: fused from them
    ("afmoe", torch.bfloat16, False, "sigmoid_bias_renorm_eps+gemm"),
    ("afmoe", torch.float32, False, "sigmoid_bias_renorm_eps+fp32_gemm"),  # fp32 operands: the same GEMM
    ("afmoe", torch.bfloat16, True, "sigmoid_bias_renorm_eps"),
    ("longcat_flash", torch.bfloat16, False, "softmax_bias_unnormalised+fp32_gemm"),
    ("longcat_flash", torch.float32, False, "softmax_bias_unnormalised+fp32_gemm"),
    # LFM2-MoE's routing in fp32 is the same math (its bf16 one a precision apart: ZOO's miss).
    ("lfm2_moe", torch.float32, False, "sigmoid_bias_renorm_eps+fp32_gemm"),
])  # fmt: skip
def test_scaled_bias_routers_route_like_eager_and_float64(model_type, dtype, keep_logits, variant):
    """HF's router, fused by the named variant, against eager and against its math in float64 on
    fresh random weights: the same experts (any order: HF asks ``sorted=False``), fp32 weights
    within bf16 rounding of eager's and fp32 rounding of float64's."""
    module, x = _scaled_router(model_type, dtype, keep_logits)
    backend = fc.FusionBackend(_config_only())
    torch._dynamo.reset()
    with torch.no_grad():
        w, ids = torch.compile(module, backend=backend)(x)[-2:]
        w_eager, ids_eager = module(x)[-2:]
    assert _routing_variants(backend.report) == {variant: 1}
    w64, ids64, gap = _scaled_float64(model_type, module, x)
    assert gap.min() > 1e-5  # no near tie: fp32 rounding cannot swap the k-th expert
    order, order_eager, order64 = ids.sort(-1), ids_eager.sort(-1), ids64.sort(-1)
    assert torch.equal(order.values, order_eager.values) and torch.equal(order.values, order64.values)
    w, w_eager, w64 = (t.gather(1, o.indices) for t, o in ((w, order), (w_eager, order_eager), (w64, order64)))
    assert w.dtype == w_eager.dtype == torch.float32
    torch.testing.assert_close(w, w_eager, atol=0, rtol=2**-8)
    torch.testing.assert_close(w.double(), w64, atol=0, rtol=1e-5)


class ScaledNearMiss(NearMiss):
    """HY-V3's (or LongCat-Flash's) routing one step off, in fp32, its logits dead."""

    def __init__(self, spelling, experts=16, hidden=32):
        super().__init__(spelling, experts, hidden, seed=4)

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        softmax = self.spelling.startswith("softmax")
        scores = torch.softmax(logits, dim=-1) if softmax else torch.sigmoid(logits)
        _, ids = torch.topk(scores + self.bias, 4, dim=-1, sorted=False)
        weights = scores.gather(1, ids)
        if self.spelling in ("plain_sum_scaled", "softmax_renormalised_scaled"):  # MiniMax's w / sum, then a scale
            return weights / weights.sum(dim=-1, keepdim=True) * 2.5, ids
        if self.spelling == "eps_unscaled":
            return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20), ids
        if self.spelling == "unnormalised_scaled":
            return weights * 2.5, ids
        assert self.spelling == "tensor_scale"  # a scale read from a buffer, not a number
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.bias[:1], ids


_SIGMOID_TAKES = ("with no expert groups: the fused routing divides an ungrouped sigmoid router's weights, in fp32, by "
                  "their plain sum (MiniMax-M2's) or by their sum + an eps and then scales them (HY-V3's)")


@pytest.mark.parametrize("spelling, variants, reason", [
    # No eps: the plain renormalisation's old variant, the scale left outside the fused op.
    ("plain_sum_scaled", {"sigmoid_bias+fp32_gemm": 1}, None),
    ("eps_unscaled", {}, "the router weights its top-k experts by their unbiased sigmoid scores over their sum + "
                         "1e-20, " + _SIGMOID_TAKES),
    ("unnormalised_scaled", {}, "the router weights its top-k experts by their unbiased sigmoid scores, not "
                                "renormalised, times 2.5, " + _SIGMOID_TAKES),
    ("softmax_renormalised_scaled", {}, "the router weights its top-k experts by their unbiased softmax scores "
                                        "over their sum, times 2.5, with no expert groups: the fused routing takes a "
                                        "softmax router with a correction bias, in fp32, its weights divided by "
                                        "clamp(sum, min) (Ernie 4.5's) or not renormalised and scaled "
                                        "(LongCat-Flash's)"),
    ("tensor_scale", {}, "sigmoid_bias_renorm_eps+fp32_gemm: scale is not a constant number"),
])  # fmt: skip
def test_scaled_routes_one_step_off_keep_their_variant_or_say_why(spelling, variants, reason):
    report, eager, fused = _compile_router(ScaledNearMiss(spelling))
    assert _routing_variants(report) == variants
    if reason is not None:
        [miss] = report.misses(FAMILY)
        assert miss.reason.startswith(reason), miss.reason
    (w_f, ids_f), (w_e, ids_e) = fused, eager
    order_f, order_e = ids_f.sort(-1), ids_e.sort(-1)
    assert torch.equal(order_f.values, order_e.values)
    torch.testing.assert_close(w_f.gather(1, order_f.indices), w_e.gather(1, order_e.indices))
