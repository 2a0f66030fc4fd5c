"""The MiniMax-M2.5 serving-engine reference attention (model_adapters/reference/minimax_m2.py)
against HF's MiniMaxM2Attention, and its paged KV-cache writes.

HF runs a causal prefill of a whole sequence; the reference decodes the same tokens one at a
time, writing each token's K/V into a paged cache (scattered blocks) and attending over it.
Row p of HF's output must equal the reference's step p (bf16: RoPE rounds once here and after
each product in HF: 2.7e-3 relative on the tiny model).
"""

from __future__ import annotations

import pytest
import torch

from fusion_compiler.model_adapters import get_adapter
from fusion_compiler.model_adapters.reference import minimax_m2 as ref
from fusion_compiler.verify import relative_error
from gqa_fixtures import assert_prologue_writes_only_its_slots, paged_decode


@pytest.fixture(scope="module")
def hf_tiny():
    model = get_adapter("minimax-m2.5").build_hf(size="tiny", layers=1, dtype=torch.bfloat16)
    return model, model.model.layers[0].self_attn


def test_reference_decode_equals_hf_prefill(hf_tiny):
    model, hf_attn = hf_tiny
    cfg = ref.config_of(model.config, block_size=4)
    assert cfg.rotary_dim == 32  # partial: 32 of 64 dims (TINY_CONFIG's partial_rotary_factor 0.5)
    ours = ref.from_hf(hf_attn, cfg)
    x = torch.randn(1, 9, cfg.hidden_size, dtype=torch.bfloat16)
    positions = torch.arange(9)[None]
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, positions)
        hf_out, _ = hf_attn(x, (cos, sin), attention_mask=None)
        ours_out, *_ = paged_decode(ref, ours, cfg, x[0])
    assert relative_error(ours_out, hf_out[0]) < 1e-2  # measured 2.7e-3; full-width RoPE gives 0.24


def test_cache_writes_only_the_tokens_slots():
    assert_prologue_writes_only_its_slots(ref)


def test_fp8_cache_round_trips_within_fp8_precision(hf_tiny):
    model, hf_attn = hf_tiny
    cfg = ref.config_of(model.config, block_size=4, kv_cache_dtype="fp8")
    ours = ref.from_hf(hf_attn, cfg)
    bf16 = ref.config_of(model.config, block_size=4)
    x = torch.randn(6, cfg.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        out_fp8, k_cache, *_ = paged_decode(ref, ours, cfg, x, k_scale=0.05, v_scale=0.02)
        out_bf16, *_ = paged_decode(ref, ref.from_hf(hf_attn, bf16), bf16, x)
    assert k_cache.dtype == ref.FP8
    assert relative_error(out_fp8, out_bf16) < 0.1  # e4m3 keeps 3 mantissa bits
