"""MiniMax-M2.5 reference decode layers: whole decoder layers at real widths, in plain torch.

Each layer runs as vLLM's MiniMax-M2 decoder layer does at tensor-parallel size 1:

* residual add + input RMSNorm (HF's ``MiniMaxM2RMSNorm``: fp32, rounded, then times the weight);
* the serving-engine attention of ``minimax_m2.py``: fused qkv GEMM, q/k RMSNorm over the whole
  projections, partial NeoX RoPE, paged K/V cache, decode attention (an opaque op, identical in
  every compile mode), o_proj;
* residual add + post-attention RMSNorm;
* the MoE of ``moe.py``: HF's sigmoid + correction-bias router (top-8 of 256, renormalised, no
  scaling) and the routed experts (1536 wide), identical in every compile mode. No shared expert.

``build`` makes a stack of such layers with random weights; ``make_step`` the inputs of one
decode step (one token per sequence) with random paged caches.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import minimax_m2 as ref
from . import moe, paged_kv
from .paged_kv import ReferenceStep


@dataclasses.dataclass(frozen=True)
class Config:
    attention: ref.ReferenceConfig
    moe: moe.MoEConfig


REAL = Config(ref.REAL, moe.MoEConfig(hidden_size=3072, num_experts=256, top_k=8, intermediate_size=1536))
# The HF adapter's tiny MoE (8 experts, top-2, 128 wide) over the reference's tiny attention.
TINY = dataclasses.replace(
    REAL, attention=ref.TINY,
    moe=dataclasses.replace(REAL.moe, hidden_size=256, num_experts=8, top_k=2, intermediate_size=128),
)  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return ref.rms_norm(x, self.weight, self.eps)


def decoder_layer(cfg: Config, experts: str = "grouped") -> moe.MoEDecoderLayer:
    attention = cfg.attention
    return moe.MoEDecoderLayer(
        RMSNorm(attention.hidden_size, attention.rms_norm_eps),
        ref.Attention(attention),
        RMSNorm(attention.hidden_size, attention.rms_norm_eps),
        moe.SparseMoeBlock(cfg.moe, moe.SigmoidTopkRouter(cfg.moe), experts),
    )


def build(cfg: Config, num_layers: int, *, experts: str = "grouped", device="cpu", dtype: torch.dtype = torch.bfloat16,
          seed: int = 0) -> paged_kv.DecodeStack:  # fmt: skip
    """``num_layers`` decoder layers with seeded random weights (``moe.build``). ``experts``:
    "compute" (the routed experts run) or "zeros" (stubbed, no expert weights)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")

    def stack():
        return paged_kv.DecodeStack(cfg.attention, [decoder_layer(cfg, experts) for _ in range(num_layers)])

    return moe.build(stack, device, dtype, seed)


def make_step(model: paged_kv.DecodeStack, tokens: int = 2, context: int = 6, seed: int = 1) -> ReferenceStep:
    """One decode step of ``tokens`` sequences with ``context`` cached tokens each, on the model's
    device: random hidden / residual, a shuffled block table, random K/V caches per layer."""
    gen = torch.Generator().manual_seed(seed)
    dtype = model.layers[0].input_layernorm.weight.dtype
    kwargs = paged_kv.random_kv_step(model.cfg, len(model.layers), tokens, context, dtype, gen)
    return ReferenceStep(kwargs).to(model.cos_sin_cache.device)


def expected_sites(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per layer: the attention prologue (its q/k norms inside), both add + RMSNorm sites, the router."""
    attention = {name: 1 for name, m in model.named_modules() if isinstance(m, ref.Attention)}
    return moe.expected_sites(model, {"gqa_prologue": attention})
