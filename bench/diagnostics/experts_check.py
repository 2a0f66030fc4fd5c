"""The ``moe_experts`` stage's kernels on the GPU: the small-batch Triton kernels
(fusion_compiler/kernels/moe_experts.py) and the grouped Triton kernels
(fusion_compiler/kernels/moe_experts_grouped.py) against a torch grouped path (``grouped_mm_experts``
below: sort + two ``torch._grouped_mm``, the op's rounding points), and both kernels' launch shapes.

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
  sweep   at T = 1 and 8 (``--sweep-tokens``): each small-batch kernel alone over a few
          (block_n, block_k, warps, stages) shapes (each checked first through the whole
          launcher), then the whole launcher with the best of each;
  grouped sweep
          at T = 64 (``--grouped-sweep-tokens``; after every model's check / time / sweep, the
          weights made again): the grouped launcher (``G.grouped_experts`` with an explicit
          ``GroupedConfig``: align, gate/up, down, combine) over ``dataclasses.replace``s of its
          ``default_config``: the gate/up kernel's (block_n, block_k, warps, stages) over
          GROUPED_GATE_UP_SHAPES with down at its default, then the down kernel's over
          GROUPED_DOWN_SHAPES with gate/up at its default, then the fastest of each together,
          then that with block_m 16 and 32 (T >= 64). Each config is checked first against the
          torch grouped path (computed once per model and T; rel_err > 1e-2: rejected with the
          reason, not timed); a shape whose shared memory, counted as ``default_config``'s
          docstring does ((BLOCK_M x BLOCK_K + 2 x BLOCK_K x BLOCK_N for gate/up, 1 x for down)
          x 2 B x stages), passes GROUPED_SMEM_LIMIT (200 KiB; the H200's is 227 KiB) is rejected
          unrun. Timed whole (GROUPED_SWEEP_TIMING: 8 calls a graph, 15 replays: DeepSeek's call
          is ~4.6 ms at 64 tokens); per entry µs, GB/s of the distinct experts' bytes, % of the
          copy bandwidth and % of the read bandwidth (common.copy_bandwidth_gbs /
          read_bandwidth_gbs, both measured once at the start; a read-only stream beats a copy,
          so % of copy may pass 100). GPU time per model and T: at most 29 timed configs x 164
          calls (~4750) at ~1.4 / 2.2 / 4.6 ms (MiniMax / Qwen3.5 / DeepSeek, 64 tokens) is ~7 /
          10 / 22 s at the default's speed, ~10 / 15 / 30 s with the slower shapes: ~55 s for
          the three (256 tokens about the same, 16 tokens about half). Each new config also
          compiles one or two Triton kernels on the host (~1-2 s each, ~30 per model and T), so
          the wall time is ~1-1.5 min per model and T; ``--grouped-sweep-budget-s`` caps it.

Each case runs in its own try/except (errors recorded in the JSON, which is rewritten after each
model and after each grouped-sweep entry); ``--budget-s`` (420) skips what is left past it. About 2
minutes on an H200 without the grouped sweep (``--grouped-sweep-tokens`` with no value), about
6 with it; the grouped sweep alone at 64 tokens, about 4:

    python bench/diagnostics/experts_check.py --out bench/results/experts_check_h200.json
    python bench/diagnostics/experts_check.py --tokens --grouped-sweep-tokens 64 --budget-s 480 \\
        --out bench/results/experts_check_grouped_sweep_h200.json

On CPU (``--device cpu --tiny``, the test): tiny widths (TINY_MODELS), the kernels under Triton's
interpreter, the same checks and sweeps with 2 shapes per grouped kernel besides the default,
nothing timed (no CUDA graphs).
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

if not torch.cuda.is_available():  # --device cpu: Triton's interpreter, chosen before the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fusion_compiler.kernels import moe_experts as K  # noqa: E402
from fusion_compiler.kernels import moe_experts_grouped as G  # noqa: E402
from fusion_compiler.ops.moe_experts import SMALL_BATCH_MAX_TOKENS  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

MODELS = {  # name: (experts, top_k, hidden, intermediate, routing-weights dtype)
    "minimax-m2.5": (256, 8, 3072, 1536, torch.float32),
    "qwen3.5": (512, 10, 4096, 1024, torch.bfloat16),
    "deepseek-v3.2": (256, 8, 7168, 2048, torch.float32),
}
TINY_MODELS = {  # --tiny (the CPU test): the same routing, widths an interpreter runs in seconds
    "minimax-m2.5": (8, 2, 128, 64, torch.float32),
    "qwen3.5": (16, 2, 96, 32, torch.bfloat16),  # H 96: a masked last K / N tile
    "deepseek-v3.2": (8, 2, 160, 48, torch.float32),
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

# The grouped sweep. (block_n, block_k, warps, stages) per kernel, the default_config's (64, 64,
# 4, 3) swept first; shared memory at block_m 16 in KiB after each (all under
# GROUPED_SMEM_LIMIT). The kernels are memory-bound (each touched expert's rows read once, 1-8
# pairs a run at these T): what may move them is the bytes in flight per SM (stages, tile
# size), the contiguous run per weight row (block_k x 2 B: 128 B at 64), and the grid (slots x
# I or H / block_n programs), so the shapes vary those, each a step or two from the default.
GROUPED_SWEEP_TOKENS = (64,)
GROUPED_GATE_UP_SHAPES = (
    (64, 64, 4, 4),  # 72: one more stage in flight
    (64, 64, 4, 5),  # 90
    (64, 128, 4, 3),  # 108: 256 B a row
    (64, 128, 4, 4),  # 144
    (64, 128, 8, 4),  # 144
    (32, 128, 4, 4),  # 80: twice the programs
    (32, 128, 4, 6),  # 120
    (32, 256, 4, 3),  # 120: 512 B a row
    (32, 256, 8, 4),  # 160
    (16, 256, 4, 4),  # 96: four times the programs
    (16, 512, 4, 3),  # 144: 1 KB a row
    (128, 64, 4, 3),  # 102: half the programs, x rows reused twice as much
    (128, 64, 8, 4),  # 136
)
GROUPED_DOWN_SHAPES = (
    (64, 64, 4, 5),  # 50
    (64, 128, 4, 3),  # 60
    (64, 128, 4, 4),  # 80
    (64, 128, 8, 4),  # 80
    (64, 256, 4, 3),  # 120
    (32, 128, 4, 4),  # 48
    (32, 256, 4, 4),  # 96
    (16, 256, 4, 4),  # 64
    (16, 512, 4, 3),  # 96
    (128, 64, 4, 4),  # 72
    (128, 128, 8, 3),  # 108
    (128, 128, 8, 4),  # 144
    (256, 64, 8, 3),  # 102
)
TINY_GROUPED_GATE_UP_SHAPES = ((16, 32, 4, 2), (32, 64, 8, 1))
TINY_GROUPED_DOWN_SHAPES = ((16, 32, 4, 2), (32, 16, 2, 1))
GROUPED_BLOCK_M = (16, 32)  # on the best combined config, at T >= GROUPED_BLOCK_M_MIN_TOKENS
GROUPED_BLOCK_M_MIN_TOKENS = 64
GROUPED_SMEM_LIMIT = 200 * 1024  # bytes a kernel may use by the count above (H100 / H200: 227 KiB)
GROUPED_SWEEP_TIMING = {"calls_per_graph": 8, "replays": 15}  # 3 + 5 x 8 + 15 x 8 = 163 calls
GROUPED_TOLERANCE = 1e-2  # rel_err against the torch grouped path past which a config is rejected
# The configs' swept fields, recorded in each grouped-sweep entry.
GROUPED_FIELDS = ("block_m", "gate_up_block_n", "gate_up_block_k", "gate_up_warps", "gate_up_stages",
                  "down_block_n", "down_block_k", "down_warps", "down_stages")  # fmt: skip


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


def make_weights(experts, hidden, inter, device="cuda", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    gate_up.mul_(hidden**-0.5)
    down = torch.randn(experts, hidden, inter, generator=gen, device=device, dtype=torch.bfloat16)
    down.mul_(inter**-0.5)
    return gate_up, down


def make_sets(tokens, experts, top_k, hidden, inter, weights_dtype, device="cuda", seed=1):
    """ROTATIONS input sets: hidden, distinct ids per token, renormalised weights, and the act
    buffer / output the single-kernel timings write to."""
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(ROTATIONS):
        ids = torch.rand(tokens, experts, generator=gen, device=device).argsort(dim=-1)[:, :top_k].contiguous()
        w = torch.rand(tokens, top_k, generator=gen, device=device) + 0.1
        sets.append({
            "hidden": torch.randn(tokens, hidden, generator=gen, device=device).bfloat16(),
            "top_k_ids": ids,
            "top_k_weights": (w / w.sum(dim=-1, keepdim=True)).to(weights_dtype),
            "act": torch.randn(tokens * top_k, inter, generator=gen, device=device).bfloat16(),
            "out": torch.empty(tokens, hidden, device=device, dtype=torch.bfloat16),
        })  # fmt: skip
    return sets


def distinct_experts(sets) -> float:
    """Distinct experts an input set names, averaged over the sets."""
    return sum(s["top_k_ids"].unique().numel() for s in sets) / len(sets)


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


def kernel_shape(config, kernel) -> tuple:
    """``config``'s (block_n, block_k, warps, stages) of ``kernel`` ("gate_up" or "down")."""
    return tuple(getattr(config, f"{kernel}_{field}") for field in ("block_n", "block_k", "warps", "stages"))


