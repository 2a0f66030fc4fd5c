"""GPU tier: the whole decode step in one CUDA graph per batch bucket (cudagraph.py).

A 2-layer tiny MiniMax-M2.5 reference decode stack (paged K/V caches, the router; routed
experts stubbed to zeros, see the test) runs
1,000 decode steps with a varying number of sequences (2..40, some rows with slot -1) and fresh
slots, once through the backend with CUDA graphs and once without, on two copies of the caches.
Every step's output and, at the end, both caches must agree; there must be exactly one graph per
bucket used, each with kernel nodes read from the captured graph."""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import paged_kv
from fusion_compiler.model_adapters.minimax_m2 import decode_layer
from fusion_compiler.verify import relative_error

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONTEXT = 20
MAX_TOKENS = 40
STEPS = 1000


def _step_inputs(cfg, tokens: int, gen: torch.Generator) -> dict:
    _, table = paged_kv.random_block_table(tokens, CONTEXT, cfg.block_size, gen)
    dead = torch.rand(tokens, generator=gen) < 0.1
    table["slots"] = torch.where(dead, -1, table["slots"])  # a serving engine's own padding rows
    inputs = {
        "hidden": torch.randn(tokens, cfg.hidden_size, generator=gen).bfloat16(),
        "residual": torch.randn(tokens, cfg.hidden_size, generator=gen).bfloat16(),
        **table,
    }
    inputs = {k: v.cuda() for k, v in inputs.items()}
    for name in ("hidden", "residual", "positions", "slots", "block_table", "seq_lens"):
        torch._dynamo.mark_dynamic(inputs[name], 0)
    return inputs


@requires_cuda
def test_replays_equal_uncaptured_over_a_thousand_steps():
    cfg = decode_layer.TINY
    # Routed experts stubbed: GEMMs of bucket rows and of B rows may round a near-tied router
    # choice differently, which flips a whole row; the router itself still runs in the graph.
    model = decode_layer.build(cfg, 2, experts="zeros", device="cuda")
    attention = cfg.attention
    blocks = MAX_TOKENS * -(-(CONTEXT + 1) // attention.block_size) + 2
    shape = (blocks, attention.block_size, attention.num_kv_heads, attention.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = {
        "k_caches": [torch.randn(shape, generator=gen).bfloat16().cuda() for _ in range(2)],
        "v_caches": [torch.randn(shape, generator=gen).bfloat16().cuda() for _ in range(2)],
    }
    uncaptured_caches = {k: [c.clone() for c in v] for k, v in caches.items()}
    torch._dynamo.reset()
    graphs = fc.FusionBackend(fc.FusionConfig(cudagraphs=True))
    plain = fc.FusionBackend(fc.FusionConfig(cudagraphs=False))
    with_graphs, without = torch.compile(model, backend=graphs), torch.compile(model, backend=plain)
    buckets_used = set()
    worst = 0.0
    with torch.no_grad():
        for step in range(STEPS):
            # from 2: Dynamo specialises a size-1 dim, so 1 sequence is a graph of its own
            tokens = int(torch.randint(2, MAX_TOKENS + 1, (1,), generator=gen))
            inputs = _step_inputs(attention, tokens, gen)
            got = with_graphs(**inputs, **caches)
            want = without(**inputs, **uncaptured_caches)
            worst = max(worst, relative_error(got, want))
            assert worst < 2e-2, (step, tokens, worst)
            buckets_used.add(next(b for b in graphs.config.cudagraph_buckets if b >= tokens))
    for name in caches:
        for a, b in zip(caches[name], uncaptured_caches[name]):
            assert relative_error(a, b) < 2e-2
    reports = [g.report() for g in graphs.step_graphs]
    print(reports, "worst relative error", worst)
    assert len(reports) == 1, reports  # one compiled graph: no graph break, no recompile for size
    report = reports[0]
    assert report["capture_error"] is None and report["recaptures"] == 0 and report["uncaptured_calls"] == 0
    assert set(report["kernel_nodes_by_rows"]) == buckets_used
    assert all(n and n > 0 for n in report["kernel_nodes_by_rows"].values()), report
