"""MiniMax-M2.5 decode attention as a serving engine runs it, in plain torch.

HF's ``MiniMaxM2Attention`` keeps separate q/k/v projections and a static per-layer cache. This
module writes the path the fusions target in production, in the form vLLM's ``minimax_m2.py``
runs it at tensor-parallel size 1 (docs/MODELS.md):

* one fused ``qkv_proj`` GEMM (3072 -> 6144 + 1024 + 1024), split into q, k, v;
* q RMSNorm over the **whole** q projection (48 heads x 128 = 6144) and k RMSNorm over the whole
  k projection (8 x 128 = 1024), before the head split (HF's ``MiniMaxM2RMSNorm``: fp32 math,
  rounded to the activation dtype, then times the weight);
* NeoX RoPE on the first ``rotary_dim`` (64) of each head's 128 dims, cos/sin read from a
  ``cos_sin_cache`` [max_position, rotary_dim] table (cos | sin halves) at ``positions``, in
  fp32 with one rounding (vLLM's rotary kernel; HF rounds after each product);
* a paged KV cache ``[num_blocks, block_size, kv_heads, head_dim]`` for K and for V, written at
  ``slot_mapping``, in bf16 or FP8 e4m3 with one per-tensor scale per
  cache (``value / scale`` clamped to +-448 and rounded to FP8, as vLLM's ``fp8`` kv-cache dtype);
* decode attention over each sequence's context through its block table; o_proj.

Everything here is ordinary model code: nothing imports the compiler's ops.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .. import paged_kv
from ..paged_kv import FP8, context_of, paged_decode_attention, read_cache, rope_neox_partial, write_cache

# The paged-cache pieces live in paged_kv (shared with Qwen3.5's reference); re-exported here.
__all__ = [
    "FP8", "REAL", "TINY", "Attention", "ReferenceConfig", "config_of", "context_of", "from_hf", "read_cache",
    "rms_norm", "rope_cos_sin_cache", "rope_neox_partial", "write_cache",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 5e6
    rms_norm_eps: float = 1e-6
    num_layers: int = 2
    block_size: int = 16
    kv_cache_dtype: str = "bf16"  # or "fp8"
    max_position: int = 4096

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def cache_dtype(self) -> torch.dtype:
        return paged_kv.cache_dtype_of(self.kv_cache_dtype)


REAL = ReferenceConfig(hidden_size=3072, num_heads=48, num_kv_heads=8, head_dim=128, rotary_dim=64)
TINY = ReferenceConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's MiniMaxM2RMSNorm: normalise in fp32, round to x's dtype, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_cos_sin_cache(cfg: ReferenceConfig) -> torch.Tensor:
    """[max_position, rotary_dim] fp32 cos | sin table of ``cfg`` (paged_kv.rope_cos_sin_cache)."""
    return paged_kv.rope_cos_sin_cache(cfg.rotary_dim, cfg.rope_theta, cfg.max_position)


class Attention(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_width + 2 * cfg.kv_width, bias=False)
        self.q_norm_weight = nn.Parameter(torch.ones(cfg.q_width))
        self.k_norm_weight = nn.Parameter(torch.ones(cfg.kv_width))
        self.o_proj = nn.Linear(cfg.q_width, cfg.hidden_size, bias=False)

    def prologue(self, x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale):
        """x -> (q [T, heads, D] after norm + RoPE); writes K and V."""
        return self.after_qkv(self.qkv_proj(x), cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale)

    def after_qkv(self, qkv, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale):
        """The qkv GEMM's output -> q; writes K and V: the region the GQA prologue fusion replaces."""
        cfg = self.cfg
        q, k, v = qkv.split([cfg.q_width, cfg.kv_width, cfg.kv_width], dim=-1)
        q = rms_norm(q, self.q_norm_weight, cfg.rms_norm_eps).view(-1, cfg.num_heads, cfg.head_dim)
        k = rms_norm(k, self.k_norm_weight, cfg.rms_norm_eps).view(-1, cfg.num_kv_heads, cfg.head_dim)
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        q = rope_neox_partial(q, cos, sin, cfg.rotary_dim)
        k = rope_neox_partial(k, cos, sin, cfg.rotary_dim)
        write_cache(k_cache, slots, k, k_scale)
        write_cache(v_cache, slots, v.view(-1, cfg.num_kv_heads, cfg.head_dim), v_scale)
        return q

    def forward(self, x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid):
        """Decode: token t is the last token of sequence t; it attends to context_slots[t]
        (its sequence's slots, the new one included, padded where context_valid is False)."""
        cfg = self.cfg
        q = self.prologue(x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale)
        out = paged_decode_attention(
            q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid, cfg.num_kv_heads
        )
        return self.o_proj(out.to(x.dtype).reshape(-1, cfg.q_width))


def from_hf(hf_attention: nn.Module, cfg: ReferenceConfig) -> Attention:
    """Our attention with the weights of HF's MiniMaxM2Attention (q/k/v projections fused)."""
    ours = Attention(cfg).to(hf_attention.q_proj.weight.dtype)
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([hf_attention.q_proj.weight, hf_attention.k_proj.weight, hf_attention.v_proj.weight]))
        ours.q_norm_weight.copy_(hf_attention.q_norm.weight)
        ours.k_norm_weight.copy_(hf_attention.k_norm.weight)
        ours.o_proj.weight.copy_(hf_attention.o_proj.weight)
    return ours.to(hf_attention.q_proj.weight.device)


def config_of(hf_config, **overrides) -> ReferenceConfig:
    """The reference config of an HF MiniMaxM2Config (its partial_rotary_factor gives rotary_dim)."""
    rope = hf_config.rope_parameters
    head_dim = hf_config.head_dim
    return ReferenceConfig(
        hidden_size=hf_config.hidden_size, num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads, head_dim=head_dim,
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)), rope_theta=rope["rope_theta"],
        rms_norm_eps=hf_config.rms_norm_eps, **overrides,
    )  # fmt: skip
