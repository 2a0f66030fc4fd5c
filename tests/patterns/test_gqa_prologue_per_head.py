"""The GQA prologue with HF's plain per-head q/k norm (issue 29): Qwen3-MoE and GLM-4-MoE.

- HF's own ``qwen3_moe`` (full NeoX RoPE) and ``glm4_moe`` (``use_qk_norm``, RoPE over half the
  head) at the support matrix's tiny widths (fusion_compiler/inspect/support_models.py), one bf16
  decode step on HF's static cache, strict against the expectations read from the module tree:
  one gqa_prologue per attention layer, the q/k norms inside it (add_rms_norm takes the other
  norms only), logits within bf16 tolerance of eager's, the new cache rows close to eager's and
  every other cache byte unchanged.
- Near miss: the same per-head plain norm applied after RoPE (nothing to fuse: the cached rows
  are a norm's, not a rotation's). The plain per-head norm into a paged cache (serving code) is a
  miss in words: tests/patterns/test_gqa_prologue.py.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import adapter_from_hf_config, make_decode_step
from fusion_compiler.patterns import add_rms_norm, gqa_prologue
from fusion_compiler.verify import relative_error
from gqa_fixtures import assert_hf_caches, compile_beside_eager
from model_configs import GLM4_MOE, QWEN3_MOE

FAMILY = "gqa_prologue"
CONFIGS = {"qwen3_moe": (QWEN3_MOE, "per_head.hf_full_rope"), "glm4_moe": (GLM4_MOE, "per_head.hf")}


@functools.cache
def decode_run(name: str) -> dict:
    """HF's tiny model from its config file, eager and compiled on one decode step."""
    config, _ = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        adapter = adapter_from_hf_config(path)
    torch.manual_seed(0)
    model = adapter.build_hf(size="tiny", dtype=torch.bfloat16)
    for name_, param in model.named_parameters():  # norm weights away from their init of ones
        if name_.endswith(("q_norm.weight", "k_norm.weight")):
            torch.nn.init.normal_(param, 1.0, 0.2)
    expected = adapter.expected_sites(model)
    step = make_decode_step(model)
    fused_step = step.fresh()
    eager = step.run(model)
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    torch._dynamo.reset()
    fused = fused_step.run(torch.compile(model, backend=backend))
    return dict(model=model, expected=expected, report=backend.report, eager=eager, fused=fused, eager_step=step,
                fused_step=fused_step)  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_attention_layer_fuses_its_per_head_plain_norm_prologue(name):
    run = decode_run(name)
    report, variant = run["report"], CONFIGS[name][1]
    config = run["model"].config
    layers = config.num_hidden_layers
    assert name != "glm4_moe" or (config.use_qk_norm and config.partial_rotary_factor == 0.5)
    assert report.misses(FAMILY) == [] and report.missing_expected() == [], report.format()
    assert report.expected_per_layer(FAMILY) == dict.fromkeys(range(layers), 1)
    assert report.per_variant()[variant] == layers
    # The q/k norms went into the prologue: add_rms_norm fused exactly the decoder's own norms.
    assert report.per_module("add_rms_norm") == run["expected"]["add_rms_norm"]
    assert not any(".q_norm" in m or ".k_norm" in m for m in report.per_module("add_rms_norm"))
    assert relative_error(run["fused"], run["eager"]) < 1e-2
    assert_hf_caches(run["eager_step"], run["fused_step"].cache, range(layers))


# ------------------------------------------------------------------------------------------
# Near misses
# ------------------------------------------------------------------------------------------


class NormAfterRope(torch.nn.Module):
    """Qwen3-MoE's prologue with the per-head norm moved after the (full) RoPE: the cached K
    rows are a norm's output, not a rotation's."""

    def forward(self, q, k, v, qw, kw, cos, sin, k_cache, v_cache, positions):
        q, k, v = (x.view(1, x.shape[1], -1, 16).transpose(1, 2) for x in (q, k, v))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = add_rms_norm.hf(gqa_prologue.rope_full_hf(q, cos, sin).transpose(1, 2), qw, 1e-6).transpose(1, 2)
        k = add_rms_norm.hf(gqa_prologue.rope_full_hf(k, cos, sin).transpose(1, 2), kw, 1e-6).transpose(1, 2)
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        return q


def test_per_head_norm_after_rope_does_not_fuse():
    torch.manual_seed(0)
    t, d = 2, 16
    q, k, v = (torch.randn(1, t, h * d, dtype=torch.bfloat16) for h in (4, 2, 2))
    qw, kw = torch.randn(d, dtype=torch.bfloat16), torch.randn(d, dtype=torch.bfloat16)
    angles = torch.rand(1, t, d // 2) * 10
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    caches = [torch.randn(1, 2, 8, d, dtype=torch.bfloat16) for _ in range(2)]
    args = (q, k, v, qw, kw, cos, sin)
    report = compile_beside_eager(NormAfterRope(), args, caches, torch.tensor([3, 4]), {"mla_prologue": "off"})
    assert report.per_module(FAMILY) == {} and report.misses(FAMILY) == [], report.format()

