"""vLLM's spellings of the add_rms_norm family: its RMSNorm IR ops, before vLLM lowers them.

Inside vLLM 0.33 our pass runs in `PostGradPassManager` after vLLM's own fusions and before
`VllmIRLoweringPass`, so vLLM's `RMSNorm` / `GemmaRMSNorm` layers reach it as single nodes
(seen on vllm 0.33.0, torch 2.14.0, CPU):

    RMSNorm(x)                 vllm_ir.rms_norm.default(x, weight, eps)
    RMSNorm(x, residual)       vllm_ir.fused_add_rms_norm.default(x, residual, weight, eps)
                               -> (out, residual_out), read through getitem (a model's final
                               norm reads only out: the `out_only` variants)
    GemmaRMSNorm               the same ops, weight = weight.float() + 1.0 (a convert and an add)

Semantics (vllm/ir/ops/layernorm.py): fp32 math over the whole row; the residual sum is taken
in fp32 and `residual_out` is that sum cast to x's dtype; the weight multiplies
``normed.to(weight.dtype)``, and the result is cast to x's dtype. Our ops apply the weight in
fp32 and normalise the sum after its cast: with a bf16 weight (or a bf16 residual sum) that is
one bf16 rounding apart, as for HF's norms (ops/rms_norm.py).

Outside vLLM's backend (plain `torch.compile` of vLLM layers) the residual form arrives as
``auto_functionalized_v2(vllm_ir.fused_add_rms_norm.maybe_inplace, ...)`` with ``copy_`` of its
new bases back into x and residual. `functionalize_maybe_inplace` turns it into the default
overload first, as vLLM's own pre-grad `VllmIRInplaceFunctionalizationPass` does inside vLLM:
``maybe_inplace`` donates its activations (their contents afterwards are undefined), and the
native implementation leaves them unchanged, so the call's inputs stand for the written-back
values.

These ops exist only once vLLM has registered them; nothing here imports vLLM, and the family
is traced only by the vLLM integration (integrations/vllm.py), which runs it before the core
add_rms_norm family.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch

from .. import _compat
from . import add_rms_norm
from .registry import Family, Reason, Variant

RMS_NORM = "vllm_ir::rms_norm"
FUSED_ADD_RMS_NORM = "vllm_ir::fused_add_rms_norm"
_NORMS = (RMS_NORM, FUSED_ADD_RMS_NORM)
_AUTO_FUNCTIONALIZED = (_compat.auto_functionalized, _compat.auto_functionalized_v2)


def _vllm_ir():
    return torch.ops.vllm_ir


def _weight(weight):
    return weight


def _gemma_weight(weight):
    return weight.float() + 1.0


def _norm(weight_of):
    def search(x, weight, eps):
        return _vllm_ir().rms_norm.default(x, weight_of(weight), eps)

    return search


def _add_norm(weight_of):
    def search(x, residual, weight, eps):
        out, residual_out = _vllm_ir().fused_add_rms_norm.default(x, residual, weight_of(weight), eps)
        return out, residual_out

    return search


def _add_norm_out_only(weight_of):
    """A model's final norm: ``hidden_states, _ = self.norm(hidden_states, residual)``, the
    residual sum read by nothing."""

    def search(x, residual, weight, eps):
        return _vllm_ir().fused_add_rms_norm.default(x, residual, weight_of(weight), eps)[0]

    return search


# Gemma first: the plain variant's weight would also bind Gemma's (w + 1) node, and compute the
# same thing less directly.
_WEIGHTS = {"gemma": (_gemma_weight, 1.0), "": (_weight, 0.0)}

VARIANTS = tuple(
    Variant(f"vllm_ir.{op}{'.' + name if name else ''}", build(weight_of),
            {"weight_offset": offset, "residual": residual, "residual_out": build is _add_norm, "fp8": False})
    for op, build, residual in (("fused_add_rms_norm", _add_norm, True),
                                ("fused_add_rms_norm.out_only", _add_norm_out_only, True), ("rms_norm", _norm, False))
    for name, (weight_of, offset) in _WEIGHTS.items()
)  # fmt: skip


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    if values.get("weight") is None:
        return "weight is None (RMSNorm(has_weight=False)); the fused op multiplies by a weight"
    return add_rms_norm.guard(values, variant)


def replacement(variant: Variant, lowering: str):
    replace = add_rms_norm.replacement(variant, lowering)
    if not variant.params["residual"] or variant.params["residual_out"]:
        return replace

    def replace_out_only(x, residual, weight, eps):
        return replace(x, residual, weight, eps)[0]

    return replace_out_only


def _is_norm(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and _compat.op_name(node.target) in _NORMS


def _wrapped_norm(node: torch.fx.Node) -> bool:
    """An in-place norm `functionalize_maybe_inplace` left as it was (its reason: `explain`)."""
    return (
        node.op == "call_function" and node.target in _AUTO_FUNCTIONALIZED
        and _compat.op_name(node.args[0]) in _NORMS
    )  # fmt: skip


def is_site(node: torch.fx.Node) -> bool:
    return _is_norm(node) or _wrapped_norm(node)


def _argument(node: torch.fx.Node, name: str):
    for index, (arg_name, _, default) in enumerate(_compat.op_arguments(node.target)):
        if arg_name == name:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(name, None if default is _compat.NO_DEFAULT else default)
    raise KeyError(name)


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """eps as the graph's op call holds it (torch 2.11 drops scalars from a re-traced match)."""
    return {"graph_eps": _argument(n, "epsilon") for n in nodes if _is_norm(n)}


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    if _wrapped_norm(anchor):
        return anchor, (
            f"{_compat.op_name(anchor.args[0])} writes into a view of a larger tensor; the in-place "
            "call was left as it is, not rewritten to the functional op the patterns match"
        )
    variance_size = _argument(anchor, "variance_size")
    if variance_size is not None:
        return anchor, (
            f"variance_size={variance_size}: the variance covers only part of the row; "
            "the fused op normalises over the whole row"
        )
    return None


