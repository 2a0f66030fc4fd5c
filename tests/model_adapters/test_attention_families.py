"""Which prologue family an attention is expected to take comes from what it computes, never from
the model's name (model_adapters.base.attention_families / structural_sites), and the misses
say why in words.

* Transformers' own classes at tiny widths (no compile): MLA with RoPE -> mla_prologue (DeepSeek
  V3, V3.2); per-head K/V with q/k norms -> gqa_prologue whatever the rotary dim (MiniMax-M2 on
  its own config and HF's default, Qwen3-MoE, GLM-4-MoE with use_qk_norm, Qwen3-Next's and
  Qwen3.5's full attention), and without q/k norms where the code ropes with HF's rotate_half
  (Mixtral, GLM-4-MoE without use_qk_norm; GLM-4's GPT-J pairs); no q/k norms and another RoPE ->
  no family, with the reason (gpt-oss).
* Qwen3-MoE compiled through the backend with those expectations: the attention's gqa_prologue
  site fuses (its per-head plain-weight q/k norms, full RoPE), and the RoPE rotations are not
  reported as mla_prologue candidates.
"""

from __future__ import annotations

import json

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import adapter_from_hf_config, attention_families, get_adapter
from model_configs import DEEPSEEK_V3, QWEN3_NEXT

_TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)  # fmt: skip
QWEN3_MOE = dict(_TINY, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
GLM4_MOE = dict(_TINY, model_type="glm4_moe", n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                n_group=2, topk_group=1, moe_intermediate_size=64, first_k_dense_replace=0, use_qk_norm=True,
                partial_rotary_factor=0.5)  # fmt: skip


def _hf(config: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields), dtype=torch.bfloat16)


def _families(model) -> dict:
    return {name: family for name, (family, _) in attention_families(model).items()}


@pytest.mark.parametrize("build, family", [
    (lambda: get_adapter("deepseek-v3.2").build_hf(size="tiny", layers=1), "mla_prologue"),
    (lambda: _hf(DEEPSEEK_V3), "mla_prologue"),
    (lambda: get_adapter("minimax-m2.5").build_hf(size="tiny", layers=1), "gqa_prologue"),
    (lambda: _hf(dict(_TINY, model_type="minimax_m2", num_local_experts=4, num_experts_per_tok=2)), "gqa_prologue"),
    (lambda: _hf(QWEN3_MOE), "gqa_prologue"),
    (lambda: _hf(GLM4_MOE), "gqa_prologue"),
    (lambda: _hf(dict(QWEN3_NEXT, num_hidden_layers=4)), "gqa_prologue"),
    (lambda: get_adapter("qwen3.5").build_hf(size="tiny", layers=4), "gqa_prologue"),
    (lambda: _hf(dict(_TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)), "gqa_prologue"),
    (lambda: _hf(dict(GLM4_MOE, use_qk_norm=False)), "gqa_prologue"),
    (lambda: _hf(dict(_TINY, model_type="glm4", pad_token_id=0)), "gqa_prologue"),
], ids=["deepseek-v3.2", "deepseek-v3", "minimax-m2.5", "minimax-hf-default", "qwen3-moe", "glm4-moe", "qwen3-next",
        "qwen3.5", "mixtral", "glm4-moe-without-qk-norm", "glm4"])  # fmt: skip
def test_attention_family_follows_the_math(build, family):
    families = _families(build())
    assert families and set(families.values()) == {family}, families


def test_no_family_applies_without_qk_norms_or_rotate_half_and_says_why():
    """gpt-oss: no q/k norms, and its RoPE (``_apply_rotary_emb``, chunked halves) is not HF's
    rotate_half spelling that the no-norm gqa_prologue variants are written as."""
    model = _hf(dict(_TINY, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2))
    [(family, why)] = attention_families(model).values()
    assert family is None and why.startswith("no family applies: ") and "q/k norms" in why and "rotate_half" in why


def test_qwen3_moe_prologue_fuses_and_is_no_mla_candidate(tmp_path):
    path = tmp_path / "qwen3_moe.json"
    path.write_text(json.dumps(dict(QWEN3_MOE, num_hidden_layers=2)))
    adapter = adapter_from_hf_config(path)
    model = adapter.build_hf(size="tiny", dtype=torch.bfloat16)
    expected = adapter.expected_sites(model)
    assert expected["gqa_prologue"] == {f"model.layers.{i}.self_attn": 1 for i in (0, 1)}
    assert "mla_prologue" not in expected
    from fusion_compiler.model_adapters import make_decode_step

    backend = fc.FusionBackend(fc.FusionConfig(expected=expected))
    torch._dynamo.reset()
    make_decode_step(model).run(torch.compile(model, backend=backend))
    report = backend.report
    assert not [s for s in report.sites if s.family == "mla_prologue"]
    assert report.misses("gqa_prologue") == [], report.format()
    assert report.per_module("gqa_prologue") == expected["gqa_prologue"]
    assert report.per_variant()["per_head.hf_full_rope"] == 2
    assert report.per_module("moe_experts") == expected["moe_experts"]


def _adapter(tmp_path, config: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return adapter_from_hf_config(path)


def test_a_class_that_rejects_sdpa_builds_with_eager_attention(tmp_path, caplog):
    """gpt-oss rejects SDPA: the generic adapter asks for it, and the build falls back, logged."""
    model = _adapter(tmp_path, dict(_TINY, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2)).build_hf()
    assert type(model).__name__ == "GptOssForCausalLM" and model.config._attn_implementation == "eager"
    assert "building it with eager attention" in caplog.text


def test_a_decoder_with_no_causal_lm_class_is_its_base_model_plus_a_head(tmp_path):
    """Qwen3-VL-MoE's text tower has no *ForCausalLM class: its base model plus a vocabulary
    head, module paths as a causal LM's; one compiled decode step fuses its routing and experts
    per layer and stays within 2e-2 of eager."""
    from fusion_compiler.model_adapters import make_decode_step
    from fusion_compiler.model_adapters.base import BaseModelWithHead
    from fusion_compiler.verify import relative_error

    text = dict(_TINY, model_type="qwen3_vl_moe_text", num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                           "mrope_section": [4, 6, 6]})  # fmt: skip
    adapter = _adapter(tmp_path, {"model_type": "qwen3_vl_moe", "text_config": text})
    model = adapter.build_hf(size="tiny", dtype=torch.bfloat16)
    assert isinstance(model, BaseModelWithHead)
    expected = adapter.expected_sites(model)
    layers = {f"model.layers.{i}.mlp.experts": 1 for i in (0, 1)}
    assert expected["moe_experts"] == layers
    backend = fc.FusionBackend(fc.FusionConfig(expected=expected))
    torch._dynamo.reset()
    eager = make_decode_step(model).run(model)
    fused = make_decode_step(model).run(torch.compile(model, backend=backend))
    assert backend.report.per_module("moe_experts") == layers
    assert backend.report.per_layer("moe_routing") == {0: 1, 1: 1}
    assert relative_error(fused, eager) < 2e-2
