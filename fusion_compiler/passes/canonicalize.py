"""Rewrite equivalent spellings into the one form the patterns are traced in.

Real graphs say the same thing several ways: `nn.RMSNorm` reduces over `[1]` where HF
code says `[-1]`, and adds eps with `add.Scalar` where HF's `+ eps` traces to
`add.Tensor`; a 0-d constant is `scalar_tensor` in a trace and `full([])` in a graph;
`torch.topk(x, k)` and `torch.topk(x, k, dim=-1, sorted=False)` differ in
their argument lists. Without this, a pattern silently matches one spelling and misses the
other. Pattern traces go through the same rewrite (patterns/registry.py).
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)


def canonicalize(graph: torch.fx.Graph) -> int:
    """Returns the number of nodes rewritten."""
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.add.Scalar and len(node.args) == 2 and not node.kwargs:
            node.target = aten.add.Tensor
            changed += 1
        elif node.target in _REDUCTIONS and len(node.args) > 1:
            changed += _negative_dims(node)
        elif node.target is aten.topk.default:
            changed += _full_topk(node)
        elif node.target is aten.scalar_tensor.default and len(node.args) == 1:
            # What masked_fill(x, m, float) decomposes to in a pattern trace; real graphs
            # already carry it as a 0-d full (Inductor's own rewrite).
            node.target = aten.full.default
            node.args = ([], node.args[0])
            node.kwargs = {**node.kwargs, "pin_memory": False}
            changed += 1
    return changed


def _full_topk(node: torch.fx.Node) -> int:
    """topk(x, k, dim, largest, sorted) with every argument given, dim negative, and
    sorted=True: "unsorted" allows any order, so sorted is one valid result of it."""
    names = ("self", "k", "dim", "largest", "sorted")
    defaults = {"dim": -1, "largest": True, "sorted": True}
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    source = values["self"]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    dim = values.get("dim", -1)
    if value is not None and dim >= 0:
        dim -= value.dim()
    full = (source, values["k"], dim, values.get("largest", defaults["largest"]), True)
    if full == tuple(node.args) and not node.kwargs:
        return 0
    node.args, node.kwargs = full, {}
    return 1


def _negative_dims(node: torch.fx.Node) -> int:
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    dims = node.args[1]
    if value is None or not isinstance(dims, (list, tuple)):
        return 0
    rank = value.dim()
    negative = [d - rank if d >= 0 else d for d in dims]
    if negative == list(dims):
        return 0
    node.args = (source, negative, *node.args[2:])
    return 1
