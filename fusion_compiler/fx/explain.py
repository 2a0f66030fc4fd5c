"""The FX nodes of a missed site, for ``fusion-compiler inspect --explain``.

A miss records the node where matching stopped. The chain is the path of nodes between the
site's anchor and that node (found through inputs, or else through users), each written as
``name = target(arguments)``, so a reader sees the code the pattern walked and where it left
the expected spelling. Nodes do not outlive the compile; the chain is text.
"""

from __future__ import annotations

from collections import deque

import torch

MAX_DEPTH = 24  # patterns span up to ~20 nodes from their anchor (gdn's delta rule to its norm)


def describe(node: torch.fx.Node) -> str:
    """``name = target(args)``: arguments by node name, literals as written (long ones cut)."""
    target = getattr(node.target, "__name__", None) or str(node.target)
    if node.op == "placeholder":
        return f"{node.name} = input"

    def show(arg) -> str:
        if isinstance(arg, torch.fx.Node):
            return arg.name
        if isinstance(arg, (list, tuple)):
            return "[" + ", ".join(show(a) for a in arg) + "]"
        text = repr(arg)
        return text if len(text) <= 40 else text[:37] + "..."

    args = [show(a) for a in node.args] + [f"{k}={show(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {target}({', '.join(args)})"


def _path(start: torch.fx.Node, goal: torch.fx.Node, step) -> list[torch.fx.Node] | None:
    parent: dict[torch.fx.Node, torch.fx.Node | None] = {start: None}
    queue = deque([(start, 0)])
    while queue:
        node, depth = queue.popleft()
        if node is goal:
            path = []
            while node is not None:
                path.append(node)
                node = parent[node]
            return path
        if depth < MAX_DEPTH:
            for nxt in step(node):
                if nxt not in parent:
                    parent[nxt] = node
                    queue.append((nxt, depth + 1))
    return None


def chain(anchor: torch.fx.Node, stopped: torch.fx.Node) -> tuple[str, ...]:
    """The nodes from ``stopped`` to ``anchor`` in graph order (either may come first), the
    diverging node marked; just the anchor and its inputs when matching stopped at the anchor
    or the two are not connected within MAX_DEPTH."""
    if stopped is not anchor:
        upstream = _path(anchor, stopped, lambda n: n.all_input_nodes)
        path = upstream or _path(anchor, stopped, lambda n: list(n.users))
        if path is not None:
            ordered = path if upstream else list(reversed(path))
            return tuple(describe(n) + ("    <- diverged here" if n is stopped else "") for n in ordered)
    return tuple(describe(n) for n in anchor.all_input_nodes) + (describe(anchor) + "    <- diverged here",)
