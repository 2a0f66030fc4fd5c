"""Why a mode's HF ``generate()`` at batch 1 runs slower than its GPU work says: one process,
the modes in turn, each timed as bench/generate.py times it, and beside each timing what the
process state is.

Each probe records:
- decode ms per step and the one-token ``generate()`` (prefill, which runs eager in every mode);
- the host cost of one small eager launch (2,000 ``add_``);
- the caching allocator's counters (device mallocs / frees, retries) across the timed calls;
- the same timings with Python's GC off;
- a cProfile of one ``generate()``: the top functions by own time.

Sequence: eager, stock (warm, probe, torch.profiler as the bench runs it, probe), ours (the same),
eager again, stock again. A probe that moves after a profile, or eager's prefill moving after a
mode compiled, points at the process rather than the mode.

    python bench/diagnostics/generate_host_probe.py --model deepseek-v3.2 --out probe.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import generate as gen  # noqa: E402

from fusion_compiler.model_adapters import get_adapter  # noqa: E402

_ALLOC_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def launch_us(n: int = 2000) -> float:
    """Host µs per small eager kernel launch (nan on CPU)."""
    if not torch.cuda.is_available():
        return float("nan")
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host


def alloc_stats() -> dict:
    if not torch.cuda.is_available():
        return {k: None for k in (*_ALLOC_KEYS, "allocated_gb", "reserved_gb")}
    stats = torch.cuda.memory_stats()
    return {**{k: stats.get(k) for k in _ALLOC_KEYS},
            "allocated_gb": torch.cuda.memory_allocated() / 1e9, "reserved_gb": torch.cuda.memory_reserved() / 1e9}  # fmt: skip


def top_functions(runner: gen.Runner, mode: str, lines: int = 25) -> str:
    profile = cProfile.Profile()
    profile.enable()
    runner.generate(mode, 1)
    runner.sync()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def probe(runner: gen.Runner, mode: str, label: str, repeats: int) -> dict:
    before = alloc_stats()
    all_times = runner.timed(mode, 1, runner.new_tokens, repeats)
    first_times = runner.timed(mode, 1, 1, repeats)
    after = alloc_stats()
    gc.disable()
    try:
        gc_off = runner.timed(mode, 1, runner.new_tokens, repeats)
    finally:
        gc.enable()
    a, f = statistics.median(all_times), statistics.median(first_times)
    row = {"label": label, "mode": mode, "generate_s": all_times, "first_token_s": first_times,
           "step_ms": (a - f) / (runner.new_tokens - 1) * 1e3, "first_ms": f * 1e3,
           "gc_off_step_ms": (statistics.median(gc_off) - f) / (runner.new_tokens - 1) * 1e3,
           "launch_us": launch_us(), "alloc_delta": {k: (after[k] or 0) - (before[k] or 0) for k in _ALLOC_KEYS},
           "alloc_after": after}  # fmt: skip
    print(f"{label:22} step {row['step_ms']:.3f} ms (gc off {row['gc_off_step_ms']:.3f})  first {row['first_ms']:.2f} ms"
          f"  launch {row['launch_us']:.2f} us  alloc {row['alloc_delta']}  reserved {after['reserved_gb']} GB",
          flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v3.2")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny widths on CPU: the script runs, nothing timed means much")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    adapter = get_adapter(args.model)
    layers = args.layers or gen.LAYERS[args.model]
    device = "cpu" if args.smoke else "cuda"
    model = adapter.build_hf(size="tiny" if args.smoke else "real", layers=layers, device=device)
    runner = gen.Runner(model, device, 32, cpu_compile=args.smoke)
    result = {"bench": "generate_host_probe", "model": args.model, "layers": layers,
              "provenance": common.provenance(None if device == "cuda" else "cpu (smoke)"), "rows": [], "profiles": {}}  # fmt: skip
    if device == "cuda":
        result.update(common.device_facts())
    rows = result["rows"]
    rows.append({"label": "fresh", "launch_us": launch_us(), "alloc_after": alloc_stats()})
    print("fresh launch", rows[-1]["launch_us"], flush=True)

    def save():
        if args.out:
            common.write_json(args.out, result)

    runner.generate("eager", 1)
    rows.append(probe(runner, "eager", "eager", args.repeats))
    save()
    for mode in ("stock", "ours"):
        runner.generate(mode, 1)  # compile, warm-up, capture
        runner.generate(mode, 1)
        runner.generate(mode, 1, 1)
        rows.append(probe(runner, mode, mode, args.repeats))
        result["profiles"][mode] = top_functions(runner, mode)
        if runner.device == "cuda":  # as bench/generate.py profiles each compiled mode
            gen.profiled_generate(runner, mode, 1)
        rows.append(probe(runner, mode, f"{mode}_after_profile", args.repeats))
        save()
    rows.append(probe(runner, "eager", "eager_end", args.repeats))
    for _ in range(2):
        runner.generate("stock", 1)
    runner.generate("stock", 1, 1)
    rows.append(probe(runner, "stock", "stock_again", args.repeats))
    save()
    for mode, text in result["profiles"].items():
        print(f"--- cProfile, {mode}: one generate() of 32 tokens, by own time")
        print("\n".join(text.splitlines()[:40]))
    return result


if __name__ == "__main__":
    main()