def grouped_smem_bytes(config, kernel) -> int:
    """Shared memory of a grouped GEMM kernel as ``G.default_config``'s docstring counts it: the
    pipelined operand tiles, (BLOCK_M x BLOCK_K + w x BLOCK_K x BLOCK_N) x 2 B x stages, w = 2
    for gate/up (gate and up tiles), 1 for down."""
    n, k, _, stages = kernel_shape(config, kernel)
    return (config.block_m * k + (2 if kernel == "gate_up" else 1) * k * n) * 2 * stages


def grouped_label(config) -> str:
    gu, dn = kernel_shape(config, "gate_up"), kernel_shape(config, "down")
    return (f"m{config.block_m} gate_up {gu[0]}x{gu[1]} w{gu[2]} s{gu[3]}, "
            f"down {dn[0]}x{dn[1]} w{dn[2]} s{dn[3]}")  # fmt: skip


class Runner:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.device = args.device
        self.timing = args.device == "cuda"  # CPU: checks only (no CUDA graphs, no events)
        self.models = TINY_MODELS if args.tiny else MODELS
        self.payload = {"script": "bench/diagnostics/experts_check.py", "errors": [], "skipped": [], "models": {}}

    def over_budget(self, what) -> bool:
        if time.monotonic() - self.start > self.args.budget_s:
            self.payload["skipped"].append(what)
            return True
        return False

    def synchronize(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def attempt(self, what, fn):
        """fn() or None, its exception recorded (and the CUDA error state cleared if possible)."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - a bench run records every failure and moves on
            self.payload["errors"].append({"case": what, "error": repr(e), "trace": traceback.format_exc()[-2000:]})
            print(f"  ERROR {what}: {e!r}", flush=True)
            try:
                self.synchronize()
            except Exception as sticky:  # noqa: BLE001 - a sticky CUDA error: later cases record theirs too
                print(f"  (synchronize after the error: {sticky!r})", flush=True)
            return None

    def save(self):
        self.payload["seconds"] = time.monotonic() - self.start
        common.write_json(self.args.out, self.payload)


def model_row(run: Runner, name: str) -> dict:
    experts, top_k, hidden, inter, _ = run.models[name]
    return run.payload["models"].setdefault(name, {
        "experts": experts, "top_k": top_k, "hidden": hidden, "intermediate": inter,
        "expert_bytes": 3 * inter * hidden * 2, "tokens": {}, "sweep": {}, "grouped_sweep": {},
    })  # fmt: skip


def run_model(run: Runner, name: str) -> None:
    """Check, time and (small-batch) sweep at every ``--tokens``."""
    experts, top_k, hidden, inter, _ = run.models[name]
    row = model_row(run, name)
    if not run.args.tokens:
        return
    gate_up, down = make_weights(experts, hidden, inter, run.device)
    run.synchronize()
    for tokens in run.args.tokens:
        if not run.over_budget(f"{name} T={tokens}"):
            run.attempt(f"{name} T={tokens}", lambda tokens=tokens: run_tokens(run, name, tokens, gate_up, down, row))
            run.save()


def run_tokens(run: Runner, name: str, tokens: int, gate_up, down, row: dict) -> None:
    experts, top_k, hidden, inter, weights_dtype = run.models[name]
    what = f"{name} T={tokens}"
    sets = make_sets(tokens, experts, top_k, hidden, inter, weights_dtype, run.device)
    config = K.default_config(tokens, top_k, hidden, inter)
    distinct = distinct_experts(sets)
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
    for label, (fn, nbytes) in timed.items() if run.timing else ():
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
        if not run.timing:
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


def run_grouped_sweeps(run: Runner, name: str) -> None:
    """The grouped sweep at every ``--grouped-sweep-tokens`` (the model's weights made again)."""
    if not run.args.grouped_sweep_tokens or run.over_budget(f"{name} grouped sweep"):
        return
    experts, top_k, hidden, inter, _ = run.models[name]
    row = model_row(run, name)
    gate_up, down = make_weights(experts, hidden, inter, run.device)
    run.synchronize()
    for tokens in run.args.grouped_sweep_tokens:
        what = f"{name} T={tokens} grouped sweep"
        if not run.over_budget(what):
            run.attempt(what, lambda tokens=tokens: grouped_sweep(run, name, tokens, gate_up, down, row))
            run.save()


def grouped_sweep(run: Runner, name: str, tokens: int, gate_up, down, row: dict) -> None:
    """The grouped launcher over GroupedConfigs (module docstring): entries in
    ``row["grouped_sweep"][str(tokens)]["entries"]``, each with its stage, the config's
    GROUPED_FIELDS, ``default`` (the default_config?), shared memory per kernel, and either
    rel_err (and on CUDA µs, GB/s, % of copy and read bandwidth) or ``rejected`` (why)."""
    experts, top_k, hidden, inter, weights_dtype = run.models[name]
    what = f"{name} T={tokens} grouped sweep"
    began = time.monotonic()
    sets = make_sets(tokens, experts, top_k, hidden, inter, weights_dtype, run.device)
    config = G.default_config(tokens, top_k, experts, hidden, inter)
    distinct = distinct_experts(sets)
    nbytes = distinct * row["expert_bytes"]
    copy_gbs, read_gbs = run.payload.get("copy_gbs"), run.payload.get("read_gbs")
    result = row["grouped_sweep"][str(tokens)] = {
        "pairs": tokens * top_k, "distinct_experts": distinct, "distinct_bytes": nbytes,
        "default_config": dataclasses.asdict(config), "timed": run.timing,
        "timing": GROUPED_SWEEP_TIMING if run.timing else None, "tolerance": GROUPED_TOLERANCE,
        "smem_limit_bytes": GROUPED_SMEM_LIMIT, "entries": [],
    }  # fmt: skip
    s0 = sets[0]
    ref = grouped_mm_experts(s0["hidden"], s0["top_k_ids"], s0["top_k_weights"], gate_up, down)
    measured = {}  # config -> its measurement: a config met again (the default, a best) is not rerun

    def launcher(cfg):
        def fn(i):
            s = sets[i]
            return G.grouped_experts(s["hidden"], s["top_k_ids"], s["top_k_weights"], gate_up, down, config=cfg)

        return fn

    def measure(stage, cfg):
        label = f"{stage} {grouped_label(cfg)}"
        if run.over_budget(f"{what} {label}"):
            return
        if time.monotonic() - began > run.args.grouped_sweep_budget_s:
            cap = run.args.grouped_sweep_budget_s
            run.payload["skipped"].append(f"{what} {label} (--grouped-sweep-budget-s {cap:g})")
            return
        entry = {"stage": stage, "label": grouped_label(cfg), **{f: getattr(cfg, f) for f in GROUPED_FIELDS},
                 "default": cfg == config}  # fmt: skip
        result["entries"].append(entry)
        if cfg in measured:
            entry.update(measured[cfg], repeat=True)
            return
        m = measured[cfg] = {f"smem_{k}_bytes": grouped_smem_bytes(cfg, k) for k in ("gate_up", "down")}
        over = [f"{k} {m[f'smem_{k}_bytes']} B" for k in ("gate_up", "down")
                if m[f"smem_{k}_bytes"] > GROUPED_SMEM_LIMIT]  # fmt: skip
        if over:
            m["rejected"] = f"shared memory over {GROUPED_SMEM_LIMIT} B: {', '.join(over)}"
        else:
            try:
                m.update(errors(launcher(cfg)(0), ref))
                if not m["rel_err"] <= GROUPED_TOLERANCE:  # (NaN: rejected too)
                    m["rejected"] = f"wrong result: rel_err {m['rel_err']:.3g} > {GROUPED_TOLERANCE:g}"
                elif run.timing:
                    us = common.graph_time_us(launcher(cfg), ROTATIONS, **GROUPED_SWEEP_TIMING)
                    m.update(us=us, gbs=gbs(nbytes, us))
                    if copy_gbs:
                        m["pct_copy_bw"] = 100 * gbs(nbytes, us) / copy_gbs
                    if read_gbs:
                        m["pct_read_bw"] = 100 * gbs(nbytes, us) / read_gbs
            except Exception as e:
                m["rejected"] = f"error: {e!r}"[:500]
                entry.update(m)
                raise  # run.attempt records the trace and synchronizes
        entry.update(m)
        nan = float("nan")
        if "rejected" in m:
            print(f"  {label}: rejected ({m['rejected']})", flush=True)
        elif "us" not in m:
            print(f"  {label}: rel err {m['rel_err']:.2e}", flush=True)
        else:
            print(f"  {label}: {m.get('us', nan):.1f} us, {m.get('gbs', nan):.0f} GB/s "
                  f"({m.get('pct_copy_bw', nan):.0f}% copy, {m.get('pct_read_bw', nan):.0f}% read bw), "
                  f"rel err {m['rel_err']:.2e}", flush=True)  # fmt: skip
        run.save()

    def attempt(stage, cfg):
        run.attempt(f"{what} {stage} {grouped_label(cfg)}", lambda: measure(stage, cfg))

    def fastest(stage):
        timed = [e for e in result["entries"] if e["stage"] == stage and "us" in e]
        return min(timed, key=lambda e: e["us"]) if timed else None

    shapes = {"gate_up": TINY_GROUPED_GATE_UP_SHAPES if run.args.tiny else GROUPED_GATE_UP_SHAPES,
              "down": TINY_GROUPED_DOWN_SHAPES if run.args.tiny else GROUPED_DOWN_SHAPES}  # fmt: skip
    for kernel, replace in (("gate_up", with_gate_up), ("down", with_down)):
        for shape in dict.fromkeys((kernel_shape(config, kernel), *shapes[kernel])):
            attempt(kernel, replace(config, shape))
    chosen = config  # on CPU (nothing timed) block_m is tried on the default
    best_gate_up, best_down = fastest("gate_up"), fastest("down")
    if best_gate_up and best_down:
        chosen = dataclasses.replace(config, **{f: best_gate_up[f] for f in GROUPED_FIELDS if f.startswith("gate_up_")},
                                     **{f: best_down[f] for f in GROUPED_FIELDS if f.startswith("down_")})  # fmt: skip
        attempt("combined", chosen)
    if tokens >= GROUPED_BLOCK_M_MIN_TOKENS:
        for block_m in GROUPED_BLOCK_M:
            attempt("block_m", dataclasses.replace(chosen, block_m=block_m))

    result["seconds"] = time.monotonic() - began
    timed = [e for e in result["entries"] if "us" in e]
    default = next((e for e in timed if e["default"]), None)
    best = result["best"] = min(timed, key=lambda e: e["us"]) if timed else None
    result["default_us"] = default["us"] if default else None
    nan = float("nan")
    rejected = sum("rejected" in e for e in result["entries"])
    worst = max((e["rel_err"] for e in result["entries"] if "rel_err" in e), default=nan)
    head = f"{what}: {len(result['entries'])} entries, {rejected} rejected, max rel err {worst:.2e}"
    if best is None:
        print(f"{head}; nothing timed", flush=True)
        return
    d_us = default["us"] if default else nan
    print(f"{head}; default {d_us:.1f} us ({(default or {}).get('pct_copy_bw', nan):.0f}% copy bw), "
          f"best {best['us']:.1f} us ({best['stage']}: {best['label']}; {best.get('pct_copy_bw', nan):.0f}% copy, "
          f"{best.get('pct_read_bw', nan):.0f}% read bw), {100 * (best['us'] / d_us - 1):+.1f}% vs default",
          flush=True)  # fmt: skip


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=list(SWEEP_TOKENS),
                        help="small-batch kernel sweep at these of --tokens")  # fmt: skip
    parser.add_argument("--grouped-sweep-tokens", type=int, nargs="*", default=list(GROUPED_SWEEP_TOKENS),
                        help="grouped kernel sweep at these token counts (apart from --tokens)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip what is left after this many seconds")
    parser.add_argument("--grouped-sweep-budget-s", type=float, default=150.0,
                        help="per model and T: the grouped sweep's configs left past this many s skipped")  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny widths (TINY_MODELS; the CPU test)")
    args = parser.parse_args(argv)
    common.check_cpu_tiny(parser, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("experts_check.py needs a CUDA device (or --device cpu --tiny)")

    run = Runner(args)
    run.payload["args"] = vars(args)
    run.payload["small_batch_max_tokens"] = SMALL_BATCH_MAX_TOKENS
    run.payload["grouped_sweep_shapes"] = {
        "gate_up": [list(s) for s in (TINY_GROUPED_GATE_UP_SHAPES if args.tiny else GROUPED_GATE_UP_SHAPES)],
        "down": [list(s) for s in (TINY_GROUPED_DOWN_SHAPES if args.tiny else GROUPED_DOWN_SHAPES)],
        "block_m": list(GROUPED_BLOCK_M), "block_m_min_tokens": GROUPED_BLOCK_M_MIN_TOKENS,
    }  # fmt: skip
    if run.timing:
        run.payload["device"] = run.attempt("device facts", common.device_facts)
        run.payload["copy_gbs"] = run.attempt("copy bandwidth", lambda: common.copy_bandwidth_gbs(1.0))
        run.payload["read_gbs"] = run.attempt("read bandwidth", common.read_bandwidth_gbs)
        print(f"copy {run.payload['copy_gbs'] or float('nan'):.0f} GB/s, "
              f"read {run.payload['read_gbs'] or float('nan'):.0f} GB/s", flush=True)  # fmt: skip
    else:
        run.payload["device"] = {"device": "cpu"}
        run.payload["copy_gbs"] = run.payload["read_gbs"] = None
    run.save()
    for phase in (run_model, run_grouped_sweeps):  # one model's weights at a time (DeepSeek's: 22.5 GB)
        for name in args.models:
            if run.over_budget(f"{name} {phase.__name__}"):
                continue
            run.attempt(name, lambda name=name, phase=phase: phase(run, name))
            if run.device == "cuda":
                torch.cuda.empty_cache()
            run.save()
    run.save()
    print(f"{len(run.payload['errors'])} errors, {len(run.payload['skipped'])} skipped, "
          f"{run.payload['seconds']:.0f} s -> {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
