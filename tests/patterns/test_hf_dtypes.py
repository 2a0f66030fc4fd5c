"""HF's tiny models in fp32 and float64: fp32 sites fuse, float64 sites are declined with reasons.

In an fp32 model ``.float()`` and HF's norm upcasts are no casts, so the graph differs from a bf16
model's; the families trace fp32 spellings too, and their kernels take fp32 (tests/kernels/
test_fp32_paths.py checks those paths against float64). Counted per layer on one decode step:
DeepSeek V3.2's four prologue sites and its DSA indexer, Qwen3.5's Gated DeltaNet.

A float64 model compiles and runs: a site whose kernel takes no float64 is a miss that says so
(Qwen3.5 here: the GDN core, the decode attention, the RoPEs no prologue took), never a crash
and never "no variant matched". Its experts run HF's ``batched_mm`` (``grouped_mm`` takes no
float64, and the ``eager`` loop breaks the graph so its layers run uncompiled). Each run is
compiled once and shared by the tests that read it.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler._compat import TORCH_VERSION
from fusion_compiler.model_adapters import get_adapter, make_decode_step
from fusion_compiler.verify import relative_error

# Qwen3.5 in two layers: one Gated DeltaNet layer, and the full-attention layer HF's cache needs.
QWEN_LAYERS = ("linear_attention", "full_attention")
# Stock CPU Inductor before 2.13 aborts compiling tiny Qwen3.5 (bench/NOTES.md): not ours.
QWEN_COMPILES_ON_CPU = TORCH_VERSION >= (2, 13)


@functools.cache
def _run(name: str, dtype: torch.dtype, layer_types: tuple[str, ...] | None = None):
    """(the report, the logits' error against eager) of one compiled decode step."""
    build = {"layers": len(layer_types), "layer_types": list(layer_types)} if layer_types else {"layers": 1}
    if dtype == torch.float64:
        build["experts_implementation"] = "batched_mm"
    model = get_adapter(name).build_hf(size="tiny", dtype=dtype, **build)
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    eager_step, fused_step = make_decode_step(model), make_decode_step(model)
    eager = eager_step.run(model)
    fused = fused_step.run(torch.compile(model, backend=backend))
    return backend.report, relative_error(fused.double(), eager.double())


def _deepseek_fp32():
    return _run("deepseek-v3.2", torch.float32)


def _qwen(dtype):
    if not QWEN_COMPILES_ON_CPU:
        pytest.skip("torch < 2.13 CPU Inductor crashes compiling tiny Qwen3.5 (stock too)")
    return _run("qwen3.5", dtype, QWEN_LAYERS)


def test_deepseek_fp32_fuses_every_prologue_site_and_the_indexer():
    report, error = _deepseek_fp32()
    assert report.per_layer("mla_prologue") == {0: 4}, report.format()
    assert report.per_layer("dsa_topk_mask") == {0: 1}, report.format()
    assert report.misses() == [], report.format()
    assert error < 1e-4, error


def test_qwen35_fp32_fuses_the_gated_deltanet_core():
    report, error = _qwen(torch.float32)
    assert report.per_layer("gdn") == {0: 1}, report.format()
    assert report.misses("gdn") == [] and report.misses("gated_rms_norm") == [], report.format()
    assert error < 1e-4, error


def test_qwen35_float64_declines_each_site_saying_float64():
    report, error = _qwen(torch.float64)
    misses = {(m.family, m.module): m.reason for m in report.misses()}
    gdn = misses[("gdn", "model.layers.0.linear_attn")]
    assert "float64" in gdn and "gdn's patterns and kernels are for bfloat16, float32 models" in gdn, gdn
    attention = misses[("decode_attention", "model.layers.1.self_attn")]
    assert "does not take this site: q dtype torch.float64 not supported" in attention, attention
    for (family, module), reason in misses.items():
        if family != "gqa_prologue":  # its words are its own (patterns/gqa_prologue.py)
            assert "float64" in reason, (family, module, reason)
    assert report.count("gdn") == 0 and report.count("decode_attention") == 0
    assert error < 1e-5, error  # measured 1.3e-7: the ops that fused compute in fp32, as HF does there


def test_miss_reasons_are_sentences_not_matcher_dumps():
    """Every miss of these runs is one line about the model's code: no ``CallFunction(`` trees."""
    qwen = [_qwen(torch.float32), _qwen(torch.float64)] if QWEN_COMPILES_ON_CPU else []
    for report, _ in [_deepseek_fp32(), *qwen]:
        for miss in report.misses():
            assert "CallFunction(" not in miss.reason and "\n" not in miss.reason, miss.reason
            assert len(miss.reason) < 400, miss.reason
