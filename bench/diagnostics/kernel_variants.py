"""Where the fused add+RMSNorm kernel loses to Inductor's at decode shapes: Inductor's
generated launch config beside ours with other (rows, warps) choices, in one run.

    python bench/diagnostics/kernel_variants.py --out bench/results/kernel_variants_h200.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402
from kernels import hf_add_rms_norm  # noqa: E402

from fusion_compiler import _compat  # noqa: E402
from fusion_compiler.kernels import rms_norm as kernel  # noqa: E402

SHAPES = ((1, 4096), (1, 7168), (16, 7168), (256, 3072), (256, 4096), (256, 7168))
CONFIGS = ((1, 4), (1, 8), (1, 16), (1, 32), (2, 4), (2, 8), (4, 4), (4, 8))


ROTATIONS = 1  # --rotations: input sets cycled through (HBM-resident inputs when > 1)


def _sets(tokens, hidden):
    out = []
    for _ in range(ROTATIONS):
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        r, w = torch.randn_like(x), torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
        out.append((x, r, w, torch.empty_like(x), torch.empty_like(x)))
    return out


def inductor_config(tokens, hidden):
    sets = _sets(tokens, hidden)
    x, r, w = sets[0][:3]
    torch._dynamo.reset()
    fn = torch.compile(hf_add_rms_norm, dynamic=False)
    _, sources = _compat.run_and_get_code(lambda: fn(x, r, w))
    text = "\n".join(sources)
    found = re.findall(r"num_warps['\"]?\s*[:=]\s*(\d+)", text)
    blocks = re.findall(r"'(XBLOCK|R0_BLOCK|RBLOCK)':\s*(\d+)", text)
    kind = re.findall(r"@triton_heuristics\.(\w+)", text)
    time_us = common.graph_time_us(lambda i: fn(*sets[i][:3]), ROTATIONS)
    return {"heuristic": kind, "num_warps": found, "blocks": blocks, "us": time_us}


def _run(sets, config):
    def call(i):
        x, r, w, out, total = sets[i]
        kernel.rms_norm_fwd(x, w, 1e-6, 0.0, out, residual=r, sum_out=total, config=config)

    return common.graph_time_us(call, len(sets))


def ours(tokens, hidden, rows, warps):
    return _run(_sets(tokens, hidden), kernel.RmsNormConfig(rows=rows, warps=warps))


def ours_looped(tokens, hidden, chunk, warps):
    """Force the two-pass chunked path (the shape of Inductor's looped `reduction`)."""
    return _run(_sets(tokens, hidden), kernel.RmsNormConfig(warps=warps, loop_block_n=chunk))


LOOPED = ((1024, 4), (1024, 8), (2048, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/kernel_variants_h200.json")
    parser.add_argument("--rotations", type=int, default=1, help="input sets cycled through (>1: from HBM)")
    parser.add_argument("--shapes", nargs="*", default=None, help="TOKENSxHIDDEN, e.g. 256x4096")
    args = parser.parse_args()
    global ROTATIONS
    ROTATIONS = args.rotations
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    rows = []
    for tokens, hidden in shapes:
        row = {"tokens": tokens, "hidden": hidden, "inductor": inductor_config(tokens, hidden)}
        row["ours"] = {f"rows{r}_warps{w}": ours(tokens, hidden, r, w) for r, w in CONFIGS}
        row["ours"].update({f"looped{c}_warps{w}": ours_looped(tokens, hidden, c, w) for c, w in LOOPED})
        rows.append(row)
        best = min(row["ours"].items(), key=lambda kv: kv[1])
        print(f"T={tokens} H={hidden}: inductor {row['inductor']['us']:.2f} us {row['inductor']['heuristic']} warps {row['inductor']['num_warps']} {row['inductor']['blocks']}; ours "
              + " ".join(f"{k}={v:.2f}" for k, v in row["ours"].items()) + f"; best {best[0]}", flush=True)
    common.write_json(args.out, {"facts": common.device_facts(), "rotations": ROTATIONS, "rows": rows})


if __name__ == "__main__":
    main()
