"""A single-query attention over a repeated K/V cache, read from the cache itself
(``ops/decode_attention.py``).

HF's SDPA attention with fewer K/V heads than query heads repeats the whole cache first
(``repeat_kv``: ``expand`` + ``clone`` + ``reshape`` to every query head), then runs SDPA with
the causal mask of a static cache. At decode that copy is the layer's largest memory traffic:
on the H200, MiniMax-M2.5's two copies took 32 us of a 130 us layer at batch 1 and 1.9 ms of
3.4 ms at batch 64 (bench/NOTES.md, sections 6 and 17), and SDPA then read G times the cache's
bytes. The op reads each K/V row once for all G query heads of its K/V head; the copies become
dead code. Without a repeat (DeepSeek's expanded MLA cache, G = 1) the op is the same attention.

Keyed on the graph, not on module names: every SDPA op of Inductor's post-grad graphs (the
device's lowering: CPU flash, cuDNN, memory-efficient, flash) whose query length is 1 is a
site; it fuses when dropout is 0, it is not causal, only the attention output is read (no
log-sum-exp), and the mask (after its broadcasts, alignment pad and slice) is one row of S per
batch entry: ``[B or 1, 1, 1, >= S]``, bool or additive. Anything else is a miss with its reason.
Prefill (query length > 1) is not a site.

With a mask, the op is told to read it first (``sparse_mask``) and loads no K / V row it rules
out. HF's static cache masks its unwritten tail at every decode step but the last, and DeepSeek
V3.2's sparse attention keeps ``index_topk`` of S positions; on the H100 (kernel alone) the skip
took DSA's top-k 1.45-1.47x faster, a half-masked tail 1.15-1.99x, and cost at most 6% where
nothing was masked (bench/NOTES.md, section 6). Where the mask is a top-k mask (dsa_topk_mask's
op, through views) the site's variant says ``sparse``.
"""

from __future__ import annotations

import operator

import torch

from ..fx.graph_walk import RESHAPES, is_full, val_shape
from ..fx.module_paths import module_path
from .site import Site

aten = torch.ops.aten
FAMILY = "decode_attention"


def _sdpa_ops() -> tuple:
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")  # fmt: skip
    return tuple(getattr(aten, n).default for n in names if hasattr(aten, n))


