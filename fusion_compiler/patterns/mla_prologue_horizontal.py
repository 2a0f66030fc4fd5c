"""Horizontal merge: a layer's independent prologue sites become one kernel launch.

Each pattern replaces one site with a fused op that has only that site's role filled in
(``mla_kv_prologue``'s q / kv / index_k roles, ``mla_q_prologue``'s q / index_q roles). Sites
of the same op kind in the same layer that do not depend on each other are folded into one
call with all their roles, so DeepSeek V3.2 runs one launch before the q_b GEMM and one after.
A plain ``rms_norm`` op (HF's q_a_layernorm) joins as the q role.

Members merge only when: same layer (from ``nn_module_stack``; a graph without layer paths,
such as one attention module compiled alone, is one group), no data path between them,
distinct roles, the same RoPE angles (same tensor under views and a first-half slice), and
the same slots and cache quant format wherever both write a cache.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import torch

from .. import _compat
from ..fx.canonicalize import reshape_sizes
from ..fx.module_paths import layer_of, module_path
from ..ops import mla_kv_prologue as kv_ops
from ..ops import mla_q_prologue as q_ops

aten = torch.ops.aten

_ROLES = {
    "kv": {"q": ("q_c", "q_weight", "q_eps", "q_quant_group", "q_ue8m0", "q_scale_column_major"),
           "kv": ("kv_c", "k_pe", "kv_weight", "kv_eps", "deinterleave_rope", "latent_cache", "return_kv"),
           "index_k": ("index_k", "index_k_weight", "index_k_bias", "index_k_eps", "index_cache", "return_index_k")},
    "q": {"q": ("q_pe", "q_other", "deinterleave_rope"),
          "index_q": ("index_q", "index_weights", "index_weights_scale", "index_q_fp8", "ue8m0")},
}  # fmt: skip
_ROLE_INPUT = {"kv": {"q": "q_c", "kv": "kv_c", "index_k": "index_k"}, "q": {"q": "q_pe", "index_q": "index_q"}}
_SHARED = ("cos", "sin", "positions", "slots", "cache_ue8m0", "round_before_quant")


@dataclasses.dataclass
class Member:
    node: torch.fx.Node
    kind: str  # "kv" | "q"
    kwargs: dict
    roles: set
    as_rms_norm: bool = False  # a plain rms_norm op, joining as the q role

    @functools.cached_property
    def ancestors(self) -> set:
        """Every node this member reads, directly or not (computed once per member)."""
        return _ancestors(self.node)


def _op(kind: str):
    return {"kv": torch.ops.fusion_compiler.mla_kv_prologue.default, "q": torch.ops.fusion_compiler.mla_q_prologue.default}[kind]


def _arg_names(kind: str):
    return kv_ops._ARG_NAMES if kind == "kv" else q_ops._ARG_NAMES


def _member(node: torch.fx.Node) -> Member | None:
    if node.op != "call_function":
        return None
    if node.target is _compat.auto_functionalized and node.args[0] is _op("kv"):
        kwargs = dict(node.kwargs)
        return Member(node, "kv", kwargs, _present_roles("kv", kwargs))
    if node.target is _op("q"):
        kwargs = dict(zip(_arg_names("q"), node.args))
        return Member(node, "q", kwargs, _present_roles("q", kwargs))
    if node.target is torch.ops.fusion_compiler.rms_norm.default:
        x, weight, eps, offset, out_dtype = node.args
        x_val = x.meta.get("val")
        if offset != 0.0 or x_val is None or out_dtype != x_val.dtype:
            return None
        return Member(node, "kv", {**kv_ops.DEFAULTS, "q_c": x, "q_weight": weight, "q_eps": eps}, {"q"}, as_rms_norm=True)
    return None


def _present_roles(kind: str, kwargs: dict) -> set:
    return {role for role, arg in _ROLE_INPUT[kind].items() if kwargs.get(arg) is not None}


def _layer(node: torch.fx.Node):
    """A replacement's nodes carry no module stack; the nearest model nodes above it do."""
    frontier, seen = [node], {node}
    for _ in range(8):
        for candidate in frontier:
            layer = layer_of(module_path(candidate))
            if layer is not None:
                return layer
        frontier = [p for n in frontier for p in n.all_input_nodes if p not in seen and p.op != "placeholder"]
        seen.update(frontier)
    return None


