"""A 2-layer decode stack compiled once for every batch size (Dynamo's dynamic batch dim, as the
whole-step CUDA graphs need it) fuses every expected site of both layers.

Regression: with a symbolic batch, layer 1's GQA prologue match bound layer 2's q/k path (the
multi-output pattern binds each output's sub-pattern on its own), a cycle that failed Inductor's
topological sort. The registry now declines such a binding and retries the anchor once the
other site is replaced (patterns/registry.py, ``_cycle_reason``)."""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import get_adapter, make_decode_step
from fusion_compiler.model_adapters.reference import paged_kv
from fusion_compiler.model_adapters.reference import minimax_m2_decode_layer as decode_layer
from fusion_compiler.verify import relative_error
from router_ties import near_tied, router_margins

CONTEXT = 20


def _inputs(cfg, tokens: int, gen: torch.Generator) -> dict:
    _, table = paged_kv.random_block_table(tokens, CONTEXT, cfg.block_size, gen)
    inputs = {
        "hidden": torch.randn(tokens, cfg.hidden_size, generator=gen).bfloat16(),
        "residual": torch.randn(tokens, cfg.hidden_size, generator=gen).bfloat16(),
        **table,
    }
    for name in ("hidden", "residual", "positions", "slots", "block_table", "seq_lens"):
        torch._dynamo.mark_dynamic(inputs[name], 0)
    return inputs


def test_two_layers_with_a_dynamic_batch_fuse_every_site():
    cfg = decode_layer.TINY
    # Routed experts stubbed: a near-tied router choice flipping between eager and compiled
    # changes a whole row, which says nothing about the fusions under test (routing keeps its
    # own tests); the router still runs and fuses.
    model = decode_layer.build(cfg, 2, experts="zeros")
    attention = cfg.attention
    blocks = 12 * -(-(CONTEXT + 1) // attention.block_size) + 2
    shape = (blocks, attention.block_size, attention.num_kv_heads, attention.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = {name: [torch.randn(shape, generator=gen).bfloat16() for _ in range(2)] for name in ("k_caches", "v_caches")}
    expected = decode_layer.expected_sites(model)
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for tokens in (5, 12, 3):
            inputs = _inputs(attention, tokens, gen)
            eager_caches = {k: [c.clone() for c in v] for k, v in caches.items()}
            got = compiled(**inputs, **caches)
            want = model(**inputs, **eager_caches)
            assert relative_error(got, want) < 2e-2, tokens
            for name in caches:
                for a, b in zip(caches[name], eager_caches[name]):
                    assert relative_error(a, b) < 1e-2
    assert backend.compiles == 1  # one graph for every batch size
    assert backend.report.missing_expected() == []
    assert backend.report.per_module("gqa_prologue") == expected["gqa_prologue"]


# Qwen3.5 (43 s on 2 CPU cores) nightly; the CI tier keeps DeepSeek's HF model and the reference stack above.
@pytest.mark.parametrize("model_name", ["deepseek-v3.2", pytest.param("qwen3.5", marks=pytest.mark.nightly)])
def test_hf_model_fuses_every_site_again_after_the_batch_goes_dynamic(model_name):
    """HF's code at batch 2, then batch 3: Dynamo recompiles with a symbolic batch, and every
    expected site must fuse in that graph too (strict). Regression (H200 decode bench, batch 8
    then 64): DeepSeek's router and Qwen3.5's GDN core were refused in the dynamic graph, since
    Dynamo passed the batch symbol through several placeholders and Inductor's re-trace of a
    match binds one per symbol; DeepSeek's layer ran 2.6x slower than stock Inductor at batch 64.
    fx/canonicalize.py now names one placeholder per symbol and spells a dynamic reshape's
    symbolic dim -1."""
    adapter = get_adapter(model_name)
    model = adapter.build_hf(size="tiny", layers=4 if model_name == "qwen3.5" else 2, device="cpu",
                             dtype=torch.bfloat16, seed=0)  # fmt: skip
    expected = adapter.expected_sites(model, batch=1, context=16)
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch in (2, 3):
            step = make_decode_step(model, batch=batch, context=16, seed=batch, max_cache_len=32)
            got = step.run(compiled)
            with router_margins(model) as margins:
                want = step.run(model)
            # Rows whose routing is a near tie may pick the other expert (tests/router_ties.py).
            kept = ~near_tied(margins, (batch, 1))[:, 0]
            assert kept.any() and relative_error(got[kept].float(), want[kept].float()) < 2e-2, batch
    assert backend.compiles == 2  # the static batch-2 graph, then one with a symbolic batch
    assert backend.report.missing_expected() == []
