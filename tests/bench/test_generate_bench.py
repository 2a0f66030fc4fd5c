"""bench/generate.py's pure parts on CPU: the teacher-forcing processor, the per-step error, the
decode rate, and the capture verdict read off a profile's event tree (the GPU tier and the H200
runs read real profiles)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import generate as bench  # noqa: E402


def test_force_ids_picks_the_given_token_and_leaves_the_raw_logits_alone():
    ids = torch.tensor([[5, 6, 7, 1], [5, 6, 2, 3]])
    scores = torch.randn(2, 9)
    raw = scores.clone()
    forced = bench.ForceIds(ids, prompt=2)(ids[:, :2], scores)
    assert forced.argmax(-1).tolist() == [7, 2]
    assert torch.equal(scores, raw)


def test_step_errors_flag_shape_and_nan():
    ref = [torch.ones(2, 4), torch.ones(2, 4)]
    errors = bench.step_relative_errors([torch.ones(2, 4), torch.full((2, 4), 1.01)], ref)
    assert errors[0] == 0.0 and abs(errors[1] - 0.01) < 1e-6
    assert bench.step_relative_errors([torch.ones(2, 3), torch.full((2, 4), float("nan"))], ref) == [math.inf, math.inf]


def test_decode_rate_leaves_out_the_prefill():
    assert bench.decode_tokens_per_second(8, 32, 1.31, 0.07) == 8 * 31 / 1.24


@dataclasses.dataclass
class Range:
    start: int
    end: int = 0


@dataclasses.dataclass
class Event:
    name: str
    cpu_children: list = dataclasses.field(default_factory=list)
    time_range: Range = dataclasses.field(default_factory=lambda: Range(0))
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CPU


def test_capture_verdict_from_the_profile_tree():
    def region(at, *names):
        return Event("Torch-Compiled Region: 0/1", [Event("CompiledFunction", [Event(n) for n in names])], Range(at))

    events = [
        region(3, "cudaMemcpyAsync", "cudaGraphLaunch"),  # replayed, its inputs copied in
        region(0, "cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync"),  # the prefill, uncaptured
        region(2, "cudaGraphLaunch", "cuLaunchKernelEx"),  # captured on this call, then replayed
        region(1, "cudaLaunchKernel"),  # uncaptured
        Event("aten::argmax", [Event("cudaLaunchKernel")]),  # generate's own loop: no region
    ]
    regions = bench.region_launches(events)
    verdict = bench.capture_verdict(regions)
    assert verdict.pop("launched_by") == {"CompiledFunction": 4}
    assert verdict == {
        "calls": 4, "captured_calls": 1, "recorded_calls": 1, "uncaptured_calls": 2, "loose_kernels": 4, "memcpys": 2}  # fmt: skip
    calls = bench.split_calls(regions, new_tokens=4)
    assert calls["prefill"]["calls"] == 1 and calls["prefill"]["uncaptured_calls"] == 1
    assert calls["decode"].pop("launched_by") == {"CompiledFunction": 2}
    assert calls["decode"] == {
        "calls": 3, "captured_calls": 1, "recorded_calls": 1, "uncaptured_calls": 1, "loose_kernels": 2, "memcpys": 1}  # fmt: skip


def test_step_timeline_splits_the_period_into_host_and_gpu_busy():
    def region(at, took):
        return Event("Torch-Compiled Region: 0/1", time_range=Range(at, at + took))

    def kernel(start, end):
        return Event("void triton_kernel", time_range=Range(start, end), device_type=torch.autograd.DeviceType.CUDA)

    # a prefill region, then 4 decode calls every 100 us, each 30 us of host time; the GPU runs
    # 20 us of overlapping kernels per step (10-25 and 15-30 after each start)
    events = [region(-500, 200), *(region(100 * i, 30) for i in range(4))]
    events += [k for i in range(4) for k in (kernel(100 * i + 10, 100 * i + 25), kernel(100 * i + 15, 100 * i + 30))]
    events.append(kernel(-400, -300))  # the prefill's: outside the decode span
    timeline = bench.step_timeline(events, new_tokens=5)
    assert timeline == {"period_us": 100, "compiled_call_host_us": 30, "gpu_busy_us": 20.0, "gpu_busy_fraction": 0.2}
    assert bench.step_timeline([e for e in events if e.device_type != torch.autograd.DeviceType.CUDA], 5) == {}


def test_isolated_argv_runs_one_mode_into_its_own_file():
    argv = ["--model", "deepseek-v3.2", "--modes", "stock", "ours", "--isolate", "--batches", "1", "64",
            "--out", "r.json", "--layers", "2"]  # fmt: skip
    assert bench.isolated_argv(argv, "ours", "/t/ours.json") == [
        "--model", "deepseek-v3.2", "--batches", "1", "64", "--layers", "2", "--modes", "ours", "--out", "/t/ours.json"
    ]  # fmt: skip
    assert bench.isolated_argv(["--isolate", "--modes=stock", "--model", "qwen3.5"], "stock", "o") == [
        "--model", "qwen3.5", "--modes", "stock", "--out", "o"
    ]  # fmt: skip


def test_finish_compares_each_row_with_stock_of_its_batch(capsys):
    rows = [{"mode": "stock", "batch": 1, "decode_tokens_per_s": 200.0, "logits_rel_err_by_step": [0.01, 0.05]},
            {"mode": "ours", "batch": 1, "decode_tokens_per_s": 300.0, "logits_rel_err_by_step": [0.01, 0.2]},
            {"mode": "ours", "error": "its process wrote no result (rc 1)"}]  # fmt: skip
    result = bench.finish({"rows": rows}, None)
    assert result["rows"][1]["vs_stock"] == 1.5
    assert result["rows"][1]["steps_beyond_stock"] == 1 and result["rows"][1]["steps_over_2e-2"] == 1
    assert "vs_stock" not in result["rows"][2]
    assert "ERROR its process wrote no result" in capsys.readouterr().out
