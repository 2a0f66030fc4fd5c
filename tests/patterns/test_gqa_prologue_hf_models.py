"""The GQA prologue on HF's own models beyond MiniMax and Qwen3.5 (issue 29): per-head plain q/k
norms (Qwen3-MoE, GLM-4-MoE with use_qk_norm), no q/k norms (Mixtral, GLM-4-MoE's default) and
no q/k norms with GPT-J's interleaved RoPE (GLM-4 over half the head; Helium, nightly, over all).

- HF's own ``qwen3_moe`` (full NeoX RoPE) and ``glm4_moe`` (``use_qk_norm``, RoPE over half the
  head) at the support matrix's tiny widths (fusion_compiler/inspect/support_models.py), and
  ``mixtral`` (no q/k norm, full RoPE, as Qwen2-MoE and Llama) and ``glm4_moe`` with
  ``use_qk_norm=False`` (no q/k norm, half the head), the dense ``glm4`` (no q/k norm, GPT-J pairs
  over half the head) and ``helium`` (GPT-J pairs over all of it), one bf16 decode step on HF's
  static cache,
  strict against the expectations read from the module tree: one gqa_prologue per attention
  layer, the q/k norms inside it where there are some (add_rms_norm takes the other norms only),
  logits within bf16 tolerance of eager's, the new cache rows close to eager's and every other
  cache byte unchanged.
- Near misses in HF's layout: a per-head norm applied after RoPE with none before (a miss in
  words: the cached rows are a norm's, not a rotation's); GPT-J pairs turned by a NeoX cos / sin
  layout (``cat([c, c])`` of the first half, or ``cat(freqs, freqs)`` as it is: the two lanes of a
  pair at different angles) and GPT-J pairs written as fp32 pair products (vLLM's
  ``forward_native`` on HF's cache), each a miss in words. The plain per-head norm, or none, into
  a paged cache (serving code) is a miss in words: tests/patterns/test_gqa_prologue.py.
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
# Imported here, not in forward: torch 2.11's Dynamo breaks the graph at an import statement.
from transformers.models.glm4 import modeling_glm4 as glm4
from gqa_fixtures import assert_hf_caches, assert_missed, compile_beside_eager
from model_configs import GLM4_MOE, QWEN3_MOE

FAMILY = "gqa_prologue"
MIXTRAL = dict(model_type="mixtral", vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
               tie_word_embeddings=False)  # fmt: skip
PER_HEAD = {"qwen3_moe": (QWEN3_MOE, "per_head.hf_full_rope"), "glm4_moe": (GLM4_MOE, "per_head.hf")}
NO_NORM = {"mixtral": (MIXTRAL, "none.hf_full_rope"), "glm4_moe_no_qk_norm": (dict(GLM4_MOE, use_qk_norm=False), "none.hf")}
# Dense, no q/k norms, GPT-J pairs: GLM-4 over half the head, Helium over all of it. A pad token
# inside the tiny vocabulary (their defaults lie beyond it).
_DENSE = {k: v for k, v in MIXTRAL.items() if k not in ("model_type", "num_local_experts", "num_experts_per_tok")}
GPTJ = {"glm4": (dict(_DENSE, model_type="glm4", partial_rotary_factor=0.5, pad_token_id=0), "none.hf_gptj"),
        "helium": (dict(_DENSE, model_type="helium", pad_token_id=0, bos_token_id=1, eos_token_id=2),
                   "none.hf_full_rope_gptj")}  # fmt: skip
# Logits against eager: bf16 tolerance; GLM-4's tiny step sits at 1.05e-2 fused, 9.7e-3 with stock
# Inductor (its RoPE and cache rows are eager's bits: assert_hf_caches).
LOGITS_TOLERANCE = {"glm4": 1.5e-2}
CONFIGS = {**PER_HEAD, **NO_NORM, **GPTJ}


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
    assert relative_error(run["fused"], run["eager"]) < LOGITS_TOLERANCE.get(name, 1e-2)
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


@pytest.mark.parametrize("name", ["glm4", pytest.param("helium", marks=pytest.mark.nightly)])
def test_every_attention_layer_with_gptj_pairs_fuses_its_prologue(name):
    """GLM-4: HF's ``rotate_half`` on x[..., 0::2] / x[..., 1::2], cos / sin's first half
    ``repeat_interleave``d, over half the head; Helium the same over the whole head."""
    config = _assert_every_layer_fuses(name)["model"].config
    rotary = config.rope_parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    assert rotary == (0.5 if name == "glm4" else 1.0)


# ------------------------------------------------------------------------------------------
# Near misses: HF's layout and static cache
# ------------------------------------------------------------------------------------------


def _rope_gptj(x, cos, sin):
    """GPT-J's interleaved pairs on the first 2 * cos.shape[-1] dims (one angle a pair), the
    rest passed through."""
    rot = 2 * cos.shape[-1]
    return torch.cat([mla_prologue.rope_pairs(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


def _rope_glm4(q, k, cos, sin, angles: str):
    """HF GLM-4's ``apply_rotary_pos_emb`` on cos / sin [B, S, rot] (``cat(freqs, freqs)``), its
    angles taken as GLM-4 takes them (``pairs``: the first half ``repeat_interleave``d) or in a
    NeoX layout on the same GPT-J pairs (``tiles``: ``cat([half, half])``; ``as_is``: cos / sin
    as they are): the two lanes of a pair then turn by different angles."""
    if angles == "pairs":
        return glm4.apply_rotary_pos_emb(q, k, cos, sin)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if angles == "tiles":
        cos, sin = (torch.cat([x[..., : x.shape[-1] // 2]] * 2, dim=-1) for x in (cos, sin))
    rot = cos.shape[-1]
    return tuple(torch.cat([x[..., :rot] * cos + glm4.rotate_half(x[..., :rot]) * sin, x[..., rot:]], dim=-1)
                 for x in (q, k))  # fmt: skip


class NoNormPrologue(torch.nn.Module):
    """HF's attention prologue with no q/k norm before RoPE: NeoX (HF's ``rotate_half``, cos / sin
    ``cat(freqs, freqs)``), GPT-J pairs as fp32 products over half the head (``gptj``), or HF
    GLM-4's GPT-J pairs over half the head (``glm4``, and its near misses ``glm4_tiles``,
    ``glm4_as_is``: ``_rope_glm4``); ``norm_after``: Qwen3-MoE's per-head
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
        elif self.rope.startswith("glm4"):
            emb = torch.cat([angles[..., :4], angles[..., :4]], dim=-1)  # RoPE over half the head
            angle_layout = self.rope.removeprefix("glm4").removeprefix("_") or "pairs"
            q, k = _rope_glm4(q, k, emb.cos().to(q.dtype), emb.sin().to(q.dtype), angle_layout)
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


