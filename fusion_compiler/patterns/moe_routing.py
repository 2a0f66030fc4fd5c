"""MoE routing: router logits -> (weights, expert ids) as one fused op (``ops/moe_route.py``).

Variants are the routing math as real code writes it, keyed on the math, not on module names.
The scores are an elementwise function of the logits, sigmoid or softmax over the experts; a
router scoring them any other way (softplus, tanh, ...) is a site declined with the function
named. Each variant fixes the rest of the math:

* ``sigmoid_bias``: sigmoid scores, + a correction bias for the choice only, top-k, weights
  gathered from the *unbiased* scores, renormalised (HF MiniMax-M2.5's ``MiniMaxM2TopKRouter``).
* ``sigmoid_bias_renorm_eps``: the same choice (no groups) with the grouped routes' weights, over
  ``sum + renorm_eps`` and times ``scale`` (HF HY-V3's ``HYV3TopKRouter`` on its fp32 GEMM and
  AfMoE's ``AfmoeTokenChoiceRouter`` on its GEMM cast to fp32: eps 1e-20, any scale, 1 included).
  A renormalisation with no eps stays ``sigmoid_bias``'s, a scale after it outside the fused op.
* ``sigmoid_bias_grouped``: DeepSeek V3/V3.2's ``noaux_tc`` routing (HF ``DeepseekV3TopkRouter``,
  ``DeepseekV32TopkRouter``, ``Glm4MoeTopkRouter``): sigmoid + bias, each group scored by the sum
  of its 2 best experts, the ``topk_group`` best groups kept (the others masked to -inf), top-k,
  unbiased weights renormalised with ``+ renorm_eps`` (HF 1e-20) and scaled by
  ``routed_scaling_factor`` (any value, 1 included).
* ``sigmoid_bias_grouped_unnormalised``: the same with ``norm_topk_prob=False``: the gathered
  weights times ``routed_scaling_factor``, no renormalisation.
* ``sigmoid_bias_n_group_1`` and ``sigmoid_bias_n_group_1_unnormalised``: the grouped code with
  ``n_group=1, topk_group=1`` (GLM-4.5; HF glm4_moe's defaults), fused as no grouping. Inductor's
  joint graph has rewritten its group mask, a scatter of one index a row, into a compare with the
  group numbers (``_one_hot_group_mask``).
* ``sigmoid_bias_topk_group_1`` and ``sigmoid_bias_topk_group_1_unnormalised``: one group kept of
  several (``topk_group`` 1 < ``n_group``): the same compare, then a copy of the expanded mask
  before its reshape; the fused routing's rank-based group selection keeps one group as any
  number.
* ``softmax_bias``: softmax of the fp32 logits, + a correction bias for the choice only, top-k,
  the *unbiased* scores gathered and renormalised by ``clamp(sum, min=moe_norm_min)`` (HF Ernie
  4.5's ``Ernie4_5_MoeTopKRouter``, min 1e-12; it casts the fp32 weights to the hidden states'
  dtype after, outside the match). The k best of E softmax scores sum to at least k / E, so a min
  below that never binds and the clamp is the plain renormalisation (``_clamp_reason``: the guard
  reads the min from the graph and declines a min of k / E or more).
* ``softmax_bias_unnormalised``: the same choice, the unbiased scores gathered and scaled, not
  renormalised (HF LongCat-Flash's ``LongcatFlashTopkRouter``, ``routed_scaling_factor``; its bias
  is added as a row, ``unsqueeze(0)``: a [1, E] bias is the op's [E]).
* ``softmax``: softmax in fp32, top-k, renormalised, cast back to the logits' dtype (HF Qwen3.5,
  and Qwen3-MoE / Qwen3-Next / OLMoE with ``norm_topk_prob=True``).
* ``softmax_unnormalised``: the same without renormalising (``norm_topk_prob=False``, HF's default
  for Qwen3-MoE and OLMoE).
* ``softmax_fp32_weights``: softmax of the upcast logits, top-k, renormalised, the weights left in
  fp32 (HF Mixtral's ``MixtralTopKRouter``); with fp32 logits it is ``softmax``.
* ``softmax_of_top_logits``: top-k of the (upcast) logits, softmax over those k, cast back (HF
  GraniteMoE's ``GraniteMoeTopKRouter``): ``softmax``'s math, since softmax keeps the order and its
  denominator cancels in the renormalisation. ``softmax_of_top_logits_in_dtype``: the same with the
  top-k in the logits' dtype (HF gpt-oss's ``GptOssTopKRouter``; its router GEMM has a bias, an
  ``addmm`` no GEMM form takes, so it fuses from the logits).

A router picking its experts by ``max`` over the logits (PhiMoE's ``sparsemixer``) is a site
declined with a sentence (``explain``).

Each routing math comes twice: with the router GEMM in front (``F.linear`` of the hidden
states and the router weight, as an fp32 GEMM of upcast operands like DeepSeek's and Ernie's,
or in the weight's dtype like MiniMax's and Qwen's), replaced by ``moe_router`` (GEMM + routing, one
launch at few tokens), and from the logits, replaced by ``moe_route``. The GEMM forms are
tried first; a router whose logits are also used elsewhere (returned, or fed to an aux loss)
fails them, because the logits would have to stay, and fuses from its logits instead.
Widest of all, for the softmax routes: the GEMM form plus Qwen's shared-expert gate,
``sigmoid(F.linear(hidden, gate_weight))`` with a one-row weight on the same hidden states,
computed as one more GEMM row.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..fx.graph_walk import upstream, val_shape
from ..ops import moe_route as route_ops
from .registry import Family, Reason, Variant

aten = torch.ops.aten

# Example scalar values, traced as keyword arguments. Inductor re-traces every match with the
# bound values and turns any literal equal to an example into that argument again, so an
# example must not collide with a literal of a real graph (a token count, a group size):
# large primes, and the guard checks every bound int against the graph (facts_of).
_TOP_K = 1097
_N_GROUP, _TOPK_GROUP = 1103, 1031
_GROUPED_EXPERTS = 2 * _N_GROUP
_EXPERTS = 2 * _TOP_K
_TOKENS = 2
_HIDDEN = 1117
_RENORM_EPS = 1.2345e-21
_RENORM_MIN = 3.4567e-13
_SCALE = 2.3456
_SCALARS = {"top_k": _TOP_K, "n_group": _N_GROUP, "topk_group": _TOPK_GROUP, "renorm_eps": _RENORM_EPS,
            "renorm_min": _RENORM_MIN, "scale": _SCALE}  # fmt: skip


def _biased_choice(scores, bias, top_k):
    """The top-k experts of the scores + a correction bias, and their *unbiased* scores."""
    _, ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False)
    return scores.gather(1, ids), ids


def _renormalised(weights, renorm_eps, scale):
    """``w / (w.sum() + renorm_eps) * scale``, the op's renormalisation in its order."""
    weights = weights / (weights.sum(dim=-1, keepdim=True) + renorm_eps)
    return weights * scale


