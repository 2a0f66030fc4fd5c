"""The GEMM-fused router launch at real widths on the GPU: correctness, where to split between
it and cuBLAS + the routing kernel, and its launch shape.

For DeepSeek V3.2 (7168 -> 256, 8 groups, fp32 logits), MiniMax-M2.5 (3072 -> 256, bf16 logits)
and Qwen3.5 (4096 -> 512, softmax, bf16 logits), bf16 operands:

  check   the op on CUDA against ``moe_router_reference`` (cuBLAS logits): logits relative
          error; per token, ids equal to the reference's routing *of the kernel's own logits*
          (so only ulp-level exp/sigmoid differences remain), and ids vs the cuBLAS-logits
          reference as sets, with differing tokens classified by the score gap they straddle;
  split   per token count 1..256, kernels and CUDA-graph µs of ours as shipped (one launch up
          to FUSED_GEMM_MAX_TOKENS, else GEMM + routing), of both forms at every count, and of
          cuBLAS + the routing kernel: what FUSED_GEMM_MAX_TOKENS should be;
  shape   the GEMM launch's program target / split cap alternatives at 1 and 16 tokens;
  cublas  kernels and µs of cuBLAS + routing, with the GEMM as logits = h @ W^T and as
          (W @ h^T)^T (cuBLAS picks split-K, two kernels, for these skinny shapes);
  warps   the routing kernel's num_warps at 64 tokens;
  ab      the one launch's routing-tail alternatives (``AB_VARIANTS``: ``MoeRouteConfig``'s
          select / tail_loads fields and a launch shape) at 1, 2 and 16 tokens, Qwen3.5 with its
          shared-expert gate column: each variant's ids and weights checked against the routing of
          its own logits (and its gate against sigmoid of them) before it is timed; plus the
          L2-resident router-weight copy floor in the same run (not in the default parts);
  gemm    the one launch's GEMM-phase alternatives (``GEMM_VARIANTS``: ``MoeRouteConfig``'s
          block_k / block_e / gemv / unroll / w_hints / gemm_warps / gemm_stages / target_programs /
          max_split and routing-tail fields) at 1, 2 and 16 tokens, each checked like ``ab``'s, then timed warm (CUDA-graph
          replays, the weight L2-resident), cold (a graph of [L2 flush, op] pairs minus a graph
          of the flushes alone) and rotated (one graph over >= 256 MB of router-weight copies,
          each call on the next), beside the router-weight copy timed all three ways in the run;
          ratios to both floors, a summary table on stdout (not in the default parts):

    python bench/moe_router_check.py --parts ab --out bench/results/moe_router_ab_h200.json
    python bench/moe_router_check.py --parts gemm --out bench/results/moe_router_gemm_h200.json

    python bench/moe_router_check.py --out bench/results/moe_router_check_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fusion_compiler.kernels import moe_route as K  # noqa: E402
from fusion_compiler.ops import moe_route as ops  # noqa: E402

MODELS = {
    # name: (hidden, experts, routing args after bias (top_k .. weights_dtype), logits dtype)
    "deepseek-v3.2": (7168, 256, (8, 8, 4, 0, True, 1e-20, 2.5, torch.float32), torch.float32),
    "minimax-m2.5": (3072, 256, (8, 1, 1, 0, True, 0.0, 1.0, torch.float32), torch.bfloat16),
    "qwen3.5": (4096, 512, (10, 1, 1, 1, True, 0.0, 1.0, torch.bfloat16), torch.bfloat16),
}
SPLIT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 256)
SHAPES = ((128, 8), (256, 16), (64, 4), (128, 4))  # (target_programs, max_split)
AB_TOKENS = (1, 2, 16)
# name: the variant's ``MoeRouteConfig`` fields (the rest shipped: the tail by shape, routing_tail).
# Session 11 also timed a merge-network selection (one tl.reduce merging sorted key lists): slower
# than the rounds for all three (8.15 / 5.71 / 11.01 us at 1 token), removed.
AB_VARIANTS = {
    "by_shape": {},
    "rounds_reload": {"select": 0, "tail_loads": 0},  # moe_route-12
    "topk_reload": {"select": 1, "tail_loads": 0},
    "rounds_regs": {"select": 0, "tail_loads": 1},
    "topk_regs": {"select": 1, "tail_loads": 1},
    "by_shape_256prog": {"target_programs": 256, "max_split": 16},
}
AB_GATE = {"qwen3.5"}  # routers timed with the shared-expert gate column, as the model runs them
# name: ``MoeRouteConfig`` fields of the GEMM phase (its docstring).  Shapes at
# 1 token, DeepSeek / MiniMax / Qwen3.5 (+ gate column), as (BLOCK_K x K_STEPS, programs):
# shipped 64x14 128, 64x6 128, 64x22 99; span 512x1 224, 256x1 192, 1024x1 132; span_prog64
# 1024x1 112, 512x1 96, 1024x1 132; span_prog256 256x1 448, 128x1 384, 512x1 264.  The GEMV
# variants are GEMVs at 1 token only (above, their tl.dot base shape).
# moe_route-13's shape: 64-column steps, a 16-row tl.dot also at one token, no load hints.
_ROUTE13 = {"block_k": 64, "gemv": False, "w_hints": ("", "")}
GEMM_VARIANTS = {
    "shipped": {},
    "route13": _ROUTE13,
    "gemv_span_no_hint": {"w_hints": ("", "")},
    "span_evict_last_no_gemv": {"gemv": False},
    # Session 12's first A/B (moe_route-13 shipped; results/moe_router_gemm_h200_session12.json):
    "prog256": {**_ROUTE13, "target_programs": 256, "max_split": 16},
    "prog512": {**_ROUTE13, "target_programs": 512, "max_split": 32},
    "bk128_st4": {**_ROUTE13, "block_k": 128, "gemm_stages": 4},  # 4 KB a step, fetched 3 steps ahead
    "unroll": {**_ROUTE13, "unroll": True},
    "span": {**_ROUTE13, "block_k": 0},  # one tile per program: all its weight bytes in flight at once
    "span_prog64": {**_ROUTE13, "block_k": 0, "target_programs": 64},
    "span_prog256": {**_ROUTE13, "block_k": 0, "target_programs": 256},
    "span_w8": {**_ROUTE13, "block_k": 0, "gemm_warps": 8},
    "span_evict_last": {**_ROUTE13, "block_k": 0, "w_hints": ("", "evict_last")},
    "gemv_unroll": {**_ROUTE13, "gemv": True, "unroll": True},
    "gemv_span": {**_ROUTE13, "gemv": True, "block_k": 0},
    "gemv_span_prog256": {**_ROUTE13, "gemv": True, "block_k": 0, "target_programs": 256},
    # Session 14: the routing tail (shipped - diag_arrive) measured 2.7-4.1 us of 5.8-8.4; its
    # block-wide reductions and tl.topk's exchanges cross warps through shared memory and bar.sync.
    # Fewer warps per program keep more of them inside a warp (and the GEMM programs smaller).
    "w1": {"gemm_warps": 1},
    "w2": {"gemm_warps": 2},
    "w1_prog256": {"gemm_warps": 1, "target_programs": 256},
    "w2_prog256": {"gemm_warps": 2, "target_programs": 256},
    "w1_rounds": {"gemm_warps": 1, "select": 0},
    "w1_regs": {"gemm_warps": 1, "tail_loads": 1},
    "w2_rounds": {"gemm_warps": 2, "select": 0},
    # Session 14's offline SASS reading (bench/NOTES.md): the tail's partial loads return in
    # dependent waves under ptxas's register reuse; a register cap lets them issue together.
    # moe_route-15 ships 128 (MoeRouteConfig.maxnreg); no_maxnreg is moe_route-14's launch.
    "no_maxnreg": {"maxnreg": 0},
    # Session 16: MiniMax sat at the 2x-the-copy bar (1.98-2.01x). Round 1 also timed sigmoid as
    # rcp.rn.f32 and the poll's loads as ld.relaxed.gpu (inline PTX): no gain, and the relaxed
    # loads doubled Qwen3.5's time (BENCHMARKS.md); both removed. Fewer experts per program at one
    # token (GEMV only: tl.dot needs 16 rows) means fewer hidden-dim splits for the router to sum.
    # Round 2 (round 1: 4 experts fastest for all three, 5.88 / 4.47 / 6.54 -> 5.53 / 4.15 / 5.83
    # us; Qwen3.5 at the same split, so more programs mattered too): experts a program x the
    # GEMV's span cap, as programs x splits at one token, DeepSeek / MiniMax / Qwen3.5: be4 448x7
    # 192x3 516x4; be2 896x7 384x3 1028x4; be4_s2k 256x4 192x3 258x2; be2_s2k 512x4 256x2 514x2;
    # be1_s2k 1024x4 512x2 1026x2; be2_s4k 256x2 256x2 257x1; be1_s4k 512x2 512x2 513x1.
    **{f"be{e}" + ("" if span == 1024 else f"_s{span // 1024}k"): {"block_e": e, "max_gemv_span": span}
       for e, span in ((8, 1024), (4, 1024), (2, 1024), (4, 2048), (2, 2048), (1, 2048), (2, 4096), (1, 4096))},
    # moe_route-16 ships be2_s2k (5.35 / 3.93 / 5.74 us in round 2); route15 is -15's one-token shape.
    "route15": {"block_e": 16, "max_gemv_span": 1024},
    "maxnreg128": {"maxnreg": 128},
    "maxnreg160": {"maxnreg": 160},
    # Session 15 (moe_route-15): the routing tail's forms (kernels/moe_route.py routing_tail). The
    # shipped tail is int32 logit keys selected per warp without a bias (Qwen3.5), the logit in
    # the int64 key with one (MiniMax; DeepSeek's fp32 logits keep the reload).
    "keys64": {"keys": 0},  # moe_route-14's tail without a bias: int64 score keys
    "reload": {"tail_loads": 0},  # ... and with a bias: the picked logits reloaded
    "select_rounds": {"select": 0},  # block-wide rounds over the shipped keys
    "select_topk": {"select": 1},  # tl.topk over the shipped keys
    "select_warp": {"select": 2},  # per-warp rounds + rank merge, also over int64 keys
    "counters": {"poll_one_token": False},  # one token: the arrival counter (moe_route-14's) not polling
    # The diagnostic cuts diag_gemm / diag_arrive / diag_gemm_w1 / diag_gemm_be4 (outputs left
    # unwritten) are gone with the kernel's diagnostics; their results stand (bench/NOTES.md, 7).
}
GEMM_TOKENS = (1, 2, 16)
FLUSH_BYTES = 256 << 20  # > 5x the H200's 50 MB L2
# Cold by rotation: one graph calls the op (or the copy) on each of N copies of the router weight
# in turn, N copies >= ROTATE_BYTES, so each call's weight was evicted by the others' (no
# subtraction of two ~85 µs graphs, whose difference moved by 1-2 µs between runs in session 12).
ROTATE_BYTES = 256 << 20


def make_args(name: str, tokens: int, seed: int = 0):
    hidden, experts, routing, logits_dtype = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(experts, hidden, device="cuda", generator=gen) * hidden**-0.5).bfloat16()
    bias = None if routing[3] == 1 else torch.randn(experts, device="cuda", generator=gen) * 0.01
    return (x, w, bias, *routing, logits_dtype)


def _fused(args, gate_weight=None, config=None):
    named = dict(zip(ops._ROUTER_ARG_NAMES, args))
    x, w = named["hidden"], named["router_weight"]
    logits = torch.empty(x.shape[0], w.shape[0], dtype=named["logits_dtype"], device="cuda")
    weights = torch.empty(x.shape[0], named["top_k"], dtype=named["weights_dtype"], device="cuda")
    ids = torch.empty(x.shape[0], named["top_k"], dtype=torch.int64, device="cuda")
    gate = None if gate_weight is None else torch.empty(x.shape[0], 1, dtype=x.dtype, device="cuda")
    K.moe_router_fwd(named, x, w, logits, weights, ids, gate_weight=gate_weight, gate=gate, config=config)
    return weights, ids, logits, gate


def ab_check(args, gate_weight, out) -> dict:
    """One variant's outputs against the routing of its own logits (ulp-level exp/sigmoid
    differences aside, ids must be equal) and its gate against sigmoid of F.linear's."""
    weights, ids, logits, gate = out
    own_w, own_ids = ops.moe_route_reference(logits, *args[2:-1])  # bias .. weights_dtype
    entry = {"tokens_ids_equal": int((ids == own_ids).all(-1).sum()), "tokens": ids.shape[0],
             "weights_max_rel_err": ((weights.float() - own_w.float()).abs() / own_w.float().abs()).max().item()}
    if gate is not None:
        ref_gate = torch.sigmoid(torch.nn.functional.linear(args[0], gate_weight).float())
        entry["gate_max_abs_err"] = (gate.float() - ref_gate).abs().max().item()
    return entry


