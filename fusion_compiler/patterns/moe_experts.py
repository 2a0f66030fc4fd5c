"""The routed experts of a MoE layer, from the routing's (weights, ids) to the weighted
combine, as one op (``ops/moe_experts.py``).

Keyed on the math of the experts as HF transformers 5.17 writes them (``integrations/moe.py``),
seen in Inductor's post-grad graph, not on module names. Two forms fuse:

* ``grouped_mm`` (HF's default): the (token, k) pairs sorted by expert, ``hidden[perm // k]``,
  ``_grouped_mm`` over the gate/up weights' transposed view with per-expert offsets, SiLU(gate) *
  up, ``_grouped_mm`` over the down weights, times the sorted routing weights, un-permuted
  (``index_put`` of an iota), viewed [T, k, H] and summed over k. The sentinel masks
  (``where(sorted_id >= E, 0, .)``) may or may not be there. With non-bf16 weights under
  compile HF calls ``transformers::grouped_mm_fallback`` instead of ``_grouped_mm``: the same.
* ``batched_mm``: each token repeated k times, the ids clamped to [0, E), the experts' weights
  gathered per pair (``W[ids]``) and ``bmm``, SiLU(gate) * up, ``bmm`` with the gathered down
  weights, times the routing weights, viewed [T, k, H] and summed over k. The op reads the
  weights of each pair's expert in place instead of copying them.

HF's ``eager`` experts (a Python loop over the experts hit, with ``nonzero``) break the graph at
every expert, so no graph holds a whole site: not fused, and not reported as a site.

A site is the first expert GEMM of a chain (``_grouped_mm`` with a 3-D weight, or ``bmm`` of
gathered 3-D weights; a chain's GEMMs share their group offsets or their ids); every site fuses or is a miss with the reason, one sentence about the
model's code. The op takes the routing's ids and weights as the model computed them (after
``moe_routing`` fused them, its op's outputs), the hidden states [T, H] and the two 3-D weights.
"""

from __future__ import annotations

import operator

import torch

from ..fx.explain import chain
from ..fx.graph_walk import CASTS, RESHAPES, is_silu, target, val_shape
from ..fx.module_paths import module_path
from .site import Site

aten = torch.ops.aten
FAMILY = "moe_experts"


def _grouped_gemms() -> tuple:
    ops = [aten._grouped_mm.default]
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        ops.append(fallback.default)
    return tuple(ops)


class _Miss(Exception):
    """Why a site does not fuse (one sentence about the model's code), and the node it names
    (the report's "stopped at"; the site's GEMM when None)."""

    def __init__(self, reason: str, node: torch.fx.Node | None = None):
        super().__init__(reason)
        self.node = node


