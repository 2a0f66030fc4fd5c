"""vLLM's spelling of the gdn family: its opaque GDN core and the gated RMSNorm after it, as one
``fusion_compiler::gdn_decode_vllm`` (ops/gdn_decode_vllm.py).

vLLM 0.33's Qwen3.5 / Qwen3-Next layer (``QwenGatedDeltaNetAttention.forward_cuda``) reaches
our pass, with ``use_inductor_graph_partition=True``, as (seen on vllm 0.33.0, torch 2.14, CPU):

    core  = aten.full([T, Hv, Dv], 0)
    res   = auto_functionalized(vllm.qwen_gdn_attention_core.default, qkv_or_qkvz=mixed_qkv,
                                b_or_ba=clone(b), a_or_z_out=clone(a), core_attn_out=core,
                                layer_name=<LayerName graph input>, use_aiter=False)
    o     = res[2]                                     # core_attn_out, written
    x     = o.float();  normed = x * rsqrt(mean(x ** 2, -1, keepdim) + eps)
    out   = (normed * w.float() * silu(z.float())).to(o.dtype)     # RMSNormGated, native

The rewrite is by hand, keyed on that op and that math (the op's operands are an opaque layer
name and buffers it mutates, which a traced pattern does not spell): ``out``'s users read our
op's output instead, and the core, its zeros and the ``.contiguous()`` copies of b and a go dead
(the op reads b and a through their row strides).

With the default ``use_inductor_graph_partition=False`` vLLM splits the FX graph at the op
before Inductor: the pass sees the norm in the next piece, reading a graph input. That site is
reported as a miss with the reason; nothing is rewritten.

Nothing here imports vLLM; ``integrations/vllm.py`` runs `run` before the core gdn family, only
once vLLM has registered its op.
"""

from __future__ import annotations

import operator

import torch

from .. import _compat
from ..fx.graph_walk import is_silu, target
from ..fx.module_paths import module_path
from .site import Site

aten = torch.ops.aten
prims = torch.ops.prims

FAMILY = "gdn"
VARIANT = "gdn.vllm"
SPLIT_REASON = (
    "vLLM splits its graph at qwen_gdn_attention_core (use_inductor_graph_partition=False), so this "
    "gated norm is in another piece than the GDN core; set use_inductor_graph_partition=True to fuse them"
)


def _core():
    return torch.ops.vllm.qwen_gdn_attention_core.default


def is_site(node: torch.fx.Node) -> bool:
    """vLLM's GDN core call (functionalised)."""
    return (
        target(node) in (_compat.auto_functionalized, _compat.auto_functionalized_v2)
        and hasattr(torch.ops, "vllm") and hasattr(torch.ops.vllm, "qwen_gdn_attention_core")
        and node.args[0] is _core()
    )  # fmt: skip


def _only_user(node: torch.fx.Node, want) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and target(users[0]) is want else None


def _is_f32_cast(node) -> bool:
    return target(node) is prims.convert_element_type.default and node.args[1] is torch.float32


def gated_norm(o: torch.fx.Node):
    """RMSNormGated.forward_native on ``o``: (out, z, weight, eps), or (None, reason)."""
    x = _only_user(o, prims.convert_element_type.default)
    if x is None or not _is_f32_cast(x):
        return None, f"{o.name} is not read by one float() alone"
    users = {target(u): u for u in x.users}
    pow_, normed = users.get(aten.pow.Tensor_Scalar), users.get(aten.mul.Tensor)
    if len(x.users) != 2 or pow_ is None or normed is None or pow_.args[1] != 2:
        return None, f"{x.name} is not squared and normalised (an RMSNorm)"
    mean = _only_user(pow_, aten.mean.dim)
    add = mean and _only_user(mean, aten.add.Tensor)
    rsqrt = add and _only_user(add, aten.rsqrt.default)
    last_dim = ([-1], [_val(x).dim() - 1]) if _val(x) is not None else ([-1],)
    if rsqrt is None or list(mean.args[1]) not in last_dim or rsqrt not in normed.args or not isinstance(add.args[1], float):
        return None, f"{pow_.name}: not rsqrt(mean(x ** 2, -1) + eps) times x"
    weighted = _only_user(normed, aten.mul.Tensor)
    gated = weighted and _only_user(weighted, aten.mul.Tensor)
    if gated is None:
        return None, f"{normed.name}: not times a weight, then a gate"
    weight = next(a for a in weighted.args if a is not normed)
    weight = weight.args[0] if _is_f32_cast(weight) else weight
    gate = next(a for a in gated.args if a is not weighted)
    if not is_silu(gate) or not _is_f32_cast(gate.args[0]):
        return None, f"{gate.name}: the gate is not silu(z.float())"
    out = _only_user(gated, prims.convert_element_type.default)
    if out is None:
        return None, f"{gated.name}: not cast back once"
    z = gate.args[0].args[0]
    return (out, z, weight, add.args[1]), None


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _reason(anchor: torch.fx.Node):
    """(the norm's nodes, None) where the site is ours to fuse, else (None, (stopped at, why))."""
    if target(anchor) is not _compat.auto_functionalized:
        return None, (anchor, "auto_functionalized_v2 form of the GDN core (vLLM's backend emits v1)")
    kw = anchor.kwargs
    if kw.get("use_aiter"):
        return None, (anchor, "the AITER path (qkvz and ba packed): ROCm only")
    outs = {u.args[1]: u for u in anchor.users if target(u) is operator.getitem}
    if set(outs) != {2} or len(anchor.users) != 1:
        return None, (anchor, "the GDN core's a_or_z_out output is read, or core_attn_out is not")
    core = kw["core_attn_out"]
    if len(core.users) != 1:
        return None, (core, f"core_attn_out {core.name} has other readers")
    norm, why = gated_norm(outs[2])
    if norm is None:
        return None, (outs[2], f"no gated RMSNorm after the GDN core: {why}")
    out, z = norm[0], norm[1]
    z_val, out_val = _val(z), _val(out)
    if z_val is None or out_val is None or z_val.shape != out_val.shape or z_val.dtype != out_val.dtype:
        return None, (out, "the gate z is not the output's shape and dtype")
    if z_val.stride(-1) != 1:
        return None, (z, "the gate z is strided along its last dim")
    return norm, None


