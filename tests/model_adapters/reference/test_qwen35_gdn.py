"""The Qwen3.5 serving-engine GDN reference (model_adapters/reference/qwen35_gdn.py) against HF's
Qwen3_5MoeGatedDeltaNet decode (layer 0 of the tiny model, torch fallbacks: fla is absent).

HF prefills a batch of 2 sequences into its static cache; then both run 8 consecutive decode
steps, HF on its cache rows, the reference on state slots [3, 1] of 5 (the other slots hold
random values and must not change). HF rounds the conv output, beta and the gated norm to bf16
where the reference stays fp32 (module docstring): outputs agree to bf16 tolerance, the fp32
recurrent states to what those roundings feed into them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusion_compiler.model_adapters import get_adapter, make_decode_step
from fusion_compiler.model_adapters.reference import qwen35_gdn as ref
from fusion_compiler.verify import relative_error

STEPS, SLOTS, NUM_SLOTS = 8, torch.tensor([3, 1]), 5


@pytest.fixture(scope="module")
def hf_tiny():
    model = get_adapter("qwen3.5").build_hf(size="tiny", layers=4, dtype=torch.bfloat16)
    assert model.config.layer_types[0] == "linear_attention"
    step = make_decode_step(model, batch=2)
    return model, step.cache


def _decode_both(model, cache, cfg: ref.GdnConfig):
    hf_gdn = model.model.layers[0].linear_attn
    layer = cache.layers[0]
    hf_conv, hf_rec = layer.conv_states[0], layer.recurrent_states[0]
    hf_conv0, hf_rec0 = hf_conv.clone(), hf_rec.clone()
    ours = ref.from_hf(hf_gdn, cfg)
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(cfg.conv_state_shape(NUM_SLOTS), generator=gen).bfloat16()
    rec = torch.randn(cfg.recurrent_state_shape(NUM_SLOTS), generator=gen)
    conv[SLOTS], rec[SLOTS] = hf_conv[:, :, -cfg.state_width :], hf_rec
    pristine = conv.clone(), rec.clone()
    outs = []
    try:
        with torch.no_grad():
            for _ in range(STEPS):
                x = torch.randn(2, 1, cfg.hidden_size, generator=gen).bfloat16()
                hf_out = hf_gdn(x, cache_params=cache)
                out = ours(x[:, 0], conv, rec, SLOTS)
                outs.append((out, hf_out[:, 0]))
        states = (conv, rec, hf_conv.clone(), hf_rec.clone(), pristine)
    finally:  # the module-scoped cache goes back to its post-prefill state
        hf_conv.copy_(hf_conv0)
        hf_rec.copy_(hf_rec0)
    return outs, states


@pytest.mark.parametrize("width", ["vllm", "hf"])
def test_reference_decode_equals_hf_over_eight_steps(hf_tiny, width):
    model, cache = hf_tiny
    cfg = ref.config_of(model.config)
    if width == "hf":
        cfg = dataclasses.replace(cfg, conv_state_width=cfg.conv_kernel)
    assert (cfg.state_width, cfg.num_value_heads // cfg.num_key_heads) == (3 if width == "vllm" else 4, 2)
    outs, (conv, rec, hf_conv, hf_rec, pristine) = _decode_both(model, cache, cfg)
    for out, hf_out in outs:
        assert relative_error(out, hf_out) < 2e-2  # measured 5.8e-3 .. 8.6e-3 (HF's bf16 roundings)
    assert torch.equal(conv[SLOTS], hf_conv[:, :, -cfg.state_width :])  # the inputs, shifted
    assert relative_error(rec[SLOTS], hf_rec) < 1e-2  # measured 4.1e-3 after 8 steps
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[SLOTS] = False
    assert torch.equal(conv[untouched], pristine[0][untouched])
    assert torch.equal(rec[untouched], pristine[1][untouched])


def test_without_the_l2norm_the_reference_departs_from_hf(hf_tiny, monkeypatch):
    """The comparison above is sharp enough to see a missing step."""
    model, cache = hf_tiny
    monkeypatch.setattr(ref, "l2norm", lambda x, eps=ref.QK_L2NORM_EPS: x)
    outs, _ = _decode_both(model, cache, ref.config_of(model.config))
    assert max(relative_error(out, hf_out) for out, hf_out in outs) > 0.1


def test_configs():
    assert ref.REAL.conv_dim == 2 * 16 * 128 + 64 * 128 == 12288
    assert ref.REAL.recurrent_state_shape(8) == (8, 64, 128, 128)
    assert ref.REAL.conv_state_shape(8) == (8, 12288, 3)
    real = get_adapter("qwen3.5").hf_config(size="real", layers=4)
    assert ref.config_of(real) == ref.REAL
    tiny = get_adapter("qwen3.5").hf_config(size="tiny", layers=4)
    assert ref.config_of(tiny) == ref.TINY
    with pytest.raises(ValueError, match="evenly"):
        ref.GdnConfig(hidden_size=8, num_key_heads=3, num_value_heads=4, key_head_dim=2, value_head_dim=2)
