"""Fold a RoPE table gather into the fused GQA prologue that reads it.

Serving code gathers its cos/sin rows once per layer (``cos, sin = cos_sin_cache[positions]
.chunk(2, -1)``, vLLM's rotary table). The gqa_prologue pattern takes the gathered cos / sin as
inputs, so the gather stays an Inductor kernel of its own (two at one token, where Inductor
splits it): one more launch per step than the prologue needs. The op reads tables at
``positions`` itself, so every prologue whose cos / sin are the two halves of such a gather is
rewritten to take the table halves and the positions; the gather then has no users left and
dies with the dead code.
"""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten


def _gather_halves(cos: torch.fx.Node, sin: torch.fx.Node):
    """(table, positions, half) when cos / sin are getitem 0 / 1 of one ``split`` of
    ``table[positions]`` into two equal halves along the last dim; else None."""
    if not all(isinstance(n, torch.fx.Node) and n.target is operator.getitem for n in (cos, sin)):
        return None
    split = cos.args[0]
    if sin.args[0] is not split or (cos.args[1], sin.args[1]) != (0, 1):
        return None
    if split.target is not aten.split.Tensor or len(split.args) < 3 or split.args[2] not in (-1, 1):
        return None
    gather, half = split.args[0], split.args[1]
    if gather.target is not aten.index.Tensor or len(gather.args[1]) != 1 or gather.args[1][0] is None:
        return None
    table, positions = gather.args[0], gather.args[1][0]
    table_val = table.meta.get("val")
    if table_val is None or table_val.dim() != 2 or table_val.shape[-1] != 2 * half or positions.meta["val"].dim() != 1:
        return None
    return table, positions, half


def fold_rope_gathers(graph: torch.fx.Graph, op) -> int:
    """Rewrite every ``auto_functionalized(op, ...)`` whose cos / sin come from a table gather
    (and that has no positions yet). Returns the number of prologues rewritten."""
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not node.args or node.args[0] is not op:
            continue
        kwargs = node.kwargs
        if kwargs.get("positions") is not None:
            continue
        found = _gather_halves(kwargs["cos"], kwargs["sin"])
        if found is None:
            continue
        table, positions, half = found
        with graph.inserting_before(node):
            halves = []
            for start, end in ((0, half), (half, 2 * half)):
                piece = graph.call_function(aten.slice.Tensor, (table, 1, start, end))
                piece.meta["val"] = table.meta["val"][:, start:end]
                halves.append(piece)
        node.kwargs = {**kwargs, "cos": halves[0], "sin": halves[1], "positions": positions}
        if "eager_input_vals" in node.meta:  # Inductor re-traces the op's decomposition with these
            fake_args, fake_kwargs = node.meta["eager_input_vals"]
            node.meta["eager_input_vals"] = (fake_args, {
                **fake_kwargs, "cos": halves[0].meta["val"], "sin": halves[1].meta["val"],
                "positions": positions.meta["val"],
            })  # fmt: skip
        folded += 1
    return folded


# The pipeline's stage (stages.STAGES): what it reports, empty, and its run and report lines.
RESULTS = {"folded_rope_gathers": 0}


def run(graph: torch.fx.Graph, config) -> dict:
    return {"folded_rope_gathers": fold_rope_gathers(graph, torch.ops.fusion_compiler.gqa_prologue.default)}


def describe(results: dict) -> list[str]:
    n = results["folded_rope_gathers"]
    return [f"folded the RoPE table gather into {n} gqa prologue(s)"] if n else []
