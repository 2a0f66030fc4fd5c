"""Where a decode layer's microseconds go: device time per kernel name, per layer, on HF's code
or on our reference layers (``--source reference``, routed experts per ``--experts``).

bench/decode.py says how long a layer takes; this says which kernels take it. For each (model,
layer kind) it builds decode.py's two stacks (HF's routed experts stubbed to zeros, as there), runs
stock Inductor's step captured in a CUDA graph and our backend's step under the profiler, and
writes, per kernel name, the device µs and launches per call of (2 layers) - (1 layer). The sum
of kernel time against the step's wall time (CUDA events) is the time the GPU sat between
kernels. Our 1-layer step's warm-up call is also watched by ``attention_probe``: what each
decode_attention launch is given (mask kind, kept positions a row, split plan) and its time
re-measured alone on those tensors, skip on and off (``attention_probe`` in the JSON).

    python bench/diagnostics/profile_step.py --out bench/results/profile_step_h200.json
    python bench/diagnostics/profile_step.py --models minimax-m2.5 --batch 1 --out p.json
    python bench/diagnostics/profile_step.py --source reference --experts grouped --models minimax-m2.5 --batch 64 --out p.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402
import decode  # noqa: E402
from diagnostics import attention_probe  # noqa: E402

MODES = ("inductor_graph", "fusion_compiler")
CALLS = 20


def kernel_times(run) -> dict[str, dict[str, float]]:
    """Device µs and launches per call, by kernel name (memcpy / memset included: they cost too)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            run()
        torch.cuda.synchronize()
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"us": 0.0, "launches": 0.0})
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = table[event.name[:140]]
            entry["us"] += event.time_range.elapsed_us() / CALLS
            entry["launches"] += 1 / CALLS
    return dict(table)


def profile_case(source: str, model: str, kind: str, batch: int, context: int, experts: str) -> dict:
    big, small = decode.layer_pairs(source, model)[kind]
    build = decode.build_hf if source == "hf" else decode.build_reference
    stacks, probed = {}, []
    for label, kinds in (("two", big), ("one", small)):
        torch._dynamo.reset()
        stack = build(model, kinds, "real", "cuda", experts)
        compiled = decode.compile_modes(MODES, stack.model, stack.expected)
        step = decode.Step(source, model, stack, batch, context)
        stacks[label] = {}
        for mode in MODES:
            watch = label == "one" and mode == "fusion_compiler"
            with attention_probe.probe() if watch else contextlib.nullcontext([]) as calls:
                run, _, _ = decode.prepare(mode, compiled[mode], step)
            probed += attention_probe.summarise(calls, time_it=True)
            del calls
            step.restore()
            wall = decode.time_us(run)
            step.restore()
            stacks[label][mode] = {"wall_us": wall, "kernels": kernel_times(run)}
        del step, stack, compiled
        torch.cuda.empty_cache()
    per_layer = {}
    for mode in MODES:
        two, one = stacks["two"][mode], stacks["one"][mode]
        names = set(two["kernels"]) | set(one["kernels"])
        zero = {"us": 0.0, "launches": 0.0}
        rows = {n: {k: two["kernels"].get(n, zero)[k] - one["kernels"].get(n, zero)[k] for k in ("us", "launches")}
                for n in names}  # fmt: skip
        rows = {n: r for n, r in rows.items() if abs(r["launches"]) > 1e-6 or abs(r["us"]) > 0.05}
        kernel_us = sum(r["us"] for r in rows.values())
        wall = two["wall_us"] - one["wall_us"]
        per_layer[mode] = {"wall_us": wall, "kernel_us": kernel_us, "between_kernels_us": wall - kernel_us,
                           "kernels": dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"]))}  # fmt: skip
    return {"source": source, "model": model, "kind": kind, "batch": batch, "context": context, "experts": experts,
            "per_layer": per_layer, "stacks": stacks, "attention_probe": probed}


def print_case(case: dict) -> None:
    for mode, layer in case["per_layer"].items():
        print(f"{case['source']} {case['model']} {case['kind']} B={case['batch']} {mode}: {layer['wall_us']:.1f} us a layer, "
              f"kernels {layer['kernel_us']:.1f} us, between kernels {layer['between_kernels_us']:.1f} us")  # fmt: skip
        for name, row in list(layer["kernels"].items())[:18]:
            print(f"    {row['us']:7.2f} us  x{row['launches']:4.1f}  {name[:110]}")
    for row in case.get("attention_probe", []):
        print(f"  decode_attention in the step: {row}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="*", default=list(decode.MODELS), choices=list(decode.MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--source", default="hf", choices=("hf", "reference"))
    parser.add_argument("--experts", default=None,
                        help="routed experts: HF's zeros / compute (default zeros), ours compute / grouped (default compute)")
    args = parser.parse_args()
    experts = args.experts or ("zeros" if args.source == "hf" else "compute")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    cases = []
    for model in args.models:
        for kind in decode.layer_pairs(args.source, model):
            case = profile_case(args.source, model, kind, args.batch, args.context, experts)
            print_case(case)
            cases.append(case)
            common.write_json(args.out, {"device": common.device_facts(), "method": __doc__, "cases": cases})


if __name__ == "__main__":
    main()
