"""The DeepSeek V3.2 attention-prologue family on real model code.

- Our serving-engine reference (model_adapters/reference/deepseek_v32.py, FP8 latent and
  indexer caches): every layer fuses its four sites plus the q_a norm+quant, each layer's
  sites fold into two launches, outputs match eager, and layer 0's cache bytes equal eager's
  (later layers read inputs that differ in the last bf16 bit, so only layer 0 is exact).
- HF transformers' DeepseekV32 (no FP8, no latent cache): the HF-style sites fuse in every layer.
- Near misses: a NeoX RoPE written with slices where interleaved is expected, and the reverse.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler._compat import JOINT_GRAPH_DROPS_ROUND_TRIPS
from fusion_compiler.model_adapters import make_decode_step
from fusion_compiler.model_adapters.reference import deepseek_v32 as ref
from fusion_compiler.fx.module_paths import layer_of
from fusion_compiler.verify import relative_error
from hf_fixtures import default_decode_run

FAMILY = "mla_prologue"
SITES_PER_LAYER = {"kv", "index_k", "q", "index_q"}


def _per_layer(report, family=FAMILY):
    out: dict[int, list[str]] = {}
    for site in report.sites:
        if site.family == family and site.status == "matched":
            out.setdefault(layer_of(site.module), []).append(site.variant.split(".")[0])
    return out


@pytest.fixture(scope="module")
def reference_run():
    cfg = dataclasses.replace(ref.TINY, kv_cache_dtype="fp8_ds_mla", num_layers=2)
    model = ref.build(cfg)
    step = ref.make_step(cfg, tokens=3, context=6)
    pristine = step.clone()
    eager_step, fused_step = step.clone(), step.clone()
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=ref.expected_sites(model)))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(**eager_step.kwargs)
        fused = torch.compile(model, backend=backend)(**fused_step.kwargs)
        # Torch 2.11's joint graph folds x.to(bf16).to(float32): the rounding before the FP8
        # quantisation is gone for stock Inductor and for us alike (bench/NOTES.md section 12), so
        # there stock Inductor's bytes are the bar for layer 0's (measured on 2.11: ours one
        # FP8 code off eager in one byte; with 2.13's rule patched into 2.11, eager's bytes).
        stock_step = step.clone() if JOINT_GRAPH_DROPS_ROUND_TRIPS else None
        if stock_step is not None:
            torch._dynamo.reset()
            torch.compile(model, backend="inductor")(**stock_step.kwargs)
    return dict(cfg=cfg, report=backend.report, eager=eager, fused=fused, pristine=pristine,
                eager_step=eager_step, fused_step=fused_step, stock_step=stock_step)  # fmt: skip


def test_reference_every_layer_fuses_its_four_sites(reference_run):
    report = reference_run["report"]
    assert report.misses() == [], report.format()
    assert report.missing_expected() == []
    assert report.expected_per_layer(FAMILY) == {0: 4, 1: 4}
    assert report.expected_per_layer("add_rms_norm") == {0: 2, 1: 2}
    per_layer = _per_layer(report)
    assert sorted(per_layer) == [0, 1]
    for layer, sites in per_layer.items():
        assert sorted(sites) == sorted(SITES_PER_LAYER), (layer, sites)
    variants = report.per_variant()
    assert variants["kv.cache_fp8_ue8m0"] == 2 and variants["index_k.cache_fp8_ue8m0"] == 2
    assert variants["q.absorbed"] == 2 and variants["index_q.fp8_ue8m0"] == 2
    assert variants["rms_norm_fp8_ue8m0.deepseek"] == 2  # q_a norm + FP8 quant


def test_reference_sites_fold_into_two_launches_per_layer(reference_run):
    merges = sorted(reference_run["report"].merges())
    assert merges == [("layers.0", "kv", 3), ("layers.0", "q", 2), ("layers.1", "kv", 3), ("layers.1", "q", 2)]


def test_reference_output_matches_eager(reference_run):
    # Stock Inductor alone lands 4.4% from eager on this random-weight model (activations in
    # the hundreds, simulated FP8 GEMMs re-associated); ours 2.3%, the same with this family
    # off. The exact checks are the layer-0 cache bytes below.
    assert relative_error(reference_run["fused"], reference_run["eager"]) < 5e-2


def test_reference_layer0_cache_bytes_equal_eager_and_untouched_slots_unchanged(reference_run):
    slots = reference_run["pristine"].kwargs["slots"]
    for name in ("latent_caches", "index_caches"):
        before = reference_run["pristine"].kwargs[name]
        eager, fused = reference_run["eager_step"].kwargs[name], reference_run["fused_step"].kwargs[name]
        for layer, (b, e, f) in enumerate(zip(before, eager, fused)):
            b, e, f = (t.view(-1, t.shape[-1]) for t in (b, e, f))
            untouched = torch.ones(b.shape[0], dtype=torch.bool)
            untouched[slots] = False
            assert torch.equal(f[untouched], b[untouched]), (name, layer)
            assert not torch.equal(f[slots], b[slots]), (name, layer)
            if layer == 0 and reference_run["stock_step"] is None:
                assert torch.equal(f[slots], e[slots]), name
            elif layer == 0:  # no more bytes off eager's than stock Inductor's
                s = reference_run["stock_step"].kwargs[name][layer].view(-1, b.shape[-1])
                assert (f[slots] != e[slots]).sum() <= (s[slots] != e[slots]).sum(), name


@pytest.fixture(scope="module")
def hf_run():
    # Strict against the adapter's expectations (2 layers): any expected site left unfused raises.
    return default_decode_run("deepseek-v3.2")


def test_hf_every_layer_fuses_its_four_sites(hf_run):
    report = hf_run.report
    assert report.misses(FAMILY) == [] and report.misses("add_rms_norm") == [], report.format()
    assert len(report.graphs) == 1
    assert report.missing_expected() == []
    assert report.expected_per_layer(FAMILY) == {0: 4, 1: 4}
    per_layer = _per_layer(report)
    for layer in (0, 1):
        assert sorted(per_layer[layer]) == sorted(SITES_PER_LAYER)
    assert {v: n for v, n in report.per_variant().items() if v.split(".")[0] in SITES_PER_LAYER} == {
        "kv.hf": 2, "index_k.hf": 2, "q.hf": 2, "index_q.hf": 2,
    }  # fmt: skip
    # q_a_layernorm (a plain RMSNorm) folds into the kv launch with kv and index_k.
    assert sorted(report.merges()) == [("layers.0", "kv", 3), ("layers.0", "q", 2), ("layers.1", "kv", 3), ("layers.1", "q", 2)]


def test_hf_indexer_top_k_mask_fuses_once_per_layer(hf_run):
    """patterns/dsa_topk_mask.py on HF's indexer + the attention's scatter (context 16 > the tiny
    index_topk 8, so the mask drops keys); the logits test below covers its numbers."""
    report = hf_run.report
    indexers = {"model.layers.0.self_attn.indexer": 1, "model.layers.1.self_attn.indexer": 1}
    assert report.per_module("dsa_topk_mask") == indexers, report.format()
    assert report.count("dsa_topk_mask", "bool_mask") == 2
    assert report.misses("dsa_topk_mask") == []


def test_hf_logits_match_eager(hf_run):
    assert relative_error(hf_run.fused, hf_run.eager) < 2e-2


def test_hf_deepseek_v3_fuses_from_its_config_file_alone(tmp_path):
    """DeepSeek V3's attention (Kimi-K2's code), no adapter of ours: from its config JSON the
    expected sites come from the module tree (kv and q per layer, no indexer). Strict: both fuse
    in each layer, routing and norms too, no candidate left over (its k_rot cache write, full
    rotary straight from kv_a_proj, is no GQA site); logits equal eager's."""
    import json

    from fusion_compiler.model_adapters import adapter_from_hf_config
    from model_configs import DEEPSEEK_V3

    path = tmp_path / "deepseek_v3.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    adapter = adapter_from_hf_config(path)
    model = adapter.build_hf(size="tiny", dtype=torch.bfloat16)
    expected = adapter.expected_sites(model)
    assert expected[FAMILY] == {"model.layers.0.self_attn": 2, "model.layers.1.self_attn": 2}
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    eager = make_decode_step(model).run(model)
    fused = make_decode_step(model).run(torch.compile(model, backend=backend))
    report = backend.report
    assert report.misses() == [] and report.missing_expected() == [], report.format()
    assert report.per_layer(FAMILY) == {0: 2, 1: 2} and report.per_layer("moe_routing") == {0: 1, 1: 1}
    assert report.per_module("moe_experts") == expected["moe_experts"] == {f"model.layers.{i}.mlp.experts": 1 for i in (0, 1)}
    assert relative_error(fused, eager) < 2e-2