FAMILY = Family(
    name="add_rms_norm",
    variants=VARIANTS,
    dtype_combos=add_rms_norm.DTYPE_COMBOS,
    example_inputs=add_rms_norm.example_inputs,
    scalars=add_rms_norm.FAMILY.scalars,
    guard=guard,
    facts_of=facts_of,
    replacement=replacement,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, *add_rms_norm.FAMILY.source_modules),
)


def functionalize_maybe_inplace(graph: torch.fx.Graph) -> int:
    """``auto_functionalized[_v2](vllm_ir.<op>.maybe_inplace, ...)`` -> ``vllm_ir.<op>.default``,
    for the norms this module matches. Returns the number of calls rewritten. A call that writes
    into a view of a larger base stays (its anchor reports why: `explain`)."""
    rewritten = 0
    for node in list(graph.nodes):
        if not _wrapped_norm(node):
            continue
        inputs = _functional_inputs(node)
        if inputs is None or any(u.target is not operator.getitem for u in node.users):
            continue
        op = _compat.default_overload(node.args[0])
        with graph.inserting_before(node):
            call = graph.call_function(op, tuple(inputs))
        call.meta = {k: v for k, v in node.meta.items() if k != "val"}
        outputs = _compat.op_return_count(op)
        written = [value for (_, mutable, _), value in zip(_compat.op_arguments(op), inputs) if mutable]
        for user in list(node.users):
            index = user.args[1]
            if index < outputs:
                user.args = (call, index)
            else:
                user.replace_all_uses_with(_written_value(node, written, index - outputs))
                graph.erase_node(user)
        if "val" in node.meta:
            call.meta["val"] = tuple(node.meta["val"][:outputs])
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _written_value(node: torch.fx.Node, written: list, index: int):
    """What the call's extra output ``index`` held: v1 returns the written arguments in order,
    v2 its ``_all_bases`` (each written argument is a whole base here)."""
    if node.target is _compat.auto_functionalized:
        return written[index]
    return node.kwargs["_all_bases"][index]


# How auto_functionalized_v2 records a written argument that is a view of its base.
_VIEW_KWARGS = ("size", "stride", "storage_offset", "slice_dim", "slice_start", "slice_end", "alias")


def _functional_inputs(node: torch.fx.Node) -> list | None:
    """The default overload's positional arguments (trailing defaults dropped), or None when a
    written argument is a view (v2 records its size/stride/offset or slice against the base)."""
    op, kwargs = node.args[0], node.kwargs
    values = []
    for name, mutable, default in _compat.op_arguments(op):
        if mutable and node.target is _compat.auto_functionalized_v2:
            if any(f"_{name}_{view}" in kwargs for view in _VIEW_KWARGS):
                return None
            value = kwargs["_all_bases"][kwargs[f"_{name}_base_index"]]
        else:
            value = kwargs.get(name, None if default is _compat.NO_DEFAULT else default)
        values.append((value, default))
    while values and values[-1][1] is not _compat.NO_DEFAULT and values[-1][0] == values[-1][1]:
        values.pop()
    return [value for value, _ in values]


__all__ = ["FAMILY", "VARIANTS", "functionalize_maybe_inplace", "is_site"]
