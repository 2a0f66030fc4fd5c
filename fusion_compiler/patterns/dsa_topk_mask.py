"""DeepSeek V3.2's DSA indexer tail, scores to sparse attention mask, as one op
(``ops/dsa_topk_mask.py``).

HF's ``DeepseekV32Indexer`` scores every cached key (an fp32 GEMM of the queries against the
whole indexer cache, relu, a second GEMM for the per-head weights), masks, takes the top-k, and
the attention scatters those indices into a boolean mask. On the H200 that is ~10 kernels of a
DeepSeek decode layer (two of them a sort of the 4096 scores, 50 us at batch 1). The op computes
the same mask with a score kernel and a radix select.

Keyed on the graph, not on module names: a site is a ``topk`` whose indices (through dtype
casts) are scattered as ``False`` into an all-``True`` mask of the scores' shape, HF's top-k
mask; where later layers reuse that top-k (GLM-MoE-DSA's "shared" layers) and scatter it the
same way, the site is the one top-k and its mask replaces every scatter. (DeepSeek's group
routing scatters its top groups as 1 into zeros, and our FP8 reference indexer, token-major,
its top-k as True into zeros: neither is a site.)
It fuses when the scores are, as post-grad graphs spell HF's code,

    where(~mask, -inf, s) | s + mask | s,   s = (w' @ relu((q' @ k'^T) * scale)) squeezed
    w' = unsqueeze(weights [.float()] [* weight_scale], -2)     broadcast to [B*S, 1, H]
    q' = q [B, S, H, D] [.float()]                                 broadcast to [B*S, H, D]
    k'^T = permute(k [B, T, D], [0, 2, 1]) [.float()], unsqueezed  broadcast to [B*S, D, T]

(every broadcast / reshape in between keeps the last two dims: it only merges or splits the
leading ones), scale > 0, top-k over the last dim, largest first, the values unread. Anything
else is a miss with its reason. The scatter becomes ``~keep``; where HF then ANDs the 4-D mask
whose [:, 0] the indexer scored with ``~index_mask``, that AND is ``keep`` itself (``keep`` is
already inside that mask) and becomes ``keep.unsqueeze(1)``.
"""

from __future__ import annotations

import operator

import torch

from ..fx.explain import chain
from ..fx.graph_walk import CASTS, RESHAPES, is_full, target, val_shape
from ..fx.module_paths import module_path
from .site import Site

aten = torch.ops.aten
FAMILY = "dsa_topk_mask"

_BROADCASTS = (*RESHAPES, aten.expand.default, aten.clone.default)