def _angle_key(node):
    """What identifies the RoPE angles: a table's column range, or the tensor the
    per-token angles come from, through views and a first-half slice."""
    if getattr(node, "target", None) is aten.slice.Tensor and node.args[0].op == "placeholder":
        return (node.args[0], *node.args[1:])
    while isinstance(node, torch.fx.Node) and node.target in (
        aten.reshape.default, aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor,
    ):  # fmt: skip
        if node.target is aten.slice.Tensor and (len(node.args) > 2 and node.args[2] not in (0, None)):
            break
        node = node.args[0]
    return node


def _angle_table(node):
    """(table, positions, half) when `node` is one half of ``table[positions]`` cut in two
    (vLLM / DeepSeek ``cos_sin_cache[positions].chunk(2)``), through views."""
    while isinstance(node, torch.fx.Node) and node.target in (aten.reshape.default, aten.unsqueeze.default):
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target is operator.getitem):
        return None
    split, piece = node.args
    if getattr(split, "target", None) is not aten.split.Tensor or split.args[2:] not in ((-1,), ()):
        return None
    gathered, half = split.args[0], split.args[1]
    if getattr(gathered, "target", None) is not aten.index.Tensor or len(gathered.args[1]) != 1:
        return None
    table, (positions,) = gathered.args
    if table.meta["val"].dim() != 2 or table.meta["val"].shape[-1] != 2 * half:
        return None
    return table, positions, half, piece


def _read_angles_in_kernel(graph: torch.fx.Graph, member: Member) -> None:
    """Let the kernel gather cos/sin at `positions` itself: one launch less than a separate
    gather, and the gather's [T, rot] fp32 round trip is gone."""
    cos, sin = member.kwargs.get("cos"), member.kwargs.get("sin")
    found_cos, found_sin = _angle_table(cos), _angle_table(sin)
    if not found_cos or not found_sin or member.kwargs.get("positions") is not None:
        return
    (table, positions, half, cos_piece), (table2, positions2, _, sin_piece) = found_cos, found_sin
    if table is not table2 or positions is not positions2 or (cos_piece, sin_piece) != (0, 1):
        return
    with graph.inserting_before(member.node):
        halves = []
        for start in (0, half):
            piece = graph.call_function(aten.slice.Tensor, (table, 1, start, start + half))
            piece.meta["val"] = table.meta["val"][:, start : start + half]
            halves.append(piece)
    member.kwargs.update(cos=halves[0], sin=halves[1], positions=positions)