def test_hf_deepseek_v3_latent_of_64_fuses_every_site_and_matches_eager(tmp_path):
    """kv_lora_rank 64 (no multiple of 128, the FP8 fp8_ds_mla layout's quant group): the bf16
    path takes it. DeepSeek V3's HF code from its config file, strict: kv and q fuse in each
    layer, nothing missed, logits within bf16 of eager's."""
    import json

    from fusion_compiler.model_adapters import adapter_from_hf_config
    from model_configs import DEEPSEEK_V3

    path = tmp_path / "deepseek_v3_latent64.json"
    path.write_text(json.dumps({**DEEPSEEK_V3, "kv_lora_rank": 64}))
    adapter = adapter_from_hf_config(path)
    model = adapter.build_hf(size="tiny", dtype=torch.bfloat16)
    assert model.config.kv_lora_rank == 64
    expected = adapter.expected_sites(model)
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    torch._dynamo.reset()
    eager = make_decode_step(model).run(model)
    fused = make_decode_step(model).run(torch.compile(model, backend=backend))
    report = backend.report
    assert report.misses(FAMILY) == [] and report.missing_expected() == [], report.format()
    assert report.per_layer(FAMILY) == {0: 2, 1: 2}
    assert {v: n for v, n in report.per_variant().items() if v.split(".")[0] in SITES_PER_LAYER} == {"kv.hf": 2, "q.hf": 2}
    assert relative_error(fused, eager) < 1e-2


