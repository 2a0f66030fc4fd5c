"""Projections that read the same activation, merged into one GEMM (``ops/merged_linear.py``).

q / k / v of an attention layer, DeepSeek's q_a / kv_a / indexer projections, Gated DeltaNet's
four input projections, a shared expert's gate and up: each is an ``mm(x, w^T)`` of the same
activation. At decode sizes each GEMM is a launch that reads its weight once; one GEMM over the
concatenated weights reads the same bytes in one launch. The pass runs after the families, so
GEMMs inside a fused site (the router's) are already gone from the graph; each merged GEMM's
consumers read a slice of the merged output, a view.

Keyed on the graph, not on module names: any ``mm`` whose second operand is a transposed weight
(a placeholder or a constant, 2-D, possibly cast to a wider float first: it is then read in its
stored dtype) joins the group of the activation it reads, where the
activation is the same node or the same reshape of the same node (HF reshapes the normed hidden
state once per projection). Groups of one are left alone, except on the devices in
``single_devices`` (CUDA with ``FusionConfig.skinny_gemm``): there a lone projection becomes the
op with one weight too, whose small-M path is our skinny GEMM kernel (kernels/skinny_gemm.py).

A weight the model block-dequantises first (FP8 codes widened, times their block scales: the
DeepSeek reference's ``fp8_linear`` with ``fp8_weights``) is not one merged_linear reads: such
projections stay as they are, and a group that would have been merged is declined saying so.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..fx.graph_walk import CASTS, RESHAPES
from ..fx.module_paths import module_path
from ..ops import merged_linear as merged_ops

aten = torch.ops.aten


# Exact float widenings (every value of the narrower dtype is one of the wider): a weight cast
# this way before its GEMM (DeepSeek's simulated FP8 GEMMs: ``x @ w.float().t()``) is read in its
# stored dtype by merged_linear, which widens it in registers, instead of a cast kernel writing
# the wider copy for the GEMM to read back (3x the weight's bytes, then 2x, at fp32 from bf16).
_WIDENINGS = {
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float64),
}  # fmt: skip


def _unwidened(node):
    """The input of an exact float widening (``convert_element_type`` / ``_to_copy`` with only a
    dtype), else ``node``."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in CASTS:
        return node
    source, val = node.args[0], node.meta.get("val")
    source_val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
        return node  # a device or layout change too
    if val is None or source_val is None or (source_val.dtype, val.dtype) not in _WIDENINGS:
        return node
    return source


def _untransposed(node):
    """``w`` of ``permute(w, [1, 0])`` / ``t(w)``, else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if (node.target is aten.permute.default and list(node.args[1]) == [1, 0]) or node.target is aten.t.default:
        return node.args[0]
    return None


def _stored_weight(node) -> bool:
    """A 2-D placeholder or constant."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2 and node.op in ("placeholder", "get_attr")


def _weight_of(transposed: torch.fx.Node) -> torch.fx.Node | None:
    """``w`` of ``permute(w, [1, 0])`` / ``t(w)`` when w is a 2-D weight (placeholder or constant),
    possibly exactly widened (before or after the transpose)."""
    weight = _unwidened(_untransposed(_unwidened(transposed)))
    return weight if _stored_weight(weight) else None


def _block_dequantised_weight(transposed: torch.fx.Node) -> torch.fx.Node | None:
    """The FP8 weight of ``(w.float() * scales).t()`` (a 2-D weight of a one-byte float dtype, cast,
    times anything), else None."""
    product = _untransposed(transposed)
    if not isinstance(product, torch.fx.Node) or product.target is not aten.mul.Tensor:
        return None
    for factor in product.args:
        if isinstance(factor, torch.fx.Node) and factor.target in CASTS and _stored_weight(factor.args[0]):
            dtype = factor.args[0].meta["val"].dtype
            if dtype.is_floating_point and dtype.itemsize == 1:
                return factor.args[0]
    return None


def _activation_key(x: torch.fx.Node) -> tuple:
    """The same activation read through the same reshape: one key."""
    if x.op == "call_function" and x.target in RESHAPES:
        return (x.args[0], tuple(x.args[1]))
    return (x, None)


