"""GPU tier: HF ``generate()`` through ``CompileConfig(backend="fusion_compiler")`` and a compiled
``model.forward`` on the tiny models, with bench/generate.py's checks: every compiled call after
warm-up replays a CUDA graph with no loose kernel (read off the profiler, not our report), and
teacher-forced logits stay within 2e-2 of eager's at every step. Each ``generate()`` makes a new static cache, so the later calls
also check that the step writes the caller's new cache and replays without a recapture (the
graph pool's ``use_count`` assertion, and caches copied into static buffers, broke exactly this).
A compiled ``model.forward`` also runs the prefill, whose graph HF's code makes uncapturable (a
CPU tensor copied in): it is counted apart.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import generate as bench  # noqa: E402

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW_TOKENS = 8


# HF compiles its call for the decode steps only; a compiled model.forward runs the prefill too.
COMPILED_CALLS = {"ours": NEW_TOKENS - 1, "ours_forward": NEW_TOKENS}


@requires_cuda
@pytest.mark.parametrize("route", sorted(COMPILED_CALLS))
@pytest.mark.parametrize("name", ["minimax-m2.5", "qwen3.5", "deepseek-v3.2"])
def test_generate_replays_graphs_and_matches_eager(name, route):
    from fusion_compiler.model_adapters import get_adapter

    model = get_adapter(name).build_hf(size="tiny", layers=bench.LAYERS[name], device="cuda")
    runner = bench.Runner(model, "cuda", NEW_TOKENS, cpu_compile=False)
    eager = runner.generate("eager", 2, output_logits=True, return_dict_in_generate=True)
    reference = [t.float() for t in eager.logits]
    for attempt in range(3):  # compile + warm-up, then two generates with new caches
        out = runner.generate(route, 2, output_logits=True, return_dict_in_generate=True,
                              logits_processor=[bench.ForceIds(eager.sequences, bench.PROMPT)])  # fmt: skip
        errors = bench.step_relative_errors([t.float() for t in out.logits], reference)
        assert max(errors) < 2e-2, (attempt, errors)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:  # fmt: skip
        runner.generate(route, 2)
        torch.cuda.synchronize()
    calls = bench.split_calls(bench.region_launches(prof.events()), NEW_TOKENS)
    assert calls["prefill"]["calls"] == COMPILED_CALLS[route] - (NEW_TOKENS - 1), calls
    decode = calls["decode"]
    assert decode["captured_calls"] == NEW_TOKENS - 1 and decode["loose_kernels"] == 0, calls
