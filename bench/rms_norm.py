"""Fused residual add + RMSNorm (and the gated RMSNorm) vs eager and stock Inductor, on the H200.

Every variant runs the same HF-style code (`residual + x`, then LlamaRMSNorm; with --gated,
HF's `Qwen3_5MoeRMSNormGated` at Qwen3.5's GDN dims: 64 value heads x 128 per token), timed as
CUDA-graph replays in one run: eager, stock Inductor (torch.compile of that code), and
ours (the same code through the fusion_compiler backend, so the pattern match and the
custom op are what is timed, not a bare kernel call).

    python bench/rms_norm.py --out bench/results/kernels_h200.json
    python bench/rms_norm.py --gated --out bench/results/gated_norm_h200.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

TOKENS = (1, 16, 256, 4096)
HIDDEN = (3072, 4096, 7168)
EPS = 1e-6
L2_BYTES = 60 * 2**20
ROUNDS = 5  # interleaved timing rounds per shape


def hf_add_rms_norm(x, residual, weight):
    """What HF decoder layers run: the residual add, then LlamaRMSNorm."""
    hidden = residual + x
    h32 = hidden.to(torch.float32)
    variance = h32.pow(2).mean(-1, keepdim=True)
    normed = h32 * torch.rsqrt(variance + EPS)
    return weight * normed.to(hidden.dtype), hidden


def float64_reference(x, residual, weight):
    """The HF math in float64, from the bf16-rounded residual sum."""
    h = (residual + x).double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()


GDN_HEADS, GDN_HEAD_V_DIM = 64, 128  # Qwen3.5-397B's linear-attention value heads


def hf_gated_norm(x, gate, weight):
    """HF's ``Qwen3_5MoeRMSNormGated`` as its GDN layer calls it, per value head."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated

    return Qwen3_5MoeRMSNormGated.forward(_GatedNormState(weight), x.reshape(-1, GDN_HEAD_V_DIM),
                                          gate.reshape(-1, GDN_HEAD_V_DIM)).reshape(x.shape)  # fmt: skip


class _GatedNormState:
    """The attributes HF's forward reads from its module."""

    def __init__(self, weight):
        self.weight, self.variance_epsilon, self.activation = weight, EPS, "silu"


def float64_gated_reference(x, gate, weight):
    h = x.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    return normed * torch.nn.functional.silu(gate.double())