def _group_reason(x: torch.fx.Node, members) -> str | None:
    """merged_linear's argument rules on the group's fake values: x [M, K] and weights [N_i, K] of
    one float dtype, x's or one that widens exactly to it, on x's device; else why not."""
    x_val = x.meta.get("val")
    if not isinstance(x_val, torch.Tensor) or x_val.dim() != 2 or not x_val.is_floating_point():
        what = f"{x_val.dtype} {tuple(x_val.shape)}" if isinstance(x_val, torch.Tensor) else repr(x_val)
        return f"the activation {x.name} is {what}, not a 2-D float tensor"
    for weight in (w for _, w in members):
        val = weight.meta["val"]
        if val.dtype != x_val.dtype and (val.dtype, x_val.dtype) not in _WIDENINGS:
            return f"{weight.name} is {val.dtype} and {x.name} {x_val.dtype}: the GEMM reads its weights in x's dtype or one that widens to it"
        if val.device != x_val.device:
            return f"{weight.name} is on {val.device} and {x.name} on {x_val.device}"
    return None


def merge_projections(graph: torch.fx.Graph, single_devices: tuple[str, ...] = (),
                      declined: list | None = None) -> tuple[list[int], int]:  # fmt: skip
    """Merge each group of two or more projections of one activation, and make each lone projection
    on a device in ``single_devices`` the op with one weight; returns (the merged group sizes, the
    number of lone projections made ops). A group the op cannot take stays as it is; with
    ``declined``, each such group appends (its first GEMM, why) there, as does each group of
    block-dequantised FP8 weights that would otherwise have been merged."""
    groups: dict[tuple, list[tuple[torch.fx.Node, torch.fx.Node]]] = defaultdict(list)
    fp8_groups: dict[tuple, list[tuple[torch.fx.Node, torch.fx.Node]]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.mm.default:
            weight = _weight_of(node.args[1])
            if weight is not None:
                groups[_activation_key(node.args[0])].append((node, weight))
            elif (fp8 := _block_dequantised_weight(node.args[1])) is not None:
                fp8_groups[_activation_key(node.args[0])].append((node, fp8))
    for members in fp8_groups.values():
        if declined is not None and (len(members) > 1 or members[0][0].meta["val"].device.type in single_devices):
            declined.append((members[0][0], "the weight is FP8 that the model's code block-dequantises (its codes "
                                             "times a scale per block), which merged_linear does not read"))
    merged, singles = [], 0
    for members in groups.values():
        # Same dtype and reduction width: one GEMM; anything else stays as it is.
        dtypes = {(w.meta["val"].dtype, w.meta["val"].shape[1], mm.meta["val"].dtype) for mm, w in members}
        single = len(members) == 1 and members[0][0].meta["val"].device.type in single_devices
        if (len(members) < 2 and not single) or len(dtypes) != 1:
            continue
        first, x = members[0][0], members[0][0].args[0]
        reason = _group_reason(x, members)
        if reason is not None:
            if declined is not None:
                declined.append((first, reason))
            continue
        weights = [w for _, w in members]
        with graph.inserting_before(first):
            out = graph.call_function(torch.ops.fusion_compiler.merged_linear.default, (x, weights))
            out.meta["val"] = torch.ops.fusion_compiler.merged_linear.default(x.meta["val"], [w.meta["val"] for w in weights])
            start = 0
            for mm, w in members:
                width = w.meta["val"].shape[0]
                piece = graph.call_function(aten.slice.Tensor, (out, 1, start, start + width))
                piece.meta["val"] = aten.slice.Tensor(out.meta["val"], 1, start, start + width)
                start += width
                mm.replace_all_uses_with(piece)
        for mm, _ in members:  # after the insertions: they are placed relative to the first
            graph.erase_node(mm)
        if single:
            singles += 1
        else:
            merged.append(len(members))
    return merged, singles


# The pipeline's stage (stages.STAGES): what it reports, empty, and its run and report lines.
RESULTS = {"merged_projections": [], "skinny_projections": 0, "declined_merges": []}


def run(graph: torch.fx.Graph, config) -> dict:
    declined: list = []
    merged, singles = merge_projections(graph, ("cuda",) if config.skinny_gemm else (), declined)
    return {"merged_projections": merged, "skinny_projections": singles,
            "declined_merges": [{"anchor": mm.name, "module": module_path(mm), "reason": why} for mm, why in declined]}


def describe(results: dict) -> list[str]:
    merged = results["merged_projections"]
    lines = [f"merged {sum(merged)} GEMMs of shared activations into {len(merged)} (groups of {merged})"] if merged else []
    if results["skinny_projections"]:
        lines.append(f"{results['skinny_projections']} lone projection(s) on the skinny GEMM path at small M")
    return lines + [f"projections of {d['module'] or '?'} ({d['anchor']}) left unmerged: {d['reason']}"
                    for d in results["declined_merges"]]