def sigmoid_bias(logits, bias, top_k):
    weights, ids = _biased_choice(torch.sigmoid(logits.float()), bias, top_k)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def sigmoid_bias_renorm_eps(logits, bias, top_k, renorm_eps, scale):
    """``sigmoid_bias``'s ungrouped choice with the grouped routes' weights: over their sum + an
    eps, then scaled (HF HY-V3's ``HYV3TopKRouter`` on its fp32 GEMM, AfMoE's
    ``AfmoeTokenChoiceRouter`` on its GEMM cast to fp32; 1e-20 both)."""
    weights, ids = _biased_choice(torch.sigmoid(logits.float()), bias, top_k)
    return _renormalised(weights, renorm_eps, scale), ids


def _scattered_group_mask(group_scores, group_idx, n_group):
    return torch.zeros_like(group_scores).scatter(1, group_idx, 1)


def _one_hot_group_mask(group_scores, group_idx, n_group):
    """The scatter above where one group is kept, as Inductor's joint graph rewrites it
    (``scatter_upon_const_tensor``: a scatter of one index a row into a constant is a compare)."""
    hit = group_idx.expand(group_scores.shape) == torch.arange(n_group, device=group_idx.device).view(1, n_group)
    return torch.where(hit, 1, 0).to(group_scores.dtype)


def _experts_of_top_groups(choice, top_k, n_group, topk_group):
    """DeepSeek's group-limited choice: the top-k experts of the ``topk_group`` best groups."""
    experts = choice.shape[-1]
    group_scores = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = (_one_hot_group_mask if topk_group == 1 else _scattered_group_mask)(group_scores, group_idx, n_group)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, experts // n_group).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]


def sigmoid_bias_grouped(logits, bias, top_k, n_group, topk_group, renorm_eps, scale):
    scores = logits.sigmoid()
    ids = _experts_of_top_groups(scores + bias, top_k, n_group, topk_group)
    return _renormalised(scores.gather(1, ids), renorm_eps, scale), ids


def sigmoid_bias_grouped_unnormalised(logits, bias, top_k, n_group, topk_group, scale):
    scores = logits.sigmoid()
    ids = _experts_of_top_groups(scores + bias, top_k, n_group, topk_group)
    return scores.gather(1, ids) * scale, ids


def softmax_bias(logits, bias, top_k, renorm_min):
    """HF Ernie 4.5's ``Ernie4_5_MoeTopKRouter`` on its fp32 logits: softmax + the correction bias
    for the choice only, the *unbiased* scores gathered at the ids, renormalised by
    ``clamp(sum, min=moe_norm_min)``. The k best of E softmax scores sum to at least k / E, so a
    clamp below that never binds (the guard checks): the op's plain renormalisation."""
    weights, ids = _biased_choice(torch.softmax(logits, dim=1, dtype=torch.float), bias, top_k)
    return weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=renorm_min), ids


def softmax_bias_unnormalised(logits, bias, top_k, scale):
    """Softmax of the fp32 logits + a correction bias for the choice only, the *unbiased* scores
    gathered at the ids and scaled, not renormalised (HF LongCat-Flash's ``LongcatFlashTopkRouter``,
    ``routed_scaling_factor``)."""
    weights, ids = _biased_choice(torch.softmax(logits, dim=1, dtype=torch.float), bias, top_k)
    return weights * scale, ids


def softmax(logits, top_k):
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), ids


def softmax_unnormalised(logits, top_k):
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    return values.to(logits.dtype), ids


