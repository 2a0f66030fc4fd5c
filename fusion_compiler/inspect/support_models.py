"""The models of `fusion-compiler support` (docs/SUPPORT.md), at tiny widths for CPU.

Our three adapters bring their own tiny configs (``get_adapter(name).build_hf(size="tiny")``);
the others are transformers config files as a user would write them for
``fusion-compiler inspect --hf-config`` (tests write the same dicts to disk)."""

from __future__ import annotations

# transformers' qwen3_next at tiny widths (Qwen3.5's tiny dims); no adapter of ours names it.
QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 8, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
}  # fmt: skip

# transformers' deepseek_v3 (DeepSeek V3, Kimi-K2's code): MLA without the DSA indexer, the same
# grouped sigmoid routing; DeepSeek V3.2's tiny dims.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128,
    "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "n_routed_experts": 16,
    "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "first_k_dense_replace": 0, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False,
}  # fmt: skip

# transformers' qwen3_moe: per-head plain RMSNorm q/k norm, full NeoX RoPE, softmax top-k routing.
QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
}  # fmt: skip

# transformers' glm4_moe: partial RoPE (half the head), q/k norm, grouped sigmoid routing.
GLM4_MOE = {
    "model_type": "glm4_moe", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4,
    "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 0, "use_qk_norm": True,
    "partial_rotary_factor": 0.5,
}  # fmt: skip

# transformers' ernie4_5_moe (ERNIE-4.5-MoE): no q/k norm, GPT-J pairs turned in fp32 over the
# whole head, softmax routing with a correction bias and a clamped renormalisation, a shared expert.
ERNIE4_5_MOE = {
    "model_type": "ernie4_5_moe", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "moe_num_experts": 8, "moe_k": 2, "moe_num_shared_experts": 1, "moe_layer_start_index": 0,
    "max_position_embeddings": 256,
}  # fmt: skip


def _minimax_hf_default() -> dict:
    """Our MiniMax-M2.5 tiny widths under HF's default ``MiniMaxM2Config`` RoPE (RoPE over the
    whole head): the real checkpoint's partial rotary is the adapter's ``partial_rotary_factor``."""
    from ..model_adapters.minimax_m2 import TINY_CONFIG

    config = {**TINY_CONFIG, "model_type": "minimax_m2", "num_hidden_layers": 2}
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    del config["rotary_dim"]
    return config


# (row label, our adapter's name or a config dict), in the table's order.
def models() -> list[tuple[str, str | dict]]:
    return [
        ("DeepSeek V3.2", "deepseek-v3.2"),
        ("MiniMax-M2.5", "minimax-m2.5"),
        ("MiniMax-M2 (HF default config)", _minimax_hf_default()),
        ("Qwen3.5", "qwen3.5"),
        ("Qwen3-Next", QWEN3_NEXT),
        ("DeepSeek V3", DEEPSEEK_V3),
        ("Qwen3-MoE", QWEN3_MOE),
        ("GLM-4-MoE", GLM4_MOE),
        ("ERNIE-4.5-MoE", ERNIE4_5_MOE),
    ]
