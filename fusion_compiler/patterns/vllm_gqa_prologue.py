"""vLLM's GQA attention prologue, anchored on its K/V cache write -> ``gqa_prologue_vllm``
(issue 30, item 3).

vLLM 0.33's `Attention` writes the cache in ``vllm.unified_kv_cache_update(key, value,
layer_name)`` and then calls ``unified_attention_with_output(query, key, value, output,
layer_name, kv_cache_dummy_dep=<its result>)``. The update is a splitting op unless
``use_inductor_graph_partition`` (integrations/vllm.py sets it); then the post-grad graph holds,
per MiniMax-M2 layer (vllm 0.33.0, torch 2.14.0, CPU, ``custom_ops=["none"]``):

    q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
    q, k = MiniMaxText01RMSNormTP.forward_qk(...)     # per q / k, over its whole width:
        h = x.float(); (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    cos, sin = cos_sin_cache[positions].chunk(2, -1)  # RotaryEmbedding.forward_static
    q, k = rope_neox_partial(q.view(T, -1, D), ...), rope_neox_partial(k.view(T, -1, D), ...)
    dummy = unified_kv_cache_update(k, v.view(-1, kv_heads, D), layer_name)

The search ends at the update; its outputs are the dummy and the roped q and k (attention's
query and key). The replacement is one ``gqa_prologue_vllm`` call (q, the cache write and the
dummy). Attention's ``key`` operand becomes the projection's k as a view, with no kernel: for a
decoder whose cache is written here, vLLM's FlashAttention, Triton and FlashInfer backends read
K from the cache, and read ``key`` only for encoder attention (which has no cache write) or
decode context parallelism (the op's checks decline it). Computing the roped k for it would cost
the launch the fusion saves.

Rounding: vLLM's norm rounds once (fp32 math, weight included); its RoPE is written in bf16 ops,
which Inductor computes in fp32 and rounds once: the op's default rounding for both.

Why a site is declined, in the model's terms: the guard checks the graph (partial NeoX RoPE,
full-width norms, dtypes), then the layer in the vLLM config being compiled (backend, kv-cache
dtype, the update kept in ``splitting_ops``, decode context parallelism:
``gqa_prologue_vllm.compile_time_reason``).

Nothing here imports vLLM at import time: the family is traced only by the vLLM integration,
which has loaded vLLM (and registered ``gqa_prologue_vllm``) by then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from . import gqa_prologue, vllm_rope
from .registry import Family, Reason, Variant

aten = torch.ops.aten
KV_UPDATE = "vllm.unified_kv_cache_update.default"
_EPS = 1.2345e-6
_NO_END = 2**63 - 1


def norm_forward_qk(x, weight, eps):
    """``MiniMaxText01RMSNormTP.forward_qk`` for one of q / k (one rank): over the whole width,
    fp32, the weight applied in fp32, rounded once."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(dim=-1, keepdim=True)
    return (h * torch.rsqrt(variance + eps) * weight).to(x.dtype)


def minimax(q, k, v, q_weight, k_weight, cos_sin_cache, positions, layer_name, eps):
    """MiniMax-M2's attention from the qkv split to the cache write: v is [T, kv_heads, D]."""
    head_dim = v.shape[-1]
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q = vllm_rope.rope_neox_partial(norm_forward_qk(q, q_weight, eps).reshape(q.shape[0], -1, head_dim), cos, sin)
    k = vllm_rope.rope_neox_partial(norm_forward_qk(k, k_weight, eps).reshape(k.shape[0], -1, head_dim), cos, sin)
    dummy = torch.ops.vllm.unified_kv_cache_update.default(k, v, layer_name)
    return dummy, q, k  # the update first: the matcher starts at the first output


VARIANTS = (Variant("vllm.minimax", minimax, {"norm": "minimax", "cache": "vllm"}),)

DTYPE_COMBOS = ((torch.bfloat16,),)
_T, _HQ, _HKV, _D, _ROT, _POSITIONS = 2, 4, 2, 16, 8, 8


def _layer_name():
    """An example layer name as vLLM hands it to its ops (a `LayerName` on torch >= 2.11)."""
    from vllm.utils.torch_utils import _encode_layer_name  # the integration has loaded vLLM

    return _encode_layer_name("model.layers.0.self_attn.attn")