def _ancestors(node: torch.fx.Node) -> set:
    seen, stack = set(), [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _writes_cache(member: Member) -> bool:
    return any(member.kwargs.get(name) is not None for name in ("latent_cache", "index_cache"))


def _quantizes_norm(member: Member) -> bool:
    """The member's roles read `round_before_quant` (a normed value FP8-quantized)."""
    latent = member.kwargs.get("latent_cache")
    latent_fp8 = latent is not None and latent.meta["val"].dtype == torch.uint8
    return bool(member.kwargs.get("q_quant_group")) or latent_fp8


def _compatible(group: list[Member], candidate: Member) -> bool:
    if any(candidate.roles & m.roles for m in group):
        return False
    for m in group:
        for name in _SHARED:
            a, b = m.kwargs.get(name), candidate.kwargs.get(name)
            if a is None or b is None:
                continue
            if name == "cache_ue8m0" and not (_writes_cache(m) and _writes_cache(candidate)):
                continue
            if name == "round_before_quant" and not (_quantizes_norm(m) and _quantizes_norm(candidate)):
                continue
            if name in ("cos", "sin"):
                if _angle_key(a) != _angle_key(b):
                    return False
            elif a is not b and a != b:
                return False
    members = {m.node for m in group}
    if members & candidate.ancestors:
        return False
    return not any(candidate.node in m.ancestors for m in group)


def merge_prologues(graph: torch.fx.Graph) -> list[tuple[str, str, int]]:
    """Fold sibling prologue ops; returns (layer, kind, members) for every merged launch.
    Leaves the graph for the caller to sort topologically (FusionPass does)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    by_layer: dict[tuple, list[Member]] = {}
    for node in graph.nodes:
        member = _member(node)
        if member is not None:
            by_layer.setdefault((_layer(node), member.kind), []).append(member)
    merged = []
    for members in by_layer.values():
        for member in members:
            if not member.as_rms_norm:
                _read_angles_in_kernel(graph, member)
    for (layer, kind), members in by_layer.items():
        groups: list[list[Member]] = []
        for member in members:
            if member.as_rms_norm and not any(not m.as_rms_norm for m in members):
                continue
            target = next((g for g in groups if _compatible(g, member)), None)
            if target is None:
                groups.append([member])
            else:
                target.append(member)
        for group in groups:
            real = [m for m in group if not m.as_rms_norm]
            if not real:
                continue
            # A fresh node even for a group of one: its angle arguments may have changed, and
            # a node edited in place keeps stale metadata Inductor reads when lowering.
            _replace_group(graph, kind, group, order)
            if len(group) > 1:
                merged.append((f"layers.{layer}" if layer is not None else "graph", kind, len(group)))
    return merged


def _replace_group(graph: torch.fx.Graph, kind: str, group: list[Member], order: dict) -> None:
    """One call with every member's roles, inserted after the last member (``order``: the
    graph's node order before merging); FusionPass sorts the graph once afterwards."""
    names = _arg_names(kind)
    kwargs = dict(group[0].kwargs)
    for m in group:
        for role in m.roles:
            for name in _ROLES[kind][role]:
                kwargs[name] = m.kwargs[name]
        for name in _SHARED:
            if name in names and kwargs.get(name) is None:
                kwargs[name] = m.kwargs.get(name)
        if _writes_cache(m):
            kwargs["cache_ue8m0"] = m.kwargs["cache_ue8m0"]
        if _quantizes_norm(m):
            kwargs["round_before_quant"] = m.kwargs["round_before_quant"]
    last = max(group, key=lambda m: order[m.node]).node
    with graph.inserting_after(last):
        if kind == "kv":
            flat_q = None
            for m in group:
                if m.as_rms_norm:
                    x = m.kwargs["q_c"]
                    flat_q = graph.call_function(aten.reshape.default, (x, [-1, x.meta["val"].shape[-1]]))
                    flat_q.meta["val"] = x.meta["val"].reshape(-1, x.meta["val"].shape[-1])
                    kwargs["q_c"] = flat_q
            new = graph.call_function(_compat.auto_functionalized, (_op(kind),), kwargs)
        else:
            new = graph.call_function(_op(kind), tuple(kwargs[n] for n in names))
    new.meta["val"] = _fake_outputs(new)
    for m in group:
        if m.as_rms_norm:
            with graph.inserting_after(new):
                out = graph.call_function(operator.getitem, (new, 0))
                out.meta["val"] = new.meta["val"][0]
                # -1 at a dynamic batch: a raw SymInt in a node's arguments is not a graph value
                sizes = reshape_sizes(m.node.meta["val"].shape) or list(m.node.meta["val"].shape)
                view = graph.call_function(aten.reshape.default, (out, sizes))
                view.meta["val"] = m.node.meta["val"]
            m.node.replace_all_uses_with(view)
        else:
            for user in list(m.node.users):
                assert user.target is operator.getitem, user
                user.args = (new, user.args[1])
        graph.erase_node(m.node)


def _fake_outputs(node: torch.fx.Node):
    def value(a):
        return a.meta["val"] if isinstance(a, torch.fx.Node) else a

    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    return _compat.run_with_fake_mode(node.target, args, kwargs)


# The pipeline's stage (stages.STAGES): what it reports, empty, and its run and report lines.
RESULTS = {"merged_launches": []}


def run(graph: torch.fx.Graph, config) -> dict:
    return {"merged_launches": [{"layer": l, "kind": k, "sites": n} for l, k, n in merge_prologues(graph)]}


def describe(results: dict) -> list[str]:
    return [f"merged {m['sites']} {m['kind']}-prologue sites of {m['layer']} into one launch"
            for m in results["merged_launches"]]
