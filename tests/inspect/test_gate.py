"""The numerics gate of `inspect` (fusion_compiler/inspect/gate.py): it names a broken lowering."""

from __future__ import annotations

import json

import pytest
import torch

from fusion_compiler.inspect import gate

LLAMA = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
}  # fmt: skip


def test_threshold_is_one_and_a_half_stock_never_under_1e_2():
    assert gate.threshold(0.0) == 1e-2
    assert gate.threshold(6.9e-3) == pytest.approx(1.035e-2)


def test_gate_names_add_rms_norm_when_its_lowering_is_broken(tmp_path, monkeypatch):
    """add_rms_norm's CPU implementation (its reference) scaled by 1.1: ours is ~10% from eager
    (the final norm alone scales the logits), stock Inductor is not; the float64 run clears eager,
    and turning add_rms_norm alone off brings ours back under the threshold."""
    from fusion_compiler.inspect.run import inspect_model
    from fusion_compiler.model_adapters import adapter_from_hf_config
    from fusion_compiler.ops import rms_norm

    honest = rms_norm.add_rms_norm_reference

    def broken(*args, **kwargs):
        out, s = honest(*args, **kwargs)
        return out * 1.1, s

    monkeypatch.setattr(rms_norm, "add_rms_norm_reference", broken)
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    result = inspect_model(adapter_from_hf_config(path), "tiny", 2, "cpu", compile_timing=False)
    numerics = result["numerics_gate"]
    assert numerics["fired"] and numerics["ours"] > 5e-2, numerics
    assert numerics["responsible"] == ["add_rms_norm"], numerics
    assert numerics["float64"]["eager"] < 1e-2 and numerics["flips"] == []
    (fix,) = [b for b in numerics["bisect"] if b["stage"] == "add_rms_norm"]
    assert fix["error"] <= numerics["threshold"]
    assert "family add_rms_norm (turning it off gives" in numerics["verdict"], numerics["verdict"]


def test_routing_flips_name_layer_row_experts_and_margin():
    logits = torch.zeros(2, 8, dtype=torch.float64)
    logits[1, 0], logits[1, 4] = 1.0, 1.0006
    eager = {0: {"ids": torch.tensor([[1, 2], [0, 7]])}}
    exact = {0: {"ids": torch.tensor([[2, 1], [7, 4]]), "scores": logits}}
    (flip,) = gate.routing_flips(eager, exact)
    assert (flip.layer, flip.row, flip.eager, flip.float64) == (0, 1, [0, 7], [4, 7])
    assert flip.words() == "layer 0 row 1 (experts [0, 7] vs [4, 7], margin 6.0e-04)"