# ------------------------------------------------------------------------------------------
# Near misses
# ------------------------------------------------------------------------------------------


class QRope(torch.nn.Module):
    """HF-style q site: cat(q_pass, rope(q_rot)), with the RoPE spelled by ``rope``."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def forward(self, q, cos, sin):
        q_pass, q_rot = torch.split(q, [32, 16], dim=-1)
        return torch.cat((q_pass, self.rope(q_rot, cos, sin)), dim=-1)


def interleaved(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def neox_written_with_slices(x, cos, sin):
    """Same graph as `interleaved` up to slice ints: the SGLang bug in waiting."""
    x1, x2 = x[..., :8], x[..., 8:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _compile(module, *inputs):
    backend = fc.FusionBackend(fc.FusionConfig(families={"add_rms_norm": "off"}))
    torch._dynamo.reset()
    expected = module(*inputs)
    actual = torch.compile(module, backend=backend)(*inputs)
    return backend.report, actual, expected


def _q_inputs():
    q = torch.randn(1, 2, 3, 48, dtype=torch.bfloat16)
    cos = torch.randn(1, 1, 3, 8, dtype=torch.bfloat16)
    return q, cos, torch.randn_like(cos)


def test_interleaved_q_rope_matches():
    report, actual, expected = _compile(QRope(interleaved), *_q_inputs())
    assert report.per_variant() == {"q.hf": 1}
    assert relative_error(actual, expected) < 1e-2


def test_neox_rope_written_like_interleaved_does_not_match():
    report, actual, expected = _compile(QRope(neox_written_with_slices), *_q_inputs())
    assert report.per_variant() == {}
    [miss] = report.misses()  # reported, with Inductor's or the guard's reason
    assert miss.family == FAMILY and miss.reason
    assert relative_error(actual, expected) < 1e-2


class IndexQRope(torch.nn.Module):
    """HF indexer q: NeoX rotate_half on the first 16 dims, with the RoPE spelled by ``rope``."""

    def __init__(self, rope):
        super().__init__()
        self.rope = rope

    def forward(self, q, cos, sin):
        q_rot, q_pass = torch.split(q, [16, 16], dim=-1)
        return torch.cat([self.rope(q_rot, cos, sin), q_pass], dim=-1)


def rotate_half_rope(x, cos, sin):
    x1, x2 = x[..., :8], x[..., 8:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotate_half_on_pairs(x, cos, sin):
    """rotate_half built from even/odd elements: interleaved math in NeoX clothing."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class WithAngles(torch.nn.Module):
    """Builds cos/sin as HF's rotary embedding does: cat(freqs, freqs), or not."""

    def __init__(self, inner, duplicated=True):
        super().__init__()
        self.inner, self.duplicated = inner, duplicated

    def forward(self, q, freqs):
        emb = torch.cat((freqs, freqs), dim=-1) if self.duplicated else torch.cat((freqs, freqs * 0.5), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(2), emb.sin().to(q.dtype).unsqueeze(2)
        return self.inner(q, cos, sin)


def _index_q_inputs():
    return torch.randn(1, 3, 2, 32, dtype=torch.bfloat16), torch.randn(1, 3, 8)


def test_neox_index_q_rope_matches():
    report, actual, expected = _compile(WithAngles(IndexQRope(rotate_half_rope)), *_index_q_inputs())
    assert report.per_variant() == {"index_q.hf": 1}
    assert relative_error(actual, expected) < 1e-2


def test_neox_rope_with_distinct_half_angles_does_not_match():
    """The fused NeoX RoPE reads one angle per pair; a cos whose halves differ must not fuse."""
    report, actual, expected = _compile(WithAngles(IndexQRope(rotate_half_rope), duplicated=False), *_index_q_inputs())
    assert report.per_variant() == {}
    [miss] = report.misses()
    assert "cat(freqs, freqs)" in miss.reason, miss.reason
    assert relative_error(actual, expected) < 1e-2


def test_neox_rope_on_angles_from_outside_the_graph_says_so():
    """cos/sin as graph inputs (the rotary embedding ran before a graph break): nothing shows the
    halves are equal, and the miss says where they came from."""
    q, freqs = _index_q_inputs()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype).unsqueeze(2), emb.sin().to(q.dtype).unsqueeze(2)
    report, actual, expected = _compile(IndexQRope(rotate_half_rope), q, cos, sin)
    assert report.per_variant() == {}
    [miss] = report.misses()
    assert "come into this graph from outside" in miss.reason, miss.reason
    assert relative_error(actual, expected) < 1e-2