def softmax_fp32_weights(logits, top_k):
    probs = torch.softmax(logits.float(), dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    return values / values.sum(dim=-1, keepdim=True), ids


def softmax_of_top_logits(logits, top_k):
    """Top-k of the fp32 logits, softmax over those k (HF GraniteMoE's ``GraniteMoeTopKRouter``):
    softmax is monotone and its common denominator cancels, so this is ``softmax``'s math."""
    values, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1).to(logits.dtype), ids


def softmax_of_top_logits_in_dtype(logits, top_k):
    """The same with the top-k taken in the logits' dtype, the softmax cast back to it
    (HF gpt-oss's ``GptOssTopKRouter``, whose biased router GEMM stays outside: ``addmm``)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=1, dtype=values.dtype), ids


def fp32_gemm(hidden, router_weight):
    return torch.nn.functional.linear(hidden.float(), router_weight.float())


def gemm(hidden, router_weight):
    return torch.nn.functional.linear(hidden, router_weight)


GEMMS: dict[str, Callable] = {"fp32_gemm": fp32_gemm, "gemm": gemm}


def _signed(fn: Callable, params: list) -> Callable:
    """Give ``fn`` (which takes ``*args``) named positional parameters (names or
    ``inspect.Parameter``s): Inductor reads a pattern's argument names from its signature."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    fn.__signature__ = inspect.Signature(
        [p if isinstance(p, inspect.Parameter) else inspect.Parameter(p, positional) for p in params]
    )
    return fn


def _params(fn: Callable) -> list:
    return list(inspect.signature(fn).parameters.values())


def _with_router_gemm(route: Callable, router_gemm: Callable) -> Callable:
    """``route`` with its logits computed by ``router_gemm`` from (hidden, router_weight)."""

    def search(hidden, router_weight, *route_args):
        return route(router_gemm(hidden, router_weight), *route_args)

    return _signed(search, ["hidden", "router_weight", *_params(route)[1:]])


def _with_shared_gate(search: Callable) -> Callable:
    """``search`` (a GEMM form) plus Qwen's shared-expert gate on the same hidden states:
    ``sigmoid(F.linear(hidden, gate_weight))``, gate_weight [1, H], as a third output."""

    def gated(hidden, router_weight, gate_weight, *route_args):
        weights, ids = search(hidden, router_weight, *route_args)
        return weights, ids, torch.sigmoid(torch.nn.functional.linear(hidden, gate_weight))

    params = _params(search)
    return _signed(gated, [*params[:2], "gate_weight", *params[2:]])


def _without_groups(route: Callable) -> Callable:
    """``route`` with n_group and topk_group 1 (GLM-4.5's: the grouped code with no
    grouping). Inductor has rewritten its group mask (``_one_hot_group_mask``), and the expanded
    mask reshapes as a view, where a mask of several groups is copied first."""

    def search(logits, bias, top_k, *rest):
        return route(logits, bias, top_k, 1, 1, *rest)

    return _signed(search, [p for p in _params(route) if p.name not in ("n_group", "topk_group")])


def _one_group_kept(route: Callable) -> Callable:
    """``route`` with topk_group 1 of n_group groups (several): Inductor has rewritten its group
    mask as for n_group 1 (``_one_hot_group_mask``); the expanded mask of several groups is
    copied before its reshape, which the trace keeps too."""

    def search(logits, bias, top_k, n_group, *rest):
        return route(logits, bias, top_k, n_group, 1, *rest)

    return _signed(search, [p for p in _params(route) if p.name != "topk_group"])


# DeepSeek's and Ernie's routing run on fp32 logits (an fp32 router GEMM): traced for those only.
_GROUPED = {"scoring": "sigmoid", "grouped": True, "fp32_logits": True}
_UNNORMALISED = {"renormalise": False}
_ONE_GROUP = {"n_group": 1, "topk_group": 1}
# The renormalised routes come first: an unnormalised route is the first part of one.
ROUTES = (
    ("sigmoid_bias_grouped", sigmoid_bias_grouped, _GROUPED),
    ("sigmoid_bias_n_group_1", _without_groups(sigmoid_bias_grouped), {**_GROUPED, **_ONE_GROUP}),
    ("sigmoid_bias_grouped_unnormalised", sigmoid_bias_grouped_unnormalised, {**_GROUPED, **_UNNORMALISED}),
    ("sigmoid_bias_n_group_1_unnormalised", _without_groups(sigmoid_bias_grouped_unnormalised),
     {**_GROUPED, **_UNNORMALISED, **_ONE_GROUP}),
    ("sigmoid_bias_topk_group_1", _one_group_kept(sigmoid_bias_grouped), {**_GROUPED, "topk_group": 1}),
    ("sigmoid_bias_topk_group_1_unnormalised", _one_group_kept(sigmoid_bias_grouped_unnormalised),
     {**_GROUPED, **_UNNORMALISED, "topk_group": 1}),
    ("sigmoid_bias_renorm_eps", sigmoid_bias_renorm_eps, {"scoring": "sigmoid"}),
    ("sigmoid_bias", sigmoid_bias, {"scoring": "sigmoid"}),
    ("softmax_bias", softmax_bias, {"scoring": "softmax", "fp32_logits": True}),
    ("softmax_bias_unnormalised", softmax_bias_unnormalised,
     {"scoring": "softmax", "fp32_logits": True, **_UNNORMALISED}),
    ("softmax_fp32_weights", softmax_fp32_weights, {"scoring": "softmax", "weights_dtype": torch.float32}),
    ("softmax", softmax, {"scoring": "softmax"}),
    ("softmax_unnormalised", softmax_unnormalised, {"scoring": "softmax", **_UNNORMALISED}),
    ("softmax_of_top_logits", softmax_of_top_logits, {"scoring": "softmax"}),
    ("softmax_of_top_logits_in_dtype", softmax_of_top_logits_in_dtype, {"scoring": "softmax"}),
)
# Registration order is the order Inductor tries patterns at a node: the widest match first
# (router GEMM + shared-expert gate, then the GEMM alone, then from the logits).
VARIANTS = (
    tuple(
        Variant(f"{name}+gemm+shared_gate", _with_shared_gate(_with_router_gemm(route, gemm)),
                {**params, "gemm": "gemm", "shared_gate": True})
        for name, route, params in ROUTES
        # Qwen's gated shared expert sits beside Qwen's softmax routing only
        if params["scoring"] == "softmax" and "top_logits" not in name and "bias" not in name
    )
    + tuple(
        Variant(f"{name}+{g}", _with_router_gemm(route, GEMMS[g]), {**params, "gemm": g})
        for g in GEMMS
        for name, route, params in ROUTES
    )
    + tuple(Variant(name, route, params) for name, route, params in ROUTES)
)
DTYPE_COMBOS = ((torch.bfloat16,), (torch.float32,), (torch.float16,))


