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
* decode attention over each sequence's context through its block table (one opaque op,
  ``paged_kv.paged_decode_attention``: a serving engine's attention backend, identical in every
  compile mode); o_proj.

Tensor parallelism (``Attention(cfg, tp_rank, tp_size, group)``, weights from ``shard``): each
rank holds ``num_heads / tp_size`` q heads and ``num_kv_heads / tp_size`` kv heads (vLLM's
``QKVParallelLinear``), the matching slices of the norm weights, and o_proj's input columns
(``RowParallelLinear``: its partial sums are all-reduced). The full-width norm needs the global
mean of squares: ``rms_norm_tp`` is vLLM's ``MiniMaxText01RMSNormTP.forward_qk`` (each rank's q
and k means of squares batched into one [T, 2] all-reduce, divided by the world size), written
with ``torch.distributed._functional_collectives`` so it compiles into the graph
(``_c10d_functional.all_reduce`` + ``wait_tensor``). At ``tp_size`` 1 the code path, and so the
graph, is the single-rank one above.

Everything here is ordinary model code: nothing imports the compiler's ops.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

try:  # tensor parallelism only; a torch without torch.distributed still runs one rank
    import torch.distributed._functional_collectives as funcol
except ImportError:
    funcol = None

from . import paged_kv
from .paged_kv import FP8, context_of, paged_decode_attention, read_cache, rope_neox_partial, write_cache

# The paged-cache pieces live in paged_kv (shared with Qwen3.5's reference); re-exported here.
__all__ = [
    "FP8", "REAL", "TINY", "Attention", "ReferenceConfig", "config_of", "context_of", "from_hf", "read_cache",
    "rms_norm", "rms_norm_tp", "rope_cos_sin_cache", "rope_neox_partial", "shard", "write_cache",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ReferenceConfig(paged_kv.AttentionConfig):
    rope_theta: float = 5e6
    num_layers: int = 2


# max_position: the checkpoint's max_position_embeddings, as vLLM sizes its cos/sin table (the
# default 4096 rows ended below a 4096-token context's new position: an out-of-bounds gather).
REAL = ReferenceConfig(hidden_size=3072, num_heads=48, num_kv_heads=8, head_dim=128, rotary_dim=64,
                       max_position=196608)  # fmt: skip
TINY = ReferenceConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's MiniMaxM2RMSNorm: normalise in fp32, round to x's dtype, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_tp(q, k, q_weight, k_weight, eps: float, tp_size: int, group):
    """The full-width q and k norms of one tensor-parallel rank (q, k: this rank's columns).

    vLLM's ``MiniMaxText01RMSNormTP.forward_qk``: fp32 means of squares of the local columns,
    both in one [T, 2] all-reduce, divided by the world size (the global mean, every rank's
    width being equal), then each side normalised. The tail rounds as ``rms_norm`` (HF's: cast,
    then times the weight shard), so tp_size ranks give the single-rank result up to the fp32
    order of the sum; vLLM multiplies the weight in fp32 and rounds once."""
    q32, k32 = q.float(), k.float()
    variance = torch.cat([q32.pow(2).mean(-1, keepdim=True), k32.pow(2).mean(-1, keepdim=True)], dim=-1)
    variance = funcol.all_reduce(variance, "sum", group) / tp_size
    q_var, k_var = variance.chunk(2, dim=-1)
    q = q_weight * (q32 * torch.rsqrt(q_var + eps)).to(q.dtype)
    k = k_weight * (k32 * torch.rsqrt(k_var + eps)).to(k.dtype)
    return q, k


def rope_cos_sin_cache(cfg: ReferenceConfig) -> torch.Tensor:
    """[max_position, rotary_dim] fp32 cos | sin table of ``cfg`` (paged_kv.rope_cos_sin_cache)."""
    return paged_kv.rope_cos_sin_cache(cfg.rotary_dim, cfg.rope_theta, cfg.max_position)


class Attention(nn.Module):
    """One rank's attention: all heads at ``tp_size`` 1; else this rank's share of them
    (``shard`` loads the weights), its norms reducing over ``group``."""

    def __init__(self, cfg: ReferenceConfig, tp_rank: int = 0, tp_size: int = 1, group=None):
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size or cfg.num_kv_heads % tp_size:
            raise ValueError(f"tp rank {tp_rank} of {tp_size}: needs 0 <= rank < size and a size that splits "
                             f"{cfg.num_kv_heads} kv heads evenly (kv-head replication is not modelled)")  # fmt: skip
        self.cfg, self.tp_rank, self.tp_size = cfg, tp_rank, tp_size
        self.group = group if group is not None or tp_size == 1 else torch.distributed.group.WORLD
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp_size, cfg.num_kv_heads // tp_size
        self.q_width, self.kv_width = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_width + 2 * self.kv_width, bias=False)
        self.q_norm_weight = nn.Parameter(torch.ones(self.q_width))
        self.k_norm_weight = nn.Parameter(torch.ones(self.kv_width))
        self.o_proj = nn.Linear(self.q_width, cfg.hidden_size, bias=False)

    def prologue(self, x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale):
        """x -> (q [T, heads, D] after norm + RoPE); writes K and V."""
        return self.after_qkv(self.qkv_proj(x), cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale)

    def after_qkv(self, qkv, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale):
        """The qkv GEMM's output -> q; writes K and V: the region the GQA prologue fusion replaces."""
        cfg = self.cfg
        q, k, v = qkv.split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        if self.tp_size == 1:
            q = rms_norm(q, self.q_norm_weight, cfg.rms_norm_eps).view(-1, self.num_heads, cfg.head_dim)
            k = rms_norm(k, self.k_norm_weight, cfg.rms_norm_eps).view(-1, self.num_kv_heads, cfg.head_dim)
        else:
            q, k = rms_norm_tp(q, k, self.q_norm_weight, self.k_norm_weight, cfg.rms_norm_eps, self.tp_size, self.group)
            q, k = q.view(-1, self.num_heads, cfg.head_dim), k.view(-1, self.num_kv_heads, cfg.head_dim)
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        q = rope_neox_partial(q, cos, sin, cfg.rotary_dim)
        k = rope_neox_partial(k, cos, sin, cfg.rotary_dim)
        write_cache(k_cache, slots, k, k_scale)
        write_cache(v_cache, slots, v.view(-1, self.num_kv_heads, cfg.head_dim), v_scale)
        return q

    def forward(self, x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid):
        """Decode: token t is the last token of sequence t; it attends to context_slots[t]
        (its sequence's slots, the new one included, padded where context_valid is False)."""
        q = self.prologue(x, cos_sin_cache, positions, slots, k_cache, v_cache, k_scale, v_scale)
        out = paged_decode_attention(
            q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid, self.num_kv_heads
        )
        out = self.o_proj(out.to(x.dtype).reshape(-1, self.q_width))
        return out if self.tp_size == 1 else funcol.all_reduce(out, "sum", self.group)