def _is(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _strip(node, ops) -> torch.fx.Node:
    while _is(node, *ops):
        node = node.args[0]
    return node


def _unmasked(node) -> torch.fx.Node:
    """HF's sentinel mask ``where(sorted_id >= E, 0, x)`` -> x (the node itself when absent)."""
    if _is(node, aten.where.self) and not isinstance(node.args[2], (int, float)):
        fill = node.args[1]
        if _is(fill, aten.full.default) and fill.args[1] == 0:
            return node.args[2]
    return node


def _only_user(node, what: str) -> torch.fx.Node:
    users = list(node.users)
    if len(users) != 1:
        raise _Miss(f"{what} ({node.name}) has {len(users)} users; the experts' chain needs it to feed one")
    return users[0]


def _permuted_weight(node, what: str) -> torch.fx.Node:
    """W for ``permute(W, [0, 2, 1])`` (HF's ``weight.transpose(-2, -1)``)."""
    if not (_is(node, aten.permute.default) and list(node.args[1]) == [0, 2, 1]):
        raise _Miss(f"the {what} weights are read as stored ({node.name}), i.e. as [E, in, out] (HF's "
                    "is_transposed): the kernels read [E, out, in] rows", node)  # fmt: skip
    return node.args[0]


def _expert_weight(node, what: str) -> torch.fx.Node:
    """W for ``index(W, [ids])`` (batched_mm's per-pair gather)."""
    if not (_is(node, aten.index.Tensor) and len(node.args[1]) == 1):
        raise _Miss(f"the {what} weights are not gathered per pair from an [E, out, in] stack ({node.name})")
    return node.args[0]


def is_expert_gemm(node) -> bool:
    """An expert GEMM: ``_grouped_mm`` (or HF's fallback op) with a 3-D weight, or ``bmm`` whose
    first operand gathers a 3-D weight stack per pair."""
    if _is(node, *_grouped_gemms()):
        shape = val_shape(node.args[1])
        return shape is not None and len(shape) == 3
    if _is(node, aten.bmm.default):
        gathered = node.args[0]
        return _is(gathered, aten.index.Tensor) and len(val_shape(gathered.args[0]) or ()) == 3
    return False


def _chain_key(gemm: torch.fx.Node):
    """What ties a layer's expert GEMMs together: the group offsets both grouped GEMMs take, or
    the ids both gathers use (batched_mm)."""
    if _is(gemm, aten.bmm.default):
        return ("ids", gemm.args[0].args[1][0])
    return ("offsets", gemm.args[2])


def site_gemms(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The first expert GEMM (gate/up) of each chain, in graph order: one per MoE layer, however
    long the gating between the two GEMMs is."""
    first = {}
    for node in graph.nodes:
        if is_expert_gemm(node):
            first.setdefault(_chain_key(node), node)
    return list(first.values())


def _activation(gemm_out: torch.fx.Node, inter: int) -> torch.fx.Node:
    """The node computing SiLU(gate) * up from the gate/up GEMM's output; checks the split."""
    split = _only_user(gemm_out, "the gate/up GEMM's output")
    if not (_is(split, aten.split.Tensor) and split.args[1] == inter and (split.args[2] if len(split.args) > 2 else 0) in (-1, 1)):
        raise _Miss(f"the gate/up output is not split into gate and up halves of {inter} ({split.name} {target(split)}): "
                    "the experts' gating is not HF's default chunk(2)")  # fmt: skip
    halves = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    if set(halves) != {0, 1} or len(split.users) != 2:
        raise _Miss("the gate/up halves are not each used once")
    gate, up = halves[0], halves[1]
    act = _only_user(up, "the up half")
    if not _is(act, aten.mul.Tensor):
        raise _Miss(f"the up half feeds {target(act)}, not a product with the activated gate")
    other = act.args[0] if act.args[1] is up else act.args[1]
    silu = _strip(other, CASTS)
    if not is_silu(silu):
        raise _Miss(f"the gate's activation ({silu.name}, {target(silu)}) is not SiLU: the kernels compute silu(gate) * up")
    source = silu.args[0]
    if _strip(source, CASTS) is not gate:
        raise _Miss("the SiLU does not read the gate half")
    return act


def _tail(weighted: torch.fx.Node, tokens: int, top_k: int, hidden_dtype) -> torch.fx.Node:
    """The node giving the experts' [T, H] output: ``view(weighted, [T, k, H]).sum(1)`` (then a
    cast to hidden's dtype where the sum is in a wider one)."""
    view = _only_user(weighted, "the weighted expert outputs")
    shape = val_shape(view)
    if not (_is(view, *RESHAPES) and shape is not None and tuple(shape[:2]) == (tokens, top_k)):
        raise _Miss(f"the weighted outputs are not viewed [tokens, top_k, H] before the combine ({view.name} {shape})")
    total = _only_user(view, "the [tokens, top_k, H] outputs")
    if not (_is(total, aten.sum.dim_IntList) and list(total.args[1]) in ([1], [-2])):
        raise _Miss(f"the experts' outputs are not summed over top_k ({total.name} {target(total)})")
    out = total
    users = list(total.users)
    if len(users) == 1 and _is(users[0], *CASTS) and users[0].meta["val"].dtype == hidden_dtype:
        out = users[0]
    if out.meta["val"].dtype != hidden_dtype:
        raise _Miss(f"the combined output stays {out.meta['val'].dtype}, not the hidden states' {hidden_dtype}")
    return out


def _routing_weights(scaled: torch.fx.Node, perm: torch.fx.Node | None) -> torch.fx.Node:
    """The [T, k] routing weights under ``unsqueeze(view(w, [-1])[perm], -1)`` (``perm`` None:
    no gather, batched_mm)."""
    node = _strip(scaled, (aten.unsqueeze.default,))
    if perm is not None:
        if not (_is(node, aten.index.Tensor) and list(node.args[1]) == [perm]):
            raise _Miss(f"the routing weights are not gathered in the experts' sorted order ({node.name})")
        node = node.args[0]
    if not _is(node, *RESHAPES):
        raise _Miss(f"the routing weights are not the router's [tokens, top_k] flattened ({node.name})")
    return node.args[0]


def _grouped(gemm: torch.fx.Node) -> dict:
    """The grouped_mm form from its gate/up GEMM."""
    x, weight, offsets = gemm.args[:3]
    gate_up = _permuted_weight(weight, "gate/up")
    gathered = _unmasked(x)
    if not (_is(gathered, aten.index.Tensor) and len(gathered.args[1]) == 1):
        raise _Miss(f"the gate/up GEMM's input is not the hidden states gathered per sorted pair ({gathered.name})")
    hidden, rows = gathered.args[0], gathered.args[1][0]
    if not (_is(rows, aten.div.Tensor_mode) and rows.kwargs.get("rounding_mode") == "floor"):
        raise _Miss(f"the hidden rows are not gathered by pair // top_k ({rows.name})")
    perm, top_k = rows.args
    if not (perm.target is operator.getitem and perm.args[1] == 1 and _is(perm.args[0], aten.sort.default)):
        raise _Miss("the pairs are not ordered by a sort of the expert ids")
    flat_ids = perm.args[0].args[0]
    if not _is(flat_ids, *RESHAPES):
        raise _Miss(f"the sorted ids are not the router's [tokens, top_k] ids flattened ({flat_ids.name})")
    ids = flat_ids.args[0]
    act = _activation(_unmasked_user(gemm), val_shape(gemm)[1] // 2)
    down_gemm = _only_user(act, "SiLU(gate) * up")
    if not _is(down_gemm, *_grouped_gemms()) or down_gemm.args[0] is not act:
        raise _Miss(f"SiLU(gate) * up does not feed a grouped down GEMM ({down_gemm.name} {target(down_gemm)})")
    if down_gemm.args[2] is not offsets:
        raise _Miss("the down GEMM's group offsets are not the gate/up GEMM's")
    down = _permuted_weight(down_gemm.args[1], "down")
    product = _unmasked_user(down_gemm)
    weighted = _only_user(product, "the down GEMM's output")
    if not _is(weighted, aten.mul.Tensor):
        raise _Miss(f"the down outputs are not scaled by the routing weights ({weighted.name} {target(weighted)})")
    scale = weighted.args[1] if weighted.args[0] is product else weighted.args[0]
    weights = _routing_weights(scale, perm)
    restored = _only_user(weighted, "the weighted outputs")
    if not (_is(restored, aten.index.Tensor) and len(restored.args[1]) == 1 and _inverse_of(restored.args[1][0], perm)):
        raise _Miss(f"the weighted outputs are not put back in pair order by perm's inverse ({restored.name})")
    return {"variant": "grouped_mm", "hidden": hidden, "ids": ids, "weights": weights, "gate_up": gate_up,
            "down": down, "top_k": top_k, "combined": restored}  # fmt: skip


def _unmasked_user(gemm: torch.fx.Node) -> torch.fx.Node:
    """The GEMM's output after HF's sentinel mask, if one follows it."""
    users = list(gemm.users)
    if len(users) == 1 and _unmasked(users[0]) is gemm:
        return users[0]
    return gemm


def _inverse_of(node, perm) -> bool:
    """``index_put(empty, [perm], iota)``: HF's ``inv_perm[perm] = arange``."""
    return (_is(node, aten.index_put.default) and list(node.args[1]) == [perm]
            and _is(node.args[2], torch.ops.prims.iota.default))  # fmt: skip


def _batched(gemm: torch.fx.Node) -> dict:
    """The batched_mm form from its gate/up ``bmm``."""
    gate_up = _expert_weight(gemm.args[0], "gate/up")
    clamped = gemm.args[0].args[1][0]
    flat_ids = _strip(clamped, (aten.clamp_max.default, aten.clamp_min.default, aten.clamp.default))
    if not _is(flat_ids, *RESHAPES):
        raise _Miss(f"the gathered experts are not picked by the router's [tokens, top_k] ids ({flat_ids.name})")
    ids = flat_ids.args[0]
    column = gemm.args[1]
    if not (_is(column, aten.unsqueeze.default) and column.args[1] in (-1, 2)):
        raise _Miss("the gate/up bmm's right operand is not the repeated hidden states as columns")
    repeated = _strip(column.args[0], (*RESHAPES, aten.clone.default))
    if not (_is(repeated, aten.expand.default) and _is(repeated.args[0], aten.unsqueeze.default)
            and repeated.args[0].args[1] == 1):  # fmt: skip
        raise _Miss("the hidden states are not repeated top_k times per token (repeat_interleave)")
    hidden = repeated.args[0].args[0]
    squeezed = _only_user(gemm, "the gate/up bmm")
    if not _is(squeezed, aten.squeeze.dim):
        raise _Miss("the gate/up bmm's output is not squeezed to [pairs, 2I]")
    act = _activation(squeezed, val_shape(squeezed)[1] // 2)
    column = _only_user(act, "SiLU(gate) * up")
    down_gemm = _only_user(column, "SiLU(gate) * up as columns")
    if not (_is(down_gemm, aten.bmm.default) and down_gemm.args[1] is column):
        raise _Miss(f"SiLU(gate) * up does not feed a batched down GEMM ({down_gemm.name})")
    down = _expert_weight(down_gemm.args[0], "down")
    if down_gemm.args[0].args[1][0] is not clamped:
        raise _Miss("the down weights are gathered by other ids than the gate/up weights")
    out = _only_user(down_gemm, "the down bmm")
    weighted = _only_user(out, "the down outputs")
    if not (_is(out, aten.squeeze.dim) and _is(weighted, aten.mul.Tensor)):
        raise _Miss("the down outputs are not scaled by the routing weights")
    scale = weighted.args[1] if weighted.args[0] is out else weighted.args[0]
    weights = _routing_weights(scale, None)
    return {"variant": "batched_mm", "hidden": hidden, "ids": ids, "weights": weights, "gate_up": gate_up,
            "down": down, "top_k": None, "combined": weighted}  # fmt: skip


def _site_args(gemm: torch.fx.Node) -> tuple[dict, torch.fx.Node]:
    found = _grouped(gemm) if _is(gemm, *_grouped_gemms()) else _batched(gemm)
    ids, weights, hidden = found["ids"], found["weights"], found["hidden"]
    ids_shape, weights_shape, hidden_shape = val_shape(ids), val_shape(weights), val_shape(hidden)
    if ids_shape is None or len(ids_shape) != 2:
        raise _Miss(f"the expert ids are {ids_shape}, not [tokens, top_k]")
    if weights_shape != ids_shape:
        raise _Miss(f"the routing weights are {weights_shape} and the ids {ids_shape}")
    if hidden_shape is None or len(hidden_shape) != 2 or hidden_shape[0] != ids_shape[0]:
        raise _Miss(f"the hidden states are {hidden_shape}, not [{ids_shape[0]} tokens, H]")
    if found["top_k"] is not None and found["top_k"] != ids_shape[1]:
        raise _Miss(f"pairs map to tokens by // {found['top_k']}, but the router picks {ids_shape[1]} experts")
    out = _tail(found["combined"], ids_shape[0], ids_shape[1], hidden.meta["val"].dtype)
    return found, out


def fuse_moe_experts(graph: torch.fx.Graph) -> list[Site]:
    """Replace every experts site; one Site per candidate, matched or missed."""
    from ..ops import moe_experts as _registers_the_op  # noqa: F401

    op = torch.ops.fusion_compiler.moe_experts.default
    sites = []
    for gemm in site_gemms(graph):
        site = Site(FAMILY, "missed", None, module_path(gemm), gemm.name)
        sites.append(site)
        try:
            found, out = _site_args(gemm)
        except _Miss as miss:
            stopped = miss.node if isinstance(miss.node, torch.fx.Node) else gemm
            site.reason, site.stopped_at, site.chain = str(miss), stopped.name, chain(gemm, stopped)
            continue
        args = (found["hidden"], found["ids"], found["weights"], found["gate_up"], found["down"])
        try:  # the op's argument checks, before the graph changes: a miss, not a crash
            out_val = op(*(a.meta["val"] for a in args))
        except ValueError as err:
            site.reason, site.stopped_at, site.chain = f"the fused op does not take this site: {err}", gemm.name, chain(gemm, gemm)
            continue
        with graph.inserting_before(out):
            fused = graph.call_function(op, args)
        fused.meta.update(out.meta)
        fused.meta["val"] = out_val
        out.replace_all_uses_with(fused)
        _erase_dead(graph, out)
        site.status, site.variant = "matched", found["variant"]
    return sites


def _erase_dead(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and whatever it alone kept alive (the replaced chain)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.op != "call_function" or n.users or n.is_impure() or getattr(n, "_erased", False):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)


def run(graph: torch.fx.Graph, config) -> list[Site]:
    """The pipeline's stage (stages.STAGES)."""
    return fuse_moe_experts(graph)
