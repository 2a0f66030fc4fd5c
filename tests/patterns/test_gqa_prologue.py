"""The GQA attention-prologue family (MiniMax-M2.5, Qwen3.5) on real model code.

- HF transformers' MiniMaxM2 (2 layers) and Qwen3.5 (4 layers: 3 GDN, 1 full attention), a
  decode step on HF's static cache: one site per attention layer (strict against the adapters'
  expectations), the q/k norms inside it, logits equal eager's within bf16 tolerance, the cache
  rows at the new position close to eager's and every other cache byte unchanged.
- Our serving-engine references (model_adapters/reference/<model>.py: fused qkv, paged caches, bf16
  and FP8): a 2-layer stack fuses one site per layer, each reading the RoPE table at the
  positions itself (patterns/gqa_prologue_rope_gather.py); q, the gate and the written cache bytes equal
  eager's (FP8 codes too: the op rounds where the references round), untouched slots unchanged.
- Near misses: per-head norm where full-width is expected (said in words) and the reverse, a plain ``w`` where
  Gemma's ``1 + w`` is expected (and an offset other than 1), RoPE over all dims in serving
  code's spelling (HF's fuses: tests/patterns/test_gqa_prologue_hf_paths.py), GPT-J pairs where
  NeoX halves are expected. Each is a reported miss.
- The guard of ERNIE-4.5's fp32 GPT-J variant on what the tracer leaves wildcards (the repeat's
  and the pair slices' ints), a norm in front and bf16 cos / sin; of Cohere's (q, k upcast first),
  the angles' repeat read back from cos / sin (outside the match), a LayerNorm in front and fp32
  cos / sin; Cohere's replacement on the Triton kernel (the interpreter on CPU): eager's bits.
"""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters.reference import minimax_m2 as minimax
from fusion_compiler.model_adapters.reference import qwen35 as qwen
from fusion_compiler.patterns import add_rms_norm, gqa_prologue, mla_prologue
from fusion_compiler.verify import relative_error
from gqa_fixtures import assert_hf_caches, assert_missed, compile_beside_eager, prologue_inputs
from hf_fixtures import default_decode_run

FAMILY = "gqa_prologue"
FP8 = torch.float8_e4m3fn


def test_hf_minimax_every_layer_fuses_its_prologue():
    run = default_decode_run("minimax-m2.5")
    report = run.report
    assert report.misses() == [], report.format()
    assert report.missing_expected() == []
    assert report.expected_per_layer(FAMILY) == {0: 1, 1: 1}
    assert report.per_variant()["minimax.hf"] == 2
    # The q/k norms went into the prologue: no RoPE is left for the MLA family to report.
    assert report.sites and not [s for s in report.sites if s.family == "mla_prologue"]
    assert relative_error(run.fused, run.eager) < 2e-2
    assert_hf_caches(run.eager_step, run.fused_cache, (0, 1))


def test_hf_qwen_every_full_attention_layer_fuses_its_prologue():
    run = default_decode_run("qwen3.5")
    report = run.report
    assert report.misses(FAMILY) == [] and report.missing_expected() == [], report.format()
    assert report.expected_per_layer(FAMILY) == {3: 1}
    assert report.per_variant()["qwen.hf"] == 1
    assert relative_error(run.fused, run.eager) < 2e-2
    assert_hf_caches(run.eager_step, run.fused_cache, (3,))


# ------------------------------------------------------------------------------------------
# Our serving-engine references, paged caches
# ------------------------------------------------------------------------------------------


class Stack(torch.nn.Module):
    """Two reference attention prologues, one per layer, each with its own caches; returns
    every layer's q (and Qwen's gate)."""

    def __init__(self, ref, cfg):
        super().__init__()
        self.layers = torch.nn.ModuleList(ref.Attention(cfg) for _ in range(2))
        for layer in self.layers:  # norm weights away from their init
            torch.nn.init.normal_(layer.q_norm_weight, 0.0 if ref is qwen else 1.0, 0.1)
            torch.nn.init.normal_(layer.k_norm_weight, 0.0 if ref is qwen else 1.0, 0.1)

    def forward(self, x, table, positions, slots, caches, k_scale, v_scale):
        outs = []
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            outs.append(layer.prologue(x, table, positions, slots, k_cache, v_cache, k_scale, v_scale))
            x = x * 0.5  # each layer its own input
        return outs


