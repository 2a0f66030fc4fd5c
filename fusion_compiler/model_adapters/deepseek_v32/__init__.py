"""DeepSeek V3.2 (``deepseek_v32``): MLA + DSA indexer attention, grouped sigmoid-routed MoE."""

from __future__ import annotations

from ..base import ModelAdapter, structural_sites

# Real widths: hub config.json / config_671B_v3.2.json (docs/MODELS.md section 1).
# `first_k_dense_replace` is 3 in the checkpoint (layers 0-2 use a dense 18432 MLP); we override it
# to 0 so that every layer of a short stack is the MoE layer that dominates the model.
REAL_CONFIG: dict = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "first_k_dense_replace": 0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# Tiny widths for CPU. Same structure and RoPE (yarn factor 40 over 4096 -> 163840, so the mscale
# softmax scale is exercised and HF does not warn about a factor mismatch). HF constraints:
# qk_rope_head_dim even (interleaved pairs) and <= index_head_dim (the indexer ropes the first
# qk_rope_head_dim dims of its heads); n_routed_experts divisible by n_group with >= 2 experts per
# group (group score = sum of top-2); topk_group >= 2 like the real 4 of 8, because with 1 Inductor
# rewrites the group mask's scatter into a single eq/where and the routing graph is not the real
# one. index_topk 8 < decode context so the DSA mask really is sparse.
TINY_CONFIG: dict = {
    **REAL_CONFIG,
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,  # unused: every layer is MoE
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "index_n_heads": 8,
    "index_head_dim": 64,
    "index_topk": 8,
}


def layer_kinds(config) -> list[str]:
    """"moe" for sparse-MLP layers, "dense" for the dense-MLP ones (none with our override)."""
    return ["moe" if t == "sparse" else "dense" for t in config.mlp_layer_types[: config.num_hidden_layers]]


ADAPTER = ModelAdapter(
    name="deepseek-v3.2",
    model_type="deepseek_v32",
    real_config=REAL_CONFIG,
    tiny_config=TINY_CONFIG,
    default_layers=2,
    layer_kind_fn=layer_kinds,
    # Per attention: kv and q sites, the indexer's k and q sites (mla_prologue, which takes
    # kv_a_layernorm); routing; every other RMSNorm that runs.
    expected_fn=structural_sites,
)
