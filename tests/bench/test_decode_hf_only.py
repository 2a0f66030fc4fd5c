"""bench/decode.py's HF-only models (qwen3-moe, glm4-moe; configs in bench/hf_configs.py): each
builds at tiny widths through decode's HF builder as a stack of MoE decoder layers with every
site expected, their real configs use the installed config classes' keys, and the reference
source, which has no layer for them, is refused with that reason."""

from __future__ import annotations

import os
import sys

import pytest
from transformers import AutoConfig

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import decode  # noqa: E402
import hf_configs  # noqa: E402


@pytest.mark.parametrize("model", decode.HF_ONLY)
def test_builds_a_tiny_stack_of_moe_layers(model):
    stack = decode.build_hf(model, ("moe", "moe"), "tiny", "cpu", "compute")
    config = stack.model.config
    tiny = hf_configs.tiny(hf_configs.CONFIGS[model])
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == (tiny["model_type"], 2, tiny["hidden_size"])
    assert stack.experts == (16, 4) and stack.expert_bytes > 0
    for family in ("gqa_prologue", "moe_routing", "moe_experts"):
        assert len(stack.expected[family]) == 2, (family, stack.expected)
    assert len(stack.expected["add_rms_norm"]) == 5  # two per layer and the final norm


def test_stubbed_experts_are_no_site():
    stack = decode.build_hf("glm4-moe", ("moe",), "tiny", "cpu", "zeros")
    assert stack.expert_bytes == 0 and not stack.expected.get("moe_experts")
    assert len(stack.expected["moe_routing"]) == 1


@pytest.mark.parametrize("model", decode.HF_ONLY)
def test_real_config_keys_are_the_config_class_fields(model):
    real = dict(hf_configs.CONFIGS[model])
    model_type = real.pop("model_type")
    config = AutoConfig.for_model(model_type, num_hidden_layers=2, **real)
    fields = {name for cls in type(config).__mro__ for name in getattr(cls, "__annotations__", {})}
    # head_dim: no declared field of either class; both models read it with getattr.
    assert set(real) - fields == {"head_dim"}
    assert config.head_dim == 128 and config.rope_parameters["rope_theta"] == 1e6
    assert config.rope_parameters.get("partial_rotary_factor", 1.0) == (0.5 if model == "glm4-moe" else 1.0)


def test_reference_source_is_refused_with_the_reason(capsys):
    with pytest.raises(SystemExit) as exit_:
        decode.main(["--smoke", "--models", "minimax-m2.5", "qwen3-moe", "--sources", "reference", "hf"])
    assert exit_.value.code == 2
    assert "no reference layer for qwen3-moe" in capsys.readouterr().err


def test_default_sources_give_hf_only_models_their_hf_case():
    assert decode.select_cases(None, ["minimax-m2.5", "glm4-moe"], None) == [
        ("reference", "minimax-m2.5", "moe"), ("hf", "minimax-m2.5", "moe"), ("hf", "glm4-moe", "moe")]  # fmt: skip