def _run_reference(ref, kv_cache_dtype: str, scales=(1.0, 1.0)):
    import dataclasses

    cfg = dataclasses.replace(ref.TINY, kv_cache_dtype=kv_cache_dtype, block_size=4)
    torch.manual_seed(0)
    model = Stack(ref, cfg).bfloat16()
    tokens = 3
    x = torch.randn(tokens, cfg.hidden_size, dtype=torch.bfloat16)
    table = ref.rope_cos_sin_cache(cfg)
    positions, slots = torch.tensor([5, 0, 17]), torch.tensor([13, 2, 7])

    def caches():
        gen = torch.Generator().manual_seed(1)
        shape = (6, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        return [tuple(torch.randn(*shape, generator=gen).to(cfg.cache_dtype) for _ in range(2)) for _ in range(2)]

    eager_caches, fused_caches, pristine = caches(), caches(), caches()
    expected = {FAMILY: {"layers.0": 1, "layers.1": 1}}
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    with torch.no_grad():
        eager = model(x, table, positions, slots, eager_caches, *scales)
        fused = torch.compile(model, backend=backend)(x, table, positions, slots, fused_caches, *scales)
    return dict(report=backend.report, eager=eager, fused=fused, slots=slots,
                eager_caches=eager_caches, fused_caches=fused_caches, pristine=pristine)  # fmt: skip


def _flat(cache):
    return cache.view(-1, *cache.shape[2:])


def _assert_reference_run(run, variant):
    report = run["report"]
    assert report.misses(FAMILY) == [] and report.missing_expected() == [], report.format()
    assert report.expected_per_layer(FAMILY) == {0: 1, 1: 1}
    assert report.per_variant()[variant] == 2
    # Both prologues read the RoPE table at the positions themselves: the gather is gone.
    assert report.folded_rope_gathers() == 2
    for eager, fused in zip(run["eager"], run["fused"]):
        if isinstance(eager, tuple):  # Qwen: (q, gate); the gate passes through untouched
            assert torch.equal(fused[1], eager[1])
            eager, fused = eager[0], fused[0]
        # The op rounds where the reference rounds (MiniMax's norm before its weight multiply).
        assert torch.equal(fused, eager)
    untouched = torch.ones(_flat(run["pristine"][0][0]).shape[0], dtype=torch.bool)
    untouched[run["slots"]] = False
    for layer in range(2):
        for which in range(2):
            eager, fused = _flat(run["eager_caches"][layer][which]), _flat(run["fused_caches"][layer][which])
            pristine = _flat(run["pristine"][layer][which])
            assert torch.equal(fused[untouched].view(torch.uint8), pristine[untouched].view(torch.uint8))
            # The written rows too, FP8 codes included.
            assert torch.equal(fused[run["slots"]].view(torch.uint8), eager[run["slots"]].view(torch.uint8))


def test_minimax_reference_bf16_cache():
    _assert_reference_run(_run_reference(minimax, "bf16"), "minimax.paged_bf16")


def test_qwen_reference_fp8_cache():
    _assert_reference_run(_run_reference(qwen, "fp8", scales=(0.05, 0.02)), "qwen.paged_fp8")


# ------------------------------------------------------------------------------------------
# Near misses
# ------------------------------------------------------------------------------------------


def _norm(kind: str):
    return {
        "full": lambda x, w, eps, d: add_rms_norm.hf(x, w, eps).view(x.shape[0], -1, d),
        "head": lambda x, w, eps, d: add_rms_norm.hf(x.view(x.shape[0], -1, d), w, eps),
        "gemma_head": lambda x, w, eps, d: add_rms_norm.gemma(x.view(x.shape[0], -1, d), w, eps),
        "gemma_full": lambda x, w, eps, d: add_rms_norm.gemma(x, w, eps).view(x.shape[0], -1, d),
        "none": lambda x, w, eps, d: x.view(x.shape[0], -1, d),
        "plain_w_head": lambda x, w, eps, d: add_rms_norm.torch_functional(x.view(x.shape[0], -1, d), w, eps),
        "offset_half_head": lambda x, w, eps, d: (
            add_rms_norm._normalize(x.view(x.shape[0], -1, d).float(), eps) * (0.5 + w.float())
        ).to(x.dtype),
    }[kind]


def _rope(kind: str, rot: int):
    if kind == "gptj":  # pairs on the first rot dims
        return lambda x, cos, sin: torch.cat(
            [mla_prologue.rope_pairs(x[..., :rot], cos[:, None], sin[:, None]), x[..., rot:]], dim=-1
        )
    return gqa_prologue.rope_partial_fp32


class Prologue(torch.nn.Module):
    """A paged-cache GQA prologue with the norm and RoPE spelled as asked."""

    def __init__(self, norm: str, rope: str = "neox", rot: int = 8):
        super().__init__()
        self.norm, self.rope, self.rot = _norm(norm), _rope(rope, rot), rot

    def forward(self, q, k, v, qw, kw, table, positions, k_cache, v_cache, slots):
        d = k_cache.shape[-1]
        cos, sin = table[positions].chunk(2, dim=-1)
        cos, sin = cos[:, : self.rot // 2], sin[:, : self.rot // 2]
        q = self.rope(self.norm(q, qw, 1e-6, d), cos, sin)
        k = self.rope(self.norm(k, kw, 1e-6, d), cos, sin)
        k_cache.view(-1, *k_cache.shape[2:]).index_put_((slots,), k)
        v_cache.view(-1, *v_cache.shape[2:]).index_put_((slots,), v.view(-1, *v_cache.shape[2:]))
        return q


def _near_miss(norm: str, rope: str = "neox", rot: int = 8, full_weights: bool = False):
    args, caches, slots = prologue_inputs(full_weights, table_width=max(rot, 16))
    families = {"add_rms_norm": "off", "mla_prologue": "off"}
    return compile_beside_eager(Prologue(norm, rope, rot), args, caches, slots, families)




def test_the_full_width_spelling_matches():
    assert _near_miss("full", full_weights=True).per_variant() == {"minimax.paged_bf16": 1}


def test_per_head_norm_where_full_width_is_expected_does_not_match():
    """HF's plain per-head norm fuses in HF's layout only (Qwen3-MoE, GLM-4-MoE:
    tests/patterns/test_gqa_prologue_hf_models.py); into a paged cache it is a miss in words."""
    assert_missed(_near_miss("head"), "per head with a plain weight (x * w)", "paged cache")


def test_rope_without_a_qk_norm_into_a_paged_cache_is_a_miss_in_words():
    """No q/k norm fuses in HF's code (Mixtral, GLM-4-MoE without use_qk_norm:
    tests/patterns/test_gqa_prologue_hf_models.py); serving code's paged cache is a miss in words."""
    assert_missed(_near_miss("none"), "k has no RMS norm", "paged cache", "HF's code (its static cache, or continuous batching's flat one) only")


def test_full_width_gemma_norm_where_per_head_is_expected_does_not_match():
    assert_missed(_near_miss("gemma_full", full_weights=True))


def test_plain_weight_where_gemma_is_expected_does_not_match():
    assert_missed(_near_miss("plain_w_head"))


def test_gemma_offset_other_than_one_does_not_match():
    """The 1.0 is a literal of the traced pattern (the guard checks it too: ``_norm_reason``)."""
    assert_missed(_near_miss("offset_half_head"))


def test_rope_over_all_dims_in_serving_code_s_spelling_does_not_match():
    assert_missed(_near_miss("full", rot=16, full_weights=True))


def test_guard_names_full_rope_gptj_steps_and_norm_widths():
    variant = next(v for v in gqa_prologue.VARIANTS if v.name == "minimax.paged_bf16")
    d, rot, end = 16, 8, gqa_prologue._NO_END
    partial = {(0, 4, 1), (4, 8, 1), (8, end, 1)}
    assert gqa_prologue._rope_reason(partial, rot, d, "paged") is None
    assert "all 16 dims" in gqa_prologue._rope_reason({(0, 8, 1), (8, 16, 1), (16, end, 1)}, 16, d, "paged")
    assert gqa_prologue._rope_reason({(0, 8, 1), (8, end, 1)}, 16, d, "hf", "full") is None
    assert "8 of 16 dims" in gqa_prologue._rope_reason({(0, 4, 1), (4, end, 1)}, 8, d, "hf", "full")
    assert "GPT-J" in gqa_prologue._rope_reason({(0, 8, 2), (1, 8, 2), (8, end, 1)}, rot, d, "paged")
    values = {"norm_widths": {16}, "weight_offsets": set()}
    assert "per-head where full-width" in gqa_prologue._norm_reason(values, variant.params["norm"], 4, 2, d)
    values = {"norm_widths": {64, 32}, "weight_offsets": {1.0}}
    assert "full-width where per-head" in gqa_prologue._norm_reason(values, "qwen", 4, 2, d)
    assert "Gemma" in gqa_prologue._norm_reason({"norm_widths": {16}, "weight_offsets": {0.5}}, "qwen", 4, 2, d)


def test_fp32_gptj_guard_checks_what_the_tracer_hides():
    """``none.hf_full_rope_gptj_fp32`` (ERNIE-4.5) takes the GLM-4 variants' checks: cos / sin
    repeated pairwise, x's even / odd lanes of the whole head, no norm in front; and its own fp32
    cos / sin."""
    variant = next(v for v in gqa_prologue.VARIANTS if v.name == "none.hf_full_rope_gptj_fp32")
    assert variant.params["rope_fp32"] and variant.params["rope"] == "gptj" and variant.params["rotary"] == "full"
    inputs = gqa_prologue.example_inputs(variant, (torch.bfloat16,))
    values = dict(zip(("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "where"), inputs))
    d, end = values["k_cache"].shape[-1], gqa_prologue._NO_END
    values.update(repeats={"pairs"}, unsqueezes={(1, 4), (4, 5)}, slices={(0, d // 2, 1), (0, end, 2), (1, end, 2)},
                  normed_inputs=[], centred_inputs=[], casts={torch.float32, torch.bfloat16})  # fmt: skip
    assert values["cos"].dtype == torch.float32 and gqa_prologue.guard(values, variant) is None
    departures = {
        "not pairwise": dict(repeats={"tiles"}),
        "not GPT-J pairs of the first 16 dims": dict(slices={(0, d // 2, 1), (0, end, 2), (2, end, 2)}),
        "an RMS norm sits between the projection and RoPE of k": dict(normed_inputs=["k"]),
        "fp32 cos / sin (OLMo-2's, ERNIE-4.5's)": dict(cos=values["cos"].bfloat16(), sin=values["sin"].bfloat16()),
    }
    for words, change in departures.items():
        reason = gqa_prologue.guard({**values, **change}, variant)
        assert reason is not None and words in reason, (words, reason)


def test_upcast_gptj_guard_checks_what_the_tracer_hides():
    """``none.hf_full_rope_gptj_fp32_upcast`` (Cohere): cos / sin come repeated pairwise from the
    rotary embedding, before the cos, outside the match (``angle_repeats``, read back from the
    inputs; the match's own repeats are none), x's even / odd lanes of the whole head and no
    slice of cos / sin, no norm in front (a LayerNorm named as one), cos / sin in q's dtype."""
    variant = next(v for v in gqa_prologue.VARIANTS if v.name == "none.hf_full_rope_gptj_fp32_upcast")
    assert variant.params["upcast"] and variant.params["rope_fp32"] and variant.params["rotary"] == "full"
    inputs = gqa_prologue.example_inputs(variant, (torch.bfloat16,))
    values = dict(zip(("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "where"), inputs))
    d, end = values["k_cache"].shape[-1], gqa_prologue._NO_END
    values.update(repeats=set(), angle_repeats={"pairs"}, unsqueezes={(1, 4), (4, 5)},
                  slices={(0, end, 2), (1, end, 2)}, normed_inputs=[], centred_inputs=[],
                  casts={torch.float32, torch.bfloat16})  # fmt: skip
    assert values["cos"].dtype == torch.bfloat16 and gqa_prologue.guard(values, variant) is None
    departures = {
        "cos / sin are repeated as tiles, not pairwise": dict(angle_repeats={"tiles"}),
        "no repeat of cos / sin's angles in the graph": dict(angle_repeats={"pairs", None}),
        "(start, end, step) are not GPT-J pairs of the first 16 dims":
            dict(slices={(0, d // 2, 1), (0, end, 2), (1, end, 2)}),
        "a LayerNorm (x - mean, as Cohere's use_qk_norm writes it) sits between the projection and RoPE of k":
            dict(normed_inputs=["k"], centred_inputs=["k"]),
        "cos / sin are torch.float32, q is torch.bfloat16: this variant's RoPE (Cohere's) upcasts q / k":
            dict(cos=values["cos"].float(), sin=values["sin"].float()),
    }  # fmt: skip
    for words, change in departures.items():
        reason = gqa_prologue.guard({**values, **change}, variant)
        assert reason is not None and words in reason, (words, reason)


def test_upcast_gptj_replacement_on_the_kernel_keeps_cohere_bits(monkeypatch):
    """``none.hf_full_rope_gptj_fp32_upcast``'s replacement, its op run on the Triton kernel (the
    interpreter on CPU), writes HF Cohere's eager bits, q and both caches: the op is handed cos /
    sin's even lanes in bf16 (upcast, the same fp32 values), ``interleaved_rope``, one rounding."""
    pytest.importorskip("triton")
    from transformers.models.cohere import modeling_cohere

    from fusion_compiler.ops import gqa_prologue as ops

    def on_kernel(lowering, **kwargs):  # the op's CUDA path, on copies of the caches
        kwargs.update(k_cache=kwargs["k_cache"].clone(), v_cache=kwargs["v_cache"].clone())
        q_out = ops._cuda(*(kwargs.get(name, ops.DEFAULTS.get(name)) for name in ops.ARG_NAMES))
        return q_out, kwargs["k_cache"], kwargs["v_cache"]

    monkeypatch.setattr(gqa_prologue, "_call", on_kernel)
    variant = next(v for v in gqa_prologue.VARIANTS if v.name == "none.hf_full_rope_gptj_fp32_upcast")
    torch.manual_seed(0)
    d, where = 32, torch.tensor([2, 5, 6])
    q, k, v = (torch.randn(1, 3, heads, d, dtype=torch.bfloat16) * 2 for heads in (4, 2, 2))
    emb = torch.repeat_interleave(torch.rand(1, 3, d // 2) * 40, 2, dim=-1)  # CohereRotaryEmbedding
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    caches = [torch.randn(1, 2, 8, d, dtype=torch.bfloat16) for _ in range(2)]
    q_want, k_rows = modeling_cohere.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    k_want, v_want = (c.clone().index_copy_(2, where, rows) for c, rows in zip(caches, (k_rows, v.transpose(1, 2))))
    q_out, k_new, v_new = gqa_prologue.replacement(variant, "triton")(q, k, v, cos, sin, *caches, where)
    assert torch.equal(q_out, q_want) and torch.equal(k_new, k_want) and torch.equal(v_new, v_want)
    assert not torch.equal(k_new, caches[0])  # the rows were written


def test_gptj_pairs_where_neox_is_expected_do_not_match():
    assert_missed(_near_miss("full", rope="gptj", full_weights=True))


# ------------------------------------------------------------------------------------------
# Qwen3.5's gate after attention: Inductor's own fusion, no op of ours
# ------------------------------------------------------------------------------------------


class GatedOutput(torch.nn.Module):
    """Qwen3.5 after attention: ``attn_out * sigmoid(gate)`` (gate: each head's second half of
    the [q | gate] projection, strided), optionally quantised to FP8 for o_proj (per-tensor scale)."""

    def __init__(self, fp8: bool):
        super().__init__()
        self.fp8 = fp8

    def forward(self, attn_out, q_gate):
        t, heads, d = attn_out.shape
        gate = torch.chunk(q_gate.view(t, heads, 2 * d), 2, dim=-1)[1].reshape(t, heads * d)
        out = attn_out.reshape(t, heads * d) * torch.sigmoid(gate)
        if self.fp8:
            return (out.float() / 0.05).clamp(-448.0, 448.0).to(FP8)
        return out


@pytest.mark.parametrize("fp8", [False, True])
def test_qwen_gate_multiply_is_one_inductor_kernel(fp8):
    """The issue asks for the gate multiply (+ FP8 quant) in one kernel: Inductor's pointwise
    fusion gives it without an op of ours (counted here in the CPU wrapper code; the GPU count
    is not measured yet)."""
    from fusion_compiler.inspect.counting import count_cpu_compiled

    attn_out = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    q_gate = torch.randn(2, 4 * 128, dtype=torch.bfloat16)
    module = GatedOutput(fp8)
    expected = module(attn_out, q_gate)
    compiled = torch.compile(module, backend=fc.FusionBackend(fc.FusionConfig()))
    count, actual = count_cpu_compiled(lambda: compiled(attn_out, q_gate))
    assert count.names == {"inductor::generated_kernel": 1}, count.names
    # Inductor keeps sigmoid(gate) in fp32 where eager rounds it to bf16 first: not bit-equal.
    if fp8:
        a, b = actual.view(torch.uint8).int(), expected.view(torch.uint8).int()
        assert ((a & 0x7F) - (b & 0x7F)).abs().le(1).all() and ((a ^ b) & 0x80).eq(0).all()
    else:
        assert relative_error(actual, expected) < 1e-2