def test_interleaved_rope_in_neox_clothing_does_not_match():
    report, actual, expected = _compile(WithAngles(IndexQRope(rotate_half_on_pairs)), *_index_q_inputs())
    assert report.per_variant() == {}
    [miss] = report.misses()
    assert miss.family == FAMILY and miss.reason
    assert relative_error(actual, expected) < 1e-2


class KvCacheWrite(torch.nn.Module):
    """The reference's kv site on its own: RMSNorm(kv_c) and RoPE(k_pe) into a bf16 latent cache.
    ``rope_other`` ropes a different tensor from the one written to the cache."""

    def __init__(self, rope_other=False):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(128))
        self.rope_other = rope_other

    def forward(self, kv_c, k_pe, other, cos, sin, cache, slots):
        kv = ref.rms_norm(kv_c, self.weight, 1e-6)
        if self.rope_other:
            roped = ref.rope_gptj(other, cos, sin)
            rows = torch.cat([kv, k_pe], dim=-1)
        else:
            roped = other
            rows = torch.cat([kv, ref.rope_gptj(k_pe, cos, sin)], dim=-1)
        cache.view(-1, cache.shape[-1]).index_put_((slots,), rows)
        return roped * 2


def _kv_inputs():
    t = 3
    cos = torch.randn(t, 16)
    return [torch.randn(t, 128, dtype=torch.bfloat16), torch.randn(t, 32, dtype=torch.bfloat16),
            torch.randn(t, 32, dtype=torch.bfloat16), cos, torch.randn_like(cos),
            torch.randn(4, 4, 160).to(torch.bfloat16), torch.tensor([3, 9, 14])]  # fmt: skip


def _run_kv(module):
    inputs = _kv_inputs()
    eager_in = [t.clone() for t in inputs]
    backend = fc.FusionBackend(fc.FusionConfig(families={"add_rms_norm": "off"}))
    torch._dynamo.reset()
    with torch.no_grad():
        module(*eager_in)
        torch.compile(module, backend=backend)(*inputs)
    return backend.report, inputs[5], eager_in[5]