class _Miss(Exception):
    """Why a top-k mask site does not fuse; the node where matching stopped."""

    def __init__(self, node: torch.fx.Node, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


def _require(ok: bool, node: torch.fx.Node, reason: str) -> None:
    if not ok:
        raise _Miss(node, reason)


def _before_upcasts(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor under ``.float()`` casts (HF's scores are fp32 products of bf16 values, what the
    op computes); a cast down stays, so the op reads the rounded tensor as the model did (a
    float64 model's ``.float()``: the op reads its fp32 result)."""
    while target(node) in CASTS and node.meta["val"].dtype == torch.float32 and _narrow_float(node.args[0]):
        node = node.args[0]
    return node


def _narrow_float(node) -> bool:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype in (torch.bfloat16, torch.float16, torch.float32)


def _leading_broadcasts(node: torch.fx.Node, rank: int | None = None) -> torch.fx.Node:
    """The tensor a matmul operand is broadcast from, through reshapes / expands that keep its
    last two dims (matmul's batch broadcasting only merges and expands the leading ones). With
    ``rank``: not past a tensor of that rank into one of fewer dims (in an fp32 model no
    ``.float()`` stops the walk, and HF's [B, S, H, D] queries are a view of the fused q op's
    [B*S, H, D] output)."""
    last_two = val_shape(node)[-2:]
    while target(node) in _BROADCASTS:
        source = node.args[0]
        if rank is not None and len(val_shape(node)) == rank and len(val_shape(source) or ()) < rank:
            break
        _require(val_shape(source) is not None and val_shape(source)[-2:] == last_two, node,
                 f"{node.name} reshapes the matrix dims {last_two} of a score operand")  # fmt: skip
        node = source
    return node


def _bmm_operands(node: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(a, b) of ``bmm(a, b)``, also as Inductor's joint-graph pass leaves a batch of one on the
    GPU (``bmm_to_mm``): ``mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0)``."""
    if target(node) is aten.bmm.default:
        return node.args[0], node.args[1]
    if target(node) is aten.unsqueeze.default and node.args[1] == 0 and target(node.args[0]) is aten.mm.default:
        operands = node.args[0].args[:2]
        if all(target(o) in (aten.squeeze.dim, aten.squeeze.dims) and o.args[1] in (0, [0]) for o in operands):
            return operands[0].args[0], operands[1].args[0]
    return None


def _scalar_mul(node) -> tuple[torch.fx.Node, float] | None:
    if target(node) in (aten.mul.Tensor, aten.mul.Scalar) and isinstance(node.args[1], (int, float)):
        return node.args[0], float(node.args[1])
    return None


def _scatters_of(topk: torch.fx.Node) -> list[torch.fx.Node]:
    """The scatters of ``topk``'s indices as False into all-True masks of the scores' shape
    (HF's sparse mask: True = masked out), when that is all they are for; else []. Several where
    layers share one indexer's top-k (GLM-MoE-DSA's "shared" layers scatter the previous full
    layer's indices into their own mask): each is the same mask."""
    indices = [u for u in topk.users if target(u) is operator.getitem and u.args[1] == 1]
    if len(indices) != 1:
        return []
    scatters, todo = [], list(indices[0].users)
    while todo:
        node = todo.pop()
        if target(node) is aten.scatter.value:
            base, dim, _, value = node.args
            mask_like = is_full(base, True) and val_shape(base) == val_shape(topk.args[0])
            if not (mask_like and dim in (-1, len(val_shape(base)) - 1) and value is False):
                return []
            scatters.append(node)
        elif target(node) in CASTS:
            todo.extend(node.users)
        else:
            return []
    return scatters


def _masked_scores(x: torch.fx.Node):
    """(scores, mask or None) of the top-k's input."""
    if target(x) is aten.where.self and target(x.args[0]) is aten.bitwise_not.default and is_full(x.args[1], float("-inf")):
        return x.args[2], x.args[0].args[0]
    if target(x) is aten.add.Tensor and isinstance(x.args[1], torch.fx.Node):
        return x.args[0], x.args[1]
    return x, None


def _weights(a: torch.fx.Node) -> tuple[torch.fx.Node, float]:
    """(weights [B, S, H], weight_scale) of the head-reduction GEMM's left operand."""
    node = _leading_broadcasts(a)
    _require(target(node) is aten.unsqueeze.default and node.args[1] in (-2, len(val_shape(node)) - 2), node,
             f"{node.name}: the per-head weights are not unsqueezed into a row vector")  # fmt: skip
    node, scale = node.args[0], 1.0
    scaled = _scalar_mul(node)
    if scaled is not None:
        node, scale = scaled
    return _before_upcasts(node), scale


def _queries(qv: torch.fx.Node) -> torch.fx.Node:
    return _before_upcasts(_leading_broadcasts(qv, rank=4))


def _keys(kv: torch.fx.Node) -> tuple[torch.fx.Node, torch.dtype | None]:
    """(k [B, T, D], the dtype the model casts it down to before its product, or None) from the
    transposed, upcast, unsqueezed and broadcast operand. A float64 model's ``.float()`` after
    the transpose: the op reads the keys cast first (the same fp32 values)."""
    node = _leading_broadcasts(kv)
    if target(node) is aten.unsqueeze.default:
        node = node.args[0]
    node = _before_upcasts(node)
    cast = None
    if target(node) in CASTS and target(node.args[0]) is aten.permute.default:
        cast, node = node.meta["val"].dtype, node.args[0]
    _require(target(node) is aten.permute.default and list(node.args[1]) == [0, 2, 1], node,
             f"{node.name}: the keys are not a [B, T, D] cache transposed to [B, D, T]")  # fmt: skip
    return _before_upcasts(node.args[0]), cast


def _match(topk: torch.fx.Node) -> dict:
    """The op's arguments for a top-k mask site; raises _Miss."""
    x, k = topk.args[0], topk.args[1]
    dim = topk.args[2] if len(topk.args) > 2 else -1
    largest = topk.args[3] if len(topk.args) > 3 else True
    x_shape = val_shape(x)
    _require(x_shape is not None and len(x_shape) == 3, topk, f"top-k over a {x_shape} tensor, not [B, S, T] scores")
    _require(dim in (-1, 2) and largest, topk, "not the largest-k over the last dim")
    _require(all(u.args[1] == 1 for u in topk.users), topk, "the top-k values are read, not only the indices")
    scores, mask = _masked_scores(x)
    if mask is not None:
        _require(val_shape(mask) == x_shape, mask, f"the mask {val_shape(mask)} is not one row per score row {x_shape}")
    node = scores
    if target(node) is aten.squeeze.dim:
        _require(node.args[1] in (-2, 2), node, f"{node.name} squeezes dim {node.args[1]}, not the reduced heads")
        node = node.args[0]
    reduced = _leading_broadcasts(node)
    head_sum = _bmm_operands(reduced)
    _require(head_sum is not None, reduced, f"{reduced.name}: the scores are not a GEMM over the heads")
    weights, weight_scale = _weights(head_sum[0])
    relu = _leading_broadcasts(head_sum[1])
    _require(target(relu) is aten.relu.default, relu, f"{relu.name}: the per-head scores are not relu'd")
    scaled = _scalar_mul(relu.args[0])
    _require(scaled is not None and scaled[1] > 0, relu.args[0], "the per-head scores are not scaled by a positive constant before relu")
    dots, scale = scaled
    dots = _leading_broadcasts(dots)
    products = _bmm_operands(dots)
    _require(products is not None, dots, f"{dots.name}: the per-head scores are not q @ k^T")
    q, (keys, keys_cast) = _queries(products[0]), _keys(products[1])
    q_shape, k_shape, w_shape = val_shape(q), val_shape(keys), val_shape(weights)
    _require(q_shape is not None and len(q_shape) == 4 and tuple(q_shape[:2]) == tuple(x_shape[:2]), q,
             f"the queries {q_shape} are not [B, S, H, D] of the scores {x_shape}")  # fmt: skip
    _require(k_shape is not None and len(k_shape) == 3 and k_shape[0] == x_shape[0] and k_shape[1] == x_shape[2]
             and k_shape[2] == q_shape[3], keys, f"the keys {k_shape} are not [B, T, D] for queries {q_shape}")  # fmt: skip
    _require(w_shape == tuple(q_shape[:3]), weights, f"the weights {w_shape} are not [B, S, H] of the queries {q_shape}")
    return {"q": q, "k": keys, "k_cast": keys_cast, "weights": weights, "mask": mask, "scale": scale,
            "weight_scale": weight_scale, "topk": k}  # fmt: skip


def _fold_and(scatter: torch.fx.Node, keep: torch.fx.Node, mask: torch.fx.Node | None, graph: torch.fx.Graph) -> None:
    """HF's ``attention_mask & ~index_mask.unsqueeze(1)`` is ``keep.unsqueeze(1)`` when the
    indexer scored ``attention_mask[:, 0]`` of a one-head mask."""
    if mask is None or target(mask) is not aten.select.int or tuple(mask.args[1:]) != (1, 0):
        return
    four_d = mask.args[0]
    if val_shape(four_d) is None or val_shape(four_d)[1] != 1:
        return
    for unsqueezed in [u for u in scatter.users if target(u) is aten.unsqueeze.default and u.args[1] == 1]:
        for negated in [u for u in unsqueezed.users if target(u) is aten.bitwise_not.default]:
            for both in [u for u in negated.users if target(u) is aten.bitwise_and.Tensor and four_d in u.args]:
                if val_shape(both) != val_shape(unsqueezed):
                    continue
                with graph.inserting_before(both):
                    replacement = graph.call_function(aten.unsqueeze.default, (keep, 1))
                    replacement.meta["val"] = keep.meta["val"].unsqueeze(1)
                both.replace_all_uses_with(replacement)
                graph.erase_node(both)


def fuse_dsa_topk_masks(graph: torch.fx.Graph) -> list[Site]:
    """Replace every top-k mask site; one Site per candidate, matched or missed."""
    from ..ops import dsa_topk_mask as _registers_the_op  # noqa: F401

    op = torch.ops.fusion_compiler.dsa_topk_mask.default
    sites = []
    for topk in [n for n in graph.nodes if target(n) is aten.topk.default]:
        scatters = _scatters_of(topk)
        if not scatters:
            continue  # indices used as indices (MoE routing, a sparse-attention gather), other masks
        site = Site(FAMILY, "missed", None, module_path(topk), topk.name)
        try:
            found = _match(topk)
        except _Miss as miss:
            site.reason, site.stopped_at, site.chain = miss.reason, miss.node.name, chain(topk, miss.node)
            sites.append(site)
            continue
        args = tuple(found[name] for name in ("q", "k", "weights", "mask", "scale", "weight_scale", "topk"))
        vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        if found["k_cast"] is not None:
            vals[1] = vals[1].to(found["k_cast"])
        try:  # the op's argument checks (its fake function), before the graph changes
            keep_val = op(*vals)
        except ValueError as err:
            site.reason, site.stopped_at, site.chain = f"the fused op does not take this site: {err}", topk.name, chain(topk, topk)
            sites.append(site)
            continue
        with graph.inserting_before(topk):  # its inputs are the op's
            if found["k_cast"] is not None:
                cast = graph.call_function(torch.ops.prims.convert_element_type.default, (args[1], found["k_cast"]))
                cast.meta["val"] = vals[1]
                args = (args[0], cast, *args[2:])
            keep = graph.call_function(op, args)
            keep.meta["val"] = keep_val
            not_kept = graph.call_function(aten.bitwise_not.default, (keep,))
            not_kept.meta["val"] = ~keep.meta["val"]
        for scatter in scatters:
            scatter.replace_all_uses_with(not_kept)
            graph.erase_node(scatter)
        _fold_and(not_kept, keep, found["mask"], graph)
        site.status, site.variant = "matched", _variant(found["mask"])
        sites.append(site)
    return sites


def _variant(mask: torch.fx.Node | None) -> str:
    if mask is None:
        return "no_mask"
    return "bool_mask" if mask.meta["val"].dtype == torch.bool else "additive_mask"


def run(graph: torch.fx.Graph, config) -> list[Site]:
    """The pipeline's stage (stages.STAGES)."""
    return fuse_dsa_topk_masks(graph)
