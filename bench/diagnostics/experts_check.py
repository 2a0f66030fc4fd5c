"""The ``moe_experts`` stage's kernels on the GPU: the small-batch Triton kernels
(fusion_compiler/kernels/moe_experts.py) and the grouped Triton kernels
(fusion_compiler/kernels/moe_experts_grouped.py) against a torch grouped path (``grouped_mm_experts``
below: sort + two ``torch._grouped_mm``, the op's rounding points), and the small-batch launch shapes.

For MiniMax-M2.5 (256 experts, top 8, H 3072, I 1536), Qwen3.5-397B (512, top 10, H 4096,
I 1024) and DeepSeek V3.2 (256, top 8, H 7168, I 2048), random bf16 weights (one model's at a
time: DeepSeek's are 22.5 GB), random distinct ids per token, fp32 routing weights (Qwen's
router returns bf16 ones, so bf16 there):

  check   per T in 1, 4, 8, 16, 64: the small-batch and the grouped kernels' outputs vs the torch
          grouped path's (relative error ||a - b|| / ||b|| and max |a - b| / max |b|);
  time    per T: CUDA-graph µs (bench/common.graph_time_us: one graph of calls cycling through
          4 input sets with different experts, so weights come from HBM) of the torch grouped
          path, the small-batch kernels as shipped (``default_config``), each of them alone, and
          the grouped kernels (their ``default_config``); the chosen
          experts' weight bytes (distinct experts: what the grouped path reads, the floor; and
          per (token, k) pair: what the kernels read, a repeated expert again) and GB/s;
  sweep   at T = 1 and 8: each kernel alone over a few (block_n, block_k, warps, stages) shapes
          (each checked first through the whole launcher), then the whole launcher with the best
          of each.

Each case runs in its own try/except (errors recorded in the JSON, which is rewritten after each
model); ``--budget-s`` skips what is left past it. About 2 minutes on an H200.

    python bench/diagnostics/experts_check.py --out bench/results/experts_check_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402

from fusion_compiler.kernels import moe_experts as K  # noqa: E402
from fusion_compiler.kernels import moe_experts_grouped as G  # noqa: E402
from fusion_compiler.ops.moe_experts import SMALL_BATCH_MAX_TOKENS  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

MODELS = {  # name: (experts, top_k, hidden, intermediate, routing-weights dtype)
    "minimax-m2.5": (256, 8, 3072, 1536, torch.float32),
    "qwen3.5": (512, 10, 4096, 1024, torch.bfloat16),
    "deepseek-v3.2": (256, 8, 7168, 2048, torch.float32),
}
TOKENS = (1, 4, 8, 16, 64)  # 64: past the op's split, the grouped kernels' side
SWEEP_TOKENS = (1, 8)
ROTATIONS = 4
# (block_n, block_k, warps, stages) per kernel; the default_config choice is always timed too.
GATE_UP_SHAPES = ((16, 256, 4, 1), (8, 256, 4, 1), (8, 512, 4, 1), (16, 512, 8, 1), (32, 256, 8, 1), (4, 512, 2, 1),
                  (16, 128, 4, 1), (16, 256, 4, 3), (8, 256, 4, 4))  # fmt: skip
DOWN_SHAPES = ((8, 512, 4, 1), (4, 512, 4, 1), (4, 1024, 4, 1), (16, 256, 4, 1), (16, 512, 8, 1), (8, 1024, 8, 1),
               (2, 1024, 2, 1), (8, 512, 4, 3), (16, 256, 4, 4))  # fmt: skip
SWEEP_TIMING = {"calls_per_graph": 10, "replays": 30}


def grouped_mm_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj) -> torch.Tensor:
    """The (token, k) rows sorted by expert, then ``torch._grouped_mm`` per projection over the
    weights' transposed views (HF's grouped-mm layout; ids all in [0, E)). Offsets from a count
    on the device (``index_add_``, not ``bincount``): no host sync, a CUDA graph captures it."""
    tokens, top_k = top_k_ids.shape
    flat = top_k_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // top_k  # the token of each sorted (token, k) row
    counts = torch.zeros(gate_up_proj.shape[0], dtype=torch.int32, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(hidden[rows], gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    out = torch._grouped_mm(torch.nn.functional.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)
    weighted = out.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    total = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return total.index_add_(0, rows, weighted).to(hidden.dtype)


def make_weights(experts, hidden, inter, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    gate_up.mul_(hidden**-0.5)
    down = torch.randn(experts, hidden, inter, generator=gen, device="cuda", dtype=torch.bfloat16)
    down.mul_(inter**-0.5)
    return gate_up, down


def make_sets(tokens, experts, top_k, hidden, inter, weights_dtype, seed=1):
    """ROTATIONS input sets: hidden, distinct ids per token, renormalised weights, and the act
    buffer / output the single-kernel timings write to."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sets = []
    for _ in range(ROTATIONS):
        ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=-1)[:, :top_k].contiguous()
        w = torch.rand(tokens, top_k, generator=gen, device="cuda") + 0.1
        sets.append({
            "hidden": torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16(),
            "top_k_ids": ids,
            "top_k_weights": (w / w.sum(dim=-1, keepdim=True)).to(weights_dtype),
            "act": torch.randn(tokens * top_k, inter, generator=gen, device="cuda").bfloat16(),
            "out": torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16),
        })  # fmt: skip
    return sets


