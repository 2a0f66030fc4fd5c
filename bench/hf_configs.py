"""Real-width transformers configs of the models the benches build from a config alone (no
adapter of ours, no reference layer): HF's code at the released checkpoint's widths, random
weights. Keys are those of the installed config classes (``transformers.Qwen3MoeConfig``,
``transformers.Glm4MoeConfig``): RoPE in ``rope_parameters``; ``head_dim`` is no declared field of
either class but both models read it (``getattr(config, "head_dim", ...)``). The stack builder
sets ``num_hidden_layers``.

:func:`tiny` shrinks one to CPU widths and keeps everything else (routing, RoPE, norms)."""

from __future__ import annotations

import copy

# Qwen3-235B-A22B: GQA with per-head q/k RMSNorm, full RoPE, softmax top-8 of 128 experts.
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 4096, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
    "intermediate_size": 12288, "norm_topk_prob": True, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}  # fmt: skip

# GLM-4.5: GQA with q/k norm, RoPE over half the head, grouped sigmoid top-8 of 160 experts plus a
# shared expert. first_k_dense_replace 0: every layer of a bench stack is an MoE layer.
GLM4_MOE = {
    "model_type": "glm4_moe", "hidden_size": 5120, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "use_qk_norm": True, "n_routed_experts": 160, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "intermediate_size": 12288,
    "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "vocab_size": 151552, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    "max_position_embeddings": 131072, "tie_word_embeddings": False,
}  # fmt: skip

# Bench name -> real config.
CONFIGS = {"qwen3-moe": QWEN3_MOE, "glm4-moe": GLM4_MOE}

# The widths `tiny` replaces, where a config has the key.
_TINY_WIDTHS = {
    "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_experts": 16, "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
    "intermediate_size": 512, "vocab_size": 512,
}  # fmt: skip


def tiny(config: dict) -> dict:
    """``config`` at CPU widths (a new dict): every width of ``_TINY_WIDTHS`` it has replaced."""
    return {**copy.deepcopy(config), **{key: value for key, value in _TINY_WIDTHS.items() if key in config}}