def shard(full: Attention, tp_rank: int, tp_size: int, group=None) -> Attention:
    """Rank ``tp_rank``'s attention with the weights of a single-rank one, split as vLLM's
    loaders split them: q heads ``[r * H/tp, (r + 1) * H/tp)``, kv heads likewise, the norm
    weights over the same columns, o_proj over its input columns."""
    if full.tp_size != 1:
        raise ValueError("shard takes a single-rank attention")
    ours = Attention(full.cfg, tp_rank, tp_size, group).to(full.qkv_proj.weight.dtype)
    q, k, v = full.qkv_proj.weight.split([full.q_width, full.kv_width, full.kv_width])

    def part(t, width):
        return t[tp_rank * width : (tp_rank + 1) * width]

    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([part(q, ours.q_width), part(k, ours.kv_width), part(v, ours.kv_width)]))
        ours.q_norm_weight.copy_(part(full.q_norm_weight, ours.q_width))
        ours.k_norm_weight.copy_(part(full.k_norm_weight, ours.kv_width))
        ours.o_proj.weight.copy_(part(full.o_proj.weight.t(), ours.q_width).t())
    return ours.to(full.qkv_proj.weight.device)


def from_hf(hf_attention: nn.Module, cfg: ReferenceConfig) -> Attention:
    """Our attention with the weights of HF's MiniMaxM2Attention (q/k/v projections fused)."""
    return paged_kv.load_hf_attention(Attention(cfg), hf_attention)


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
