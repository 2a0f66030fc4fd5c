"""Qwen3.5's GDN decode inside vLLM 0.33: vLLM's ``qwen_gdn_attention_core`` and the gated
RMSNorm after it, one op that finds its states through vLLM's forward context (issue 31).

    fusion_compiler::gdn_decode_vllm(Tensor mixed_qkv, Tensor b, Tensor a, Tensor z,
        Tensor norm_weight, float eps, Tensor(a!) out, LayerName layer_name) -> ()

It stands where ``patterns/vllm_gdn.py`` finds, in one graph (vLLM's
``use_inductor_graph_partition=True``):

    torch.ops.vllm.qwen_gdn_attention_core(mixed_qkv, b, a, core_attn_out, layer_name)
    out = RMSNormGated(norm_before_gate=True, silu)(core_attn_out, z)   # forward_native, fp32

Arguments, T tokens (vLLM may pad T past the batch: ``num_actual_tokens`` rows are real):

    mixed_qkv     [T, conv_dim]   [q | k | v], any row stride, unit stride along the width
    b, a          [T, Hv]         any row stride (the op reads them before vLLM's ``.contiguous()``)
    z             [T, Hv, Dv]     the gate, unit stride along Dv
    norm_weight   [Dv]; eps       the gated norm's
    out           [T, Hv, Dv]     contiguous, written: the gated norm's output; rows past the
                                  batch and padded rows (index <= 0) are zeros, as vLLM leaves them
    layer_name    vLLM's ``LayerName`` (or str): ``no_compile_layers[name]`` is the
                  ``QwenGatedDeltaNetAttention`` whose ``kv_cache`` = (conv_state, ssm_state)
                  and whose ``attn_metadata[prefix]`` is a ``GDNAttentionMetadata``

The states are vLLM's strided views into its int8 pages, updated in place: conv
[slots, K - 1, conv_dim] (vLLM's "SD" layout; the kernel reads its transpose, as vLLM's do) and
SSM [slots, Hv, Dv, Dk] fp32, Dk innermost. ``non_spec_state_indices_tensor`` gives each row's
slot; an index <= 0 (NULL_BLOCK_ID) is padding: no state is read or written.

Paths, decided per call on the host from the metadata (vLLM's own op decides the same way):

- ``_kernel_declines`` says nothing (all tokens decode, no speculative decode, CUDA, fp32 SSM,
  no conv bias, SiLU, the conv state and weight in the activations' dtype): one launch of ``kernels/gdn_decode.py`` with ``vllm_math`` (vLLM's
  rounding points: causal_conv1d_update, the packed decode kernel, RMSNormGated.forward_native),
  which writes both states and ``out``. vLLM takes 2 launches for the core
  (``causal_conv1d_update``, ``fused_recurrent_gated_delta_rule_packed_decode``), and its graph
  one or two Inductor kernels more (``b.contiguous()`` / ``a.contiguous()``, the zeros of
  ``core_attn_out``, the gated norm).
- anything else (prefill, mixed batches, speculative decode, vLLM's warm-up without metadata,
  CPU): vLLM's own op on a zeroed ``out``, then the gated norm in plain torch; each reason is
  logged once.

Nothing is allocated on the kernel path but the kernel's per-device arrival counters, which are
sized on the first call (vLLM's warm-up runs before CUDA-graph capture). vLLM's op is a splitting
op for its piecewise CUDA graphs; so must this one be (integrations/vllm.py).

Imports vLLM: only ``integrations/vllm.py`` loads this module (the core never imports vLLM).
"""

from __future__ import annotations

import functools
import logging

import torch
from vllm.forward_context import get_forward_context
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name

from .rms_norm import gated_rms_norm_reference

log = logging.getLogger("fusion_compiler")

OP = "fusion_compiler::gdn_decode_vllm"
# vLLM's qk l2norm eps (the packed decode kernel's literal 1e-6).
QK_L2NORM_EPS = 1e-6


def layer_and_metadata(layer_name):
    """The GDN layer named by ``layer_name`` and its metadata this step (None in vLLM's warm-up)."""
    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    metadata = context.attn_metadata
    return layer, metadata.get(layer.prefix) if isinstance(metadata, dict) else None