def example_inputs(variant: Variant, combo) -> list:
    """Fake tensors, as vLLM traces its own patterns (``enable_fake_mode``): the trace calls
    ``unified_kv_cache_update``, whose real implementation needs a forward context."""
    (act,) = combo
    with FakeTensorMode():

        def r(*shape):
            return torch.empty(*shape, dtype=act)

        return [r(_T, _HQ * _D), r(_T, _HKV * _D), r(_T, _HKV, _D), r(_HQ * _D), r(_HKV * _D), r(_POSITIONS, _ROT),
                torch.empty(_T, dtype=torch.long), _layer_name(), _EPS]  # fmt: skip


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    q, k, v, cache = values["q"], values["k"], values["v"], values["cos_sin_cache"]
    if v.dim() != 3:
        return f"v {tuple(v.shape)} is not [tokens, kv_heads, head_size]"
    head_dim, rot = v.shape[-1], cache.shape[-1]
    if q.dim() != 2 or k.dim() != 2 or q.shape[-1] % head_dim or k.shape[-1] != v.shape[1] * head_dim:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)} are not whole heads of {head_dim} (v {tuple(v.shape)})"
    if values["norm_widths"] != {q.shape[-1], k.shape[-1]}:
        return f"norm widths {sorted(values['norm_widths'])} are not q's and k's whole widths (full-width norm)"
    for name in ("q_weight", "k_weight"):
        weight, x = values[name], values[name[0]]
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            return f"{name} {tuple(weight.shape)} does not cover {name[0]}'s {x.shape[-1]} columns"
    reason = _rope_reason(values["slices"], rot, head_dim)
    if reason:
        return reason
    if cache.dtype != q.dtype:
        return f"cos_sin_cache is {cache.dtype}, q is {q.dtype}: vLLM matches the table to the query's dtype"
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"activations are {q.dtype}: the op computes bf16 / fp16 / fp32 models"
    if not isinstance(values.get("eps"), float):
        return f"eps is {values.get('eps')!r}, not a constant"
    from ..ops import gqa_prologue_vllm  # imports vLLM: only the vLLM integration traces this family

    return gqa_prologue_vllm.compile_time_reason(values["layer_name"])


def _rope_reason(slices: set, rot: int, head_dim: int) -> Reason:
    """vLLM's partial NeoX RoPE: x[..., :rot] rotated (its halves a chunk), x[..., rot:] passed."""
    if any(step != 1 for *_, step in slices):
        return "RoPE slices with steps: GPT-J pairs (is_neox_style=False) where NeoX halves are expected"
    if rot >= head_dim:
        return f"RoPE covers all {head_dim} dims (no pass-through): this variant fuses partial rotary"
    if {(start, end) for start, end, _ in slices} != {(0, rot), (rot, _NO_END)}:
        return (f"RoPE slices {sorted(s[:2] for s in slices)} are not the first {rot} dims (the cos_sin_cache "
                f"width) of {head_dim} and the rest passed through")  # fmt: skip
    return None


def replacement(variant: Variant, lowering: str):
    if lowering not in ("triton", "inductor"):
        raise ValueError(f"no replacement for lowering {lowering!r}")

    def replace(q, k, v, q_weight, k_weight, cos_sin_cache, positions, layer_name, eps):
        q_out, dummy = torch.ops.fusion_compiler.gqa_prologue_vllm.default(
            q, k, v, q_weight, k_weight, eps, 0.0, True, cos_sin_cache, positions, False, False, layer_name
        )
        # Attention's key operand: read by no decoder path whose cache the op writes (module docstring).
        return dummy, q_out, k.view(k.shape[0], -1, v.shape[-1])

    return replace


def is_site(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) == KV_UPDATE


def _upstream(node: torch.fx.Node, depth: int) -> list[torch.fx.Node]:
    seen, frontier = [node], [node]
    for _ in range(depth):
        frontier = [m for n in frontier for m in n.all_input_nodes if m not in seen]
        seen += frontier
    return seen


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """Why the K written is not this family's, in words: computed by a kernel the graph cannot
    see into (Qwen3.5 on CUDA: vLLM's ``fused_qk_rmsnorm_rope_gate``), not RoPE'd in vLLM's
    spelling, or normed by vLLM's per-head RMSNorm IR op (Qwen3.5's Gemma norm elsewhere)."""
    key = anchor.args[0]
    if not isinstance(key, torch.fx.Node):
        return None
    for node in _upstream(key, 4):
        if "triton_kernel_wrapper" in str(node.target):
            return node, ("the K written to the cache comes out of a Triton kernel the graph cannot see into "
                          "(vLLM's fused_qk_rmsnorm_rope_gate for Qwen3.5 / Qwen3-Next on CUDA): nothing to fuse")  # fmt: skip
    if key.target is not aten.cat.default:
        return key, ("the K written to the cache is not RoPE'd in vLLM's spelling (no cat of the rotated first "
                     "dims and the pass-through)")  # fmt: skip
    for node in _upstream(key, 8):
        if str(node.target) == "vllm_ir.rms_norm.default":
            return node, ("q/k are normed per head by vLLM's RMSNorm IR op (Qwen3.5's Gemma norm); the vLLM K/V "
                          "prologue variant is MiniMax's full-width forward_qk")  # fmt: skip
    return None


# The core family's name: it runs first in the gqa_prologue stage (integrations/vllm.py).
FAMILY = Family(
    name="gqa_prologue", variants=VARIANTS, dtype_combos=DTYPE_COMBOS, example_inputs=example_inputs,
    scalars={"eps": _EPS}, guard=guard, replacement=replacement, facts_of=gqa_prologue.facts_of, is_site=is_site,
    explain=explain,
    source_modules=(__name__, "fusion_compiler.ops.gqa_prologue_vllm"), distinct_inputs=(("q", "k"),),
)  # fmt: skip

__all__ = ["FAMILY", "VARIANTS", "minimax", "norm_forward_qk"]
