"""The routed experts with FP8 weights (DeepSeek's served format): ours against our bf16 op on the
same weights and against stock Inductor over a plain-torch FP8 forward, for DeepSeek V3.2,
MiniMax-M2.5 and Qwen3.5-397B at real widths.

The format (ops/moe_experts_fp8.py): e4m3 weights with one fp32 scale per 128 x 128 block, in
HF's ``*_scale_inv`` layout (gate_up_proj [E, 2I, H] with scales [E, 2I/128, H/128], down_proj
[E, H, I] with [E, H/128, I/128]); activations quantised per token in 1 x 128 groups.

Weights: each model's experts built as bench/moe_experts.py builds them (HF's module from the
real config, bf16 N(0, 1/fan_in) drawn on the device), then quantised with the op module's
``quantize_weight`` QUANTIZE_EXPERTS_PER_CHUNK experts at a time, and the bf16 weights overwritten
with the dequantised values (fp32 product rounded to bf16): every mode computes with the weights
the FP8 codes stand for. Routing inputs: bench/moe_experts.py's ``routing_set``, same
seeds, so its rows and these see the same ids; ROTATIONS input sets per token count, cycled by one
CUDA graph.

Modes, all timed in the same process as CUDA-graph replays (common.graph_time_us):
  ours_fp8   torch.ops.fusion_compiler.moe_experts_fp8 on the codes and scales
  ours_bf16  torch.ops.fusion_compiler.moe_experts on the dequantised bf16 weights: the path FP8
             should beat by reading half the bytes
  stock_fp8  what someone without a kernel writes: every expert's blocks dequantised to bf16
             (``dequantize_weight`` in fp32, rounded), then bench/moe_experts.py's
             grouped_mm_experts (torch._grouped_mm over the pairs sorted by expert), compiled by
             torch.compile(backend="inductor", fullgraph=True, dynamic=False); a compile or run
             error is recorded and the run goes on

Correctness before timing, on the first input set, max |err| / max |ref|: ours_fp8 against
``moe_experts_fp8_reference`` (same quantisation and rounding points, fp32 GEMMs), ours_bf16 and
stock_fp8 against bench/moe_experts.py's fp32 ``moe_experts_reference`` on the dequantised
weights; ours_fp8 also against that bf16 reference (what FP8 activations cost, not checked).
Either ours over TOLERANCE marks the row failed, prints FAIL, and the run exits 1.

Bytes: touched FP8 = distinct experts x (3 x H x I x 1 B + their fp32 block scales), touched bf16
= distinct experts x 3 x H x I x 2 B, averaged over the rotated sets; activations, ids and
weights left out. GB/s of ours_fp8 and stock_fp8 over the FP8 bytes (stock reads and writes far
more: it dequantises every expert), of ours_bf16 over the bf16 bytes; % of the copy bandwidth
measured once at the start (common.copy_bandwidth_gbs). speedup_fp8_vs_bf16 = ours_bf16 µs /
ours_fp8 µs; the bytes' ratio (ideal_speedup_fp8_vs_bf16, ~2) is what reading half would give.

--seconds (default 120, for a ~150 s slot): rows not started by then are skipped; the JSON is
rewritten after every row. On CPU (--device cpu --tiny, the test) the ours modes call their op's
CUDA dispatch (the Triton kernels the GPU launches) under Triton's interpreter, stock_fp8
compiles with aot_eager, and nothing is timed.

--sweep: after each model's rows, our FP8 launcher (small batch at <= SMALL_BATCH_MAX_TOKENS
tokens, grouped above) called with explicit configs at each --sweep-tokens (default 1 8 64): the
default, then SWEEP_SMALL_BATCH's kernel-1 product (kernel 2 at default) and kernel-2 product
(kernel 1 at default), or SWEEP_GROUPED's fields one at a time; then each stage's fastest fields
combined. Every config is checked against the FP8 reference on the first set first (a launcher
error or max_rel_err over TOLERANCE: ``rejected`` with why, not timed), then timed as time_modes
times (µs, GB/s, % of copy bw over the touched FP8 bytes); "sweep" in the JSON holds one result
per model and token count (configs, default_us, best, speedup_best_vs_default). --sweep-seconds
(default 300, time in sweeps only; --seconds counts the rows only): configs not started by then
are skipped. On CPU every config is checked under the interpreter and none timed.

    python bench/moe_experts_fp8.py --out bench/results/moe_experts_fp8_h200.json [--models ...] [--tokens 1 8 64 256]
    TRITON_INTERPRET=1 python bench/moe_experts_fp8.py --device cpu --tiny --out /tmp/moe_experts_fp8_cpu.json
    python bench/moe_experts_fp8.py --tokens --sweep [--sweep-tokens 1 8 64] --out /tmp/moe_experts_fp8_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if not torch.cuda.is_available():  # --device cpu: Triton's interpreter, chosen before the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import common  # noqa: E402
import moe_experts as bf16_bench  # noqa: E402 - SPECS, build_experts, routing_set, grouped_mm_experts, reference

import fusion_compiler.ops.moe_experts as bf16_ops  # noqa: E402 - registers torch.ops.fusion_compiler.moe_experts
import fusion_compiler.ops.moe_experts_fp8 as fp8_ops  # noqa: E402 - registers ...moe_experts_fp8
from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.kernels import moe_experts_fp8 as fp8_kernels  # noqa: E402

TOKENS = (1, 8, 64, 256)
MODES = ("ours_fp8", "ours_bf16", "stock_fp8")
OURS = ("ours_fp8", "ours_bf16")  # checked against TOLERANCE
SPECS = bf16_bench.SPECS
ROTATIONS = bf16_bench.ROTATIONS
# Both ours against references with their own rounding points: the bf16 bench's bound. The FP8
# kernels equal their reference under the interpreter; on the GPU another fp32 summation order
# can flip a rare act code (one e4m3 step of one element: tests/kernels allow 3e-3 by norm).
TOLERANCE = 1e-2
QUANTIZE_EXPERTS_PER_CHUNK = 16  # fp32 copies of this many experts at a time (DeepSeek gate_up: 1.9 GB a copy)
BLOCK = fp8_ops.BLOCK
TOUCHED_BYTES = {
    "fp8": "distinct experts (unique ids of the set) x (3 x H x I x 1 B e4m3 gate, up, down rows + 4 B x "
           "(ceil(2I/128) x ceil(H/128) + ceil(H/128) x ceil(I/128)) fp32 block scales)",
    "bf16": "distinct experts x 3 x H x I x 2 B (bf16 gate, up, down rows)",
    "left_out": "activations, ids and routing weights",
}  # fmt: skip
MODE_BYTES = {"ours_fp8": "fp8", "ours_bf16": "bf16", "stock_fp8": "fp8"}  # GB/s and % of copy bw over these
MODE_REFERENCE = {"ours_fp8": "fp8", "ours_bf16": "bf16", "stock_fp8": "bf16"}
SWEEP_TOKENS = (1, 8, 64)  # two small-batch token counts, one grouped
SWEEP_SMALL_BATCH = {  # stage (kernel) -> LaunchConfig field -> candidates; a stage's product, the other at default
    "gate_up": {"gate_up_block_k": (64, 128, 256, 512), "gate_up_warps": (4, 8), "gate_up_stages": (1, 2, 3)},
    "down": {"down_block_n": (4, 8, 16), "down_block_k": (512, 1024), "down_warps": (2, 4)},
}  # fmt: skip
SWEEP_GROUPED = {  # GroupedConfig field -> candidates, one field at a time (a stage each), the rest at default
    "block_m": (16, 32, 64), "gate_up_warps": (4, 8), "gate_up_stages": (2, 3, 4),
    "down_block_n": (64, 128, 256), "down_warps": (4, 8), "down_stages": (2, 3, 4),
}  # fmt: skip
SWEEP_CALLS, SWEEP_REPLAYS = 2 * ROTATIONS, 20  # time_modes' graph: calls per graph, replays


def fp8_bytes_per_expert(hidden: int, inter: int) -> int:
    """One expert's e4m3 gate, up and down rows and their fp32 block scales."""
    scales = -(-2 * inter // BLOCK) * -(-hidden // BLOCK) + -(-hidden // BLOCK) * -(-inter // BLOCK)
    return 3 * hidden * inter + 4 * scales


def quantize_in_place(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 stack [E, N, K] -> (e4m3 codes, fp32 block scales) by ``quantize_weight``,
    QUANTIZE_EXPERTS_PER_CHUNK experts at a time (DeepSeek's whole gate_up in fp32 is 30 GB), and
    ``weight`` overwritten with ``dequantize_weight``'s fp32 values rounded to its dtype."""
    experts, n, k = weight.shape
    codes = torch.empty(weight.shape, dtype=fp8_ops.FP8_DTYPE, device=weight.device)
    scale = torch.empty(experts, -(-n // BLOCK), -(-k // BLOCK), dtype=torch.float32, device=weight.device)
    for lo in range(0, experts, QUANTIZE_EXPERTS_PER_CHUNK):
        hi = lo + QUANTIZE_EXPERTS_PER_CHUNK
        codes[lo:hi], scale[lo:hi] = fp8_ops.quantize_weight(weight[lo:hi])
        weight[lo:hi] = fp8_ops.dequantize_weight(codes[lo:hi], scale[lo:hi]).to(weight.dtype)
    return codes, scale


def stock_fp8_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale):
    """The FP8 experts as someone without a kernel writes them: every expert's weight blocks
    dequantised to hidden's dtype (the fp32 product, rounded), then the bf16 grouped_mm forward."""
    gate_up = fp8_ops.dequantize_weight(gate_up_proj, gate_up_scale).to(hidden.dtype)
    down = fp8_ops.dequantize_weight(down_proj, down_scale).to(hidden.dtype)
    return bf16_bench.grouped_mm_experts(hidden, top_k_ids, top_k_weights, gate_up, down)


def compile_stock(device: str):
    backend = "inductor" if device == "cuda" else "aot_eager"
    return torch.compile(stock_fp8_experts, backend=backend, fullgraph=True, dynamic=False)


def mode_fns(experts: torch.nn.Module, fp8: dict, compiled, device: str) -> dict:
    """Each mode as ``fn(hidden, top_k_ids, top_k_weights)``. On CPU the ours modes call their
    op's CUDA dispatch (``_cuda``: the path by token count, Triton under the interpreter), since
    the op's CPU kernel is its reference."""
    fp8_op = torch.ops.fusion_compiler.moe_experts_fp8 if device == "cuda" else fp8_ops._cuda
    bf16_op = torch.ops.fusion_compiler.moe_experts if device == "cuda" else bf16_ops._cuda
    return {
        "ours_fp8": lambda hidden, top_k_ids, top_k_weights: fp8_op(
            hidden, top_k_ids, top_k_weights, fp8["gate_up_proj"], fp8["gate_up_scale"], fp8["down_proj"],
            fp8["down_scale"]),
        "ours_bf16": lambda hidden, top_k_ids, top_k_weights: bf16_op(
            hidden, top_k_ids, top_k_weights, experts.gate_up_proj, experts.down_proj),
        "stock_fp8": lambda hidden, top_k_ids, top_k_weights: compiled(hidden, top_k_ids, top_k_weights, **fp8),
    }  # fmt: skip


def check_modes(row: dict, fns: dict, first: dict, expected: dict) -> None:
    """Each mode's first call on ``first`` against its reference (``expected`` by MODE_REFERENCE);
    a mode that raises keeps the error and leaves ``fns``. Ours over TOLERANCE: a failure."""
    for mode, fn in list(fns.items()):
        entry = row["modes"][mode]
        try:
            called = time.monotonic()
            out = fn(**first)
            entry["first_call_s"] = time.monotonic() - called  # Inductor's compile, Triton's JIT
            entry["max_rel_err"] = common.max_relative_error(out, expected[MODE_REFERENCE[mode]])
            if mode == "ours_fp8":
                entry["max_rel_err_vs_bf16_reference"] = common.max_relative_error(out, expected["bf16"])
        except Exception as error:  # noqa: BLE001 - a mode that cannot compile or run is a result
            entry["error"] = bf16_bench.error_string(error)
            print(f"ERROR {row['model']} T={row['tokens']} {mode}: {entry['error']}", flush=True)
            del fns[mode]
    for mode in OURS:
        err = row["modes"][mode].get("max_rel_err")
        if err is None or not err <= TOLERANCE:  # NaN fails too
            why = row["modes"][mode].get("error") or f"max_rel_err {err:.3g} > {TOLERANCE:g}"
            row["failures"].append(f"{mode} vs {MODE_REFERENCE[mode]} reference: {why}")
            print(f"FAIL {row['model']} T={row['tokens']} {mode}: {why}", flush=True)
    row["ours_correct"] = not row["failures"]


def time_modes(row: dict, fns: dict, sets: list[dict], env: dict) -> None:
    """Kernel count, CUDA-graph µs over the rotated sets, GB/s and % of the copy bandwidth of each
    mode into its entry; the speedups into the row."""
    calls = 2 * ROTATIONS  # a DeepSeek stock_fp8 call writes ~22 GB of bf16: keep the replays few
    for mode, fn in fns.items():
        entry = row["modes"][mode]
        try:
            entry["kernels"] = common.kernels_in(lambda fn=fn: fn(**sets[0]))
            entry["us"] = common.graph_time_us(lambda i, fn=fn: fn(**sets[i]), ROTATIONS, calls, replays=20)
            entry["gbs"] = row[f"touched_bytes_{MODE_BYTES[mode]}"] / entry["us"] / 1e3
            entry["pct_copy_bw"] = 100 * entry["gbs"] / env["copy_bandwidth_gbs"]
        except Exception as error:  # noqa: BLE001
            entry["error"] = bf16_bench.error_string(error)
            print(f"ERROR {row['model']} T={row['tokens']} {mode} timing: {entry['error']}", flush=True)
    fp8_us = row["modes"]["ours_fp8"].get("us")
    for other, key in (("ours_bf16", "speedup_fp8_vs_bf16"), ("stock_fp8", "speedup_fp8_vs_stock_fp8")):
        if fp8_us and row["modes"][other].get("us"):
            row[key] = row["modes"][other]["us"] / fp8_us


def input_sets(name: str, experts: torch.nn.Module, tokens: int) -> tuple[list[dict], list[int]]:
    """ROTATIONS routing sets on the experts' device (the bf16 bench's seeds) and each one's distinct experts."""
    seed = 1000 * tokens + sorted(SPECS).index(name)  # the bf16 bench's
    gen = torch.Generator(device=experts.gate_up_proj.device).manual_seed(seed)
    sets = [bf16_bench.routing_set(experts, experts.config.num_experts_per_tok, tokens, SPECS[name], gen)
            for _ in range(ROTATIONS)]  # fmt: skip
    return sets, [int(torch.unique(s["top_k_ids"]).numel()) for s in sets]


def run_row(name: str, experts: torch.nn.Module, fp8: dict, compiled, tokens: int, args, env: dict) -> dict:
    spec, device, began = SPECS[name], args.device, time.monotonic()
    top_k = experts.config.num_experts_per_tok
    hidden, inter, num_experts = experts.hidden_dim, experts.intermediate_dim, experts.num_experts
    sets, distinct = input_sets(name, experts, tokens)
    per_fp8, per_bf16 = fp8_bytes_per_expert(hidden, inter), 3 * hidden * inter * 2
    path = "small_batch" if tokens <= fp8_ops.SMALL_BATCH_MAX_TOKENS else "grouped"
    row = {
        "model": name, "tokens": tokens, "top_k": top_k, "experts": num_experts, "hidden": hidden,
        "intermediate": inter, "scoring": spec.scoring, "weights_dtype": str(spec.weights_dtype),
        "distinct_experts": statistics.mean(distinct), "distinct_experts_per_set": distinct,
        "touched_bytes_fp8": statistics.mean(distinct) * per_fp8,
        "touched_bytes_bf16": statistics.mean(distinct) * per_bf16,
        "touched_bytes_fp8_per_set": [d * per_fp8 for d in distinct],
        "ideal_speedup_fp8_vs_bf16": per_bf16 / per_fp8,
        "modes": {mode: {} for mode in MODES}, "failures": [],
    }  # fmt: skip
    for mode, op in zip(OURS, ("moe_experts_fp8", "moe_experts"), strict=True):
        called_as = f"torch.ops.fusion_compiler.{op}" if device == "cuda" else f"ops/{op}._cuda, TRITON_INTERPRET=1"
        row["modes"][mode].update(path=path, called_as=called_as)
    row["modes"]["stock_fp8"]["backend"] = "inductor" if device == "cuda" else "aot_eager (cpu --tiny)"

    fns = mode_fns(experts, fp8, compiled, device)
    expected = {
        "fp8": fp8_ops.moe_experts_fp8_reference(**sets[0], **fp8),
        "bf16": bf16_bench.reference_fp32(**sets[0], gate_up_proj=experts.gate_up_proj, down_proj=experts.down_proj),
    }
    check_modes(row, fns, sets[0], expected)
    if device == "cuda":
        time_modes(row, fns, sets, env)
    return row | {"row_s": time.monotonic() - began}


def sweep_stages(path: str) -> dict[str, dict[str, tuple]]:
    """Stage -> the config fields it varies -> their candidates (SWEEP_SMALL_BATCH or SWEEP_GROUPED)."""
    return SWEEP_SMALL_BATCH if path == "small_batch" else {f: {f: v} for f, v in SWEEP_GROUPED.items()}


def config_label(config, default) -> str:
    """The fields where ``config`` differs from ``default``, or "default"."""
    base = dataclasses.asdict(default)
    diff = [f"{k}={v}" for k, v in dataclasses.asdict(config).items() if base[k] != v]
    return " ".join(diff) or "default"


def run_sweep(name: str, experts: torch.nn.Module, fp8: dict, tokens: int, args, env: dict, over) -> dict:
    """Our FP8 launcher for ``tokens`` (small batch or grouped, by SMALL_BATCH_MAX_TOKENS) called
    with explicit configs: the default, each stage's candidates (sweep_stages) off the default,
    then every stage's fastest fields combined. Each config first against the FP8 reference on the
    first set (a launcher error or max_rel_err over TOLERANCE: ``rejected`` with why), then on CUDA
    timed as time_modes times (µs, GB/s and % of copy bw over the touched FP8 bytes). ``over()``:
    the sweep budget spent (a config not started then goes to ``skipped``)."""
    device, began = args.device, time.monotonic()
    top_k = experts.config.num_experts_per_tok
    hidden, inter, num_experts = experts.hidden_dim, experts.intermediate_dim, experts.num_experts
    sets, distinct = input_sets(name, experts, tokens)
    path = "small_batch" if tokens <= fp8_ops.SMALL_BATCH_MAX_TOKENS else "grouped"
    if path == "small_batch":
        launcher = fp8_kernels.small_batch_experts_fp8
        default = fp8_kernels.default_config(tokens, top_k, hidden, inter)
    else:
        launcher = fp8_kernels.grouped_experts_fp8
        default = fp8_kernels.default_grouped_config(tokens, top_k, num_experts, hidden, inter)
    nbytes = statistics.mean(distinct) * fp8_bytes_per_expert(hidden, inter)
    result = {
        "model": name, "tokens": tokens, "path": path, "launcher": f"kernels/moe_experts_fp8.{launcher.__name__}",
        "default_config": dataclasses.asdict(default), "touched_bytes_fp8": nbytes, "timed": device == "cuda",
        "timing": {"calls_per_graph": SWEEP_CALLS, "replays": SWEEP_REPLAYS} if device == "cuda" else None,
        "tolerance": TOLERANCE, "configs": [], "skipped": [],
    }  # fmt: skip
    expected = fp8_ops.moe_experts_fp8_reference(**sets[0], **fp8)
    measured = {}  # config -> its result: the default met again in a stage is not rerun

    def call(config, i):
        return launcher(**sets[i], **fp8, config=config)

    def measure(stage: str, config) -> None:
        label = config_label(config, default)
        if over():
            result["skipped"].append(f"{stage} {label}")
            return
        entry = {"stage": stage, "label": label, "config": dataclasses.asdict(config), "default": config == default}
        result["configs"].append(entry)
        if config in measured:
            entry.update(measured[config], repeat=True)
            return
        m = measured[config] = {}
        try:
            m["max_rel_err"] = common.max_relative_error(call(config, 0), expected)
            if not m["max_rel_err"] <= TOLERANCE:  # NaN too
                m["rejected"] = f"wrong result: max_rel_err {m['max_rel_err']:.3g} > {TOLERANCE:g}"
            elif device == "cuda":
                m["us"] = common.graph_time_us(lambda i: call(config, i), ROTATIONS, SWEEP_CALLS, replays=SWEEP_REPLAYS)
                m["gbs"] = nbytes / m["us"] / 1e3
                m["pct_copy_bw"] = 100 * m["gbs"] / env["copy_bandwidth_gbs"]
        except Exception as error:  # noqa: BLE001 - a launcher's ValueError, a compile's out-of-resources: a result
            m["rejected"] = bf16_bench.error_string(error)
            if device == "cuda":
                torch.cuda.synchronize()
        entry.update(m)
        shown = m.get("rejected") or (f"{m['us']:.1f} us, {m['gbs']:.0f} GB/s ({m['pct_copy_bw']:.0f}% copy bw)"
                                      if "us" in m else f"max rel err {m['max_rel_err']:.2e}")  # fmt: skip
        print(f"  sweep {name} T={tokens} {stage} {label}: {shown}", flush=True)

    stages = sweep_stages(path)
    measure("default", default)
    for stage, axes in stages.items():
        for values in itertools.product(*axes.values()):
            measure(stage, dataclasses.replace(default, **dict(zip(axes, values, strict=True))))
    timed = [e for e in result["configs"] if "us" in e]
    if timed:  # on CPU nothing is timed: no fastest to combine
        fields = {}
        for stage, axes in stages.items():
            fastest = min((e for e in timed if e["stage"] in (stage, "default")), key=lambda e: e["us"])
            fields.update({f: fastest["config"][f] for f in axes})
        measure("combined", dataclasses.replace(default, **fields))
        timed = [e for e in result["configs"] if "us" in e]
    default_entry = measured.get(default, {})  # absent: the budget was spent before it
    best = min(timed, key=lambda e: e["us"]) if timed else None
    result.update(
        checked=len(measured), rejected=sum("rejected" in m for m in measured.values()),
        default_us=default_entry.get("us"), default_gbs=default_entry.get("gbs"),
        default_pct_copy_bw=default_entry.get("pct_copy_bw"),
        best={k: best[k] for k in ("stage", "label", "config", "us", "gbs", "pct_copy_bw")} if best else None,
        speedup_best_vs_default=default_entry["us"] / best["us"] if best and "us" in default_entry else None,
        sweep_s=time.monotonic() - began,
    )  # fmt: skip
    head = f"sweep {name} T={tokens} {path}: {result['checked']} configs, {result['rejected']} rejected"
    if best and result["default_us"]:
        head += (f"; default {result['default_us']:.1f} us ({result['default_pct_copy_bw']:.0f}% copy bw), best "
                 f"{best['us']:.1f} us ({best['pct_copy_bw']:.0f}%: {best['label']}), "
                 f"{result['speedup_best_vs_default']:.2f}x")  # fmt: skip
    print(head, flush=True)
    return result


def summary(row: dict) -> str:
    return " | ".join(bf16_bench.summary_parts(row, ("speedup_fp8_vs_bf16", "speedup_fp8_vs_stock_fp8")))


def build_model(name: str, args) -> tuple[torch.nn.Module, dict]:
    """bench/moe_experts.py's experts (bf16 weights, its seed) and their FP8 codes and scales;
    the module's weights then hold the dequantised values."""
    experts = bf16_bench.build_experts(name, args.tiny, args.device, seed=sorted(SPECS).index(name))
    gate_up_proj, gate_up_scale = quantize_in_place(experts.gate_up_proj.data)
    down_proj, down_scale = quantize_in_place(experts.down_proj.data)
    fp8 = {"gate_up_proj": gate_up_proj, "gate_up_scale": gate_up_scale, "down_proj": down_proj,
           "down_scale": down_scale}  # fmt: skip
    return experts, fp8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results, rewritten after every row")
    parser.add_argument("--models", nargs="*", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--seconds", type=float, default=120.0, help="budget: rows not started by then are skipped")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny widths (the CPU test)")
    parser.add_argument("--sweep", action="store_true", help="after each model's rows, sweep our FP8 launch shapes")
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=list(SWEEP_TOKENS))
    parser.add_argument("--sweep-seconds", type=float, default=300.0,
                        help="sweep budget (time in sweeps only): configs not started by then are skipped")
    args = parser.parse_args(argv)
    common.check_cpu_tiny(parser, args)
    start = time.monotonic()
    env = common.bandwidth_env(args.device)
    payload = {
        "provenance": common.provenance(None if args.device == "cuda" else "cpu"),
        **env,
        "args": {"models": args.models, "tokens": args.tokens, "seconds": args.seconds, "device": args.device,
                 "tiny": args.tiny, "sweep": args.sweep, "sweep_tokens": args.sweep_tokens,
                 "sweep_seconds": args.sweep_seconds},
        "modes": list(MODES),
        "kernel_versions": {**KERNEL_VERSIONS, "moe_experts_fp8": fp8_kernels.KERNEL_VERSION},
        "small_batch_max_tokens": fp8_ops.SMALL_BATCH_MAX_TOKENS,
        "rotations": ROTATIONS,
        "format": {"weights": "float8_e4m3fn, one fp32 scale per 128 x 128 block (HF *_scale_inv)",
                   "activations": "float8_e4m3fn, one fp32 scale per 1 x 128 group per token"},
        "touched_bytes_formula": TOUCHED_BYTES,
        "mode_bytes": MODE_BYTES,
        "tolerance": {mode: TOLERANCE for mode in OURS},
        "reference": {
            "fp8": "moe_experts_fp8_reference (fp32 GEMMs) on the device, first input set; max |err| / max |ref|",
            "bf16": "moe_experts_reference in fp32 on the dequantised weights (bench/moe_experts.reference_fp32)",
            "modes": MODE_REFERENCE,
        },
        "setup_s": {},
        "rows": [],
    }  # fmt: skip
    if args.sweep:
        payload["sweep_candidates"] = {"small_batch": SWEEP_SMALL_BATCH, "grouped": SWEEP_GROUPED}
        payload["sweep"] = []
    failed = False
    sweep_spent = [0.0]  # seconds in sweeps so far: --sweep-seconds' budget, not --seconds'

    def sweep_over() -> bool:
        return sweep_spent[0] + time.monotonic() - sweep_began > args.sweep_seconds

    with torch.no_grad():
        for name in args.models:
            experts = fp8 = compiled = None

            def built():
                nonlocal experts, fp8, compiled
                if experts is None:
                    began = time.monotonic()
                    experts, fp8 = build_model(name, args)
                    compiled = compile_stock(args.device)
                    payload["setup_s"][name] = time.monotonic() - began
                return experts, fp8, compiled

            for tokens in args.tokens:
                if time.monotonic() - start - sweep_spent[0] > args.seconds:
                    row = {"model": name, "tokens": tokens, "skipped": f"budget of {args.seconds:g} s spent"}
                else:
                    try:
                        row = run_row(name, *built(), tokens, args, env)
                        failed |= bool(row["failures"])
                    except Exception as error:  # noqa: BLE001 - one broken row must not end the run
                        row = {"model": name, "tokens": tokens, "error": bf16_bench.error_string(error)}
                        failed = True
                print(summary(row), flush=True)
                payload["rows"].append(row)
                payload["elapsed_s"] = time.monotonic() - start
                common.write_json(args.out, payload)
            for tokens in args.sweep_tokens if args.sweep else ():
                sweep_began = time.monotonic()
                if sweep_over():
                    result = {"model": name, "tokens": tokens, "skipped": f"budget of {args.sweep_seconds:g} s spent"}
                else:
                    try:
                        result = run_sweep(name, *built()[:2], tokens, args, env, sweep_over)
                    except Exception as error:  # noqa: BLE001
                        result = {"model": name, "tokens": tokens, "error": bf16_bench.error_string(error)}
                        print(f"ERROR sweep {name} T={tokens}: {result['error']}", flush=True)
                        failed = True
                sweep_spent[0] += time.monotonic() - sweep_began
                payload["sweep"].append(result)
                payload["elapsed_s"] = time.monotonic() - start
                common.write_json(args.out, payload)
            # One model's weights at a time (DeepSeek's: 22 GB bf16 + 11 GB FP8), a fresh Dynamo per model.
            del experts, fp8, compiled
            torch._dynamo.reset()
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
