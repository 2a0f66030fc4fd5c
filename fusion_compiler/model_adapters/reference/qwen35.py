"""Qwen3.5 gated full attention (decode) as a serving engine runs it, in plain torch.

HF's ``Qwen3_5MoeAttention`` keeps separate q/k/v projections and a DynamicCache. This module
writes the path the fusions target in production, in the form vLLM's ``Qwen3NextAttention``
(``qwen3_next.py``, used by ``qwen3_5.py``) runs it at tensor-parallel size 1 (docs/MODELS.md):

* one fused ``qkv_proj`` GEMM (4096 -> 16384 + 512 + 512), split into q|gate, k, v. The q|gate
  part keeps HF's ``q_proj`` layout, interleaved per head: head h owns columns [h*2D, h*2D + D)
  (q) and [h*2D + D, (h+1)*2D) (the output gate), as HF's ``view(..., heads, 2D).chunk(2, -1)``;
* q and k RMSNorm **per head** (over D = 256), Gemma style, as HF's ``Qwen3_5MoeRMSNorm`` and
  vLLM's ``GemmaRMSNorm``: fp32 ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, one rounding. The
  stored weight is the offset ``w`` (HF inits it to zeros);
* NeoX RoPE on the first ``rotary_dim`` (64) of each head's 256 dims, cos/sin read from a
  ``cos_sin_cache`` [max_position, rotary_dim] fp32 table at ``positions``, fp32 math and one
  rounding (vLLM's rotary kernel). The hub config asks for interleaved M-RoPE
  (``mrope_section`` [11, 11, 10]); with text-only inputs the three position rows are equal, so
  it is plain RoPE over one position per token;
* the paged K/V cache of ``paged_kv`` (bf16 or FP8 e4m3 with a per-tensor scale), written at
  ``slots``; decode attention over each sequence's context (``paged_kv.paged_decode_attention``,
  one opaque op, identical in every compile mode);
* ``out * sigmoid(gate)`` in the activation dtype, then o_proj.

Rounding differences from HF (bf16): HF rounds cos/sin to bf16 and rounds after each RoPE
product. Here cos/sin stay fp32 and RoPE rounds once. Both attend by SDPA (here over bf16 q/k/v
with a bf16 cache, fp32 with an FP8 one). The norms round once in both.

Everything here is ordinary model code: nothing imports the compiler's ops.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import paged_kv
from .paged_kv import paged_decode_attention, rope_neox_partial, write_cache


@dataclasses.dataclass(frozen=True)
class ReferenceConfig(paged_kv.AttentionConfig):
    rope_theta: float = 1e7


# max_position: the checkpoint's max_position_embeddings, as vLLM sizes its cos/sin table.
REAL = ReferenceConfig(hidden_size=4096, num_heads=32, num_kv_heads=2, head_dim=256, rotary_dim=64,
                       max_position=262144)  # fmt: skip
# The adapter's tiny config: partial_rotary_factor 0.25 of head_dim 64.
TINY = ReferenceConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=16)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3_5MoeRMSNorm over the last dim: fp32 ``x * rsqrt(mean(x^2) + eps) * (1 + w)``,
    then rounded to x's dtype once."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * (1.0 + weight.float())
    return h.type_as(x)


def rope_cos_sin_cache(cfg: ReferenceConfig) -> torch.Tensor:
    """[max_position, rotary_dim] fp32 cos | sin table of ``cfg`` (paged_kv.rope_cos_sin_cache)."""
    return paged_kv.rope_cos_sin_cache(cfg.rotary_dim, cfg.rope_theta, cfg.max_position)


class Attention(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * cfg.q_width + 2 * cfg.kv_width, bias=False)
        self.q_norm_weight = nn.Parameter(torch.zeros(cfg.head_dim))  # Gemma offset: used as 1 + w
        self.k_norm_weight = nn.Parameter(torch.zeros(cfg.head_dim))
        self.o_proj = nn.Linear(cfg.q_width, cfg.hidden_size, bias=False)

    def prologue(self, x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale):
        """x -> (q [T, heads, D] after norm + RoPE, gate [T, heads * D]); writes K and V."""
        return self.after_qkv(self.qkv_proj(x), cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale)

    def after_qkv(self, qkv, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale):
        """The qkv GEMM's output -> (q, gate); writes K and V: the region the GQA prologue
        fusion replaces."""
        cfg = self.cfg
        q_gate, k, v = qkv.split([2 * cfg.q_width, cfg.kv_width, cfg.kv_width], dim=-1)
        q, gate = torch.chunk(q_gate.view(-1, cfg.num_heads, 2 * cfg.head_dim), 2, dim=-1)
        gate = gate.reshape(-1, cfg.q_width)
        q = gemma_rms_norm(q, self.q_norm_weight, cfg.rms_norm_eps)
        k = gemma_rms_norm(k.view(-1, cfg.num_kv_heads, cfg.head_dim), self.k_norm_weight, cfg.rms_norm_eps)
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        q = rope_neox_partial(q, cos, sin, cfg.rotary_dim)
        k = rope_neox_partial(k, cos, sin, cfg.rotary_dim)
        write_cache(k_cache, slots, k, k_scale)
        write_cache(v_cache, slots, v.view(-1, cfg.num_kv_heads, cfg.head_dim), v_scale)
        return q, gate

    def forward(self, x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid):
        """Decode: token t is the last token of sequence t; it attends to context_slots[t]
        (its sequence's slots, the new one included, padded where context_valid is False)."""
        cfg = self.cfg
        q, gate = self.prologue(x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale)
        out = paged_decode_attention(
            q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid, cfg.num_kv_heads
        )
        out = out.to(x.dtype).reshape(-1, cfg.q_width) * torch.sigmoid(gate)
        return self.o_proj(out)


def from_hf(hf_attention: nn.Module, cfg: ReferenceConfig) -> Attention:
    """Our attention with the weights of HF's Qwen3_5MoeAttention: q_proj (q|gate interleaved per
    head, kept as it is), k_proj and v_proj stacked into qkv_proj; the norms' offset weights w and
    o_proj copied. HF's ``attention_bias`` must be False (the default; the real model has none)."""
    if any(getattr(hf_attention, name).bias is not None for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise ValueError("HF attention has projection biases (attention_bias=True); the reference has none")
    return paged_kv.load_hf_attention(Attention(cfg), hf_attention)


def config_of(hf_text_config, **overrides) -> ReferenceConfig:
    """The reference config of an HF Qwen3_5MoeTextConfig (rotary_dim = head_dim times its
    partial_rotary_factor; M-RoPE sections are ignored: text-only positions)."""
    rope = hf_text_config.rope_parameters
    head_dim = hf_text_config.head_dim
    return ReferenceConfig(
        hidden_size=hf_text_config.hidden_size, num_heads=hf_text_config.num_attention_heads,
        num_kv_heads=hf_text_config.num_key_value_heads, head_dim=head_dim,
        rotary_dim=int(head_dim * rope["partial_rotary_factor"]), rope_theta=rope["rope_theta"],
        rms_norm_eps=hf_text_config.rms_norm_eps, **overrides,
    )  # fmt: skip