def _unclone(node: torch.fx.Node) -> torch.fx.Node:
    """b / a before vLLM's ``.contiguous()`` where the copy has no other reader (the kernel takes
    row strides; the copy then goes dead)."""
    if target(node) is aten.clone.default and len(node.users) == 1:
        return node.args[0]
    return node


def _rewrite(graph: torch.fx.Graph, anchor: torch.fx.Node, norm) -> None:
    from ..ops.gdn_decode_vllm import gdn_decode_vllm  # registers the op (imports vLLM)

    out, z, weight, eps = norm
    kw = anchor.kwargs
    z_val = _val(z)
    with graph.inserting_before(out):
        buf = graph.call_function(aten.empty_like.default, (z,), {"memory_format": torch.contiguous_format})
        fused = graph.call_function(_compat.auto_functionalized, (gdn_decode_vllm._opoverload,), {
            "mixed_qkv": kw["qkv_or_qkvz"], "b": _unclone(kw["b_or_ba"]), "a": _unclone(kw["a_or_z_out"]), "z": z,
            "norm_weight": weight, "eps": eps, "out": buf, "layer_name": kw["layer_name"],
        })  # fmt: skip
        result = graph.call_function(operator.getitem, (fused, 1))
    with z_val.fake_mode:
        buf.meta["val"] = torch.empty_like(z_val, memory_format=torch.contiguous_format)
    fused.meta["val"], result.meta["val"] = (None, buf.meta["val"]), buf.meta["val"]
    for node in (buf, fused, result):
        node.meta["nn_module_stack"] = anchor.meta.get("nn_module_stack", {})
    out.replace_all_uses_with(result)
    graph.eliminate_dead_code()  # the norm's nodes
    # The core and its outputs are dead too; erased here whether or not DCE counts the HOP pure.
    if not getattr(anchor, "_erased", False):
        for node in list(anchor.users):
            graph.erase_node(node)
        graph.erase_node(anchor)
        graph.eliminate_dead_code()  # its zeros, the copies of b and a


def _in_layer(module: str | None, layers: tuple[str, ...]) -> bool:
    """Whether ``module`` (as nn_module_stack names it, relative to the compiled module, e.g.
    ``layers.0.linear_attn._forward_method.__self__.norm``) is inside one of ``layers`` (vLLM's
    full prefixes, ``model.layers.0.linear_attn``)."""
    parts = f"{module}.".split(".") if module else []
    for layer in layers:
        names = layer.split(".")
        if any(parts[: len(names) - k] == names[k:] for k in range(len(names))):
            return True
    return False


def run(graph: torch.fx.Graph, model_nodes: set, split_layers: tuple[str, ...] = ()) -> list[Site]:
    """Rewrite every GDN core + gated norm of ``graph``: a site per core. ``split_layers``: the
    GDN layers whose core vLLM split into another graph piece; a gated norm of theirs reading a
    graph input is a miss saying so."""
    sites = []
    for anchor in [n for n in graph.nodes if n in model_nodes and is_site(n)]:
        module = module_path(anchor)
        norm, miss = _reason(anchor)
        if norm is None:
            stopped, why = miss
            sites.append(Site(FAMILY, "missed", None, module, anchor.name, why, stopped.name))
            continue
        _rewrite(graph, anchor, norm)
        sites.append(Site(FAMILY, "matched", VARIANT, module, anchor.name))
    for node in graph.find_nodes(op="placeholder") if split_layers else ():
        norm, _ = gated_norm(node) if node.users else (None, None)
        if norm is not None and _in_layer(module_path(norm[0]), split_layers):
            sites.append(Site(FAMILY, "missed", None, module_path(norm[0]), node.name, SPLIT_REASON, node.name))
    return sites
