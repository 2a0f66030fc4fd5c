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

FP8 = torch.float8_e4m3fn


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
        if self.kv_cache_dtype not in ("bf16", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'bf16' or 'fp8', got {self.kv_cache_dtype!r}")
        return torch.bfloat16 if self.kv_cache_dtype == "bf16" else FP8


REAL = ReferenceConfig(hidden_size=3072, num_heads=48, num_kv_heads=8, head_dim=128, rotary_dim=64)
TINY = ReferenceConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's MiniMaxM2RMSNorm: normalise in fp32, round to x's dtype, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_cos_sin_cache(cfg: ReferenceConfig) -> torch.Tensor:
    """[max_position, rotary_dim] fp32: cos of the rotary_dim / 2 frequencies, then sin."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float64) / cfg.rotary_dim))
    angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def rope_neox_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """NeoX (rotate-half) RoPE on the first ``rotary_dim`` dims of x [T, heads, D]; cos / sin
    [T, rotary_dim / 2]. fp32 math, one rounding; the other dims pass through."""
    half = rotary_dim // 2
    first, second = x[..., :half].float(), x[..., half:rotary_dim].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([first * c - second * s, second * c + first * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    """cache [blocks, block_size, kv_heads, D] at flat ``slots`` [T] <- values [T, kv_heads, D],
    divided by ``scale``, clamped and rounded for an FP8 cache. As the DeepSeek reference, an
    ``index_put_`` (compiles without data-dependent shapes); every slot must be valid here (the
    fused op also skips vLLM's padding slot -1, which index_put_ would wrap to the last row)."""
    rows = (values.float() / scale).clamp(-448.0, 448.0) if cache.dtype == FP8 else values
    cache.view(-1, *cache.shape[2:]).index_put_((slots,), rows.to(cache.dtype))


def read_cache(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """[n, kv_heads, D] fp32 rows at flat ``slots``."""
    rows = cache.view(-1, *cache.shape[2:])[slots].float()
    return rows * scale if cache.dtype == FP8 else rows


class Attention(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_width + 2 * cfg.kv_width, bias=False)
        self.q_norm_weight = nn.Parameter(torch.ones(cfg.q_width))
        self.k_norm_weight = nn.Parameter(torch.ones(cfg.kv_width))
        self.o_proj = nn.Linear(cfg.q_width, cfg.hidden_size, bias=False)

    def prologue(self, x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale):
        """qkv GEMM output -> (q [T, heads, D] after norm + RoPE); writes K and V. The region the
        GQA prologue fusion replaces is everything after the GEMM."""
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_width, cfg.kv_width, cfg.kv_width], dim=-1)
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
        keys = read_cache(k_cache, context_slots.clamp(min=0).flatten(), k_scale)
        values = read_cache(v_cache, context_slots.clamp(min=0).flatten(), v_scale)
        tokens, ctx = context_slots.shape
        keys = keys.view(tokens, ctx, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 2)
        values = values.view(tokens, ctx, cfg.num_kv_heads, cfg.head_dim).repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 2)
        scores = torch.einsum("thd,tchd->thc", q.float(), keys) * cfg.head_dim**-0.5
        scores = scores.masked_fill(~context_valid[:, None, :], float("-inf"))
        out = torch.einsum("thc,tchd->thd", scores.softmax(-1), values).to(x.dtype)
        return self.o_proj(out.reshape(tokens, cfg.q_width))


def context_of(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """(context_slots [B, max_len], context_valid [B, max_len]) of each sequence's positions."""
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=block_table.device)
    slots = block_table[:, pos // block_size] * block_size + pos % block_size
    return slots, pos[None, :] < seq_lens[:, None]


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