def _logits_dtype(variant: Variant, operand_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if variant.params.get("gemm") == "fp32_gemm" else operand_dtype


def example_inputs(variant: Variant, combo) -> list:
    (dtype,) = combo  # the logits' dtype, or the GEMM operands' with a GEMM form
    grouped = variant.params.get("grouped")
    if variant.params.get("fp32_logits") and (
        _logits_dtype(variant, dtype) != torch.float32 or variant.params.get("gemm") == "gemm"
    ):
        return None  # DeepSeek and Ernie route on fp32 logits (an fp32 router GEMM: fp32_gemm's trace)
    if variant.params.get("weights_dtype") == _logits_dtype(variant, dtype):
        return None  # without a cast back, the same trace as the route that casts back
    if variant.params.get("gemm") == "gemm" and not variant.params.get("shared_gate") and dtype == torch.float32:
        return None  # fp32 operands: fp32_gemm's fp32 trace (.float() of fp32 is itself), registered before it
    experts = _GROUPED_EXPERTS if grouped else _EXPERTS
    tokens = _TOKENS if grouped else 3
    if variant.params.get("gemm"):
        head = [torch.randn(tokens, _HIDDEN, dtype=dtype), torch.randn(experts, _HIDDEN, dtype=dtype)]
        if variant.params.get("shared_gate"):
            head.append(torch.randn(1, _HIDDEN, dtype=dtype))
    else:
        head = [torch.randn(tokens, experts, dtype=dtype)]
    tail = [torch.randn(experts) if p == "bias" else _SCALARS[p] for p in _route_params(variant)]
    return head + tail


def _route_params(variant: Variant) -> list[str]:
    """The routing arguments of ``variant``'s search function (after logits or the GEMM's)."""
    return [p for p in inspect.signature(variant.search).parameters if p == "bias" or p in _SCALARS]


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """top_k and the reduced dims, read from the graph (wildcards in the pattern)."""
    facts: dict[str, Any] = {"topk_dims": set(), "reduce_dims": set()}
    topks = [n for n in nodes if n.target is aten.topk.default]
    for node in topks:
        facts["topk_dims"].add(node.args[2] if len(node.args) > 2 else -1)
    if topks:
        # The expert top-k is the one not over a reshaped group view or over group sums.
        experts = [n for n in topks if getattr(n.args[0], "target", None) not in (aten.reshape.default, aten.sum.dim_IntList)]
        facts["graph_top_k"] = (experts or topks)[-1].args[1]
        group_tops = [n for n in topks if getattr(n.args[0], "target", None) is aten.reshape.default]
        facts["group_top"] = group_tops[0].args[1] if group_tops else None
        if group_tops:
            # The graph's own constants, to check what the matcher bound (see _group_reason).
            facts["graph_n_group"] = group_tops[0].args[0].args[1][1]
            over_sums = [n for n in topks if getattr(n.args[0], "target", None) is aten.sum.dim_IntList]
            facts["graph_topk_group"] = over_sums[0].args[1] if over_sums else None
    for node in nodes:
        if node.op != "call_function":
            continue
        constant = _number(node)
        sources = {getattr(a, "target", None) for a in node.args if isinstance(a, torch.fx.Node)}
        if node.target is aten.add.Tensor and aten.sum.dim_IntList in sources and constant is not None:
            facts["graph_renorm_eps"] = constant  # w / (w.sum() + eps)
        elif node.target is aten.mul.Tensor and sources & {aten.div.Tensor, aten.gather.default} and constant is not None:
            facts["graph_scale"] = constant  # (w / ...) * scale, or w * scale
        elif node.target is aten.clamp_min.default and aten.sum.dim_IntList in sources and constant is not None:
            facts["graph_renorm_min"] = constant  # w / clamp(w.sum(), min=renorm_min)
        elif node.target in (aten.sum.dim_IntList, aten.amax.default):
            facts["reduce_dims"].add(tuple(node.args[1]))
        elif node.target is aten.gather.default:
            facts["topk_dims"].add(node.args[1])
    return facts


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    if variant.params.get("gemm"):
        reason = _gemm_reason(values, variant)
        if reason:
            return reason
        experts = values["router_weight"].shape[0]
    else:
        logits = values["logits"]
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            return f"logits are not [tokens, experts] (got {getattr(logits, 'shape', logits)})"
        experts = logits.shape[-1]
    top_k = values.get("top_k")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        return f"top_k is not a constant int (got {top_k})"
    if values.get("graph_top_k") != top_k:
        return f"top_k bound to {top_k} but the graph says {values.get('graph_top_k')} (ambiguous int literals)"
    if not 1 <= top_k <= experts:
        return f"top_k {top_k} is not in [1, {experts}]"
    if values["topk_dims"] - {-1, 1}:
        return f"top-k or gather runs over dims {sorted(values['topk_dims'])}, not the expert dim"
    if values["reduce_dims"] - {(-1,), (1,)}:
        return f"a reduction runs over dims {sorted(values['reduce_dims'])}, not the expert dim"
    if variant.params.get("grouped"):
        reason = _group_reason(values, variant, experts, top_k)
        if reason:
            return reason
    bias = values.get("bias")
    if bias is not None:
        # [E], or one row [1, E] broadcast over the tokens (LongCat-Flash's ``bias.unsqueeze(0)``)
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) not in ((experts,), (1, experts)):
            return f"the bias is {tuple(getattr(bias, 'shape', ()))}, not one value per expert [{experts}]"
        if bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the bias is {bias.dtype}; the routing kernel takes an fp32, bf16 or fp16 bias"
    for name in {"renorm_eps", "scale"} & set(_route_params(variant)):
        value = values.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{name} is not a constant number (got {value})"
        if name == "renorm_eps" and value < 0:
            return f"the renormalisation adds {value} to the sum; the fused routing adds an eps >= 0"
    if "renorm_min" in _route_params(variant):
        return _clamp_reason(values, experts, top_k)
    return None


