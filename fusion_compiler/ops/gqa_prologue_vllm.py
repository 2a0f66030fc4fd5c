"""The GQA attention prologue inside vLLM: ``gqa_prologue`` whose K/V cache write is vLLM's
``vllm::unified_kv_cache_update`` (issue 30, item 3).

    fusion_compiler::gqa_prologue_vllm(Tensor q, Tensor k, Tensor v, Tensor? q_norm_weight,
        Tensor? k_norm_weight, float eps, float weight_offset, bool full_width_norm,
        Tensor cos_sin_cache, Tensor positions, bool round_normalized, bool round_rope_products,
        LayerName layer_name) -> (Tensor q_out, Tensor kv_cache_dummy_dep)

Semantics: ``gqa_prologue`` (ops/gqa_prologue.py, the numerical truth) with

    cos, sin     the halves of vLLM's ``cos_sin_cache`` [max_positions, rotary_dim], read at
                 ``positions``
    q, k, v      [T, heads * D], [T, kv_heads * D] (full-width norm) or [T, heads, D],
                 [T, kv_heads, D]; v [T, kv_heads, D]
    the caches   what ``unified_kv_cache_update(rope(norm(k)), v, layer_name)`` writes: the
                 layer, its ``kv_cache`` and its slot mapping come from vLLM's forward context
                 (``get_attention_context``), as vLLM's own fused ops find them. vLLM 0.33's
                 FlashAttention, Triton and FlashInfer backends all hold
                 [blocks, kv_heads, block_size, 2 * D] (K then V in the last dim, any physical
                 order) and write ``kv_cache.transpose(1, 2).split(D, -1)``: K and V views
                 [blocks, block_size, kv_heads, D], the paged layout gqa_prologue writes. No slot
                 mapping (vLLM's profiling run): nothing is written. A slot mapping shorter than
                 T (padded tokens) writes its tokens only; slot -1 writes nothing. KV cache dtype
                 ``auto`` / ``bfloat16`` / ``float16``: the rows as they are; ``fp8`` /
                 ``fp8_e4m3`` (a uint8 cache): ``value / scale`` rounded to e4m3 with the
                 layer's per-tensor ``_k_scale_float`` / ``_v_scale_float``, the bytes vLLM's
                 Triton writer (``triton_reshape_and_cache_flash``) stores for in-range values
                 (it divides in fp32; gqa_prologue's division is correctly rounded, the same
                 result).
    returns      q_out [T, heads, D] and the empty tensor ``unified_kv_cache_update`` returns,
                 which vLLM's attention op takes as ``kv_cache_dummy_dep`` (the write's order)

`compile_time_reason` checks the layer in the vLLM config being compiled and says why in the
model's terms (a kv-cache dtype or backend the op does not write, the kv update kept out of
CUDA graphs as a splitting op, decode context parallelism): the pattern family's guard
(patterns/vllm_gqa_prologue.py) reports it as the site's reason. On CUDA the op is one launch of ``kernels/gqa_prologue.py`` (through
``gqa_prologue``); elsewhere gqa_prologue's plain-torch reference.

This module imports vLLM: integrations/vllm.py imports it; the core never does.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name

from . import gqa_prologue  # noqa: F401  (registers fusion_compiler::gqa_prologue)

KV_UPDATE = "vllm::unified_kv_cache_update"
# vLLM's kv-cache dtype strings the op writes: as the activations, or per-tensor FP8 e4m3.
NATIVE_KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
# The backends whose kv_cache is [blocks, kv_heads, block_size, 2 * D] (their do_kv_cache_update).
PAGED_BACKENDS = ("FlashAttentionImpl", "TritonAttentionImpl", "FlashInferImpl")


def cache_views(kv_cache: torch.Tensor, head_size: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [blocks, block_size, kv_heads, D] views (FP8: the uint8 bytes as e4m3)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    if fp8:
        key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
    return key_cache, value_cache


def layer_reason(layer) -> str | None:
    """Why the op cannot write this attention layer's cache, or None."""
    impl = layer.impl
    backend = type(impl).__name__
    if backend not in PAGED_BACKENDS:
        return f"attention backend {backend} is not one whose cache the op writes ({', '.join(PAGED_BACKENDS)})"
    dtype = layer.kv_cache_dtype
    if dtype not in NATIVE_KV_DTYPES + FP8_KV_DTYPES:
        return f"kv_cache_dtype {dtype!r}: the op writes the activation dtype or per-tensor fp8 (e4m3)"
    if getattr(impl, "_is_per_token_head_quant", False) or getattr(impl, "is_kvcache_nvfp4", False):
        return f"kv_cache_dtype {dtype!r} quantises per token and head: the op's FP8 scales are per tensor"
    if getattr(impl, "kv_sharing_target_layer_name", None) is not None:
        return "the layer shares another layer's KV cache: vLLM writes none for it"
    if getattr(impl, "dcp_world_size", 1) > 1:
        return "decode context parallelism: vLLM's attention reads the roped key there, which the op does not return"
    if layer.head_size_v != layer.head_size:
        return f"V head size {layer.head_size_v} differs from K's {layer.head_size}"
    return None


