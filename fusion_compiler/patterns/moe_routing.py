"""MoE routing: router logits -> (weights, expert ids) as one fused op (``ops/moe_route.py``).

Variants are the routing math as real code writes it, keyed on the math, not on module names:

* ``sigmoid_bias``: sigmoid scores, + a correction bias for the choice only, top-k, weights
  gathered from the *unbiased* scores, renormalised (HF MiniMax-M2.5's ``MiniMaxM2TopKRouter``;
  DeepSeek V3's math without expert groups).
* ``softmax``: softmax in fp32, top-k, renormalised, cast back to the logits' dtype (HF
  Qwen3.5's ``Qwen3_5MoeTopKRouter``).

Not yet: DeepSeek V3.2's grouped routing (group scores from the top-2 of each group, top
groups, -inf masking). Its final top-k is still a site, so it is reported as a miss, with
the node where matching stopped, until that variant lands.

The router GEMM stays outside the pattern (cuBLAS); the GEMM-fused lowering for few tokens is
issue 4's next step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..ops import moe_route as route_ops
from .registry import Family, Reason, Variant

aten = torch.ops.aten

# Example scalar values no real routing uses, so the tracer can tell them from other literals.
_TOP_K = 7
_EXPERTS = 64


def sigmoid_bias(logits, bias, top_k):
    scores = torch.sigmoid(logits.float())
    _, ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False)
    weights = scores.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def softmax(logits, top_k):
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    values, ids = torch.topk(probs, top_k, dim=-1)
    values = values / values.sum(dim=-1, keepdim=True)
    return values.to(logits.dtype), ids


VARIANTS = (
    Variant("sigmoid_bias", sigmoid_bias, {"scoring": "sigmoid"}),
    Variant("softmax", softmax, {"scoring": "softmax"}),
)
DTYPE_COMBOS = ((torch.bfloat16,), (torch.float32,), (torch.float16,))


def example_inputs(variant: Variant, combo) -> list:
    (dtype,) = combo
    logits = torch.randn(3, _EXPERTS, dtype=dtype)
    if variant.params["scoring"] == "sigmoid":
        return [logits, torch.randn(_EXPERTS), _TOP_K]
    return [logits, _TOP_K]


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """top_k and the reduced dims, read from the graph (wildcards in the pattern)."""
    facts: dict[str, Any] = {"topk_dims": set(), "reduce_dims": set()}
    for node in nodes:
        if node.target is aten.topk.default:
            facts["top_k"] = node.args[1]
            facts["topk_dims"].add(node.args[2] if len(node.args) > 2 else -1)
        elif node.target in (aten.sum.dim_IntList, aten.amax.default):
            facts["reduce_dims"].add(tuple(node.args[1]))
        elif node.target is aten.gather.default:
            facts["topk_dims"].add(node.args[1])
    return facts


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    logits = values["logits"]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        return f"logits are not [tokens, experts] (got {getattr(logits, 'shape', logits)})"
    experts = logits.shape[-1]
    top_k = values.get("top_k")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        return f"top_k is not a constant int (got {top_k})"
    if not 1 <= top_k <= experts:
        return f"top_k {top_k} is not in [1, {experts}]"
    if values["topk_dims"] - {-1, 1}:
        return f"top-k or gather runs over dims {sorted(values['topk_dims'])}, not the expert dim"
    if values["reduce_dims"] - {(-1,), (1,)}:
        return f"a reduction runs over dims {sorted(values['reduce_dims'])}, not the expert dim"
    bias = values.get("bias")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (experts,):
            return f"the bias is {tuple(getattr(bias, 'shape', ()))}, not one value per expert [{experts}]"
        if bias.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the bias is {bias.dtype}, not a float type"
    return None


def replacement(variant: Variant, lowering: str):
    route = route_ops.moe_route_reference if lowering == "inductor" else torch.ops.fusion_compiler.moe_route
    if lowering not in ("triton", "inductor"):
        raise ValueError(f"no replacement for lowering {lowering!r}")
    if variant.params["scoring"] == "sigmoid":

        def replace_sigmoid(logits, bias, top_k):
            return route(logits, bias, top_k, 1, 1, 0, True, 0.0, 1.0, torch.float32)

        return replace_sigmoid

    def replace_softmax(logits, top_k):
        return route(logits, None, top_k, 1, 1, 1, True, 0.0, 1.0, logits.dtype)

    return replace_softmax


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


def is_site(node: torch.fx.Node) -> bool:
    """The expert top-k of a router: top-k over scores, scores + bias, or scores masked to -inf
    by group selection (DeepSeek). A group's own top-k (over a reshaped view or group sums) is
    not a site."""
    if node.op != "call_function" or node.target is not aten.topk.default:
        return False
    source = node.args[0]
    if getattr(source, "target", None) is aten.where.self:
        source = source.args[2]
    if getattr(source, "target", None) is aten.add.Tensor:
        source = next((a for a in source.args if _scores_source(a)), None)
    return _scores_source(source)


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    source = anchor.args[0]
    if getattr(source, "target", None) is aten.where.self:
        return source, "expert-group masking (DeepSeek grouped routing) has no fused variant yet"
    return None


FAMILY = Family(
    name="moe_routing",
    variants=VARIANTS,
    dtype_combos=DTYPE_COMBOS,
    example_inputs=example_inputs,
    scalars={"top_k": _TOP_K},
    guard=guard,
    replacement=replacement,
    facts_of=facts_of,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, route_ops.__name__),
)