def _clamp_reason(values, experts: int, top_k: int) -> Reason:
    """Ernie's ``w / clamp(w.sum(), min=renorm_min)`` is ``w / w.sum()`` (the op's renormalisation)
    wherever the clamp cannot bind: the k best of E softmax scores sum to at least k / E, so a min
    below k / E never binds in exact arithmetic. In fp32 it could bind only where the computed sum
    falls short of k / E by its rounding, and then ``w / min`` and ``w / sum`` differ by about that
    rounding, a few fp32 ulp (``min``, rounded to fp32, lies within an ulp of the two sums)."""
    floor = values.get("renorm_min")
    if not isinstance(floor, (int, float)) or isinstance(floor, bool):
        return f"the clamp's min is not a constant number (got {floor})"
    if values.get("graph_renorm_min", floor) != floor:
        return f"renorm_min bound to {floor} but the graph says {values.get('graph_renorm_min')} (ambiguous literals)"
    if floor >= top_k / experts:
        return (f"the router renormalises by clamp(sum, min={floor}), which binds where the top {top_k} of {experts} "
                f"softmax scores sum below it (their least sum is {top_k}/{experts}); the fused routing renormalises "
                "by the sum alone")  # fmt: skip
    return None


def _gemm_reason(values, variant: Variant) -> Reason:
    hidden, weight = values.get("hidden"), values.get("router_weight")
    if not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (hidden, weight)):
        return "the router GEMM's operands are not a [tokens, hidden] input and an [experts, hidden] weight"
    if hidden.shape[1] != weight.shape[1]:
        return f"router GEMM of {tuple(hidden.shape)} by {tuple(weight.shape)}^T"
    logits_dtype = _logits_dtype(variant, weight.dtype)
    for name, t in (("hidden", hidden), ("router_weight", weight)):
        reason = route_ops.widening_reason(f"the router GEMM's {name}", t.dtype, logits_dtype)
        if reason:
            return reason
    if variant.params.get("shared_gate"):
        gate = values.get("gate_weight")
        if not isinstance(gate, torch.Tensor) or tuple(gate.shape) != (1, hidden.shape[1]):
            return f"the sigmoid gate's weight is {tuple(getattr(gate, 'shape', ()))}, not one row [1, {hidden.shape[1]}]"
        if not gate.dtype == hidden.dtype == weight.dtype:
            return f"gate {gate.dtype}, hidden {hidden.dtype} and router weight {weight.dtype} differ"
    return None