def compile_time_reason(layer_name) -> str | None:
    """Why the site cannot become this op in the vLLM config being compiled, or None.
    ``layer_name``: as the graph holds it (a str, a `LayerName`, or its fake while tracing)."""
    layer_name = getattr(layer_name, "real_obj", layer_name)  # FakeScriptObject: the traced value
    config = get_current_vllm_config().compilation_config
    if config.use_inductor_graph_partition and KV_UPDATE in (config.splitting_ops or ()):
        return (f"{KV_UPDATE} is in splitting_ops: vLLM keeps it out of CUDA graphs, and fusing it would put "
                "it back in; remove it from splitting_ops to fuse the K/V prologue")  # fmt: skip
    name = _resolve_layer_name(layer_name)
    layer = config.static_forward_context.get(name)
    if layer is None:
        return f"no attention layer {name!r} in the vLLM config being compiled"
    return layer_reason(layer)


def _slots(slot_mapping: torch.Tensor, tokens: int) -> torch.Tensor:
    """The slot mapping as one slot per token: padded tokens past its end write nothing (-1)."""
    if slot_mapping.shape[0] == tokens:
        return slot_mapping
    padding = slot_mapping.new_full((tokens - slot_mapping.shape[0],), -1)
    return torch.cat([slot_mapping, padding])


def gqa_prologue_vllm_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor | None,
                           k_norm_weight: torch.Tensor | None, eps: float, weight_offset: float, full_width_norm: bool,
                           cos_sin_cache: torch.Tensor, positions: torch.Tensor, round_normalized: bool,
                           round_rope_products: bool,
                           layer_name: LayerNameType) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Resolve the layer's cache and slots, then run gqa_prologue on its K/V views."""
    _, layer, kv_cache, slot_mapping = get_attention_context(_resolve_layer_name(layer_name))
    tokens, head_dim = v.shape[0], v.shape[-1]
    q3, k3 = q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim)
    half = cos_sin_cache.shape[-1] // 2
    cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
    fp8 = layer.kv_cache_dtype in FP8_KV_DTYPES
    if slot_mapping is None:  # profiling run: q_out as usual, no cache to write
        key_cache = torch.empty((1, 1) + tuple(k3.shape[1:]), dtype=k3.dtype, device=k3.device)
        value_cache, slots = torch.empty_like(key_cache), torch.full((tokens,), -1, device=q.device)
    else:
        key_cache, value_cache = cache_views(kv_cache, head_dim, fp8)
        slots = _slots(slot_mapping, tokens)
    q_out = torch.ops.fusion_compiler.gqa_prologue.default(
        q=q3, k=k3, v=v, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
        weight_offset=weight_offset, full_width_norm=full_width_norm, cos=cos, sin=sin, positions=positions,
        k_cache=key_cache, v_cache=value_cache, slots=slots,
        k_scale=layer._k_scale_float if fp8 else 1.0, v_scale=layer._v_scale_float if fp8 else 1.0,
        cache_heads_first=False, round_normalized=round_normalized, round_rope_products=round_rope_products,
    )  # fmt: skip
    return q_out, q.new_empty(0)


def gqa_prologue_vllm_fake(q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm,
                           cos_sin_cache, positions, round_normalized, round_rope_products, layer_name):  # fmt: skip
    tokens, head_dim = v.shape[0], v.shape[-1]
    heads = q.shape[1] if q.dim() == 3 else q.shape[-1] // head_dim
    return q.new_empty((tokens, heads, head_dim)), q.new_empty(0)


# No mutated argument: like unified_kv_cache_update, the op writes a cache no argument holds, and
# attention's kv_cache_dummy_dep on its second output keeps the order.
_op = torch.library.custom_op("fusion_compiler::gqa_prologue_vllm", gqa_prologue_vllm_impl, mutates_args=())
_op.register_fake(gqa_prologue_vllm_fake)
