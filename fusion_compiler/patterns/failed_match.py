"""Inductor's account of a failed pattern match, as one sentence about the model's code.

Inductor's ``FailedMatch`` prints the pattern it was matching, a ``CallFunction(...)`` tree
often thousands of characters long. A miss needs two things from it: the graph node where the
model's code left the pattern, and what the pattern expected there, e.g. ``at slice_2 the model
has a slice of getitem_1 where the pattern expects a dtype cast of q_pe``. The path of nodes
from the site's anchor to that node stays in the report for ``inspect --explain``
(``Site.chain``, fx/explain.py).
"""

from __future__ import annotations

import operator

import torch

from .. import _compat

# What an op is, in words ("the model has <words> of <its input>").
_WORDS = {
    "convert_element_type": "a dtype cast", "_to_copy": "a dtype cast", "slice": "a slice",
    "split_with_sizes": "a split", "split": "a split", "getitem": "one output", "cat": "a concat",
    "stack": "a stack", "reshape": "a reshape", "view": "a reshape", "_unsafe_view": "a reshape",
    "permute": "a transpose", "transpose": "a transpose", "t": "a transpose", "expand": "a broadcast",
    "clone": "a copy", "copy": "a copy", "unsqueeze": "an unsqueeze", "squeeze": "a squeeze",
    "select": "a select", "full": "a constant", "scalar_tensor": "a constant", "mul": "a multiply",
    "div": "a divide", "add": "an add", "sub": "a subtract", "neg": "a negation", "pow": "a power",
    "rsqrt": "an rsqrt", "sqrt": "a sqrt", "exp": "an exp", "mean": "a mean", "sum": "a sum",
    "amax": "an amax", "mm": "a matmul", "bmm": "a batched matmul", "addmm": "a matmul with bias",
    "index_put": "a cache write", "index": "a gather", "index_copy": "a cache write",
    "where": "a select-where", "sigmoid": "a sigmoid", "relu": "a relu", "topk": "a top-k",
    "convolution": "a convolution", "select_scatter": "a select-scatter", "slice_scatter": "a slice-scatter",
}  # fmt: skip


def op_name(target) -> str:
    """``aten.slice.Tensor`` -> "slice"."""
    if target is operator.getitem:
        return "getitem"
    return (getattr(target, "__name__", None) or str(target)).split(".")[0]


def op_words(target) -> str:
    """``aten.slice.Tensor`` -> "a slice"; an op not in the table by its own name."""
    name = op_name(target)
    return _WORDS.get(name, f"a call of {name}")


def _node_words(node) -> str:
    if not isinstance(node, torch.fx.Node):
        return f"the constant {node!r}"
    if node.op == "placeholder":
        return "an input of the graph"
    if node.op == "get_attr":
        return "a constant of the graph"
    inputs = [n.name for n in node.all_input_nodes][:2]
    return op_words(node.target) + (f" of {', '.join(inputs)}" if inputs else "")


def _pattern_words(pattern) -> str:
    call = _compat.pattern_call(pattern)
    if call is None:
        return "another value"
    if not call["targets"]:
        return f"the input {call['inputs'][0]}"
    words = op_words(call["targets"][0])
    return words + (f" of {', '.join(call['inputs'][:2])}" if call["inputs"] else "")


def sentence(failure, tried: torch.fx.Node) -> tuple[torch.fx.Node, str]:
    """(the graph node where matching stopped, one sentence saying what the model has there
    against what the pattern expects) for a FailedMatch of a pattern tried at ``tried``."""
    kind, args = _compat.failed_match_parts(failure)
    nested = next((a for a in args if isinstance(a, _compat.FailedMatch)), None)
    if nested is not None:  # a list's element: the element's failure is the one to say
        return sentence(nested, tried)
    node = next((a for a in args if isinstance(a, torch.fx.Node)), None)
    patterns = [a for a in args if _compat.pattern_call(a) is not None]
    if kind.startswith("function_mismatch") and node is not None and patterns:
        call = _compat.pattern_call(patterns[0])
        if getattr(node, "target", None) in call["targets"]:
            return node, (f"at {node.name} the model's {op_name(node.target)} takes {len(node.args)} arguments "
                          f"where the pattern's takes {call['arity']}")  # fmt: skip
        return node, f"at {node.name} the model has {_node_words(node)} where the pattern expects {_pattern_words(patterns[0])}"
    if kind.startswith("multiple_users") and patterns:
        shared = _shared_node(tried, patterns[0])
        where = shared or tried
        order = {n: i for i, n in enumerate(where.graph.nodes)}  # graph order, not the users' insertion order
        readers = ", ".join(u.name for u in sorted(where.users, key=order.__getitem__))
        return where, (f"{where.name} ({_node_words(where)}) is read by {readers}: outside the pattern, which "
                       "needs it read once, inside the fused op")  # fmt: skip
    if kind.startswith("constant_args") and node is not None:
        constants = [a for a in args if a is not node]
        got, want = (constants + [None, None])[:2]
        return node, f"at {node.name} the model passes {got!r} where the pattern has the constant {want!r}"
    if kind.startswith("repeated pattern differs"):
        return tried, ("two inputs the pattern reads as one value (the same cos, the same tensor sliced twice) "
                       "are different values in the model")  # fmt: skip
    if kind.startswith("no anchor found"):
        return tried, "the model computes one of the site's outputs and not the other"
    where = node if node is not None else tried
    return where, f"at {where.name} the model departs from the pattern ({kind.split(':')[0].split('{')[0].strip()})"


def _shared_node(tried: torch.fx.Node, pattern) -> torch.fx.Node | None:
    """The node above ``tried`` that a pattern node with a fixed user count stands for and that
    has more users (Inductor's multiple_users failure names the pattern, not the node)."""
    call = _compat.pattern_call(pattern)
    frontier, seen = [tried], {tried}
    for _ in range(24):
        for node in frontier:
            if getattr(node, "target", None) in call["targets"] and call["users"] and len(node.users) > call["users"]:
                return node
        frontier = [m for n in frontier for m in n.all_input_nodes if m not in seen]
        seen.update(frontier)
    return None