def _group_reason(values, variant: Variant, experts: int, top_k: int) -> Reason:
    n_group, topk_group = values.get("n_group"), values.get("topk_group")
    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if name in variant.params and v != variant.params[name]:
            return f"{name} is {v}; the pattern's group mask is the one of {name} {variant.params[name]}"
    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{name} is not a constant int (got {v})"
        # Inductor binds int scalars by value; where the graph's literals collide with the
        # tracer's examples it can bind the wrong one. Never fuse on a binding the graph denies.
        if values.get(f"graph_{name}") != v:
            return f"{name} bound to {v} but the graph says {values.get(f'graph_{name}')} (ambiguous int literals)"
    if n_group < 1 or experts % n_group:
        return f"{n_group} groups do not divide the {experts} experts"
    if values.get("group_top") != route_ops.GROUP_TOP:
        return f"groups are scored by their top {values.get('group_top')}, the fused routing by the top {route_ops.GROUP_TOP}"
    if experts // n_group < route_ops.GROUP_TOP:
        return f"groups of {experts // n_group} experts cannot be scored by their top {route_ops.GROUP_TOP}"
    if not 1 <= topk_group <= n_group:
        return f"topk_group {topk_group} is not in [1, {n_group}]"
    if top_k > topk_group * (experts // n_group):
        return f"top_k {top_k} is larger than the {topk_group * (experts // n_group)} experts left unmasked"
    return None


def _routing_args(variant: Variant, logits_dtype: torch.dtype, args) -> tuple:
    """moe_route's routing arguments from the search function's routing arguments: what the
    search does not take is what its math fixes (no bias, one group, no renormalisation or eps,
    scale 1; softmax weights in the logits' dtype, sigmoid weights in fp32)."""
    named = dict(zip(_route_params(variant), args))
    params = variant.params
    softmax_scores = params["scoring"] == "softmax"
    weights_dtype = params.get("weights_dtype", logits_dtype if softmax_scores else torch.float32)
    bias = named.get("bias")
    bias = bias.reshape(-1) if bias is not None and bias.dim() == 2 else bias  # a [1, E] row: the op's [E]
    return (bias, named["top_k"], named.get("n_group", 1), named.get("topk_group", 1),
            route_ops.SCORING[params["scoring"]], params.get("renormalise", True), float(named.get("renorm_eps", 0.0)),
            float(named.get("scale", 1.0)), weights_dtype)  # fmt: skip


def replacement(variant: Variant, lowering: str):
    if lowering not in ("triton", "inductor"):
        raise ValueError(f"no replacement for lowering {lowering!r}")
    inductor = lowering == "inductor"
    route = route_ops.moe_route_reference if inductor else torch.ops.fusion_compiler.moe_route
    router = route_ops.moe_router_reference if inductor else torch.ops.fusion_compiler.moe_router

    def routing_args(logits_dtype, *args):
        return _routing_args(variant, logits_dtype, args)

    if variant.params.get("gemm"):
        gated = bool(variant.params.get("shared_gate"))

        def replace_with_gemm(hidden, router_weight, *args):
            gate_weight, args = (args[0], args[1:]) if gated else (None, args)
            logits_dtype = _logits_dtype(variant, router_weight.dtype)
            weights, ids, _, gate = router(hidden, router_weight, *routing_args(logits_dtype, *args), logits_dtype,
                                           gate_weight)  # fmt: skip
            return (weights, ids, gate) if gated else (weights, ids)

        return replace_with_gemm

    def replace(logits, *args):
        return route(logits, *routing_args(logits.dtype, *args))

    return replace


def _scores_source(node) -> bool:
    """sigmoid(...), or softmax as Inductor decomposes it: exp(x - amax) / sum(exp)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target is aten.sigmoid.default:
        return True
    if node.target is aten.div.Tensor:
        num, den = node.args
        return getattr(num, "target", None) is aten.exp.default and getattr(den, "target", None) is aten.sum.dim_IntList
    return False


def _logits_of(scores) -> torch.fx.Node | None:
    """The one [tokens, experts] tensor ``scores`` is an elementwise function of (pointwise ops
    only, a few of them), or None: the logits of a router that scores them some other way."""
    if not isinstance(scores, torch.fx.Node) or not _pointwise(scores):
        return None
    leaves, seen, todo = set(), set(), [scores]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > 8:
            return None
        if _pointwise(node):
            todo.extend(node.all_input_nodes)
        elif len(val_shape(node) or ()) > 0:  # a 0-d constant is no input
            leaves.add(node)
    if len(leaves) != 1:
        return None
    (leaf,) = leaves
    return leaf if val_shape(leaf) == val_shape(scores) and len(val_shape(leaf)) == 2 else None


def _pointwise(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _function_name(node: torch.fx.Node, logits: torch.fx.Node) -> str:
    """``node`` as a function of ``logits``, for a reason: ``sqrt(softplus(logits))``."""
    if node is logits:
        return "logits"
    if node.target is torch.ops.prims.convert_element_type.default:
        return _function_name(node.args[0], logits)
    softplus_tail = node.args[2] if node.target is aten.where.self else None
    if isinstance(softplus_tail, torch.fx.Node) and upstream(softplus_tail, lambda n: n.target is aten.log1p.default, 2):
        # F.softplus: where(x * beta > threshold, x, log1p(exp(x * beta)) / beta)
        return f"softplus({_function_name(node.args[1], logits)})"
    inputs = ", ".join(_function_name(a, logits) for a in node.all_input_nodes if len(val_shape(a) or ()) > 0)
    return f"{node.target.overloadpacket.__name__}({inputs})"


def _router_logits(node) -> bool:
    """A router GEMM's [tokens, experts] output (``mm``, or ``addmm`` of a biased router), through
    dtype casts: the logits a router ranks as they are (GraniteMoE, gpt-oss)."""
    while isinstance(node, torch.fx.Node) and node.target is torch.ops.prims.convert_element_type.default:
        node = node.args[0]
    return (isinstance(node, torch.fx.Node) and node.target in (aten.mm.default, aten.addmm.default)
            and len(val_shape(node) or ()) == 2)  # fmt: skip


def _ranked_scores(topk: torch.fx.Node) -> torch.fx.Node | None:
    """What a router's expert top-k ranks: its input, less a group mask (-inf where) and a
    correction bias. Scores other than sigmoid / softmax count only where they rank experts like
    a router's: directly, or biased with the unbiased scores gathered at the chosen ids. The
    router GEMM's raw logits count too (GraniteMoE's and gpt-oss's softmax over the top k)."""
    source = topk.args[0]
    if getattr(source, "target", None) is aten.where.self:
        source = source.args[2]
    if getattr(source, "target", None) is not aten.add.Tensor:
        ranked = _scores_source(source) or _logits_of(source) is not None or _router_logits(source)
        return source if ranked else None
    ids = [u for u in topk.users if u.args[1] == 1]
    gathered = {u.args[0] for i in ids for u in i.users if u.target is aten.gather.default}
    return next((a for a in source.args if _scores_source(a) or (a in gathered and _logits_of(a) is not None)), None)


def _picks_by_max(node: torch.fx.Node) -> bool:
    """A ``max`` over the router GEMM's logits whose index picks an expert (gathered or scattered
    at): PhiMoE's ``sparsemixer``, which picks its experts one at a time."""
    if not _router_logits(node.args[0]):
        return False
    ids = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    picks = (aten.gather.default, aten.scatter.value, aten.scatter.src)
    return any(u.target in picks for i in ids for u in i.users)


def is_site(node: torch.fx.Node) -> bool:
    """The expert top-k of a router: top-k over scores, scores + bias, or scores masked to -inf
    by group selection (DeepSeek), or over the router GEMM's raw logits. The scores are sigmoid or
    softmax of the logits, or another elementwise function of them (a site the fused routing
    declines, naming the function). A group's own top-k (over a reshaped view or group sums) is
    not a site. A router picking its experts by ``max`` over the logits (PhiMoE) is a site,
    declined with its reason, anchored on its first ``max``."""
    if node.op != "call_function":
        return False
    if node.target is aten.max.dim:
        return _picks_by_max(node)
    return node.target is aten.topk.default and _ranked_scores(node) is not None


_SPARSEMIXER = ("the router picks its experts one at a time by max over the logits, weighting each by a softmax "
                "over the experts within its jitter threshold (PhiMoE's sparsemixer), not by a top-k of sigmoid or "
                "softmax scores")  # fmt: skip


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """A router whose math is none of the variants', in one sentence: experts picked by ``max``
    (PhiMoE), top-k logits weighted by another function than a softmax, scores that are neither
    sigmoid nor softmax; otherwise None (the guard's reasons and Inductor's FailedMatch say where
    a router departs)."""
    if anchor.target is aten.max.dim:
        return anchor, _SPARSEMIXER
    scores = _ranked_scores(anchor)
    if scores is None:
        return None
    if _router_logits(scores):
        return _top_logits_reason(anchor)
    if _scores_source(scores):
        return _group_departure(anchor, scores) or _weights_departure(anchor, scores)
    function = _function_name(scores, _logits_of(scores))
    return scores, (f"the router scores its logits as {function}; the fused routing takes sigmoid or softmax "
                    "over the experts")  # fmt: skip


def _scoring(scores: torch.fx.Node) -> str:
    return "sigmoid" if scores.target is aten.sigmoid.default else "softmax"


def _number(node) -> float | None:
    """The Python number among a node's arguments (an add's eps, a mul's scale), or None."""
    return next((a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)), None)


