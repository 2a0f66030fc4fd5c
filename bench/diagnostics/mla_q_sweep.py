"""Launch sweep for the q-side prologue kernel at DeepSeek V3.2 widths (H200): lanes per
program (heads per program) and warps, timed as CUDA-graph replays.

    python bench/diagnostics/mla_q_sweep.py --out bench/results/mla_q_sweep_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402

from fusion_compiler.kernels import mla_q_prologue as K  # noqa: E402
from fusion_compiler.ops import mla_q_prologue as op  # noqa: E402


def inputs(tokens: int, gen):
    table = torch.randn(8192, 64, device="cuda", generator=gen)
    q = torch.randn(tokens, 128, 192, device="cuda", generator=gen).to(torch.bfloat16)
    return dict(
        q_pe=q[..., 128:], q_other=torch.randn(tokens, 128, 512, device="cuda", generator=gen).to(torch.bfloat16),
        deinterleave_rope=False,
        index_q=torch.randn(tokens, 64, 128, device="cuda", generator=gen).to(torch.bfloat16),
        index_weights=torch.randn(tokens, 64, device="cuda", generator=gen).to(torch.bfloat16),
        index_weights_scale=0.011, index_q_fp8=True, ue8m0=True,
        cos=table[:, :32], sin=table[:, 32:], positions=torch.randint(0, 8192, (tokens,), device="cuda", generator=gen),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth_gbs()
    rows = []
    for tokens in (1, 64, 256, 4096):
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        sets = [inputs(tokens, gen) for _ in range(2 if tokens >= 256 else 4)]
        size = tokens * (128 * (64 + 512) * 2 + 128 * 576 * 2 + 64 * 128 * 3 + 64 * 6)
        outs = [[torch.empty(s, dtype=d, device="cuda") for s, d in op.output_shapes(a)] for a in sets]
        for q_lanes in (2048, 4608, 9216, 18432):
            for iq_lanes in (1024, 2048):
                for warps in (4, 8, 16):
                    config = K.MlaQPrologueConfig(q_lanes=q_lanes, index_q_lanes=iq_lanes, warps=warps)
                    us = common.graph_time_us(lambda i: K.mla_q_prologue_fwd(sets[i], *outs[i], config=config), len(sets))
                    rows.append(dict(tokens=tokens, q_lanes=q_lanes, iq_lanes=iq_lanes, warps=warps, us=us,
                                     pct_bw=100 * size / us / 1e3 / bandwidth))  # fmt: skip
        best = min((r for r in rows if r["tokens"] == tokens), key=lambda r: r["us"])
        default = next(r for r in rows if r["tokens"] == tokens and (r["q_lanes"], r["iq_lanes"], r["warps"]) == (2048, 1024, 4))
        print(f"T={tokens}: default {default['us']:.2f} us ({default['pct_bw']:.0f}%), best {best}", flush=True)
    common.write_json(args.out, {"device": common.device_facts(), "copy_bandwidth_gbs": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
