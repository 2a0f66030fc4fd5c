"""Check cudagraph.kernel_nodes against the profiler on a graph of known kernels: capture three
elementwise kernels and a GEMM, then print the kernel nodes read from the graph and the kernels
the profiler sees in one eager call and in one replay.

    python bench/diagnostics/cudagraph_nodes_check.py
"""

from __future__ import annotations

import torch

from fusion_compiler.cudagraph import kernel_nodes
from fusion_compiler.inspect.counting import count_cuda_kernels


def main() -> None:
    x = torch.randn(256, 256, device="cuda")

    def step():
        return ((x + 1) * 2).relu() @ x

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        step()
    graph.instantiate()
    print("kernel nodes in the graph:", kernel_nodes(graph))
    print("profiler kernels, eager:", count_cuda_kernels(step).count, "replay:", count_cuda_kernels(graph.replay).count)


if __name__ == "__main__":
    main()
