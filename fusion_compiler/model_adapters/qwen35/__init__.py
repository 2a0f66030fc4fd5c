"""Qwen3.5-397B-A17B MoE, text part (``qwen3_5_moe_text`` -> ``Qwen3_5MoeForCausalLM``):
3 Gated-DeltaNet layers then 1 gated full-attention layer, repeated; softmax MoE + gated shared expert.

``qwen3_5_moe`` is the VLM wrapper; we build its text config only.
"""

from __future__ import annotations

from ..base import ModelAdapter, structural_sites

FULL_ATTENTION_INTERVAL = 4


def layer_types(num_layers: int) -> list[str]:
    """The real pattern truncated to ``num_layers``: layer i is full attention iff i % 4 == 3."""
    return [
        "full_attention" if i % FULL_ATTENTION_INTERVAL == FULL_ATTENTION_INTERVAL - 1 else "linear_attention"
        for i in range(num_layers)
    ]


# Real widths (docs/MODELS.md section 1). Text-only inputs make M-RoPE plain RoPE.
REAL_CONFIG: dict = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "tie_word_embeddings": False,
}

# Tiny: rotary dim 64*0.25 = 16, so the M-RoPE sections must sum to 8.
TINY_CONFIG: dict = {
    **REAL_CONFIG,
    "vocab_size": 512,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
}


def _layer_config(cfg: dict, num_layers: int) -> dict:
    return {"layer_types": layer_types(num_layers)}


def layer_kinds(config) -> list[str]:
    """"linear_attention" / "full_attention" per layer (config.layer_types)."""
    return list(config.layer_types[: config.num_hidden_layers])


ADAPTER = ModelAdapter(
    name="qwen3.5",
    model_type="qwen3_5_moe_text",
    real_config=REAL_CONFIG,
    tiny_config=TINY_CONFIG,
    default_layers=4,
    layer_kind_fn=layer_kinds,
    layer_config_fn=_layer_config,
    # Full-attention layers: gqa_prologue (partial rotary, q/k norms); GDN layers: gdn, which
    # takes their gated norm.
    expected_fn=structural_sites,
)
