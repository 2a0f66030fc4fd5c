"""bench/moe_experts.py on CPU (--device cpu --tiny): HF's experts module builds, every mode runs
and agrees with the fp32 reference, and the row carries what the H200 run reports. Timing, CUDA
graphs and kernel counts run on the GPU only."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import moe_experts as bench  # noqa: E402


def test_tiny_cpu_run_writes_a_correct_row_per_token_count(tmp_path):
    out = tmp_path / "moe_experts.json"
    assert bench.main(["--device", "cpu", "--tiny", "--models", "qwen3.5", "--tokens", "3", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["provenance"]["device"] == "cpu"
    assert payload["modes"] == list(bench.MODES)
    assert "distinct experts" in payload["touched_bytes_formula"]
    [row] = payload["rows"]
    assert (row["model"], row["tokens"], row["top_k"]) == ("qwen3.5", 3, 2)
    per_set = row["distinct_experts_per_set"]
    assert len(per_set) == bench.ROTATIONS and all(2 <= d <= 6 for d in per_set)
    assert row["distinct_experts"] == sum(per_set) / len(per_set)
    assert row["touched_bytes"] == row["distinct_experts"] * 3 * row["hidden"] * row["intermediate"] * 2
    assert row["ours_correct"] and row["failures"] == []
    for mode in bench.MODES:
        assert "error" not in row["modes"][mode], (mode, row["modes"][mode])
        assert row["modes"][mode]["max_rel_err"] < 1e-2, (mode, row["modes"][mode])


def test_grouped_mm_experts_matches_the_reference_with_repeated_experts():
    import torch

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 1], [0, 1], [2, 3], [3, 0]])
    weights = torch.rand(5, 2, generator=gen)
    gate_up = (torch.randn(4, 2 * 16, 32, generator=gen) / 32**0.5).to(torch.bfloat16)
    down = (torch.randn(4, 32, 16, generator=gen) / 16**0.5).to(torch.bfloat16)
    expected = bench.reference_fp32(hidden, ids, weights, gate_up, down)
    got = bench.grouped_mm_experts(hidden, ids, weights, gate_up, down)
    assert bench.common.max_relative_error(got, expected) < 1e-2


def test_chunked_fp32_reference_equals_the_whole_stack_reference(monkeypatch):
    import torch

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 5], [5, 1], [2, 4], [3, 0]])
    weights = torch.rand(4, 2, generator=gen)
    gate_up = torch.randn(6, 2 * 16, 32, generator=gen).to(torch.bfloat16)
    down = torch.randn(6, 32, 16, generator=gen).to(torch.bfloat16)
    whole = bench.moe_experts_reference(hidden.float(), ids, weights, gate_up.float(), down.float())
    monkeypatch.setattr(bench, "REFERENCE_EXPERTS_PER_CHUNK", 4)  # chunks [0, 4) and [4, 6)
    assert torch.allclose(bench.reference_fp32(hidden, ids, weights, gate_up, down), whole, rtol=1e-5, atol=1e-5)