def errors(actual, expected) -> dict:
    return {
        "rel_err": relative_error(actual, expected),
        "max_rel_err": common.max_relative_error(actual, expected),
    }


def gbs(nbytes, us) -> float:
    return nbytes / us / 1e3


def with_gate_up(config, shape):
    n, k, w, st = shape
    return dataclasses.replace(config, gate_up_block_n=n, gate_up_block_k=k, gate_up_warps=w, gate_up_stages=st)


def with_down(config, shape):
    n, k, w, st = shape
    return dataclasses.replace(config, down_block_n=n, down_block_k=k, down_warps=w, down_stages=st)


class Runner:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.payload = {"script": "bench/diagnostics/experts_check.py", "errors": [], "skipped": [], "models": {}}

    def over_budget(self, what) -> bool:
        if time.monotonic() - self.start > self.args.budget_s:
            self.payload["skipped"].append(what)
            return True
        return False

    def attempt(self, what, fn):
        """fn() or None, its exception recorded (and the CUDA error state cleared if possible)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a bench run records every failure and moves on
            self.payload["errors"].append({"case": what, "error": repr(e), "trace": traceback.format_exc()[-2000:]})
            print(f"  ERROR {what}: {e!r}", flush=True)
            try:
                torch.cuda.synchronize()
            except Exception as sticky:  # noqa: BLE001 - a sticky CUDA error: later cases record theirs too
                print(f"  (synchronize after the error: {sticky!r})", flush=True)
            return None

    def save(self):
        self.payload["seconds"] = time.monotonic() - self.start
        common.write_json(self.args.out, self.payload)


def run_model(run: Runner, name: str) -> None:
    experts, top_k, hidden, inter, _ = MODELS[name]
    row = run.payload["models"].setdefault(name, {
        "experts": experts, "top_k": top_k, "hidden": hidden, "intermediate": inter,
        "expert_bytes": 3 * inter * hidden * 2, "tokens": {}, "sweep": {},
    })  # fmt: skip
    gate_up, down = make_weights(experts, hidden, inter)
    torch.cuda.synchronize()
    for tokens in run.args.tokens:
        if not run.over_budget(f"{name} T={tokens}"):
            run.attempt(f"{name} T={tokens}", lambda tokens=tokens: run_tokens(run, name, tokens, gate_up, down, row))
            run.save()


def run_tokens(run: Runner, name: str, tokens: int, gate_up, down, row: dict) -> None:
    experts, top_k, hidden, inter, weights_dtype = MODELS[name]
    what = f"{name} T={tokens}"
    sets = make_sets(tokens, experts, top_k, hidden, inter, weights_dtype)
    config = K.default_config(tokens, top_k, hidden, inter)
    distinct = sum(s["top_k_ids"].unique().numel() for s in sets) / len(sets)
    case = row["tokens"].setdefault(str(tokens), {
        "pairs": tokens * top_k, "distinct_experts": distinct,
        "distinct_bytes": distinct * row["expert_bytes"], "pair_bytes": tokens * top_k * row["expert_bytes"],
        "default_config": dataclasses.asdict(config),
        "op_takes_small_batch": tokens <= SMALL_BATCH_MAX_TOKENS,
    })  # fmt: skip

    def kernels(s):
        return K.small_batch_experts(s["hidden"], s["top_k_ids"], s["top_k_weights"], gate_up, down, config)

    def grouped(s):
        return grouped_mm_experts(s["hidden"], s["top_k_ids"], s["top_k_weights"], gate_up, down)

    def grouped_kernels(s):
        return G.grouped_experts(s["hidden"], s["top_k_ids"], s["top_k_weights"], gate_up, down)

    def gate_up_alone(s):
        K.launch_gate_up(s["hidden"], s["top_k_ids"], gate_up, s["act"],
                         config.gate_up_block_n, config.gate_up_block_k, config.gate_up_warps,
                         config.gate_up_stages)  # fmt: skip

    def down_alone(s):
        K.launch_down(s["act"], s["top_k_ids"], s["top_k_weights"], down, s["out"],
                      config.down_block_n, config.down_block_k, config.down_warps, config.down_stages)  # fmt: skip

    def check():
        ref = grouped(sets[0])
        case.update(errors(kernels(sets[0]), ref))
        case["deterministic"] = bool(torch.equal(kernels(sets[0]), kernels(sets[0])))
        case["grouped_kernels"] = errors(grouped_kernels(sets[0]), ref)
        case["grouped_kernels"]["deterministic"] = bool(torch.equal(grouped_kernels(sets[0]), grouped_kernels(sets[0])))

    run.attempt(f"{what} check", check)
    timed = {  # label: (fn, bytes the GB/s are of)
        "grouped": (grouped, case["distinct_bytes"]),
        "kernels": (kernels, case["distinct_bytes"]),
        "grouped_kernels": (grouped_kernels, case["distinct_bytes"]),
        "gate_up": (gate_up_alone, case["pair_bytes"] * 2 / 3),
        "down": (down_alone, case["pair_bytes"] / 3),
    }
    for label, (fn, nbytes) in timed.items():
        us = run.attempt(f"{what} time {label}", lambda fn=fn: common.graph_time_us(lambda i: fn(sets[i]), ROTATIONS))
        if us is not None:
            case[f"{label}_us"] = us
            case[f"{label}_gbs"] = gbs(nbytes, us)
            if run.payload.get("copy_gbs"):
                case[f"{label}_pct_bw"] = 100 * gbs(nbytes, us) / run.payload["copy_gbs"]
    if case.get("kernels_us") and case.get("grouped_us"):
        case["speedup"] = case["grouped_us"] / case["kernels_us"]
    nan = float("nan")
    print(f"{what}: grouped {case.get('grouped_us', nan):.1f} us, grouped kernels "
          f"{case.get('grouped_kernels_us', nan):.1f} us, kernels {case.get('kernels_us', nan):.1f} us "
          f"({case.get('kernels_gbs', nan):.0f} GB/s of distinct experts; gate_up {case.get('gate_up_us', nan):.1f}, "
          f"down {case.get('down_us', nan):.1f}), rel err {case.get('rel_err', nan):.2e}", flush=True)  # fmt: skip
    if tokens in run.args.sweep_tokens:
        sweep(run, name, tokens, sets, gate_up, down, config, case)


def sweep(run: Runner, name, tokens, sets, gate_up, down, config, case) -> None:
    what = f"{name} T={tokens} sweep"
    result = {"gate_up": [], "down": []}
    run.payload["models"][name]["sweep"][str(tokens)] = result
    ref = grouped_mm_experts(sets[0]["hidden"], sets[0]["top_k_ids"], sets[0]["top_k_weights"], gate_up, down)
    default_gate_up = (config.gate_up_block_n, config.gate_up_block_k, config.gate_up_warps, config.gate_up_stages)
    default_down = (config.down_block_n, config.down_block_k, config.down_warps, config.down_stages)

    def one(kernel, shape):
        if run.over_budget(f"{what} {kernel} {shape}"):
            return
        entry = dict(zip(("block_n", "block_k", "warps", "stages"), shape, strict=True))
        full = with_gate_up(config, shape) if kernel == "gate_up" else with_down(config, shape)
        s0 = sets[0]
        out = K.small_batch_experts(s0["hidden"], s0["top_k_ids"], s0["top_k_weights"], gate_up, down, full)
        entry.update(errors(out, ref))
        if entry["rel_err"] > 1e-2:
            entry["rejected"] = "wrong result"
            result[kernel].append(entry)
            return
        n, k, w, st = shape
        if kernel == "gate_up":
            nbytes = case["pair_bytes"] * 2 / 3

            def fn(i):
                s = sets[i]
                K.launch_gate_up(s["hidden"], s["top_k_ids"], gate_up, s["act"], n, k, w, st)
        else:
            nbytes = case["pair_bytes"] / 3

            def fn(i):
                s = sets[i]
                K.launch_down(s["act"], s["top_k_ids"], s["top_k_weights"], down, s["out"], n, k, w, st)

        entry["us"] = common.graph_time_us(fn, ROTATIONS, **SWEEP_TIMING)
        entry["gbs"] = gbs(nbytes, entry["us"])
        result[kernel].append(entry)

    for kernel, shapes, default in (("gate_up", GATE_UP_SHAPES, default_gate_up), ("down", DOWN_SHAPES, default_down)):
        for shape in dict.fromkeys((default, *shapes)):
            run.attempt(f"{what} {kernel} {shape}", lambda kernel=kernel, shape=shape: one(kernel, shape))

    best = {}
    for kernel in ("gate_up", "down"):
        ok = [e for e in result[kernel] if "us" in e]
        if ok:
            best[kernel] = min(ok, key=lambda e: e["us"])
    result["best"] = best
    if len(best) == 2 and not run.over_budget(f"{what} best combined"):
        g, d = best["gate_up"], best["down"]
        keys = ("block_n", "block_k", "warps", "stages")
        combined = with_down(with_gate_up(config, tuple(g[k] for k in keys)), tuple(d[k] for k in keys))

        def fn(i):
            s = sets[i]
            K.small_batch_experts(s["hidden"], s["top_k_ids"], s["top_k_weights"], gate_up, down, combined)

        us = run.attempt(f"{what} best combined", lambda: common.graph_time_us(fn, ROTATIONS))
        if us is not None:
            result["best_config"] = dataclasses.asdict(combined)
            result["best_us"] = us
            result["best_gbs"] = gbs(case["distinct_bytes"], us)
            print(f"{what}: best gate_up {g['block_n']}x{g['block_k']} w{g['warps']} s{g['stages']} {g['us']:.1f} us, "
                  f"down {d['block_n']}x{d['block_k']} w{d['warps']} s{d['stages']} {d['us']:.1f} us, "
                  f"together {us:.1f} us "
                  f"(default {case.get('kernels_us', float('nan')):.1f})", flush=True)  # fmt: skip


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=list(SWEEP_TOKENS))
    parser.add_argument("--budget-s", type=float, default=170.0, help="skip what is left after this many seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("experts_check.py needs a CUDA device")

    run = Runner(args)
    run.payload["device"] = run.attempt("device facts", common.device_facts)
    run.payload["small_batch_max_tokens"] = SMALL_BATCH_MAX_TOKENS
    run.payload["copy_gbs"] = run.attempt("copy bandwidth", lambda: common.copy_bandwidth_gbs(1.0))
    run.save()
    for name in args.models:
        if run.over_budget(name):
            continue
        run.attempt(name, lambda name=name: run_model(run, name))
        torch.cuda.empty_cache()
        run.save()
    run.save()
    print(f"{len(run.payload['errors'])} errors, {len(run.payload['skipped'])} skipped, "
          f"{run.payload['seconds']:.0f} s -> {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
