"""The GDN decode step on fla-core's kernels (lowering "fla" of the ``gdn`` family).

fla-core (https://github.com/fla-org/flash-linear-attention, pure Triton) is what vLLM runs for
Qwen3.5's GDN layers: a conv update (``fla.modules.causal_conv1d.causal_conv1d_update``), the
fused recurrent gated delta rule (gates, l2norm and the state update in one kernel) and the
gated RMSNorm (``fla.modules.norm.layernorm_gated.rmsnorm_fn``, norm before gate, one group a
head). This module composes them with the op's contract (``fusion_compiler.ops.gdn_decode``):
states updated in place at ``state_slots``, padding rows (slot -1) writing nothing and
returning zeros.

fla-core 0.6 has no slot indexing: sequence i reads and writes state row i. So the rows at the
slots are gathered into contiguous copies (``index_select``; padding rows read slot 0), fla runs
on the copies, and ``_scatter_rows`` writes each live row back to its slot. That is two more
passes over the recurrent state than fla in place (4 MiB a sequence each way at Qwen3.5's
dims), the price of fla's layout: the one-kernel lowering ("triton") has none of it.

Numerics differ from the op's reference (HF's rounding points) within bf16 tolerance: fla takes
beta's sigmoid and the gated norm's weight in fp32 (HF rounds both to bf16), and multiplies q by
Dk**-0.5 instead of dividing. ``qk_l2norm_eps`` must be 1e-6 (fla's kernel hard-codes it).

fla is imported on first use; without it the op raises, naming the package to install.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import launch_on_device

KERNEL_VERSION = "gdn_fla-1"
FLA_QK_L2NORM_EPS = 1e-6  # fla's fused recurrent kernel: q / sqrt(sum(q * q) + 1e-6)


@triton.jit
def _scatter_rows_kernel(SRC, DST, SLOTS, row_numel, BLOCK: tl.constexpr):
    """Row t of SRC -> row SLOTS[t] of DST; rows with slot -1 are skipped."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < row_numel) & (slot >= 0)
    values = tl.load(SRC + t * row_numel + offs, mask=mask)
    tl.store(DST + tl.maximum(slot, 0) * row_numel + offs, values, mask=mask)


def scatter_rows(dst: torch.Tensor, src: torch.Tensor, slots: torch.Tensor) -> None:
    """``dst[slots[t]] = src[t]`` for every t with ``slots[t] >= 0`` (no host sync)."""
    if not (dst.is_contiguous() and src.is_contiguous()) or dst.shape[1:] != src.shape[1:]:
        raise ValueError(f"scatter_rows needs contiguous rows of one shape, got {tuple(dst.shape)} <- {tuple(src.shape)}")
    row_numel = src[0].numel() if src.shape[0] else 0
    if row_numel == 0:
        return
    block = 4096

    def _launch():
        _scatter_rows_kernel[(src.shape[0], triton.cdiv(row_numel, block))](src, dst, slots, row_numel, BLOCK=block)

    launch_on_device(src, _launch)


def _fla():
    try:
        from fla.modules.causal_conv1d import causal_conv1d_update
        from fla.modules.norm.layernorm_gated import rmsnorm_fn
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as error:
        raise ImportError(
            "the gdn family's lowering 'fla' runs fla-core's kernels: pip install 'fla-core>=0.6,<0.7' "
            f"(import failed: {error})"
        ) from error
    return causal_conv1d_update, fused_recurrent_gated_delta_rule, rmsnorm_fn


def gdn_decode_fla_fwd(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps, conv_state,
                       recurrent_state, state_slots, *, key_heads: int) -> torch.Tensor:  # fmt: skip
    """The op's step on fla's kernels: returns out [T, Hv * Dv]; both states updated in place."""
    tokens = mixed_qkv.shape[0]
    _, value_heads, key_dim, value_dim = recurrent_state.shape
    kernel = conv_weight.shape[-1]
    if qk_l2norm_eps != FLA_QK_L2NORM_EPS:
        raise ValueError(f"lowering 'fla': fla's kernel fixes the q/k l2norm eps at 1e-6, the site has {qk_l2norm_eps}")
    if conv_state.shape[-1] != kernel:
        raise ValueError(
            f"lowering 'fla': fla's conv update keeps a window of the kernel's {kernel} columns (HF's layout); "
            f"this conv state has {conv_state.shape[-1]}"
        )
    conv_update, recurrent, gated_norm = _fla()
    if tokens == 0:
        return mixed_qkv.new_zeros(0, value_heads * value_dim)
    rows = state_slots.long().clamp(min=0)
    conv = conv_state.index_select(0, rows)  # [T, conv_dim, K], contiguous
    x, _ = conv_update(mixed_qkv, conv, weight=conv_weight.reshape(conv_weight.shape[0], kernel), activation="silu")
    key_width = key_heads * key_dim
    q, k, v = x.split([key_width, key_width, value_heads * value_dim], dim=-1)
    o, final_state = recurrent(
        q.reshape(tokens, 1, key_heads, key_dim), k.reshape(tokens, 1, key_heads, key_dim),
        v.reshape(tokens, 1, value_heads, value_dim), g=a.reshape(tokens, 1, value_heads),
        beta=b.reshape(tokens, 1, value_heads), scale=key_dim**-0.5,
        initial_state=recurrent_state.index_select(0, rows), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True,
    )  # fmt: skip
    out = gated_norm(o.reshape(tokens * value_heads, value_dim), norm_weight, None,
                     z=z.reshape(tokens * value_heads, value_dim).contiguous(), eps=eps, group_size=value_dim,
                     norm_before_gate=True).reshape(tokens, value_heads * value_dim)  # fmt: skip
    scatter_rows(conv_state, conv, state_slots)
    scatter_rows(recurrent_state, final_state, state_slots)
    return torch.where((state_slots >= 0)[:, None], out.to(mixed_qkv.dtype), torch.zeros_like(out, dtype=mixed_qkv.dtype))
