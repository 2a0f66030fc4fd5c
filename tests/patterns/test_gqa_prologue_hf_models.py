"""The GQA prologue on HF's own models beyond MiniMax and Qwen3.5 (issue 29): per-head plain q/k
norms (Qwen3-MoE, GLM-4-MoE with use_qk_norm) and no q/k norms (Mixtral, GLM-4-MoE's default).

- HF's own ``qwen3_moe`` (full NeoX RoPE) and ``glm4_moe`` (``use_qk_norm``, RoPE over half the
  head) at the support matrix's tiny widths (fusion_compiler/inspect/support_models.py), and
  ``mixtral`` (no q/k norm, full RoPE, as Qwen2-MoE and Llama) and ``glm4_moe`` with
  ``use_qk_norm=False`` (no q/k norm, half the head), one bf16 decode step on HF's static cache,
  strict against the expectations read from the module tree: one gqa_prologue per attention
  layer, the q/k norms inside it where there are some (add_rms_norm takes the other norms only),
  logits within bf16 tolerance of eager's, the new cache rows close to eager's and every other
  cache byte unchanged.
- Near misses in HF's layout: a per-head norm applied after RoPE with none before (nothing to
  fuse: the cached rows are a norm's, not a rotation's), GPT-J's interleaved RoPE without a norm
  (a miss in those words). The plain per-head norm, or none, into a paged cache (serving code) is
  a miss in words: tests/patterns/test_gqa_prologue.py.
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
from fusion_compiler.patterns import add_rms_norm, gqa_prologue, mla_prologue
from fusion_compiler.verify import relative_error
from gqa_fixtures import assert_hf_caches, assert_missed, compile_beside_eager
from model_configs import GLM4_MOE, QWEN3_MOE

FAMILY = "gqa_prologue"
MIXTRAL = dict(model_type="mixtral", vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
               tie_word_embeddings=False)  # fmt: skip
PER_HEAD = {"qwen3_moe": (QWEN3_MOE, "per_head.hf_full_rope"), "glm4_moe": (GLM4_MOE, "per_head.hf")}
NO_NORM = {"mixtral": (MIXTRAL, "none.hf_full_rope"), "glm4_moe_no_qk_norm": (dict(GLM4_MOE, use_qk_norm=False), "none.hf")}
CONFIGS = {**PER_HEAD, **NO_NORM}


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


def _assert_every_layer_fuses(name: str) -> dict:
    run = decode_run(name)
    report, variant = run["report"], CONFIGS[name][1]
    layers = run["model"].config.num_hidden_layers
    assert run["expected"][FAMILY] == {f"model.layers.{i}.self_attn": 1 for i in range(layers)}
    assert report.misses(FAMILY) == [] and report.missing_expected() == [], report.format()
    assert report.expected_per_layer(FAMILY) == dict.fromkeys(range(layers), 1)
    assert report.per_variant()[variant] == layers
    # add_rms_norm fused exactly the decoder's own norms: the q/k norms (if any) went into the prologue.
    assert report.per_module("add_rms_norm") == run["expected"]["add_rms_norm"]
    assert not any(".q_norm" in m or ".k_norm" in m for m in report.per_module("add_rms_norm"))
    assert relative_error(run["fused"], run["eager"]) < 1e-2
    assert_hf_caches(run["eager_step"], run["fused_step"].cache, range(layers))
    return run


@pytest.mark.parametrize("name", sorted(PER_HEAD))
def test_every_attention_layer_fuses_its_per_head_plain_norm_prologue(name):
    config = _assert_every_layer_fuses(name)["model"].config
    assert name != "glm4_moe" or (config.use_qk_norm and config.partial_rotary_factor == 0.5)


@pytest.mark.parametrize("name", sorted(NO_NORM))
def test_every_attention_layer_without_qk_norms_fuses_its_prologue(name):
    config = _assert_every_layer_fuses(name)["model"].config
    assert name == "mixtral" or (not config.use_qk_norm and config.partial_rotary_factor == 0.5)


# ------------------------------------------------------------------------------------------
# Near misses: HF's layout and static cache
# ------------------------------------------------------------------------------------------


def _rope_gptj(x, cos, sin):
    """GPT-J's interleaved pairs on the first 2 * cos.shape[-1] dims (one angle a pair), the
    rest passed through."""
    rot = 2 * cos.shape[-1]
    return torch.cat([mla_prologue.rope_pairs(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


class NoNormPrologue(torch.nn.Module):
    """HF's attention prologue with no q/k norm before RoPE: NeoX (HF's ``rotate_half``, cos / sin
    ``cat(freqs, freqs)``) or GPT-J pairs over half the head; ``norm_after``: Qwen3-MoE's per-head
    norm moved after the (full) RoPE, so the cached K rows are a norm's output; ``offset_norm``: a
    per-head norm before RoPE with a weight offset no normed variant takes (0.5 + w)."""

    def __init__(self, rope: str = "neox", norm_after: bool = False, offset_norm: bool = False):
        super().__init__()
        self.rope, self.norm_after, self.offset_norm = rope, norm_after, offset_norm

    def forward(self, q, k, v, qw, kw, angles, k_cache, v_cache, positions):
        q, k, v = (x.view(1, x.shape[1], -1, 16) for x in (q, k, v))
        if self.offset_norm:
            q, k = ((add_rms_norm._normalize(x.float(), 1e-6) * (0.5 + w.float())).to(x.dtype) for x, w in ((q, qw), (k, kw)))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rope == "gptj":
            cos, sin = (f(angles[..., :4]).to(q.dtype).unsqueeze(1) for f in (torch.cos, torch.sin))
            q, k = _rope_gptj(q, cos, sin), _rope_gptj(k, cos, sin)
        else:
            emb = torch.cat([angles, angles], dim=-1)
            cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
            q, k = gqa_prologue.rope_full_hf(q, cos, sin), gqa_prologue.rope_full_hf(k, cos, sin)
        if self.norm_after:
            q = add_rms_norm.hf(q.transpose(1, 2), qw, 1e-6).transpose(1, 2)
            k = add_rms_norm.hf(k.transpose(1, 2), kw, 1e-6).transpose(1, 2)
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        return q


def _compiled(module, lowering: str = "triton"):
    torch.manual_seed(0)
    t, d = 2, 16
    q, k, v = (torch.randn(1, t, h * d, dtype=torch.bfloat16) for h in (4, 2, 2))
    qw, kw = torch.randn(d, dtype=torch.bfloat16), torch.randn(d, dtype=torch.bfloat16)
    angles = torch.rand(1, t, d // 2) * 10
    caches = [torch.randn(1, 2, 8, d, dtype=torch.bfloat16) for _ in range(2)]
    args = (q, k, v, qw, kw, angles)
    return compile_beside_eager(module, args, caches, torch.tensor([3, 4]), {"mla_prologue": "off", FAMILY: lowering})


@pytest.mark.parametrize("lowering", ["triton", "inductor"])
def test_the_no_norm_spelling_fuses(lowering):
    """The op (Triton), or its canonical decomposition with no norm weights (Inductor), within
    bf16 tolerance of eager (``compile_beside_eager``)."""
    assert _compiled(NoNormPrologue(), lowering).per_variant() == {"none.hf_full_rope": 1}


def test_per_head_norm_after_rope_does_not_fuse():
    report = _compiled(NoNormPrologue(norm_after=True))
    assert report.per_module(FAMILY) == {} and report.misses(FAMILY) == [], report.format()


def test_a_declined_norm_before_rope_is_not_left_out_by_the_no_norm_variants():
    """Every normed variant declines a 0.5 + w norm; the no-norm one fits from RoPE on and must
    decline too (fusing it would be right, but would hide the norm's miss)."""
    report = _compiled(NoNormPrologue(offset_norm=True))
    [miss] = report.misses(FAMILY)
    assert report.per_module(FAMILY) == {} and "an RMS norm sits between the projection and RoPE of q and k" in miss.reason


def test_interleaved_gptj_rope_without_a_norm_is_a_miss_in_words():
    assert_missed(_compiled(NoNormPrologue("gptj")), "interleaved (GPT-J) RoPE")
