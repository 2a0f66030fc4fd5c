"""Config files of models we have no adapter for, as tests write them to disk (tiny widths)."""

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