def _arg(node: torch.fx.Node, name: str, default=None):
    """An argument by its schema name, passed positionally or by keyword."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[index] if index < len(node.args) else default
    return default


def _unrepeated(kv: torch.fx.Node, heads: int) -> tuple[torch.fx.Node, int] | None:
    """(the cache before ``repeat_kv``, its head count) for a ``reshape(clone(expand(
    unsqueeze(cache, 2))))``; the node itself when it has every head (no repeat)."""
    node = kv
    while node.op == "call_function" and node.target in RESHAPES:
        node = node.args[0]
    if node.op == "call_function" and node.target is aten.clone.default:
        node = node.args[0]
    if node.op == "call_function" and node.target is aten.expand.default:
        unsqueezed = node.args[0]
        if unsqueezed.op == "call_function" and unsqueezed.target is aten.unsqueeze.default and unsqueezed.args[1] == 2:
            cache = unsqueezed.args[0]
            shape, repeated = val_shape(cache), val_shape(node)
            if shape and repeated and len(shape) == 4 and len(repeated) == 5 and repeated[1] * repeated[2] == heads:
                return cache, shape[1]
    shape = val_shape(kv)
    return (kv, heads) if shape and len(shape) == 4 and shape[1] == heads else None


def _mask_row(mask: torch.fx.Node, batch: int, keys: int) -> tuple[torch.fx.Node, int] | str:
    """(the mask's one-row-per-batch source, its last-dim length) through the broadcasts, the
    alignment pad and slice SDPA's lowering adds; else why not."""
    node = mask
    while True:
        shape = val_shape(node)
        if shape is None or len(shape) != 4:
            return f"the mask is {shape}, not 4-D"
        if shape[1] == 1 and shape[2] == 1 and shape[0] in (1, batch) and shape[3] >= keys:
            return node, shape[3]
        if node.op != "call_function":
            break
        if node.target in (aten.expand.default, aten.clone.default):
            node = node.args[0]
        elif node.target is aten.slice.Tensor and node.args[1] in (3, -1) and (node.args[2] if len(node.args) > 2 else 0) == 0:
            node = node.args[0]
        elif node.target is aten.constant_pad_nd.default and list(node.args[1])[:1] == [0] and len(node.args[1]) == 2:
            node = node.args[0]
        else:
            break
    return f"the mask {val_shape(mask)} is per head or per query ({node.name} {val_shape(node)}), not one row of keys per sequence"


_MASK_VIEWS = (*RESHAPES, aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten.slice.Tensor,
               aten.constant_pad_nd.default)


def _is_top_k_mask(mask: torch.fx.Node) -> bool:
    """Whether ``mask`` is dsa_topk_mask's output through views (at most a few) and SDPA's
    bool-to-additive conversion, ``where(keep, 0, -inf)``."""
    node = mask
    for _ in range(6):
        if node.op != "call_function":
            return False
        if node.target is torch.ops.fusion_compiler.dsa_topk_mask.default:
            return True
        additive = node.target is aten.where.self and is_full(node.args[1], 0.0, ()) and is_full(node.args[2], float("-inf"), ())
        if node.target not in _MASK_VIEWS and not additive:
            return False
        node = node.args[0]
    return False


def _decline(node: torch.fx.Node) -> str | None:
    if _arg(node, "dropout_p", 0.0):
        return "dropout is on"
    if _arg(node, "is_causal", False):
        return "is_causal: a single query would see only the first key"
    for user in node.users:
        if user.target is not operator.getitem or user.args[1] != 0:
            return f"{user.name} reads an output other than the attention's (log-sum-exp, ...)"
    return None


def fuse_decode_attention(graph: torch.fx.Graph) -> list[Site]:
    """Replace every single-query SDPA site; one Site per candidate, matched or missed."""
    from ..ops import decode_attention as _registers_the_op  # noqa: F401
    from ..ops import dsa_topk_mask as _registers_the_mask_op  # noqa: F401

    op = torch.ops.fusion_compiler.decode_attention.default
    sites = []
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _sdpa_ops()]:
        q, k, v = node.args[:3]
        q_shape = val_shape(q)
        if q_shape is None or len(q_shape) != 4 or q_shape[2] != 1:
            continue  # prefill (or unknown): not a decode site
        batch, heads = q_shape[0], q_shape[1]
        site = Site(FAMILY, "missed", None, module_path(node), node.name)
        sources = [_unrepeated(k, heads), _unrepeated(v, heads)]
        mask = _arg(node, "attn_mask", _arg(node, "attn_bias"))
        reason = _decline(node)
        if reason is None and None in sources:
            reason = f"K or V is not [B, heads, S, D] nor HF's repeat_kv of a cache ({val_shape(k)}, {val_shape(v)})"
        if reason is None and sources[0][1] != sources[1][1]:
            reason = f"K and V have {sources[0][1]} and {sources[1][1]} heads"
        keys = val_shape(k)[2] if reason is None else 0
        row = _mask_row(mask, batch, keys) if reason is None and mask is not None else None
        if isinstance(row, str):
            reason = row
        elif row is not None and row[1] is not keys and not isinstance(keys, int):
            reason = f"the mask's {row[1]} columns against a symbolic key count {keys}: no slice to build"
        if reason is not None:
            site.reason = reason
            sites.append(site)
            continue
        scale = _arg(node, "scale")
        scale = float(scale) if scale is not None else q_shape[3] ** -0.5
        # The op's argument checks (its fake function) on what it would be given, before the
        # graph changes: a dtype or layout its kernel cannot take is a miss, not a crash.
        mask_val = None
        if row is not None:
            mask_val = row[0].meta["val"]
            mask_val = aten.slice.Tensor(mask_val, 3, 0, keys) if row[1] != keys else mask_val
        try:
            out_val = op(q.meta["val"], sources[0][0].meta["val"], sources[1][0].meta["val"], mask_val, scale)
        except ValueError as err:
            site.reason = f"the fused op does not take this site: {err}"
            sites.append(site)
            continue
        with graph.inserting_before(node):
            mask_arg = None
            if row is not None:
                mask_arg, length = row
                if length != keys:  # SDPA's alignment pad: the op reads the first S columns
                    sliced = graph.call_function(aten.slice.Tensor, (mask_arg, 3, 0, keys))
                    sliced.meta["val"] = mask_val
                    mask_arg = sliced
            sparse = mask_arg is not None and _is_top_k_mask(mask_arg)
            args = (q, sources[0][0], sources[1][0], mask_arg, scale, *((True,) if mask_arg is not None else ()))
            out = graph.call_function(op, args)
            out.meta["val"] = out_val
        for user in list(node.users):
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(node)
        site.status, site.variant = "matched", "repeat_kv" if sources[0][1] != heads else "heads"
        if sparse:
            site.variant += ".sparse"
        sites.append(site)
    return sites


def run(graph: torch.fx.Graph, config) -> list[Site]:
    """The pipeline's stage (stages.STAGES)."""
    return fuse_decode_attention(graph)
