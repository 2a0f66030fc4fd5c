"""The skinny GEMM kernel (kernels/skinny_gemm.py) against cuBLAS at decode sizes, on the GPU.

For the projections our compiler leaves single at real widths (Qwen3.5's out_proj / o_proj and
shared expert, MiniMax's o_proj, DeepSeek V3.2's o_proj and shared expert, and the largest
merged one, Qwen3.5's GDN in_proj), at M = 1, 2, 4, 8 rows: CUDA-graph µs of torch.mm (cuBLAS)
and of the kernel, each over weight copies rotated so every call reads its weight from HBM;
kernels per call (profiler); GB/s of the weight bytes; relative error of both against float64.
Then the kernel's launch shapes (SkinnyConfig's block_n, block_k, warps) at M = 1. The kernel is timed
above its shipped MAX_TOKENS too, to choose that threshold.

    python bench/skinny_gemm_check.py --out bench/results/skinny_gemm_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fusion_compiler.inspect.counting import count_cuda_kernels  # noqa: E402
from fusion_compiler.kernels import skinny_gemm as K  # noqa: E402

SHAPES = {  # name: (N, K)
    "qwen3.5 out_proj / o_proj": (4096, 8192),
    "qwen3.5 shared gate+up": (2048, 4096),
    "qwen3.5 shared down": (4096, 1024),
    "qwen3.5 gdn in_proj (merged)": (20608, 4096),
    "minimax o_proj": (3072, 6144),
    "deepseek o_proj": (7168, 16384),
    "deepseek shared gate+up": (4096, 7168),
    "deepseek shared down": (7168, 2048),
}
TOKENS = (1, 2, 4, 8)
LAUNCH_SHAPES = ((2, 1024, 2), (1, 2048, 2), (2, 2048, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (2, 512, 2))
ROTATE_BYTES = 256 << 20  # > 5x the H200's L2


def _relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth_gbs()
    rows = []
    above = K.SkinnyConfig(max_tokens=max(args.tokens))  # time the kernel above the shipped threshold too
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
        copies = [weight] + [weight.clone() for _ in range(max(1, ROTATE_BYTES // (n * k * 2)))]
        nbytes = n * k * 2
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            exact = x.double() @ weight.double().t()
            row = {"shape": name, "n": n, "k": k, "tokens": m, "weight_bytes": nbytes}
            for label, fn in (("cublas", lambda w: torch.mm(x, w.t())), ("skinny", lambda w: K.skinny_gemm(x, w, config=above))):
                row[f"{label}_rel_err"] = _relative_error(fn(weight), exact)
                row[f"{label}_kernels"] = count_cuda_kernels(lambda: fn(weight)).count
                us = common.graph_time_us(lambda i: fn(copies[i]), len(copies), calls_per_graph=len(copies), replays=20)
                row[f"{label}_us"] = us
                row[f"{label}_gbs"] = nbytes / us / 1e3
                row[f"{label}_pct_bw"] = 100 * nbytes / us / 1e3 / bandwidth
            row["speedup"] = row["cublas_us"] / row["skinny_us"]
            if m == 1:
                shapes = {}
                for block_n, block_k, warps in LAUNCH_SHAPES:
                    shape = K.SkinnyConfig(block_n=block_n, block_k=block_k, warps=warps, max_tokens=above.max_tokens)
                    us = common.graph_time_us(lambda i: K.skinny_gemm(x, copies[i], config=shape), len(copies),
                                              calls_per_graph=len(copies), replays=20)  # fmt: skip
                    shapes[f"{block_n}x{block_k}/{warps}w"] = round(us, 2)
                row["skinny_us_by_launch_shape"] = shapes
            print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
            rows.append(row)
            common.write_json(args.out, {"device": common.device_facts(), "copy_bandwidth_gbs": bandwidth,
                                         "kernel_version": K.KERNEL_VERSION, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