def test_per_head_norm_after_rope_is_a_miss_in_words():
    """HunYuan's spelling: the cached K rows are a norm's, not a rotation's; never silent."""
    report = _compiled(NoNormPrologue(norm_after=True))  # add_rms_norm takes the norms
    [miss] = report.misses(FAMILY)
    assert report.per_module(FAMILY) == {} and "q/k are RMS-normalised after their RoPE" in miss.reason, report.format()


def test_a_declined_norm_before_rope_is_not_left_out_by_the_no_norm_variants():
    """Every normed variant declines a 0.5 + w norm; the no-norm one fits from RoPE on and must
    decline too (fusing it would be right, but would hide the norm's miss)."""
    report = _compiled(NoNormPrologue(offset_norm=True))
    [miss] = report.misses(FAMILY)
    assert report.per_module(FAMILY) == {} and "an RMS norm sits between the projection and RoPE of q and k" in miss.reason


# The canonical lowering's pairs: bit-equal to HF's in tests/ops/test_gqa_prologue.py; compiled here nightly.
@pytest.mark.parametrize("lowering", ["triton", pytest.param("inductor", marks=pytest.mark.nightly)])
def test_hf_glm4_gptj_pairs_fuse(lowering):
    assert _compiled(NoNormPrologue("glm4"), lowering).per_variant() == {"none.hf_gptj": 1}


# Both layouts take the same explain path; the tiled one nightly.
@pytest.mark.parametrize("rope", [pytest.param("glm4_tiles", marks=pytest.mark.nightly), "glm4_as_is"])
def test_gptj_pairs_under_a_neox_cos_layout_are_a_miss_in_words(rope):
    """GLM-4's pairs with cos / sin's first half tiled (``cat([half, half])``: Inductor keeps the
    cat) or cos / sin as they are: neither is the variant's pairwise repeat, and the miss says
    why (the guard's repeat check stands behind it: the tracer leaves the repeat's dims wildcards)."""
    assert_missed(_compiled(NoNormPrologue(rope)), "GPT-J pairs (2i, 2i + 1) turn by cos / sin that are not "
                  "repeated pairwise")  # fmt: skip


def test_gptj_pairs_as_fp32_products_are_a_miss_in_words():
    assert_missed(_compiled(NoNormPrologue("gptj")), "interleaved (GPT-J) RoPE", "not as HF's GLM-4 writes them")
