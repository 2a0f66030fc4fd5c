"""Check cudagraph.count_kernel_nodes against a graph of known kernels on the GPU: capture three
elementwise kernels and a GEMM, dump CUDA's DOT of the graph to --out, print both counts.

    python bench/cudagraph_dot_check.py --out /tmp/graph.dot
"""

from __future__ import annotations

import argparse

import torch

from fusion_compiler.cudagraph import count_kernel_nodes, kernel_nodes
from fusion_compiler.inspect.counting import count_cuda_kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    x = torch.randn(256, 256, device="cuda")

    def step():
        return ((x + 1) * 2).relu() @ x

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        step()
    graph.debug_dump(args.out)
    with open(args.out) as f:
        dot = f.read()
    print("kernel nodes (DOT):", count_kernel_nodes(dot), "via kernel_nodes():", kernel_nodes(graph))
    print("profiler kernels, eager:", count_cuda_kernels(step).count, "replay:", count_cuda_kernels(graph.replay).count)
    print(dot[:1500])


if __name__ == "__main__":
    main()
