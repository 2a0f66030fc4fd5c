"""Walking a post-grad graph near a candidate site (what `is_site` and `explain` share)."""

from __future__ import annotations

import torch

aten = torch.ops.aten
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)  # .float() and kin


def val_shape(node) -> tuple | None:
    """The shape of a node's fake value, None when it holds no tensor."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def target(node):
    return getattr(node, "target", None)


def is_full(node, value, shape=None) -> bool:
    """``aten.full(shape, value)``: a constant of ``value`` (any shape where ``shape`` is None)."""
    return target(node) is aten.full.default and node.args[1] == value and (shape is None or list(node.args[0]) == list(shape))


def is_silu(node) -> bool:
    """SiLU as post-grad graphs spell it: aten.silu, or x / (1 + exp(-x))."""
    if target(node) is aten.silu.default:
        return True
    if target(node) is not aten.div.Tensor:
        return False
    denom = node.args[1]
    return target(denom) is aten.add.Tensor and target(denom.args[0]) is aten.exp.default


def is_sigmoid(node) -> bool:
    """sigmoid(z) alone (not SiLU's z · sigmoid(z)): aten.sigmoid, or 1 / (1 + exp(-z))."""
    if target(node) is aten.sigmoid.default:
        return True
    if target(node) is aten.reciprocal.default:
        node = node.args[0]
    elif target(node) is aten.div.Tensor and not isinstance(node.args[0], torch.fx.Node):
        node = node.args[1]
    else:
        return False
    return target(node) is aten.add.Tensor and target(node.args[0]) is aten.exp.default


def is_pair_slice(node) -> bool:
    """``x[..., 0::2]`` or ``x[..., 1::2]``: one half of GPT-J's interleaved RoPE pairs."""
    return target(node) is aten.slice.Tensor and len(node.args) > 4 and node.args[4] == 2


def walk(node, want, depth: int, neighbours):
    """The first node within ``depth`` steps of ``node`` (breadth first) that ``want`` accepts."""
    frontier, seen = [node], {node}
    for _ in range(depth):
        for n in frontier:
            if want(n):
                return n
        frontier = [m for n in frontier for m in neighbours(n) if m not in seen]
        seen.update(frontier)
    return None


def downstream(node, want, depth: int):
    return walk(node, want, depth, lambda n: n.users)


def upstream(node, want, depth: int):
    return walk(node, want, depth, lambda n: n.all_input_nodes)
