"""bench/moe_experts_fp8.py on CPU (--device cpu --tiny, Triton's interpreter): the weights quantise,
every mode runs and agrees with its reference on both kernel paths, the row carries the FP8 and
bf16 bytes the H200 run reports, and a wrong kernel fails the run. CUDA graphs and kernel counts
run on the GPU only; the timing's arithmetic (GB/s, % of the copy bandwidth, speedups) is checked
here with a stand-in timer."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import moe_experts_fp8 as bench  # noqa: E402

MODEL = "qwen3.5"  # tiny: 8 experts, top 2, H 256, I 128, bf16 routing weights
SMALL, GROUPED = 3, 16  # either side of SMALL_BATCH_MAX_TOKENS (8): each kernel path


def run(tmp_path, *tokens: int) -> tuple[int, dict]:
    out = tmp_path / "moe_experts_fp8.json"
    argv = ["--device", "cpu", "--tiny", "--models", MODEL, "--tokens", *map(str, tokens), "--out", str(out)]
    return bench.main(argv), json.loads(out.read_text())


def test_tiny_cpu_run_writes_a_correct_row_per_mode_and_kernel_path(tmp_path):
    rc, payload = run(tmp_path, SMALL, GROUPED)
    assert rc == 0
    assert payload["provenance"]["device"] == "cpu"
    assert payload["modes"] == list(bench.MODES)
    assert "moe_experts_fp8" in payload["kernel_versions"]
    assert [(row["model"], row["tokens"]) for row in payload["rows"]] == [(MODEL, SMALL), (MODEL, GROUPED)]
    for row, path in zip(payload["rows"], ("small_batch", "grouped"), strict=True):
        hidden, inter, distinct = row["hidden"], row["intermediate"], row["distinct_experts"]
        assert (row["top_k"], hidden % 128, inter % 128) == (2, 0, 0)
        assert len(row["distinct_experts_per_set"]) == bench.ROTATIONS
        scales = 2 * inter // 128 * hidden // 128 + hidden // 128 * inter // 128
        assert row["touched_bytes_fp8"] == distinct * (3 * hidden * inter + 4 * scales)
        assert row["touched_bytes_bf16"] == distinct * 3 * hidden * inter * 2
        assert 1.9 < row["ideal_speedup_fp8_vs_bf16"] < 2
        assert row["ours_correct"] and row["failures"] == []
        for mode in bench.MODES:
            entry = row["modes"][mode]
            assert "error" not in entry, (mode, entry)
            assert entry["max_rel_err"] <= bench.TOLERANCE, (mode, entry)
            assert entry["first_call_s"] > 0 and "us" not in entry  # nothing timed on CPU
        for mode in bench.OURS:
            assert row["modes"][mode]["path"] == path
        # FP8 activations cost something against the bf16 path on the same weights, not much.
        assert 0 < row["modes"]["ours_fp8"]["max_rel_err_vs_bf16_reference"] < 0.1


@pytest.mark.parametrize(
    ("module", "launcher", "mode"),
    [("fusion_compiler.kernels.moe_experts_fp8", "grouped_experts_fp8", "ours_fp8"),
     ("fusion_compiler.kernels.moe_experts_grouped", "grouped_experts", "ours_bf16")],
)  # fmt: skip
def test_a_kernel_off_by_a_few_percent_fails_the_run(tmp_path, monkeypatch, capsys, module, launcher, mode):
    import importlib

    kernels = importlib.import_module(module)
    real = getattr(kernels, launcher)
    monkeypatch.setattr(kernels, launcher, lambda *args, **kwargs: real(*args, **kwargs) * (1 + 4 * bench.TOLERANCE))
    rc, payload = run(tmp_path, GROUPED)
    assert rc == 1
    [row] = payload["rows"]
    assert not row["ours_correct"]
    assert [f.split(" vs ")[0] for f in row["failures"]] == [mode]
    assert row["modes"][mode]["max_rel_err"] > bench.TOLERANCE
    assert f"FAIL {MODEL} T={GROUPED} {mode}" in capsys.readouterr().out


def test_timing_fills_gbs_copy_bandwidth_and_speedups(monkeypatch):
    """time_modes (GPU only) with a stand-in timer: each fn returns its µs, stock_fp8 raises."""
    monkeypatch.setattr(bench.common, "kernels_in", lambda fn: 2)
    monkeypatch.setattr(bench.common, "graph_time_us", lambda fn, rotations, calls, replays: fn(0))

    def stock(**_):
        raise RuntimeError("inductor said no\nmore")

    fns = {"ours_fp8": lambda **_: 100.0, "ours_bf16": lambda **_: 190.0, "stock_fp8": stock}
    row = {"model": MODEL, "tokens": 1, "touched_bytes_fp8": 4e8, "touched_bytes_bf16": 8e8,
           "modes": {mode: {} for mode in bench.MODES}}  # fmt: skip
    bench.time_modes(row, fns, [{}] * bench.ROTATIONS, {"copy_bandwidth_gbs": 5000.0})
    fp8, bf16 = row["modes"]["ours_fp8"], row["modes"]["ours_bf16"]
    assert (fp8["us"], fp8["kernels"], bf16["us"]) == (100.0, 2, 190.0)
    assert math.isclose(fp8["gbs"], 4000.0) and math.isclose(fp8["pct_copy_bw"], 80.0)
    assert math.isclose(bf16["gbs"], 8e8 / 190.0 / 1e3)  # over the bf16 bytes
    assert math.isclose(row["speedup_fp8_vs_bf16"], 1.9)
    assert row["modes"]["stock_fp8"]["error"] == "RuntimeError: inductor said no"
    assert "speedup_fp8_vs_stock_fp8" not in row


def test_quantize_in_place_leaves_the_weights_the_codes_stand_for(monkeypatch):
    monkeypatch.setattr(bench, "QUANTIZE_EXPERTS_PER_CHUNK", 2)  # chunks [0, 2), [2, 3)
    weight = (torch.randn(3, 200, 136, generator=torch.Generator().manual_seed(0)) / 136**0.5).bfloat16()
    original = weight.clone()
    codes, scale = bench.quantize_in_place(weight)
    whole_codes, whole_scale = bench.fp8_ops.quantize_weight(original)
    assert torch.equal(codes.view(torch.uint8), whole_codes.view(torch.uint8)) and torch.equal(scale, whole_scale)
    assert torch.equal(weight, bench.fp8_ops.dequantize_weight(whole_codes, whole_scale).bfloat16())
    assert 0 < bench.common.max_relative_error(weight, original) < 0.1


def test_tiny_cpu_sweep_checks_every_config_on_both_kernel_paths(tmp_path, monkeypatch):
    """--sweep on CPU: every candidate checked against the FP8 reference, none timed. The
    small-batch lists cut to a corner each (the interpreter takes ~3 s a small-batch config)."""
    monkeypatch.setattr(bench, "SWEEP_SMALL_BATCH", {
        "gate_up": {"gate_up_block_k": (64, 512), "gate_up_warps": (4,), "gate_up_stages": (1, 3)},
        "down": {"down_block_n": (4, 16), "down_block_k": (512,), "down_warps": (2,)},
    })  # fmt: skip
    out = tmp_path / "sweep.json"
    argv = ["--device", "cpu", "--tiny", "--models", MODEL, "--tokens", "--sweep", "--sweep-tokens", "1",
            str(GROUPED), "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["rows"] == [] and payload["args"]["sweep"]
    small, grouped = payload["sweep"]
    assert (small["path"], grouped["path"]) == ("small_batch", "grouped")
    for result in (small, grouped):
        stages = bench.sweep_stages(result["path"])
        expected = 1 + sum(math.prod(map(len, axes.values())) for axes in stages.values())  # default + products
        assert len(result["configs"]) == expected and result["skipped"] == []
        assert result["checked"] == len({json.dumps(e["config"], sort_keys=True) for e in result["configs"]})
        assert result["configs"][0]["default"] and result["configs"][0]["config"] == result["default_config"]
        for entry in result["configs"]:
            assert "us" not in entry  # nothing timed on CPU
            assert entry.get("rejected") or entry["max_rel_err"] <= bench.TOLERANCE, entry
        assert result["best"] is None and result["speedup_best_vs_default"] is None
    assert {e["stage"] for e in grouped["configs"]} == {"default", *bench.SWEEP_GROUPED}


def test_sweep_rejects_a_wrong_config_and_times_the_rest(monkeypatch):
    """run_sweep with a stand-in timer (µs: 100 at the default, 50 at block_m 32, 80 at down_warps 8)
    and a launcher wrong at gate_up_warps 8: that config is rejected and never timed, an invalid
    block_m 24 (launcher ValueError) too, and the combined best is the fastest of each stage."""
    monkeypatch.setattr(bench, "SWEEP_GROUPED", {"block_m": (16, 24, 32), "gate_up_warps": (4, 8),
                                                 "down_warps": (4, 8)})  # fmt: skip
    kernels, real = bench.fp8_kernels, bench.fp8_kernels.grouped_experts_fp8
    timed = []

    def launcher(*args, config, **kwargs):
        out = real(*args, config=config, **kwargs)
        return out * 1.5 if config.gate_up_warps == 8 else out

    def timer(fn, rotations, calls, replays):
        fn(0)
        timed.append(config := seen[-1])
        return 100.0 / (2 if config.block_m == 32 else 1) * (0.8 if config.down_warps == 8 else 1)

    seen = []
    monkeypatch.setattr(kernels, "grouped_experts_fp8", lambda *a, config, **k: seen.append(config) or launcher(
        *a, config=config, **k))
    monkeypatch.setattr(bench.common, "graph_time_us", timer)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    args = bench.argparse.Namespace(device="cpu", tiny=True)
    experts, fp8 = bench.build_model(MODEL, args)
    args.device = "cuda"  # time (with the stand-in) what passes the check
    with torch.no_grad():
        result = bench.run_sweep(MODEL, experts, fp8, GROUPED, args, {"copy_bandwidth_gbs": 1000.0}, lambda: False)
    by_label = {e["label"]: e for e in result["configs"]}
    assert by_label["gate_up_warps=8"]["rejected"].startswith("wrong result: max_rel_err")
    assert by_label["block_m=24"]["rejected"].startswith("ValueError: block_m 24")
    assert all(c.gate_up_warps != 8 and c.block_m != 24 for c in timed)
    assert "us" not in by_label["gate_up_warps=8"] and "us" not in by_label["block_m=24"]
    assert result["rejected"] == 2 and result["default_us"] == 100.0
    assert result["best"]["stage"] == "combined" and result["best"]["label"] == "block_m=32 down_warps=8"
    assert math.isclose(result["best"]["us"], 40.0) and math.isclose(result["speedup_best_vs_default"], 2.5)
    assert math.isclose(result["best"]["gbs"], result["touched_bytes_fp8"] / 40.0 / 1e3)
    assert math.isclose(result["best"]["pct_copy_bw"], 100 * result["best"]["gbs"] / 1000.0)