def test_kv_cache_site_matches():
    report, cache, eager_cache = _run_kv(KvCacheWrite())
    assert report.per_variant() == {"kv.cache_bf16": 1}
    torch.testing.assert_close(cache.float(), eager_cache.float(), rtol=1e-2, atol=1e-2)


def test_rope_of_another_tensor_than_the_cached_one_does_not_match():
    report, cache, eager_cache = _run_kv(KvCacheWrite(rope_other=True))
    assert report.per_variant() == {}
    [miss] = report.misses()
    assert miss.family == FAMILY and miss.reason
    torch.testing.assert_close(cache.float(), eager_cache.float(), rtol=1e-2, atol=1e-2)


def test_guard_declines_a_non_contiguous_cache():
    from fusion_compiler.patterns import mla_prologue

    variant = next(v for v in mla_prologue.VARIANTS if v.name == "kv.cache_bf16")
    kv_c, k_pe, _, cos, sin, cache, slots = _kv_inputs()
    values = {
        "kv_c": kv_c, "k_pe": k_pe, "weight": torch.ones(128), "cos": cos, "sin": sin, "eps": 1e-6,
        "cache": cache.transpose(0, 1), "slots": slots,
        "slice_steps": {2}, "split_sizes": [], "chunk_widths": set(), "casts": set(), "quant_groups": set(),
        "angles_duplicated": False, "upcast_inputs": set(),
    }  # fmt: skip
    reason = mla_prologue.guard(values, variant)
    assert reason is not None and "not contiguous" in reason
    values["cache"] = cache
    assert mla_prologue.guard(values, variant) is None
    # An fp32 spelling fitting a bf16 graph past its .float(): the rotated input is the upcast.
    values["upcast_inputs"] = {"k_pe"}
    assert "k_pe is a .float() of a narrower value" in mla_prologue.guard(values, variant)


@pytest.mark.nightly  # the "inductor" lowering (a knob; the default is "triton"): 24 s on 2 CPU cores
def test_inductor_lowering_replaces_every_site_with_the_canonical_decomposition():
    """Lowering "inductor": the same sites match (strict), no fused op is called, no launch is
    merged, and the result stays as close to eager as stock Inductor's."""
    cfg = dataclasses.replace(ref.TINY, kv_cache_dtype="fp8_ds_mla", num_layers=1)
    model = ref.build(cfg)
    step = ref.make_step(cfg, tokens=2, context=5)
    eager_step, fused_step = step.clone(), step.clone()
    config = fc.FusionConfig(default_lowering="inductor", strict=True, expected=ref.expected_sites(model))
    backend = fc.FusionBackend(config)
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(**eager_step.kwargs)
        fused = torch.compile(model, backend=backend)(**fused_step.kwargs)
        torch._dynamo.reset()
        stock = torch.compile(model)(**step.clone().kwargs)
    report = backend.report
    assert report.missing_expected() == [] and report.misses() == [], report.format()
    assert report.merges() == []
    # On this random-weight model stock Inductor itself lands ~29% from eager at these inputs
    # (the Triton lowering lands 0.3%): the canonical form must do no worse than stock.
    assert relative_error(fused, eager) <= relative_error(stock, eager) + 1e-3


def test_index_q_scales_read_from_the_graph_literals():
    """torch 2.11 hands the check a re-traced match whose scalars are literals, not kwargs (the
    H200's DeepSeek reference layers: the FP8 index_q site declined with ``None * None``): the
    head and dim scales come from the graph's own muls instead, whatever values the model has."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusion_compiler.patterns import mla_prologue as family

    variant = next(v for v in family.VARIANTS if v.name == "index_q.fp8")
    q, cos, sin, weights = family.example_inputs(variant, (torch.bfloat16,))[:4]
    head_scale, dim_scale = 64**-0.5, 128**-0.5  # DeepSeek V3.2's 64 indexer heads of 128
    graph = make_fx(lambda q, c, s, w: variant.search(q, c, s, w, head_scale, dim_scale))(q, cos, sin, weights).graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    facts = family.facts_of(nodes, {"weights": placeholders[3]})
    assert (facts["head_scale"], facts["dim_scale"]) == (head_scale, dim_scale)
    assert "head_scale" not in family.facts_of(nodes, {"weights": placeholders[0]})  # not the weights' mul
