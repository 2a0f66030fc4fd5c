"""bench/diagnostics/experts_check.py on CPU (--device cpu --tiny): the grouped-kernel sweep
checks every GroupedConfig it tries against the torch grouped path (or says why it rejected it),
keeps the default config among its entries and writes its results under each model. Timing runs
on the GPU only."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "diagnostics"))
import experts_check as bench  # noqa: E402

TOKENS = 64  # >= GROUPED_BLOCK_M_MIN_TOKENS: the block_m stage runs too


def run(tmp_path, *args: str) -> dict:
    out = tmp_path / "experts_check.json"
    assert bench.main(["--device", "cpu", "--tiny", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def test_tiny_cpu_grouped_sweep_checks_every_config_of_every_model(tmp_path):
    payload = run(tmp_path, "--tokens", "--grouped-sweep-tokens", str(TOKENS))
    assert payload["errors"] == [] and payload["skipped"] == []
    assert payload["copy_gbs"] is None and payload["read_gbs"] is None  # nothing timed on CPU
    assert payload["grouped_sweep_shapes"]["gate_up"] == [list(s) for s in bench.TINY_GROUPED_GATE_UP_SHAPES]
    assert set(payload["models"]) == set(bench.MODELS)
    for name, (experts, top_k, hidden, inter, _) in bench.TINY_MODELS.items():
        row = payload["models"][name]
        sweep = row["grouped_sweep"][str(TOKENS)]
        default = bench.G.default_config(TOKENS, top_k, experts, hidden, inter)
        assert sweep["default_config"] == dataclasses.asdict(default)
        assert sweep["distinct_bytes"] == sweep["distinct_experts"] * 3 * hidden * inter * 2
        entries = sweep["entries"]
        for entry in entries:
            assert entry.get("rel_err", float("inf")) <= bench.GROUPED_TOLERANCE or entry.get("rejected"), (name, entry)
            assert "us" not in entry, entry
        is_default = [all(e[f] == getattr(default, f) for f in bench.GROUPED_FIELDS) for e in entries]
        assert any(is_default) and is_default == [e["default"] for e in entries]
        stages = [e["stage"] for e in entries]
        assert stages.count("gate_up") == 1 + len(bench.TINY_GROUPED_GATE_UP_SHAPES)  # the default, then the shapes
        assert stages.count("down") == 1 + len(bench.TINY_GROUPED_DOWN_SHAPES)
        assert "combined" not in stages  # no timings, no best of each
        assert sorted(e["block_m"] for e in entries if e["stage"] == "block_m") == sorted(bench.GROUPED_BLOCK_M)
        assert sweep["best"] is None and sweep["default_us"] is None


def test_grouped_sweep_rejects_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "GROUPED_SMEM_LIMIT", 0)  # every config over it: rejected, never run
    payload = run(tmp_path, "--models", "qwen3.5", "--tokens", "--grouped-sweep-tokens", str(TOKENS))
    entries = payload["models"]["qwen3.5"]["grouped_sweep"][str(TOKENS)]["entries"]
    assert entries and all(e["rejected"].startswith("shared memory over 0 B") and "rel_err" not in e for e in entries)

    monkeypatch.setattr(bench, "GROUPED_SMEM_LIMIT", 200 * 1024)
    monkeypatch.setattr(bench, "GROUPED_TOLERANCE", -1.0)  # every result "wrong"
    payload = run(tmp_path, "--models", "qwen3.5", "--tokens", "2", "--sweep-tokens", "--grouped-sweep-tokens", "16")
    assert payload["errors"] == []
    case = payload["models"]["qwen3.5"]["tokens"]["2"]  # the check / time step on CPU: checked, not timed
    assert case["rel_err"] <= 1e-2 and case["grouped_kernels"]["rel_err"] <= 1e-2 and "kernels_us" not in case
    entries = payload["models"]["qwen3.5"]["grouped_sweep"]["16"]["entries"]
    assert [e["stage"] for e in entries] == ["gate_up"] * 3 + ["down"] * 3  # T 16: no block_m stage
    assert all(e["rejected"].startswith("wrong result") and e["rel_err"] >= 0 for e in entries)


def test_grouped_smem_count_matches_default_config_docstring():
    config = bench.G.GroupedConfig(block_m=16, gate_up_block_n=64, gate_up_block_k=64, gate_up_stages=3)
    assert bench.grouped_smem_bytes(config, "gate_up") == (16 * 64 + 2 * 64 * 64) * 2 * 3  # "55 KB"
    assert bench.grouped_smem_bytes(config, "down") == (16 * 64 + 64 * 64) * 2 * 3
    for shapes, kernel in ((bench.GROUPED_GATE_UP_SHAPES, "gate_up"), (bench.GROUPED_DOWN_SHAPES, "down")):
        assert 12 <= len(shapes) + 1 <= 16 and len(set(shapes)) == len(shapes)
        for shape in shapes:
            replace = bench.with_gate_up if kernel == "gate_up" else bench.with_down
            assert bench.grouped_smem_bytes(replace(config, shape), kernel) <= bench.GROUPED_SMEM_LIMIT, shape


def test_grouped_sweep_combines_the_fastest_of_each_kernel(tmp_path, monkeypatch):
    """The GPU-only steps with made-up timings: the fastest gate/up and down shapes timed
    together, block_m tried on that, a config met again not rerun, the best and default read
    off the entries."""
    timings = iter([10.0, 9.0, 11.0, 8.0, 12.0, 7.0, 7.5])  # in the order the sweep times configs
    monkeypatch.setattr(bench.common, "graph_time_us", lambda fn, rotations, **timing: next(timings))
    args = bench.argparse.Namespace(tiny=True, device="cpu", budget_s=1e9, grouped_sweep_budget_s=1e9,
                                    out=str(tmp_path / "experts_check.json"))  # fmt: skip
    run = bench.Runner(args)
    run.timing = True
    run.payload.update(copy_gbs=100.0, read_gbs=200.0)
    name = "qwen3.5"
    experts, top_k, hidden, inter, _ = bench.TINY_MODELS[name]
    gate_up, down = bench.make_weights(experts, hidden, inter, "cpu")
    row = bench.model_row(run, name)
    bench.grouped_sweep(run, name, TOKENS, gate_up, down, row)
    assert run.payload["errors"] == []
    sweep = row["grouped_sweep"][str(TOKENS)]
    entries = sweep["entries"]
    assert [(e["stage"], e["us"], e.get("repeat", False)) for e in entries] == [
        ("gate_up", 10.0, False), ("gate_up", 9.0, False), ("gate_up", 11.0, False),
        ("down", 10.0, True), ("down", 8.0, False), ("down", 12.0, False),
        ("combined", 7.0, False), ("block_m", 7.0, True), ("block_m", 7.5, False),
    ]  # fmt: skip
    combined = entries[6]
    assert bench.kernel_shape(bench.G.GroupedConfig(**{f: combined[f] for f in bench.GROUPED_FIELDS}), "gate_up") == \
        bench.TINY_GROUPED_GATE_UP_SHAPES[0]  # fmt: skip
    assert (combined["down_block_n"], combined["down_block_k"]) == bench.TINY_GROUPED_DOWN_SHAPES[0][:2]
    assert [e["block_m"] for e in entries[7:]] == [16, 32]
    assert sweep["default_us"] == 10.0 and sweep["best"]["stage"] == "combined" and sweep["best"]["us"] == 7.0
    gbs = sweep["distinct_bytes"] / 7.0 / 1e3
    assert sweep["best"]["gbs"] == gbs
    assert sweep["best"]["pct_copy_bw"] == 100 * gbs / 100.0 and sweep["best"]["pct_read_bw"] == 100 * gbs / 200.0
