"""The routed experts alone (issue 27): ours against stock Inductor over HF's grouped_mm experts
and against torch._grouped_mm, for DeepSeek V3.2, MiniMax-M2.5 and Qwen3.5-397B at real widths.

Each model's experts are HF transformers' own module, built from the real config with
``config._experts_implementation = "grouped_mm"`` (its forward dispatches to
``transformers.integrations.moe.grouped_mm_experts_forward``), bf16 weights N(0, 1/fan_in)
allocated directly on the device:

  deepseek-v3.2  DeepseekV32Experts   256 experts, top-8,  H 7168, I 2048, sigmoid routing, fp32 weights
  minimax-m2.5   MiniMaxM2Experts     256 experts, top-8,  H 3072, I 1536, sigmoid routing, fp32 weights
  qwen3.5        Qwen3_5MoeExperts    512 experts, top-10, H 4096, I 1024, softmax routing, bf16 weights

Routing inputs: random logits [T, E], top-k of their sigmoid / softmax (distinct ids per token),
the k weights renormalised to sum 1, in the dtype the model's router hands its experts.
ROTATIONS input sets (hidden, ids, weights) per token count, each with its own ids; one CUDA
graph cycles through them, so consecutive calls touch different experts (the touched weights of
one call, >= 200 MB, are far larger than L2 anyway).

Modes, all timed in the same process as CUDA-graph replays (common.graph_time_us):
  ours            torch.ops.fusion_compiler.moe_experts on the module's gate_up_proj / down_proj
  stock_inductor  torch.compile(experts, backend="inductor", fullgraph=True, dynamic=False),
                  called as HF's MoE block calls it: experts(hidden, top_k_index, top_k_weights)
  grouped_mm      torch._grouped_mm directly (grouped_mm_experts below: sort by expert, on-device
                  offsets, two grouped GEMMs over the transposed weights, silu * up, combine)
  eager           the HF module uncompiled, timed uncaptured (CUDA events around 20 calls)

Correctness before timing, on the first input set: every mode against moe_experts_reference
(fusion_compiler/ops/moe_experts.py) in fp32 on the device, max |err| / max |ref|. Ours over
OURS_TOLERANCE marks the row failed, prints FAIL, and the run exits 1.

Bytes: touched = distinct experts x 3 x H x I x 2 B (gate, up and down rows of each expert an id
names, read once), averaged over the rotated sets; activations (T x H x 2 B in and out, and the
ids and weights) are left out: under 0.3 % at 256 tokens. GB/s and % of the copy bandwidth
measured once at the start of the run (common.copy_bandwidth_gbs: read + write bytes). The bar:
ours >= 70 % of it at 1 token and >= 60 % at 64 tokens.

    python bench/moe_experts.py --out bench/results/moe_experts_h200.json [--models ...] [--tokens 1 8 64 256]
    python bench/moe_experts.py --device cpu --tiny --out /tmp/moe_experts_cpu.json   # correctness, JSON shape
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fusion_compiler.ops.moe_experts  # noqa: E402,F401 - registers torch.ops.fusion_compiler.moe_experts
from fusion_compiler.model_adapters import get_adapter  # noqa: E402
from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.ops.moe_experts import SMALL_BATCH_MAX_TOKENS, moe_experts_reference  # noqa: E402

TOKENS = (1, 8, 64, 256)
MODES = ("ours", "stock_inductor", "grouped_mm", "eager")
# Each kernel path of ours at every token count (CUDA only): where the op's dispatch
# (ops/moe_experts.SMALL_BATCH_MAX_TOKENS) should switch from the one to the other, and the
# grouped kernels' two modes (plan mode ships: GroupedConfig.scan_max_pairs 0).
KERNEL_PATHS = ("ours_small_batch", "ours_grouped_scan", "ours_grouped_plan")
SCAN_MAX_PAIRS = 4096  # scan mode for every decode batch here
ROTATIONS = 4
OURS_TOLERANCE = 1e-2
BARS = {1: 70.0, 64: 60.0}  # tokens -> % of the copy bandwidth ours must reach
REFERENCE_EXPERTS_PER_CHUNK = 32  # fp32 copies of this many experts at a time (DeepSeek: 5.6 GB)
TOUCHED_BYTES = ("distinct experts (unique ids of the set) x 3 x H x I x 2 B (bf16 gate, up, down rows); "
                 "activations, ids and weights left out")


@dataclasses.dataclass(frozen=True)
class Spec:
    module: str
    cls: str
    scoring: str  # "sigmoid" or "softmax": what turns the router's logits into scores
    weights_dtype: torch.dtype  # what the model's router hands its experts


SPECS = {
    "deepseek-v3.2": Spec("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Experts",
                          "sigmoid", torch.float32),
    "minimax-m2.5": Spec("transformers.models.minimax_m2.modeling_minimax_m2", "MiniMaxM2Experts",
                         "sigmoid", torch.float32),
    "qwen3.5": Spec("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeExperts",
                    "softmax", torch.bfloat16),
}  # fmt: skip


def build_experts(name: str, tiny: bool, device: str, seed: int) -> torch.nn.Module:
    """HF's experts module of ``name`` from its real (or tiny) config, dispatching to grouped_mm,
    bf16 weights N(0, 1/fan_in) drawn where they live: built on "meta", then each weight
    allocated on the device in bf16 (nothing built on the CPU or in fp32 first)."""
    spec = SPECS[name]
    config = get_adapter(name).hf_config(size="tiny" if tiny else "real", layers=1, experts_implementation="grouped_mm")
    config._experts_implementation = "grouped_mm"
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        experts = getattr(importlib.import_module(spec.module), spec.cls)(config)
    for key, meta in list(experts.named_parameters()):  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
        weight = torch.empty(meta.shape, dtype=torch.bfloat16, device=device)
        weight.normal_(0.0, meta.shape[-1] ** -0.5, generator=gen)
        setattr(experts, key, torch.nn.Parameter(weight, requires_grad=False))
    return experts.eval()


def routing_set(experts: torch.nn.Module, top_k: int, tokens: int, spec: Spec, gen: torch.Generator) -> dict:
    """One input set: bf16 hidden states N(0, 1), and ids / weights from random router logits
    (top-k of sigmoid or softmax scores, renormalised) in the router's output dtype."""
    device = experts.gate_up_proj.device
    hidden = torch.randn(tokens, experts.hidden_dim, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(tokens, experts.num_experts, generator=gen, device=device)
    scores = logits.sigmoid() if spec.scoring == "sigmoid" else logits.softmax(dim=-1)
    weights, ids = scores.topk(top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(spec.weights_dtype)
    return {"hidden": hidden, "top_k_ids": ids, "top_k_weights": weights}


def grouped_mm_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj):
    """The experts through torch._grouped_mm, no host sync: pairs sorted by expert, offsets from
    an on-device count, gate_up and down as grouped GEMMs over the [E, in, out] transposed
    weights, silu(gate) * up in bf16, the weighted sum over k in fp32."""
    tokens, top_k = top_k_ids.shape
    flat = top_k_ids.reshape(-1)
    _, order = torch.sort(flat)
    counts = torch.zeros(gate_up_proj.shape[0], dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(hidden[order // top_k], gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(tokens, top_k, -1)
    return (unsorted.float() * top_k_weights.float().unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


def reference_fp32(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj) -> torch.Tensor:
    """moe_experts_reference in fp32, REFERENCE_EXPERTS_PER_CHUNK experts' weights cast at a time
    (DeepSeek's whole stack in fp32 would be 45 GB): each chunk's ids kept, the others made
    padding (-1), and the chunks' fp32 outputs summed."""
    total = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    touched = torch.unique(top_k_ids).tolist()
    for lo in range(0, gate_up_proj.shape[0], REFERENCE_EXPERTS_PER_CHUNK):
        hi = lo + REFERENCE_EXPERTS_PER_CHUNK
        if not any(lo <= e < hi for e in touched):
            continue
        ids = torch.where((top_k_ids >= lo) & (top_k_ids < hi), top_k_ids - lo, -1)
        total += moe_experts_reference(hidden.float(), ids, top_k_weights.float(), gate_up_proj[lo:hi].float(),
                                       down_proj[lo:hi].float())  # fmt: skip
    return total


def error_string(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"


def uncaptured_time_us(fn, rotations: int, calls: int = 20) -> float:
    """Median µs per call of ``fn(i)`` launched eagerly (CUDA events around ``calls`` calls)."""
    for i in range(3):
        fn(i % rotations)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i % rotations)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def mode_fns(experts: torch.nn.Module, compiled) -> dict:
    """Each mode as ``fn(hidden, top_k_ids, top_k_weights)``."""
    w = {"gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj}
    return {
        "ours": lambda hidden, top_k_ids, top_k_weights: torch.ops.fusion_compiler.moe_experts(
            hidden, top_k_ids, top_k_weights, w["gate_up_proj"], w["down_proj"]),
        "stock_inductor": lambda hidden, top_k_ids, top_k_weights: compiled(hidden, top_k_ids, top_k_weights),
        "grouped_mm": lambda hidden, top_k_ids, top_k_weights: grouped_mm_experts(
            hidden, top_k_ids, top_k_weights, w["gate_up_proj"], w["down_proj"]),
        "eager": lambda hidden, top_k_ids, top_k_weights: experts(hidden, top_k_ids, top_k_weights),
    }  # fmt: skip


def kernel_path_fns(experts: torch.nn.Module) -> dict:
    """Ours' two kernel paths called directly, whatever the op's dispatch would pick."""
    from fusion_compiler.kernels.moe_experts import small_batch_experts
    from fusion_compiler.kernels.moe_experts_grouped import grouped_experts

    from fusion_compiler.kernels.moe_experts_grouped import default_config

    def path(kernel, **config_fields):
        def run(hidden, top_k_ids, top_k_weights):
            config = None
            if config_fields:
                shape = (hidden.shape[0], top_k_ids.shape[1], *experts.down_proj.shape)
                config = dataclasses.replace(default_config(*shape), **config_fields)
            return kernel(hidden, top_k_ids, top_k_weights, experts.gate_up_proj, experts.down_proj, config)

        return run

    # ours_grouped_scan: scan mode (2 launches); ours_grouped_plan: plan mode (4)
    return {"ours_small_batch": path(small_batch_experts),
            "ours_grouped_scan": path(grouped_experts, scan_max_pairs=SCAN_MAX_PAIRS),
            "ours_grouped_plan": path(grouped_experts, scan_max_pairs=0)}  # fmt: skip


def run_row(name: str, experts: torch.nn.Module, compiled, tokens: int, args, env: dict) -> dict:
    spec, device, began = SPECS[name], args.device, time.monotonic()
    top_k = experts.config.num_experts_per_tok
    hidden, inter, num_experts = experts.hidden_dim, experts.intermediate_dim, experts.num_experts
    gen = torch.Generator(device=device).manual_seed(1000 * tokens + sorted(SPECS).index(name))
    sets = [routing_set(experts, top_k, tokens, spec, gen) for _ in range(ROTATIONS)]
    distinct = [int(torch.unique(s["top_k_ids"]).numel()) for s in sets]
    per_expert = 3 * hidden * inter * experts.gate_up_proj.element_size()
    touched = statistics.mean(distinct) * per_expert
    row = {
        "model": name, "tokens": tokens, "top_k": top_k, "experts": num_experts, "hidden": hidden,
        "intermediate": inter, "scoring": spec.scoring, "weights_dtype": str(spec.weights_dtype),
        "distinct_experts": statistics.mean(distinct), "distinct_experts_per_set": distinct,
        "touched_bytes": touched, "touched_bytes_per_set": [d * per_expert for d in distinct],
        "modes": {mode: {} for mode in MODES + (KERNEL_PATHS if device == "cuda" else ())}, "failures": [],
    }  # fmt: skip
    fns = mode_fns(experts, compiled) | (kernel_path_fns(experts) if device == "cuda" else {})
    row["modes"]["ours"]["path"] = "small_batch" if tokens <= SMALL_BATCH_MAX_TOKENS else "grouped"
    stock_backend = "inductor" if device == "cuda" else "aot_eager (cpu --tiny: no Inductor compile)"
    row["modes"]["stock_inductor"]["backend"] = stock_backend

    expected = reference_fp32(**sets[0], gate_up_proj=experts.gate_up_proj, down_proj=experts.down_proj)
    for mode, fn in list(fns.items()):
        entry = row["modes"][mode]
        try:
            called = time.monotonic()
            out = fn(**sets[0])
            entry["first_call_s"] = time.monotonic() - called  # Inductor's compile, Triton's JIT
            entry["max_rel_err"] = common.max_relative_error(out, expected)
        except Exception as error:  # noqa: BLE001 - a mode that cannot compile or run is a result
            entry["error"] = error_string(error)
            print(f"ERROR {name} T={tokens} {mode}: {entry['error']}", flush=True)
            del fns[mode]
    ours_err = row["modes"]["ours"].get("max_rel_err")
    row["ours_correct"] = ours_err is not None and ours_err <= OURS_TOLERANCE
    if not row["ours_correct"]:
        why = row["modes"]["ours"].get("error") or f"max_rel_err {ours_err:.3g} > {OURS_TOLERANCE:g}"
        row["failures"].append(f"ours vs fp32 reference: {why}")
        print(f"FAIL {name} T={tokens} ours: {why}", flush=True)
    if device == "cpu":
        return row | {"row_s": time.monotonic() - began}

    calls = 2 * ROTATIONS  # a DeepSeek call at 256 tokens reads ~22 GB: keep the replays few
    for mode, fn in fns.items():
        entry = row["modes"][mode]
        try:
            entry["kernels"] = common.kernels_in(lambda fn=fn: fn(**sets[0]))
            # Eager is timed uncaptured: a capture that fails can leave the context unusable
            # for the rows after it, and eager is only a yardstick here.
            entry["captured"] = mode != "eager"
            if entry["captured"]:
                entry["us"] = common.graph_time_us(lambda i, fn=fn: fn(**sets[i]), ROTATIONS, calls, replays=20)
            else:
                entry["us"] = uncaptured_time_us(lambda i, fn=fn: fn(**sets[i]), ROTATIONS)
            entry["gbs"] = touched / entry["us"] / 1e3
            entry["pct_copy_bw"] = 100 * entry["gbs"] / env["copy_bandwidth_gbs"]
        except Exception as error:  # noqa: BLE001
            entry["error"] = error_string(error)
            print(f"ERROR {name} T={tokens} {mode} timing: {entry['error']}", flush=True)
    ours_us = row["modes"]["ours"].get("us")
    for other in ("stock_inductor", "grouped_mm", "eager"):
        if ours_us and row["modes"][other].get("us"):
            row[f"speedup_ours_vs_{other}"] = row["modes"][other]["us"] / ours_us
    if tokens in BARS:
        pct = row["modes"]["ours"].get("pct_copy_bw")
        row["bar"] = {"pct_copy_bw_required": BARS[tokens], "pct_copy_bw": pct,
                      "met": bool(pct is not None and pct >= BARS[tokens] and row["ours_correct"])}  # fmt: skip
    return row | {"row_s": time.monotonic() - began}


def summary_parts(row: dict, speedups: tuple[str, ...]) -> list[str]:
    """A row's label, each mode's error, µs, kernels, GB/s and % of copy bandwidth, and the
    ``speedups`` keys it has (one line of the log, joined by the caller)."""
    if "skipped" in row or "error" in row:
        return [f"{row['model']:13s} T={row['tokens']:4d}", str(row.get("skipped") or row.get("error"))]
    parts = [f"{row['model']:13s} T={row['tokens']:4d} distinct {row['distinct_experts']:6.1f}"]
    for mode, entry in row["modes"].items():
        if "error" in entry:
            parts.append(f"{mode} ERROR")
            continue
        text = f"{mode} err {entry.get('max_rel_err', float('nan')):.1e}"
        if "us" in entry:
            text += f" {entry['us']:.1f}us {entry['kernels']}k {entry['gbs']:.0f}GB/s {entry['pct_copy_bw']:.0f}%bw"
        parts.append(text)
    parts += [f"{key.removeprefix('speedup_')} {row[key]:.2f}x" for key in speedups if key in row]
    return parts


def summary(row: dict) -> str:
    parts = summary_parts(row, ("speedup_ours_vs_stock_inductor", "speedup_ours_vs_grouped_mm"))
    if "bar" in row:
        parts.append(f"bar {row['bar']['pct_copy_bw_required']:.0f}% {'met' if row['bar']['met'] else 'NOT met'}")
    return " | ".join(parts)


def compile_stock(experts: torch.nn.Module, device: str):
    backend = "inductor" if device == "cuda" else "aot_eager"
    return torch.compile(experts, backend=backend, fullgraph=True, dynamic=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results, rewritten after every row")
    parser.add_argument("--models", nargs="*", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    parser.add_argument("--seconds", type=float, default=440.0, help="budget: rows not started by then are skipped")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny widths (the CPU test)")
    args = parser.parse_args(argv)
    common.check_cpu_tiny(parser, args, interpreter=False)
    start = time.monotonic()
    env = common.bandwidth_env(args.device)
    payload = {
        "provenance": common.provenance(None if args.device == "cuda" else "cpu"),
        **env,
        "args": {"models": args.models, "tokens": args.tokens, "seconds": args.seconds, "device": args.device,
                 "tiny": args.tiny},
        "modes": list(MODES),
        "kernel_versions": dict(KERNEL_VERSIONS),
        "rotations": ROTATIONS,
        "touched_bytes_formula": TOUCHED_BYTES,
        "bar": {"pct_copy_bw_at_tokens": {str(t): p for t, p in BARS.items()}, "ours_tolerance": OURS_TOLERANCE},
        "reference": "moe_experts_reference in fp32 on the device, from the first input set; max |err| / max |ref|",
        "rows": [],
    }  # fmt: skip
    failed = False
    with torch.no_grad():
        for index, name in enumerate(args.models):
            experts = compiled = None
            for tokens in args.tokens:
                if time.monotonic() - start > args.seconds:
                    row = {"model": name, "tokens": tokens, "skipped": f"budget of {args.seconds:g} s spent"}
                else:
                    try:
                        if experts is None:
                            experts = build_experts(name, args.tiny, args.device, seed=index)
                            compiled = compile_stock(experts, args.device)
                        row = run_row(name, experts, compiled, tokens, args, env)
                        failed |= bool(row["failures"])
                    except Exception as error:  # noqa: BLE001 - one broken row must not end the run
                        row = {"model": name, "tokens": tokens, "error": error_string(error)}
                        failed = True
                print(summary(row), flush=True)
                payload["rows"].append(row)
                payload["elapsed_s"] = time.monotonic() - start
                common.write_json(args.out, payload)
            # One model's weights at a time (DeepSeek's are 22 GB), and a fresh Dynamo per model.
            del experts, compiled
            torch._dynamo.reset()
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
