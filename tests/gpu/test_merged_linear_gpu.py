"""GPU tier: merged_linear on CUDA: one GEMM launch (at one row our skinny GEMM kernel), merged on
an eager call, refused inside a capture that comes first."""

from __future__ import annotations

import pytest
import torch

from fusion_compiler.inspect.counting import count_cuda_kernels
from fusion_compiler.ops import merged_linear as ops

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weights(*widths, k=1024):
    return [torch.nn.Parameter(0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for n in widths]


@requires_cuda
def test_one_gemm_after_the_merge_and_replays_in_a_graph():
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    weights = _weights(768, 128, 128)
    expected = ops.merged_linear_reference(x.float(), [w.detach().float() for w in weights])
    torch.ops.fusion_compiler.merged_linear(x, weights)  # merges
    kernels = count_cuda_kernels(lambda: torch.ops.fusion_compiler.merged_linear(x, weights))
    assert kernels.count == 1 and any("skinny" in name for name in kernels.names), kernels.names  # M = 1: our kernel
    wider = torch.randn(2, 1024, device="cuda", dtype=torch.bfloat16)  # above MAX_TOKENS: cuBLAS (+ its split-K reduce)
    assert 1 <= count_cuda_kernels(lambda: torch.ops.fusion_compiler.merged_linear(wider, weights)).count <= 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.fusion_compiler.merged_linear(x, weights)
    graph.replay()
    torch.cuda.synchronize()
    assert (out.float() - expected).norm() / expected.norm() < 1e-2


@requires_cuda
def test_a_capture_before_the_merge_raises():
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    weights = _weights(256, 256)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA-graph capture"):
        with torch.cuda.graph(graph):
            torch.ops.fusion_compiler.merged_linear(x, weights)


@requires_cuda
def test_bf16_weights_under_an_fp32_x_are_one_kernel_with_no_fp32_copy():
    """``x @ w.float().t()`` at one row: our kernel reads the bf16 weights (one launch, no cast
    kernel); the fp32 output within fp32 rounding of float64."""
    x = torch.randn(1, 1024, device="cuda")
    weights = _weights(768, 256)
    expected = torch.cat([x.double() @ w.detach().double().t() for w in weights], dim=1)
    torch.ops.fusion_compiler.merged_linear(x, weights)  # merges
    kernels = count_cuda_kernels(lambda: torch.ops.fusion_compiler.merged_linear(x, weights))
    assert kernels.count == 1 and any("skinny" in name for name in kernels.names), kernels.names
    out = torch.ops.fusion_compiler.merged_linear(x, weights)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("vocab", [129_280, 200_064, 248_320, 262_144])
def test_lm_head_at_real_vocabularies_launches_and_matches_float64(vocab):
    """An lm_head at one row: the 1-D grid launches 64k-131k programs (the old 2-D grid failed with
    'invalid argument' past 65,535 on y); every row right, the output poisoned first."""
    from fusion_compiler.kernels import skinny_gemm as K

    gen = torch.Generator(device="cuda").manual_seed(vocab)
    x = torch.randn(1, 1024, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(vocab, 1024, device="cuda", generator=gen) * 1024**-0.5).bfloat16()
    out = torch.full((1, vocab), float("nan"), device="cuda", dtype=torch.bfloat16)
    K.skinny_gemm(x, w, out)
    exact = x.double() @ w.double().t()
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), exact, rtol=2e-2, atol=2e-2)