def states(layer):
    """(conv [slots, conv_dim, K - 1], ssm [slots, Hv, Dk, Dv]): views of the layer's kv_cache
    in the layout the kernel indexes (nothing copied)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv, ssm = layer.kv_cache
    return (conv if is_conv_state_dim_first() else conv.transpose(-1, -2)), ssm.transpose(-1, -2)


def _kernel_declines(layer, metadata, mixed_qkv) -> str | None:
    """Why this call runs vLLM's op, or None where our kernel takes it."""
    if metadata is None:
        return "no metadata (vLLM's warm-up)"
    if metadata.spec_sequence_masks is not None or metadata.num_prefills or not metadata.num_decodes:
        return "not a batch of decode tokens alone"
    if not mixed_qkv.is_cuda:
        return "not on CUDA"
    if layer.conv1d.bias is not None or layer.activation != "silu":
        return "the conv has a bias or no SiLU"
    if layer.kv_cache[1].dtype != torch.float32:
        return f"the SSM state is {layer.kv_cache[1].dtype}, the kernel's is fp32"
    conv_dtypes = {layer.kv_cache[0].dtype, layer.conv1d.weight.dtype}
    if conv_dtypes != {mixed_qkv.dtype}:
        return f"the conv state and weight ({', '.join(sorted(map(str, conv_dtypes)))}) are not in the activations' {mixed_qkv.dtype}"
    if metadata.non_spec_state_indices_tensor.stride(0) != 1:
        return "the state indices are strided"
    return None


def decode_step(layer, metadata, mixed_qkv, b, a, z, norm_weight, eps, out) -> None:
    """The kernel path: one launch, both states and ``out`` written (checks: `_kernel_declines`)."""
    from fusion_compiler.kernels.gdn_decode import gdn_decode_fwd

    conv, ssm = states(layer)
    weight = layer.conv1d.weight
    tokens = mixed_qkv.shape[0]
    gdn_decode_fwd(
        mixed_qkv, z.reshape(tokens, -1), b, a, weight.view(weight.shape[0], weight.shape[-1]), layer.A_log,
        layer.dt_bias, norm_weight, eps, QK_L2NORM_EPS, conv, ssm, metadata.non_spec_state_indices_tensor,
        out.view(tokens, -1), rows=min(metadata.num_actual_tokens, tokens), min_slot=1, vllm_math=True,
    )  # fmt: skip


def vllm_step(mixed_qkv, b, a, z, norm_weight, eps, out, layer_name) -> None:
    """vLLM's own op into the zeroed ``out``, then the gated norm (RMSNormGated.forward_native)."""
    out.zero_()
    torch.ops.vllm.qwen_gdn_attention_core(mixed_qkv, b.contiguous(), a.contiguous(), out, layer_name)
    out.copy_(gated_rms_norm_reference(out, z, norm_weight, eps))


@torch.library.custom_op(OP, mutates_args=("out",))
def gdn_decode_vllm(
    mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, out: torch.Tensor, layer_name: LayerNameType,
) -> None:  # fmt: skip
    layer, metadata = layer_and_metadata(layer_name)
    reason = _kernel_declines(layer, metadata, mixed_qkv)
    if reason is None:
        decode_step(layer, metadata, mixed_qkv, b, a, z, norm_weight, eps, out)
    else:
        _log_vllm_path(reason)
        vllm_step(mixed_qkv, b, a, z, norm_weight, eps, out, layer_name)


@functools.cache
def _log_vllm_path(reason: str) -> None:
    """Say, once per reason, why a call ran vLLM's op and not our kernel."""
    log.info("fusion_compiler: %s runs vLLM's qwen_gdn_attention_core here: %s", OP, reason)


@gdn_decode_vllm.register_fake
def _fake(mixed_qkv, b, a, z, norm_weight, eps, out, layer_name) -> None:
    if out.shape != z.shape or not out.is_contiguous():
        raise ValueError(f"out must be contiguous and z's shape {tuple(z.shape)}, got {tuple(out.shape)}")
