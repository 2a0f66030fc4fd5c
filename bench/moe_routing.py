"""MoE routing, router GEMM included, on the H200: eager vs stock Inductor vs ours vs the
router weight's copy floor, for DeepSeek V3.2, MiniMax-M2.5 and Qwen3.5 397B at real widths.

Each model's router is HF transformers' own module (random weights), called as its MoE block
calls it, keeping only (weights, ids): router_logits is dead, as in inference.

  deepseek-v3.2  DeepseekV32TopkRouter   hidden 7168, 256 experts, 8 groups (best 4 kept), top-8,
                                         fp32 GEMM on the bf16 weight cast up, x2.5; fp32 weights
  minimax-m2.5   MiniMaxM2TopKRouter     hidden 3072, 256 experts, top-8, sigmoid + fp32 correction
                                         bias (the block's buffer, passed in); fp32 weights
  qwen3.5        Qwen3_5MoeTopKRouter    hidden 4096, 512 experts, top-10, softmax; bf16 weights

Modes, all timed in the same run as CUDA-graph replays (common.graph_time_us):
  eager                     the module called directly
  inductor                  torch.compile(dynamic=False), stock Inductor
  ours                      torch.compile(dynamic=False, backend=FusionBackend()); the variants
                            it matched are recorded, and a row where nothing matched says so
  floor_copy_router_weight  dst.copy_(src) of a bf16 [E, H] tensor: the router weight's bytes
                            read and written once (the issue's floor)
  floor_copy_router_weight_from_hbm  the same copy cycling over enough sources to overflow L2
                            (extra: where a real step would find a layer's router weight)

Router weight and bias are shared between calls (one router); only the hidden states rotate,
over as many sets as fill 2x L2 (at most 8, as bench/mla_prologue.py). A router weight smaller
than L2 (all three are, 1.5-4 MiB) therefore stays L2-resident across the graph's calls, like
the first floor's source. Bytes moved = router weight (bf16) + bias + hidden states + weights and
ids out; GB/s and % of the same-run copy bandwidth follow from them.

Correctness first, per (model, tokens), on a fresh random input: ours and Inductor vs eager,
expert ids as sets per token, weights per expert (scattered into [T, E]); ids that differ only
where the choice scores tie (or nearly, through a different GEMM's rounding) are counted apart.

    python bench/moe_routing.py --out bench/results/moe_routing_h200.json [--tokens 1 8 64 256]
    python bench/moe_routing.py --device cpu --smoke        # tiny widths, correctness only
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler.inspect.counting import count_cuda_kernels  # noqa: E402
from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.model_adapters import get_adapter  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

TOKENS = (1, 8, 64, 256)
SMOKE_TOKENS = (1, 3)
L2_FALLBACK_BYTES = 60 * 2**20
MODES = ("eager", "inductor", "ours", "floor_copy_router_weight", "floor_copy_router_weight_from_hbm")


@dataclasses.dataclass(frozen=True)
class Spec:
    adapter: str
    module: str
    cls: str
    bias: str | None  # "buffer": the router's own; "argument": the MoE block's, passed in
    scoring: str
    smoke_overrides: dict


SPECS = {
    "deepseek-v3.2": Spec(
        "deepseek-v3.2", "transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32TopkRouter",
        "buffer", "sigmoid", {"hidden_size": 64, "n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4},
    ),
    "minimax-m2.5": Spec(
        "minimax-m2.5", "transformers.models.minimax_m2.modeling_minimax_m2", "MiniMaxM2TopKRouter",
        "argument", "sigmoid", {"hidden_size": 64, "num_local_experts": 16, "num_experts_per_tok": 4},
    ),
    "qwen3.5": Spec(
        "qwen3.5", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTopKRouter",
        None, "softmax", {"hidden_size": 64, "num_experts": 16, "num_experts_per_tok": 4},
    ),
}


class Routing(torch.nn.Module):
    """The router as its MoE block calls it, returning (weights, ids): the logits are dead."""

    def __init__(self, router: torch.nn.Module, bias: torch.Tensor | None):
        super().__init__()
        self.router = router
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, hidden):
        if self.e_score_correction_bias is None:
            _, weights, ids = self.router(hidden)
        else:
            _, weights, ids = self.router(hidden, self.e_score_correction_bias)
        return weights, ids


def build(spec: Spec, smoke: bool, device: str, gen: torch.Generator) -> tuple[Routing, dict]:
    """HF's router with random bf16 weights (std H^-1/2: logits of std ~1) and, for the sigmoid
    routers, a random fp32 correction bias (std 0.01) so the biased choice is not degenerate."""
    config = get_adapter(spec.adapter).hf_config(size="tiny" if smoke else "real", layers=1, **(spec.smoke_overrides if smoke else {}))
    router = getattr(importlib.import_module(spec.module), spec.cls)(config).to(device)
    experts, hidden = router.num_experts, router.hidden_dim
    weight = torch.randn(experts, hidden, generator=gen, device=device) * hidden**-0.5
    router.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
    bias = None
    if spec.bias is not None:
        bias = 0.01 * torch.randn(experts, generator=gen, device=device)  # fp32, as HF keeps it
        if spec.bias == "buffer":
            router.e_score_correction_bias.copy_(bias)
            bias = None
    module = Routing(router, bias).eval()
    dims = {
        "hidden": hidden,
        "experts": experts,
        "top_k": router.top_k,
        "n_group": getattr(router, "num_group", 1),
        "topk_group": getattr(router, "topk_group", 1),
        "routed_scaling_factor": getattr(router, "routed_scaling_factor", 1.0),
        "norm_topk_prob": getattr(router, "norm_topk_prob", True),
        "scoring": spec.scoring,
        "router_weight_dtype": str(router.weight.dtype),
        "bias": spec.bias and f"{spec.bias}, fp32 [{experts}]",
    }
    return module, dims


def bias_of(module: Routing) -> torch.Tensor | None:
    if module.e_score_correction_bias is not None:
        return module.e_score_correction_bias
    return getattr(module.router, "e_score_correction_bias", None)


def choice_scores(module: Routing, dims: dict, hidden: torch.Tensor) -> torch.Tensor:
    """Eager's selection scores [T, E] in fp32 (HF's math; -inf where DeepSeek masks a group),
    from the logits the eager router computes itself."""
    logits = module.router(*((hidden,) if module.e_score_correction_bias is None else (hidden, module.e_score_correction_bias)))[0]
    if dims["scoring"] == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    choice = logits.float().sigmoid() + bias_of(module)
    n_group, experts = dims["n_group"], dims["experts"]
    if n_group > 1:
        groups = choice.view(-1, n_group, experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(groups).scatter(1, groups.topk(dims["topk_group"], dim=-1)[1], 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(experts // n_group, dim=1), float("-inf"))
    return choice


def compare(out, eager, choice: torch.Tensor, tie_rtol: float) -> dict:
    """Ids as sets per token; weights per expert on the tokens whose sets agree, and sorted per
    token everywhere. A token whose set differs is a tie if eager's scores of the two sets agree
    (exactly, or within `tie_rtol` of the largest: a different GEMM may round logits apart)."""
    (w, ids), (w_e, ids_e) = out, eager
    result = {
        "dtypes": [str(w.dtype), str(ids.dtype)],
        "eager_dtypes": [str(w_e.dtype), str(ids_e.dtype)],
        "dtypes_equal": w.dtype == w_e.dtype and ids.dtype == ids_e.dtype,
    }
    if ids.shape != ids_e.shape or w.shape != w_e.shape:
        return result | {"ids_equal_as_sets": False, "shape": [list(ids.shape), list(w.shape)]}
    same = (ids.sort(-1).values == ids_e.sort(-1).values).all(-1)
    result["ids_equal_as_sets"] = bool(same.all())
    result["tokens_ids_differ"] = int((~same).sum())
    exact = near = 0
    for t in (~same).nonzero().flatten().tolist():
        mine, theirs = choice[t, ids[t]].sort().values, choice[t, ids_e[t]].sort().values
        if torch.isfinite(mine).all():
            exact += bool(torch.equal(mine, theirs))
            near += bool(((mine - theirs).abs() <= tie_rtol * theirs.abs().max()).all())
    result["tokens_ids_differ_exact_tie"] = exact
    result["tokens_ids_differ_near_tie"] = near
    experts = choice.shape[-1]
    dense = torch.zeros(ids.shape[0], experts, dtype=torch.float32, device=ids.device).scatter(1, ids, w.float())
    dense_e = torch.zeros_like(dense).scatter(1, ids_e, w_e.float())
    if same.any():
        result["weights_max_abs_err"] = float((dense[same] - dense_e[same]).abs().max())
        result["weights_rel_err"] = relative_error(dense[same], dense_e[same])
    result["weights_sorted_rel_err"] = relative_error(w.float().sort(-1).values, w_e.float().sort(-1).values)
    return result


def verdict(result: dict, w_rtol: float) -> str | None:
    """Why this comparison fails, or None."""
    if not result.get("dtypes_equal", False):
        return f"(weights, ids) dtypes {result['dtypes']}, eager's {result['eager_dtypes']}"
    if "shape" in result:
        return f"shapes differ {result['shape']}"
    unexplained = result["tokens_ids_differ"] - result["tokens_ids_differ_near_tie"]
    if unexplained:
        return f"ids differ as sets on {unexplained} tokens beyond score ties"
    for key in ("weights_rel_err", "weights_sorted_rel_err"):
        if result.get(key, 0.0) > w_rtol:
            return f"{key} {result[key]:.3g} > {w_rtol:g}"
    return None


def row_bytes(dims: dict, tokens: int, weights_dtype: torch.dtype) -> dict:
    """What the routing must move: router weight (bf16) + bias read, hidden read, weights and ids written."""
    parts = {
        "router_weight": dims["experts"] * dims["hidden"] * 2,
        "bias": dims["experts"] * 4 if dims["bias"] else 0,
        "hidden": tokens * dims["hidden"] * 2,
        "outputs": tokens * dims["top_k"] * (torch.finfo(weights_dtype).bits // 8 + 8),
    }
    return parts | {"total": sum(parts.values())}


def error_string(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"


def run_row(name: str, spec: Spec, tokens: int, args, env: dict) -> dict:
    device, smoke = args.device, args.smoke
    gen = torch.Generator(device=device).manual_seed(1000 * tokens + sorted(SPECS).index(name))
    torch.manual_seed(tokens)
    module, dims = build(spec, smoke, device, gen)
    check_input = torch.randn(tokens, dims["hidden"], generator=gen, device=device).to(torch.bfloat16)
    torch._dynamo.reset()
    backend = fc.FusionBackend(fc.FusionConfig(cudagraphs=False))
    fns = {
        "eager": module,
        "inductor": torch.compile(module, dynamic=False),
        "ours": torch.compile(module, dynamic=False, backend=backend),
    }
    row = {"model": name, "tokens": tokens, "dims": dims, "modes": {m: {} for m in fns}}

    eager = module(check_input)
    w_rtol = 1e-4 if eager[0].dtype == torch.float32 else 1e-2
    tie_rtol = 1e-5 if dims["n_group"] > 1 else 1e-2  # DeepSeek routes on fp32 logits, the others on bf16
    choice = choice_scores(module, dims, check_input)
    row["correctness_tolerance"] = {"weights_rel": w_rtol, "near_tie_rel": tie_rtol}
    for mode in ("inductor", "ours"):
        try:
            result = compare(fns[mode](check_input), eager, choice, tie_rtol)
            row["modes"][mode]["vs_eager"] = result
            why = verdict(result, w_rtol)
            if why:
                print(f"FAIL {name} T={tokens} {mode} vs eager: {why}", flush=True)
            elif result["tokens_ids_differ"]:
                print(f"NOTE {name} T={tokens} {mode}: {result['tokens_ids_differ']} tokens pick other experts on score ties", flush=True)
            row["modes"][mode]["correct"] = why is None
        except Exception as error:  # noqa: BLE001 - a mode that cannot compile or run is a result
            row["modes"][mode]["error"] = error_string(error)
            print(f"ERROR {name} T={tokens} {mode}: {row['modes'][mode]['error']}", flush=True)
            del fns[mode]
    row["modes"]["ours"]["matched"] = backend.report.per_variant()
    row["modes"]["ours"]["report"] = backend.report.to_dict()
    if not row["modes"]["ours"]["matched"]:
        misses = [s.reason for s in backend.report.misses()]
        state = "failed" if "error" in row["modes"]["ours"] else "is stock Inductor here"
        print(f"WARNING {name} T={tokens}: ours matched nothing (misses: {misses}); 'ours' {state}", flush=True)
    if smoke:
        return row

    # Timing: only the hidden states rotate (the router weight is shared, as one layer's is).
    hidden_bytes = tokens * dims["hidden"] * 2
    rotations = max(1, min(8, -(-2 * env["l2_bytes"] // hidden_bytes)))
    sets = [torch.randn(tokens, dims["hidden"], generator=gen, device=device).to(torch.bfloat16) for _ in range(rotations)]
    sizes = row_bytes(dims, tokens, eager[0].dtype)
    row.update(bytes=sizes, rotations=rotations, rotating="hidden_states only; router weight and bias shared")
    weight_shape = (dims["experts"], dims["hidden"])
    src = torch.randn(weight_shape, generator=gen, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copies = min(128, -(-3 * env["l2_bytes"] // sizes["router_weight"]))
    srcs = [src] + [torch.empty_like(src).copy_(src) for _ in range(copies - 1)]
    fns["floor_copy_router_weight"] = lambda x, src=src: dst.copy_(src)
    row["modes"]["floor_copy_router_weight"] = {}
    row["modes"]["floor_copy_router_weight_from_hbm"] = {"sources": copies}
    for mode in fns:
        entry = row["modes"][mode]
        try:
            fn = fns[mode]
            fn(sets[0])  # warm-up
            count = count_cuda_kernels(lambda fn=fn: fn(sets[0]))
            entry["kernels"] = count.count
            entry["kernel_names"] = count.names
            if mode in ("inductor", "ours"):
                entry["kernel_us"] = kernel_times_us(lambda fn=fn: fn(sets[0]))
            entry["us"] = common.graph_time_us(lambda i, fn=fn: fn(sets[i]), rotations)
        except Exception as error:  # noqa: BLE001
            entry["error"] = error_string(error)
            print(f"ERROR {name} T={tokens} {mode} timing: {entry['error']}", flush=True)
    try:
        entry = row["modes"]["floor_copy_router_weight_from_hbm"]
        entry["us"] = common.graph_time_us(lambda i: dst.copy_(srcs[i]), copies, calls_per_graph=max(20, copies))
    except Exception as error:  # noqa: BLE001
        entry["error"] = error_string(error)
    for mode, entry in row["modes"].items():
        if "us" in entry:
            moved = 2 * sizes["router_weight"] if mode.startswith("floor") else sizes["total"]
            entry["bytes"] = moved
            entry["gbs"] = moved / entry["us"] / 1e3
            entry["pct_copy_bw"] = 100 * entry["gbs"] / env["copy_bandwidth_gbs"]
    us = {mode: entry.get("us") for mode, entry in row["modes"].items()}
    if us["ours"]:
        for other, key in (("inductor", "ratio_inductor_over_ours"), ("eager", "ratio_eager_over_ours")):
            if us[other]:
                row[key] = us[other] / us["ours"]
        for floor in ("floor_copy_router_weight", "floor_copy_router_weight_from_hbm"):
            if us[floor]:
                row[f"ratio_ours_over_{floor.removeprefix('floor_copy_')}"] = us["ours"] / us[floor]
    return row


def kernel_times_us(fn) -> dict:
    from mla_prologue import kernel_times_us as times  # the helper bench/mla_prologue.py uses

    return times(fn)


def summary(row: dict) -> str:
    parts = [f"{row['model']:13s} T={row['tokens']:4d}"]
    for mode, entry in row["modes"].items():
        short = {"floor_copy_router_weight": "floor", "floor_copy_router_weight_from_hbm": "floor_hbm"}.get(mode, mode)
        if "error" in entry:
            parts.append(f"{short} ERROR")
        elif "us" in entry:
            kernels = f" {entry['kernels']}k" if "kernels" in entry else ""
            parts.append(f"{short} {entry['us']:.2f}us{kernels} {entry['pct_copy_bw']:.0f}%bw")
        elif "vs_eager" in entry:
            r = entry["vs_eager"]
            parts.append(f"{short} {'ok' if entry.get('correct') else 'FAIL'} (ids_differ {r.get('tokens_ids_differ')}, w_rel {r.get('weights_rel_err', float('nan')):.2e})")
    for key in ("ratio_inductor_over_ours", "ratio_ours_over_router_weight", "ratio_ours_over_router_weight_from_hbm"):
        if key in row:
            parts.append(f"{key.removeprefix('ratio_')} {row[key]:.2f}")
    parts.append(f"matched {row['modes']['ours'].get('matched')}")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results (required unless --smoke)")
    parser.add_argument("--tokens", type=int, nargs="*", default=None)
    parser.add_argument("--models", nargs="*", default=list(SPECS), choices=list(SPECS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--smoke", action="store_true", help="tiny widths, correctness only (no graphs, timing or profiling)")
    args = parser.parse_args()
    if args.device == "cpu" and not args.smoke:
        parser.error("--device cpu runs --smoke only (CUDA graphs and the profiler need CUDA)")
    if not args.smoke and not args.out:
        parser.error("--out is required unless --smoke")
    tokens_list = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    import transformers
    import triton

    env = {"versions": {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__}}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["l2_bytes"] = getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES
        env["device"] = common.device_facts()
    else:
        env["device"] = {"device": "cpu", "python": platform.python_version()}
    if not args.smoke:
        env["copy_bandwidth_gbs"] = common.copy_bandwidth_gbs()
    rows = []
    with torch.no_grad():
        for name in args.models:
            for tokens in tokens_list:
                try:
                    row = run_row(name, SPECS[name], tokens, args, env)
                except Exception as error:  # noqa: BLE001 - one broken model must not end the run
                    row = {"model": name, "tokens": tokens, "error": error_string(error)}
                    print(f"ERROR {name} T={tokens}: {row['error']}", flush=True)
                else:
                    print(summary(row), flush=True)
                rows.append(row)
    if args.out:
        common.write_json(args.out, {
            **env,
            "kernel_versions": dict(KERNEL_VERSIONS),
            "modes": list(MODES),
            "smoke": args.smoke,
            "rotation": "hidden states rotate over min(8, 2*L2/hidden bytes) sets; the router weight and bias are "
            "shared (one router, L2-resident across a graph's calls); floor_copy_router_weight_from_hbm cycles "
            "its source over 3*L2 bytes",
            "bytes": "router weight (bf16) + bias (fp32) + hidden (bf16) + weights + int64 ids; floors: 2x router weight (read + write)",
            "rows": rows,
        })


if __name__ == "__main__":
    main()