def _group_departure(topk: torch.fx.Node, scores: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """Groups the variants do not take, read off the graph: the expert top-k over the scores
    masked by a group choice whose groups are scored by their best expert (``max``: DeepSeek-V2's
    ``group_limited_greedy``), or groups of softmax scores; None where the groups are DeepSeek-V3's
    (sigmoid + bias, each scored by its best 2: the grouped variants' guards speak there)."""
    masked = topk.args[0]
    if getattr(masked, "target", None) is not aten.where.self:
        return None
    group_topk = upstream(masked.args[0], lambda n: n.target is aten.topk.default, 12)
    if group_topk is None:
        return None
    group_scores = group_topk.args[0]
    best = getattr(group_scores, "target", None) is operator.getitem and getattr(
        group_scores.args[0], "target", None) is aten.max.dim  # fmt: skip
    scoring = _scoring(scores)
    if not best and scoring == "sigmoid":
        return None
    n_group, topk_group = (val_shape(group_scores) or (None,))[-1], group_topk.args[1]
    by = f"the highest best {scoring} score (max over each group)" if best else f"the highest {scoring} scores"
    whose = " (DeepSeek-V2's group_limited_greedy)" if best else ""
    fill = masked.args[1]
    fill_value = fill.args[1] if getattr(fill, "target", None) is aten.full.default else fill
    masked_to = f"masks the others' scores to {fill_value:g} " if isinstance(fill_value, (int, float)) else ""
    return group_scores, (f"the router keeps the {topk_group} of {n_group} expert groups with {by}, {masked_to}and "
                          f"weights its top-k experts by their {scoring} scores{whose}: "
                          "the fused routing groups only sigmoid scores + a correction bias, each group scored by the "
                          "sum of its best 2 (DeepSeek-V3's noaux_tc)")  # fmt: skip


def _gathered(topk: torch.fx.Node, scores: torch.fx.Node) -> torch.fx.Node | None:
    """``scores.gather(-1, ids)`` of the top-k's ids: the unbiased weights of a biased choice."""
    ids = [u for u in topk.users if u.target is operator.getitem and u.args[1] == 1]
    return next((u for i in ids for u in i.users if u.target is aten.gather.default and u.args[0] is scores), None)


def _weights_steps(gathered: torch.fx.Node) -> tuple[tuple[str, float] | None, float | None, torch.fx.Node]:
    """What the router does to its gathered weights: the renormalisation (``("sum", eps)`` for
    ``w / (w.sum() + eps)``, ``("clamp", min)`` for ``w / clamp(w.sum(), min)``, None for none),
    the constant it then multiplies them by (None for none), and the last node of the two."""
    renorm, scale, node = None, None, gathered
    total = next((u for u in gathered.users if u.target is aten.sum.dim_IntList), None)
    if total is not None:
        kind, value, denominator = "sum", 0.0, total
        after = next(iter(total.users)) if len(total.users) == 1 else None
        if after is not None and after.target in (aten.add.Tensor, aten.add.Scalar) and _number(after) is not None:
            value, denominator = _number(after), after
        elif after is not None and after.target is aten.clamp_min.default and _number(after) is not None:
            kind, value, denominator = "clamp", _number(after), after
        divide = next((u for u in denominator.users
                       if u.target is aten.div.Tensor and u.args == (gathered, denominator)), None)  # fmt: skip
        if divide is not None:
            renorm, node = (kind, value), divide
    while len(node.users) == 1 and next(iter(node.users)).target is torch.ops.prims.convert_element_type.default:
        node = next(iter(node.users))
    scaled = next((u for u in node.users if u.target is aten.mul.Tensor and _number(u) is not None), None)
    if scaled is not None:
        scale, node = _number(scaled), scaled
    return renorm, scale, node


def _weights_departure(topk: torch.fx.Node, scores: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """A router choosing by biased scores, no groups, whose weights (the unbiased scores gathered
    at its ids) are not what the variants make of them: those divide sigmoid scores in fp32 by
    their plain sum (MiniMax-M2's) or by their sum + an eps and then scale them (HY-V3's), and take
    softmax scores over ``clamp(sum, min)`` (Ernie 4.5's) or not renormalised and scaled
    (LongCat-Flash's). A scale after a plain sum stays outside the fused op: said with the rest,
    never the reason alone. None where the router does what a variant does (another departure:
    the variants' reasons)."""
    if getattr(topk.args[0], "target", None) is not aten.add.Tensor:
        return None
    gathered = _gathered(topk, scores)
    if gathered is None:
        return None
    renorm, scale, last = _weights_steps(gathered)
    scoring, dtype = _scoring(scores), getattr(scores.meta.get("val"), "dtype", None)
    narrow = dtype is not None and dtype != torch.float32
    scaled = scale is not None
    if scoring == "sigmoid" and not narrow and renorm is not None and renorm[0] == "sum" and (renorm[1] == 0 or scaled):
        return None
    if scoring == "softmax" and (renorm[0] == "clamp" if renorm is not None else scaled):
        return None
    if renorm is None:
        steps = ", not renormalised"
    elif renorm[0] == "clamp":
        steps = f" over clamp(sum, min={renorm[1]:g})"
    else:
        steps = f" over their sum{f' + {renorm[1]:g}' if renorm[1] else ''}"
    steps += f", times {scale:g}" if scale is not None else ""
    dtype_name = str(dtype).removeprefix("torch.")
    where = f", all in {dtype_name} (the sigmoid of its {dtype_name} logits)" if narrow else ""
    if scoring == "sigmoid":
        takes = ("divides an ungrouped sigmoid router's weights, in fp32, by their plain sum (MiniMax-M2's) or by "
                 "their sum + an eps and then scales them (HY-V3's)")  # fmt: skip
    else:
        takes = ("takes a softmax router with a correction bias, in fp32, its weights divided by clamp(sum, min) "
                 "(Ernie 4.5's) or not renormalised and scaled (LongCat-Flash's)")  # fmt: skip
    return last, (f"the router weights its top-k experts by their unbiased {scoring} scores{steps}{where}, with no "
                  f"expert groups: the fused routing {takes}")  # fmt: skip


def _top_logits_reason(topk: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """Top-k of the raw logits, its values weighted by another function than a softmax over the
    k, that function named; None where a reduction reads them (a softmax: the variants' reasons)."""
    values = [u for u in topk.users if u.args[1] == 0]
    if not values:
        return topk, ("the router takes the top k of its raw logits and no weights from them; the fused routing "
                      "weights them by a softmax over those k")  # fmt: skip
    node = values[0]
    while len(node.users) == 1 and _pointwise(next(iter(node.users))):
        node = next(iter(node.users))
    if any(u.target in (aten.amax.default, aten.sum.dim_IntList) for u in node.users):
        return None
    return node, (f"the router weights the top k of its raw logits as {_function_name(node, values[0])}; the fused "
                  "routing weights them by a softmax over those k")  # fmt: skip


FAMILY = Family(
    name="moe_routing",
    variants=VARIANTS,
    dtype_combos=DTYPE_COMBOS,
    example_inputs=example_inputs,
    scalars=_SCALARS,
    guard=guard,
    replacement=replacement,
    facts_of=facts_of,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, route_ops.__name__),
)