def cold_time_us(fn, flush, calls_per_graph: int = 10, replays: int = 30) -> float:
    """Median µs per [flush(), fn()] pair, timed as CUDA-graph replays (the L2 flushed before
    every call; fn(0) warmed up, e.g. compiled, outside the graph)."""
    for _ in range(2):
        fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            flush()
            fn(0)
    graph.replay()
    return common.replay_median_us(graph, calls_per_graph, replays)


def make_flush():
    scratch = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    return lambda: scratch.fill_(1)  # a write kernel: every line it touches is allocated in L2


def rotated_copies(weight: torch.Tensor) -> list:
    """Copies of ``weight`` totalling at least ROTATE_BYTES (at least 2)."""
    return [weight.clone() for _ in range(max(2, -(-ROTATE_BYTES // (weight.numel() * weight.element_size()))))]


def rotated_time_us(fn, copies: list) -> float:
    """Median µs per call of fn(copy) over one graph that calls it once on every copy in turn."""
    return common.graph_time_us(lambda i: fn(copies[i]), len(copies), calls_per_graph=len(copies), replays=20)


def floors(name: str, flush=None) -> dict:
    """The router-weight copy floor: L2-resident (graph replays of the copy alone) and, with
    ``flush``, cold two ways: graph of [flush, copy] minus graph of [flush, nothing], and the
    copy of each of ``rotated_copies`` in turn."""
    src = make_args(name, 1)[1]
    dst = torch.empty_like(src)
    out = {"bytes": src.numel() * src.element_size(),
           "copy_warm_us": common.graph_time_us(lambda i: dst.copy_(src), 1)}
    if flush is not None:
        out["flush_us"] = cold_time_us(lambda i: None, flush)
        out["flush_plus_copy_us"] = cold_time_us(lambda i: dst.copy_(src), flush)
        out["copy_cold_us"] = out["flush_plus_copy_us"] - out["flush_us"]
        copies = rotated_copies(src)
        out["copy_rotated_us"] = rotated_time_us(lambda w: dst.copy_(w), copies)
        out["rotated_copies"] = len(copies)
    return out


def router_variants(name: str, tokens: tuple, variants: dict, floor: dict | None = None, flush=None) -> list:
    """Each variant (``MoeRouteConfig`` fields) of the one launch at each token count: checked (``ab_check``)
    then timed warm; with ``flush`` also cold (minus ``floor['flush_us']``) and rotated over
    copies of the router weight; with ``floor`` the ratios to the copy floors."""
    rows = []
    for t in tokens:
        a = make_args(name, t)
        gen = torch.Generator(device="cuda").manual_seed(t + 1)
        gate_w = (torch.randn(1, a[0].shape[1], device="cuda", generator=gen) * a[0].shape[1] ** -0.5).bfloat16() \
            if name in AB_GATE else None
        weights = rotated_copies(a[1]) if flush is not None else []
        for label, settings in variants.items():
            entry = {"tokens": t, "variant": label, "gate": gate_w is not None}
            try:
                config = K.MoeRouteConfig(**settings)
                entry["launch"] = K.gemm_launch_config(t, a[1].shape[0] + (gate_w is not None), a[0].shape[1], config)
                entry.update(ab_check(a, gate_w, _fused(a, gate_w, config)))
                entry["us"] = common.graph_time_us(lambda i: _fused(a, gate_w, config), 1)
                if flush is not None:
                    entry["flush_plus_op_us"] = cold_time_us(lambda i: _fused(a, gate_w, config), flush)
                    entry["cold_us"] = entry["flush_plus_op_us"] - floor["flush_us"]
                    entry["rotated_us"] = rotated_time_us(lambda w: _fused((a[0], w, *a[2:]), gate_w, config), weights)
                if floor is not None:
                    entry["ratio_warm"] = entry["us"] / floor["copy_warm_us"]
                    if "cold_us" in entry:
                        entry["ratio_cold"] = entry["cold_us"] / floor["copy_cold_us"]
                        entry["ratio_rotated"] = entry["rotated_us"] / floor["copy_rotated_us"]
            except Exception as e:  # noqa: BLE001 - record and go on
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(entry)
            print(name, entry, flush=True)
    return rows


def print_gemm_table(result: dict) -> None:
    print("\nGEMM-phase variants (µs; warm: L2-resident graph replay; cold: after a 256 MB L2 flush, minus the flush)")
    for name, row in result["models"].items():
        f = row.get("gemm_floor")
        if not f:
            continue
        print(f"\n{name}: weight {f['bytes'] / 2**20:.2f} MiB, copy warm {f['copy_warm_us']:.2f}, "
              f"copy cold {f['copy_cold_us']:.2f} (flush {f['flush_us']:.1f}), "
              f"copy rotated {f['copy_rotated_us']:.2f} ({f['rotated_copies']} copies)")
        print(f"  {'variant':20s} {'T':>3s} {'ok':>3s} {'warm':>6s} {'x warm':>6s} {'cold':>6s} {'x cold':>6s} "
              f"{'rot':>6s} {'x rot':>6s}  launch")
        for e in row["gemm"]:
            if "error" in e:
                print(f"  {e['variant']:20s} {e['tokens']:3d}  ERROR {e['error'][:80]}")
                continue
            ok = "yes" if e["tokens_ids_equal"] == e["tokens"] else "NO"
            print(f"  {e['variant']:20s} {e['tokens']:3d} {ok:>3s} {e['us']:6.2f} {e['ratio_warm']:6.2f} "
                  f"{e['cold_us']:6.2f} {e['ratio_cold']:6.2f} {e['rotated_us']:6.2f} {e['ratio_rotated']:6.2f}"
                  f"  {e['launch']}")


def _cublas_logits(hidden, router_weight, logits_dtype):
    """cuBLAS logits; bf16/fp16 operands into fp32 logits as one fp32-output GEMM."""
    if hidden.dtype == router_weight.dtype != logits_dtype:
        return torch.mm(hidden, router_weight.t(), out_dtype=logits_dtype)
    return ops.router_logits(hidden, router_weight, logits_dtype)


def _cublas(args):
    named = dict(zip(ops._ROUTER_ARG_NAMES, args))
    logits = _cublas_logits(named["hidden"], named["router_weight"], named["logits_dtype"])
    weights = torch.empty(logits.shape[0], named["top_k"], dtype=named["weights_dtype"], device="cuda")
    ids = torch.empty(logits.shape[0], named["top_k"], dtype=torch.int64, device="cuda")
    K.moe_route_fwd({**named, "logits": logits}, weights, ids)
    return weights, ids, logits


def _cublas_transposed(args):
    named = dict(zip(ops._ROUTER_ARG_NAMES, args))
    h, w, ldt = named["hidden"], named["router_weight"], named["logits_dtype"]
    logits = (torch.mm(w, h.t(), out_dtype=ldt) if h.dtype != ldt else torch.mm(w, h.t())).t()
    weights = torch.empty(logits.shape[0], named["top_k"], dtype=named["weights_dtype"], device="cuda")
    ids = torch.empty(logits.shape[0], named["top_k"], dtype=torch.int64, device="cuda")
    K.moe_route_fwd({**named, "logits": logits}, weights, ids)
    return weights, ids, logits


def check(name: str, tokens: int) -> dict:
    args = make_args(name, tokens, seed=tokens)
    weights, ids, logits, _ = torch.ops.fusion_compiler.moe_router(*args)
    x, w = args[0], args[1]
    exact = (x.double() @ w.double().t())
    routing = args[2:-1]
    own_w, own_ids = ops.moe_route_reference(logits, *routing)
    ref_w, ref_ids, ref_logits, _ = ops.moe_router_reference(*args)
    same_set = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    return {
        "tokens": tokens,
        "logits_rel_err_vs_fp64": (logits.double() - exact).norm().item() / exact.norm().item(),
        "cublas_logits_rel_err_vs_fp64": (ref_logits.double() - exact).norm().item() / exact.norm().item(),
        "tokens_ids_equal_routing_of_own_logits": int((ids == own_ids).all(-1).sum()),
        "weights_max_rel_err_vs_routing_of_own_logits": ((weights.float() - own_w.float()).abs() / own_w.float().abs()).max().item(),
        "tokens_same_set_as_cublas_reference": int(same_set.sum()),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="check,split,shape,cublas,warps")
    parser.add_argument("--gemm-variants", nargs="*", default=list(GEMM_VARIANTS), choices=list(GEMM_VARIANTS),
                        help="the gemm part's variants")
    parser.add_argument("--gemm-tokens", nargs="*", type=int, default=list(GEMM_TOKENS))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    result = {"facts": common.device_facts(), "kernel_version": K.KERNEL_VERSION, "models": {}}
    for name in MODELS:
        row = result["models"][name] = {"check": [check(name, t) for t in (1, 5, 16, 64)] if "check" in parts else []}
        for c in row["check"]:
            print(name, c, flush=True)
        from fusion_compiler.inspect.counting import count_cuda_kernels

        split = []
        for t in SPLIT_TOKENS if "split" in parts else ():
            a = make_args(name, t)
            entry = {"tokens": t, "ours_kernels": count_cuda_kernels(lambda: _fused(a)).count,
                     "ours_us": common.graph_time_us(lambda i: _fused(a), 1),
                     "cublas_plus_route_us": common.graph_time_us(lambda i: _cublas(a), 1)}
            # both forms at every count, whatever the shipped split (FUSED_GEMM_MAX_TOKENS)
            for label, split_at in (("one_launch", 256), ("two_launches", 0)):
                config = K.MoeRouteConfig(fused_gemm_max_tokens=split_at)
                entry[f"{label}_kernels"] = count_cuda_kernels(lambda: _fused(a, config=config)).count
                entry[f"{label}_us"] = common.graph_time_us(lambda i: _fused(a, config=config), 1)
            split.append(entry)
            print(name, entry, flush=True)
        row["split"] = split
        shapes = []
        for t in (1, 16) if "shape" in parts else ():
            a = make_args(name, t)
            for target, cap in SHAPES:
                config = K.MoeRouteConfig(target_programs=target, max_split=cap)
                try:
                    us = common.graph_time_us(lambda i: _fused(a, config=config), 1)
                except Exception as e:  # noqa: BLE001 - record and go on
                    us = f"{type(e).__name__}: {e}"[:200]
                shapes.append({"tokens": t, "target_programs": target, "max_split": cap, "us": us})
                print(name, shapes[-1], flush=True)
        row["shapes"] = shapes
        ab = router_variants(name, AB_TOKENS, AB_VARIANTS) if "ab" in parts else []
        row["ab"] = ab
        cublas = []
        for t in (32, 64, 128, 256) if "cublas" in parts else ():
            a = make_args(name, t)
            for label, fn in (("h_wT", _cublas), ("w_hT_T", _cublas_transposed)):
                ref = _cublas(a)
                got = fn(a)
                entry = {"tokens": t, "gemm": label, "kernels": count_cuda_kernels(lambda: fn(a)).count,
                         "us": common.graph_time_us(lambda i: fn(a), 1),
                         "ids_equal_to_h_wT": bool(torch.equal(got[1], ref[1]))}
                cublas.append(entry)
                print(name, entry, flush=True)
        row["cublas"] = cublas
        warps = []
        if "warps" in parts:
            a = make_args(name, 64)
            logits = _cublas(a)[2]
            named = dict(zip(ops._ROUTER_ARG_NAMES, a))
        for nw in (1, 2, 4, 8) if "warps" in parts else ():
            config = K.MoeRouteConfig(route_warps=nw)
            wts = torch.empty(64, named["top_k"], dtype=named["weights_dtype"], device="cuda")
            ids = torch.empty(64, named["top_k"], dtype=torch.int64, device="cuda")
            us = common.graph_time_us(lambda i: K.moe_route_fwd({**named, "logits": logits}, wts, ids, config=config), 1)
            warps.append({"tokens": 64, "num_warps": nw, "us": us})
            print(name, warps[-1], flush=True)
        row["route_warps"] = warps
        if "gemm" in parts:
            flush = make_flush()
            row["gemm_floor"] = floors(name, flush)
            print(name, "gemm floor", row["gemm_floor"], flush=True)
            variants = {v: GEMM_VARIANTS[v] for v in args.gemm_variants}
            row["gemm"] = router_variants(name, tuple(args.gemm_tokens), variants, row["gemm_floor"], flush)
            del flush
        floor = torch.empty_like(make_args(name, 1)[1])
        src = make_args(name, 1)[1]
        row["floor_copy_router_weight_us"] = common.graph_time_us(lambda i: floor.copy_(src), 1)
        print(name, "floor", row["floor_copy_router_weight_us"], flush=True)
    common.write_json(args.out, result)
    if "gemm" in parts:
        print_gemm_table(result)


if __name__ == "__main__":
    main()