def bench_shape(tokens: int, hidden: int, copy_gbs: float, gated: bool = False) -> dict:
    dtype = torch.bfloat16
    # add_rms_norm reads x, residual, weight and writes out, sum; the gated norm reads x, gate,
    # weight and writes out.
    shape = (tokens, GDN_HEADS, GDN_HEAD_V_DIM) if gated else (tokens, hidden)
    numel = tokens * hidden
    bytes_moved = ((3 if gated else 4) * numel + shape[-1]) * 2
    rotations = max(1, min(64, (4 * L2_BYTES) // max(1, bytes_moved)))
    sets = [
        (torch.randn(shape, dtype=dtype, device="cuda"), torch.randn(shape, dtype=dtype, device="cuda"))
        for _ in range(rotations)
    ]
    weight = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(dtype)
    code, reference = (hf_gated_norm, float64_gated_reference) if gated else (hf_add_rms_norm, float64_reference)

    torch._dynamo.reset()
    stock = torch.compile(code, dynamic=False, fullgraph=True)
    backend = fc.FusionBackend(fc.FusionConfig(cudagraphs=False))
    ours = torch.compile(code, backend=backend, dynamic=False, fullgraph=True)
    variants = {"eager": code, "inductor": stock, "fusion_compiler": ours}

    x, r = sets[0]
    ref_out = reference(x, r, weight)
    row = {"tokens": tokens, "hidden": hidden, "bytes": bytes_moved, "rotations": rotations}
    with torch.no_grad():
        for name, fn in variants.items():
            if gated:
                out = fn(x, r, weight)  # compiles
            else:
                out, total = fn(x, r, weight)  # compiles
                row[f"{name}_sum_exact"] = bool(torch.equal(total, r + x))
            row[f"{name}_rel_err"] = relative_error(out, ref_out)
            row[f"{name}_kernels"] = common.kernels_in(lambda fn=fn: fn(x, r, weight))
        # Rounds of eager, Inductor, ours one after the other: at 2-5 us one timing per variant
        # swings by more than the 5% bar, so each variant reports the median of its rounds.
        times = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, fn in variants.items():
                times[name].append(common.graph_time_us(lambda i, fn=fn: fn(sets[i][0], sets[i][1], weight), rotations))
        for name in variants:
            us = statistics.median(times[name])
            row[f"{name}_us"] = us
            row[f"{name}_us_rounds"] = times[name]
            row[f"{name}_gbs"] = bytes_moved / us / 1e3
            row[f"{name}_pct_copy_bw"] = 100 * row[f"{name}_gbs"] / copy_gbs
    row["fusion_compiler_matches"] = backend.report.per_variant()
    row["ours_over_inductor"] = row["fusion_compiler_us"] / row["inductor_us"]
    return row


SWEEP_LAUNCHES = ((1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 16))


def sweep_launches(tokens: int, hidden: int) -> list[dict]:
    """Ours at one shape under each launch in SWEEP_LAUNCHES (the op looks its launcher up at
    every call, so one compiled graph serves all, the launcher bound to each ``RmsNormConfig``
    in turn), Inductor timed before each."""
    from fusion_compiler.kernels import rms_norm as kernel

    dtype = torch.bfloat16
    bytes_moved = (4 * tokens * hidden + hidden) * 2
    rotations = max(1, min(64, (4 * L2_BYTES) // max(1, bytes_moved)))
    sets = [(torch.randn(tokens, hidden, dtype=dtype, device="cuda"), torch.randn(tokens, hidden, dtype=dtype, device="cuda"))
            for _ in range(rotations)]  # fmt: skip
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    torch._dynamo.reset()
    stock = torch.compile(hf_add_rms_norm, dynamic=False, fullgraph=True)
    ours = torch.compile(hf_add_rms_norm, backend=fc.FusionBackend(fc.FusionConfig(cudagraphs=False)), dynamic=False, fullgraph=True)
    shipped = tuple(kernel.launch_config(hidden)[1:3])
    out = []
    with torch.no_grad():
        stock(*sets[0], weight), ours(*sets[0], weight)
        for launch in SWEEP_LAUNCHES:
            config = kernel.RmsNormConfig(rows=launch[0], warps=launch[1])
            inductor_us = common.graph_time_us(lambda i: stock(sets[i][0], sets[i][1], weight), rotations)
            with common.module_knobs(kernel, rms_norm_fwd=functools.partial(kernel.rms_norm_fwd, config=config)):
                ours_us = common.graph_time_us(lambda i: ours(sets[i][0], sets[i][1], weight), rotations)
            out.append({"rows": launch[0], "warps": launch[1], "ours_us": ours_us, "inductor_us": inductor_us,
                        "ours_over_inductor": ours_us / inductor_us, "shipped": launch == shipped})  # fmt: skip
            print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/kernels_h200.json")
    parser.add_argument("--gated", action="store_true", help="the gated norm at Qwen3.5's GDN dims, 1/8/64/256 tokens")
    parser.add_argument("--sweep", metavar="TOKENSxHIDDEN", help="only this shape: ours under each (rows, warps) "
                        "launch in turn, stock Inductor timed between them (its own spread)")
    args = parser.parse_args()
    if args.sweep:
        tokens, hidden = map(int, args.sweep.split("x"))
        common.write_json(args.out, {"facts": common.device_facts(), "sweep": sweep_launches(tokens, hidden)})
        return
    started = time.time()
    facts = common.device_facts()
    copy_gbs = common.copy_bandwidth_gbs()
    rows = []
    shapes = [(t, GDN_HEADS * GDN_HEAD_V_DIM) for t in (1, 8, 64, 256)] if args.gated else [
        (t, h) for h in HIDDEN for t in TOKENS]  # fmt: skip
    for tokens, hidden in shapes:
        rows.append(bench_shape(tokens, hidden, copy_gbs, gated=args.gated))
        r = rows[-1]
        print(
            f"T={tokens:5d} H={hidden}: eager {r['eager_us']:7.2f} us  inductor {r['inductor_us']:7.2f} us  "
            f"ours {r['fusion_compiler_us']:7.2f} us ({r['fusion_compiler_pct_copy_bw']:.0f}% copy bw, "
            f"{r['ours_over_inductor']:.3f}x inductor) kernels e/i/o {r['eager_kernels']}/{r['inductor_kernels']}/{r['fusion_compiler_kernels']}",
            flush=True,
        )
    payload = {
        "bench": "gated_rms_norm kernels (HF Qwen3_5MoeRMSNormGated)" if args.gated else "add_rms_norm kernels",
        "facts": facts,
        "copy_bandwidth_gbs": copy_gbs,
        "method": f"CUDA-graph replay, 20 calls per graph, median of 50 replays, median of {ROUNDS} interleaved rounds "
        "(eager, Inductor, ours); inputs rotated over >= 4x L2; "
        + ("bytes = read x, gate, weight + write out" if args.gated else "bytes = read x, residual, weight + write out, sum")
        + "; % of a same-run 2 GiB D2D copy (read+write)",
        "rows": rows,
        "seconds": time.time() - started,
    }
    common.write_json(args.out, payload)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; wrote {args.out} in {payload['seconds']:.0f} s")


if __name__ == "__main__":
    main()
