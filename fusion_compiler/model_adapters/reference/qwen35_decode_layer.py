"""Qwen3.5 (397B-A17B) reference decode layers: whole decoder layers of both kinds at real
widths, in plain torch.

Each layer runs as vLLM's Qwen3.5 decoder layer does at tensor-parallel size 1:

* residual add + input RMSNorm, Gemma style (``x * (1 + w)`` in fp32, one rounding: HF's
  ``Qwen3_5MoeRMSNorm``);
* the token mixer, by layer kind: "linear_attention" is the Gated DeltaNet of
  ``qwen35_gdn.py`` (conv and recurrent states in per-sequence slots); "full_attention" is
  the gated attention of ``qwen35.py`` (fused qkv, per-head Gemma q/k norms, partial NeoX
  RoPE, paged K/V cache, sigmoid output gate);
* residual add + post-attention RMSNorm (Gemma style);
* the MoE of ``moe.py``: HF's softmax router (top-10 of 512, renormalised), the routed experts
  (1024 wide), identical in every compile mode, and the shared expert (1024 wide) scaled by
  ``sigmoid(shared_expert_gate(x))``.

The real model repeats [3 linear, 1 full]; ``build`` takes any list of kinds, so each kind can
be measured alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from . import moe, paged_kv
from . import qwen35 as ref
from . import qwen35_gdn as gdn
from .paged_kv import ReferenceStep

LAYER_KINDS = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Config:
    attention: ref.ReferenceConfig
    linear_attention: gdn.GdnConfig
    moe: moe.MoEConfig


REAL = Config(
    ref.REAL,
    gdn.REAL,
    moe.MoEConfig(hidden_size=4096, num_experts=512, top_k=10, intermediate_size=1024, shared_intermediate_size=1024,
                  shared_expert_gate=True),
)  # fmt: skip
# The HF adapter's tiny MoE: 8 experts, top-2, 128 wide, a 128-wide gated shared expert.
TINY = dataclasses.replace(
    REAL, attention=ref.TINY, linear_attention=gdn.TINY,
    moe=dataclasses.replace(REAL.moe, hidden_size=256, num_experts=8, top_k=2, intermediate_size=128,
                            shared_intermediate_size=128),
)  # fmt: skip


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # the offset w of (1 + w), as HF stores it
        self.eps = eps

    def forward(self, x):
        return ref.gemma_rms_norm(x, self.weight, self.eps)


def decoder_layer(cfg: Config, kind: str, experts: str = "grouped") -> moe.MoEDecoderLayer:
    if kind not in LAYER_KINDS:
        raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {kind!r}")
    hidden, eps = cfg.attention.hidden_size, cfg.attention.rms_norm_eps
    if kind == "full_attention":
        attention, name = ref.Attention(cfg.attention), "self_attn"
    else:
        attention, name = gdn.GatedDeltaNet(cfg.linear_attention), "linear_attn"
    mlp = moe.SparseMoeBlock(cfg.moe, moe.SoftmaxTopkRouter(cfg.moe), experts)
    return moe.MoEDecoderLayer(GemmaRMSNorm(hidden, eps), attention, GemmaRMSNorm(hidden, eps), mlp, name)


class Stack(paged_kv.DecodeStack):
    """Layers of ``layer_kinds``: full-attention layers take the paged K/V caches in order, linear
    ones the GDN (conv, recurrent) states, all of them slot ``state_slots[t]`` for sequence t."""

    def __init__(self, cfg: Config, layer_kinds: Sequence[str], experts: str = "grouped"):
        super().__init__(cfg.attention, [decoder_layer(cfg, kind, experts) for kind in layer_kinds])
        self.layer_kinds = tuple(layer_kinds)
        self.linear_attention = cfg.linear_attention

    def forward(self, hidden, residual, positions, slots, block_table, seq_lens, k_caches, v_caches, conv_states,
                recurrent_states, state_slots, k_scale: float = 1.0, v_scale: float = 1.0):  # fmt: skip
        context_slots, context_valid = paged_kv.padded_context_of(block_table, seq_lens, self.cfg.block_size)
        kv_caches, gdn_states = iter(zip(k_caches, v_caches)), iter(zip(conv_states, recurrent_states))
        for kind, layer in zip(self.layer_kinds, self.layers):
            if kind == "full_attention":
                k_cache, v_cache = next(kv_caches)
                hidden, residual = layer(hidden, residual, self.cos_sin_cache, positions, slots, k_cache, v_cache,
                                         k_scale, v_scale, context_slots, context_valid)  # fmt: skip
            else:
                hidden, residual = layer(hidden, residual, *next(gdn_states), state_slots)
        return hidden + residual


def build(cfg: Config, layer_kinds: Sequence[str], *, experts: str = "grouped", device="cpu",
          dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Stack:  # fmt: skip
    """A stack of ``layer_kinds`` (e.g. ["linear_attention", "full_attention"]) with seeded random
    weights (``moe.build``). ``experts``: "compute" (the routed experts run) or "zeros" (stubbed,
    no expert weights)."""
    if not layer_kinds:
        raise ValueError("layer_kinds is empty: a stack needs at least one layer")
    return moe.build(lambda: Stack(cfg, layer_kinds, experts), device, dtype, seed)


def make_step(model: Stack, tokens: int = 2, context: int = 6, seed: int = 1) -> ReferenceStep:
    """One decode step of ``tokens`` sequences, on the model's device: random hidden / residual,
    a shuffled block table and random K/V caches for the full-attention layers, random GDN states
    in a pool of ``tokens + 2`` slots for the linear ones, and each sequence's distinct slot."""
    gen = torch.Generator().manual_seed(seed)
    dtype = model.layers[0].input_layernorm.weight.dtype
    full = model.layer_kinds.count("full_attention")
    kwargs = paged_kv.random_kv_step(model.cfg, full, tokens, context, dtype, gen)
    linear, num_slots, gdn_cfg = len(model.layer_kinds) - full, tokens + 2, model.linear_attention
    kwargs["conv_states"] = [torch.randn(gdn_cfg.conv_state_shape(num_slots), generator=gen).to(dtype)
                             for _ in range(linear)]  # fmt: skip
    # fp32, small (0.1 * randn), as tests/patterns/test_gdn.py seeds them.
    kwargs["recurrent_states"] = [0.1 * torch.randn(gdn_cfg.recurrent_state_shape(num_slots), generator=gen)
                                  for _ in range(linear)]  # fmt: skip
    kwargs["state_slots"] = torch.randperm(num_slots, generator=gen)[:tokens]
    return ReferenceStep(kwargs).to(model.cos_sin_cache.device)


def expected_sites(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per layer: the attention prologue (full attention; its q/k norms inside) or the GDN site
    (linear attention; its gated norm inside), both add + RMSNorm sites, the router."""
    attention = {name: 1 for name, m in model.named_modules() if isinstance(m, ref.Attention)}
    linear = {name: 1 for name, m in model.named_modules() if isinstance(m, gdn.GatedDeltaNet)}
    return moe.expected_sites(model, {"gqa_prologue": attention, "gdn": linear})
