"""Fold a tensor-parallel norm's all-reduce neighbours into the fused GQA prologue's ops.

MiniMax's full-width QK-norm under tensor parallelism (vLLM's ``MiniMaxText01RMSNormTP``) reads
like this on each rank:

    local   = cat([q.float().pow(2).mean(-1, keepdim=True), k.float().pow(2).mean(-1, keepdim=True)], -1)
    reduced = wait_tensor(all_reduce(local, "sum", group))
    q_var, k_var = (reduced / world).chunk(2, -1)        # -> the prologue's norms

The ``minimax.paged_tp_*`` patterns put the whole tail into one ``gqa_prologue`` taking q_var and
k_var, which leaves two Inductor kernels around the all-reduce: the division after it (a [T, 2]
pointwise kernel) and the two local means before it (two reductions of different widths). Here,
for every such prologue:

* after: the op takes ``reduced``'s columns and ``variance_divisor = world`` instead (the same
  correctly rounded division, done in the kernel): the division dies;
* before: when q's and k's means share the all-reduce as above, ``cat`` of the two means
  becomes one ``gqa_prologue_variance(q, k)`` (one launch; its [T, 2] is what is all-reduced).

Variances with their own all-reduce each (one per norm, vLLM's ``_forward``) get the first fold
only. The guard (patterns/gqa_prologue.py ``global_variance``) has already checked the chain.
"""

from __future__ import annotations

import torch

from .gqa_prologue import GlobalVariance, global_variance, mean_square_source

aten = torch.ops.aten


def _column(graph: torch.fx.Graph, found: GlobalVariance) -> torch.fx.Node:
    """The all-reduced sums this side reads: the whole [T, 1] or its column of the [T, 2]."""
    if found.column is None:
        return found.reduced
    with graph.inserting_after(found.reduced):
        column = graph.call_function(aten.slice.Tensor, (found.reduced, -1, found.column, found.column + 1))
    column.meta["val"] = found.reduced.meta["val"][:, found.column : found.column + 1]
    return column


def _fold_division(node: torch.fx.Node, q: GlobalVariance, k: GlobalVariance) -> bool:
    if q.divisor != k.divisor:
        return False
    graph = node.graph
    q_sums, k_sums = _column(graph, q), _column(graph, k)
    new = {"q_variance": q_sums, "k_variance": k_sums, "variance_divisor": q.divisor}
    node.kwargs = {**node.kwargs, **new}
    if "eager_input_vals" in node.meta:  # Inductor re-traces the op's decomposition with these
        fake_args, fake_kwargs = node.meta["eager_input_vals"]
        node.meta["eager_input_vals"] = (fake_args, {
            **fake_kwargs, "q_variance": q_sums.meta["val"], "k_variance": k_sums.meta["val"],
            "variance_divisor": q.divisor,
        })  # fmt: skip
    return True


def _fuse_local_means(q: GlobalVariance, k: GlobalVariance, variance_op) -> bool:
    """cat([mean_sq(q), mean_sq(k)]) feeding only the all-reduce -> variance_op(q, k)."""
    if q.reduced is not k.reduced or (q.column, k.column) != (0, 1):
        return False
    cat = q.reduced.args[0].args[0]
    if len(cat.args[0]) != 2 or list(cat.users) != [q.reduced.args[0]]:
        return False
    sources = [mean_square_source(mean) for mean in (q.local, k.local)]
    if any(x is None or getattr(x.meta.get("val"), "ndim", 0) != 2 for x in sources):
        return False
    if any(len(mean.users) != 1 for mean in (q.local, k.local)):
        return False
    graph = cat.graph
    with graph.inserting_before(cat):
        fused = graph.call_function(variance_op, tuple(sources))
    fused.meta = {**cat.meta, "val": cat.meta["val"]}
    cat.replace_all_uses_with(fused)
    return True


def fold_tp_variances(graph: torch.fx.Graph, prologue_op, variance_op) -> tuple[int, int]:
    """Rewrite every ``auto_functionalized(prologue_op, ...)`` whose variances are divided
    all-reduce outputs. Returns (divisions folded, local-mean pairs fused)."""
    divisions = pairs = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.args or node.args[0] is not prologue_op:
            continue
        kwargs = node.kwargs
        if kwargs.get("q_variance") is None or kwargs.get("variance_divisor", 1.0) != 1.0:
            continue
        q, k = global_variance(kwargs["q_variance"]), global_variance(kwargs["k_variance"])
        if isinstance(q, str) or isinstance(k, str) or not _fold_division(node, q, k):
            continue
        divisions += 1
        pairs += _fuse_local_means(q, k, variance_op)
    return divisions, pairs


# The pipeline's stage (stages.STAGES): what it reports, empty, and its run and report lines.
RESULTS = {"folded_tp_divisions": 0, "fused_tp_variances": 0}


def run(graph: torch.fx.Graph, config) -> dict:
    ops = torch.ops.fusion_compiler
    divisions, pairs = fold_tp_variances(graph, ops.gqa_prologue.default, ops.gqa_prologue_variance.default)
    return {"folded_tp_divisions": divisions, "fused_tp_variances": pairs}


def describe(results: dict) -> list[str]:
    if not results["folded_tp_divisions"]:
        return []
    return [f"folded the all-reduced variance division into {results['folded_tp_divisions']} gqa prologue(s); "
            f"fused {results['fused_tp_variances']} pair(s) of local q/k means before the all-reduce"]
