"""MiniMax-M2.5 (``minimax_m2``): GQA with full-width QK RMSNorm and partial RoPE, sigmoid MoE."""

from __future__ import annotations

from ..base import ModelAdapter, qk_norm_attention_sites

# Real widths (docs/MODELS.md section 1). PITFALL: the hub keys `rope_theta` + `rotary_dim: 64`
# make transformers 5.17 rope all 128 dims; the explicit `partial_rotary_factor` 0.5 is what gives
# the real 64-dim partial RoPE. `use_qk_norm` / `qk_norm_type` / `rotary_dim` / `scoring_func` /
# `use_routing_bias` are informational (HF always applies the per-layer full-width q/k norm and the
# sigmoid + e_score_correction_bias router); they are kept so the config reads like the hub's.
REAL_CONFIG: dict = {
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,  # per expert
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 196608,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "tie_word_embeddings": False,
    "bos_token_id": 200034,
    "eos_token_id": 200020,
}

# Tiny: q width 4*64 = 256 (= hidden here), k width 2*64 = 128, rotary 32 of 64 dims.
TINY_CONFIG: dict = {
    **REAL_CONFIG,
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rotary_dim": 32,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def layer_kinds(config) -> list[str]:
    """Every MiniMax-M2 layer is full attention + MoE."""
    return ["moe"] * int(config.num_hidden_layers)


ADAPTER = ModelAdapter(
    name="minimax-m2.5",
    model_type="minimax_m2",
    real_config=REAL_CONFIG,
    tiny_config=TINY_CONFIG,
    default_layers=2,
    layer_kind_fn=layer_kinds,
    expected_fn=qk_norm_attention_sites,
)
