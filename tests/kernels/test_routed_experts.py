"""The routed experts' small-batch Triton kernels (kernels/routed_experts.py).

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py), tiny shapes, bf16, fresh random inputs
(weights N(0, 1/fan_in), routing weights renormalised like the routers'): ``small_batch_experts``
against the op's torch path (``routed_experts`` with ``grouped=False``, the same rounding points)
and against a float64 computation of the same sum with no rounding in between: 1e-2 relative
error to the latter, 1.5e-3 to the former (same rounding points: a missing one shows). T = 1,
3, 8; top_k 1, 2, 8; E 8..32; H and I not powers of two (masked tiles); launch shapes with
several row blocks and several loop steps; ids repeated across tokens; fp32 and bf16 routing
weights; non-contiguous ids / weights. On CPU ``routed_experts`` keeps its torch paths (the
kernel is CUDA-only there). ``default_config`` at the three models' real shapes.

GPU tier (``-m gpu``): MiniMax's real shape (256 experts, top 8, H 3072, I 1536) at 1 and 8 tokens
against the grouped path (``_grouped_experts``), as shipped and with pipelined loops (stages 3);
``routed_experts(grouped=True)`` takes the kernel up to ``SMALL_BATCH_MAX_PAIRS`` pairs and the
grouped GEMMs past it; a CUDA graph captures it.
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, HAS_CUDA, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import routed_experts as K  # noqa: E402
from fusion_compiler.model_adapters.reference import moe  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

TOLERANCE = 1e-2
# Against the torch path, which rounds at the same points, only the summation order differs
# (under the interpreter the bits agree): a rounding point left out (gate / up / silu / each
# expert's down output kept in fp32) shows as ~4.5e-3 here, inside TOLERANCE but not this.
SAME_ROUNDING_TOLERANCE = 1.5e-3
BIG = K.LaunchConfig(64, 128, 4, 128, 64, 4)  # one row block and one loop step at the tiny shapes
SMALL = K.LaunchConfig(16, 32, 2, 32, 16, 2)  # several row blocks, several (masked) loop steps
SMALL_PIPELINED = K.LaunchConfig(16, 32, 2, 32, 16, 2, gate_up_stages=2, down_stages=3)


def _inputs(tokens, top_k, experts, hidden, inter, seed, *, pool=None, weights_dtype=torch.float32,
            device=DEVICE, dtype=torch.bfloat16):  # fmt: skip
    """Random inputs; each token's ids distinct, drawn from the first ``pool`` experts (default
    all), so a small pool repeats experts across tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen, device=device) * inter**-0.5).to(dtype)
    pool = pool or experts
    ids = torch.rand(tokens, pool, generator=gen, device=device).argsort(dim=-1)[:, :top_k]
    w = torch.rand(tokens, top_k, generator=gen, device=device) + 0.1
    w = (w / w.sum(dim=-1, keepdim=True)).to(weights_dtype)
    return x, ids, w, gate_up, down


def _float64_reference(x, ids, w, gate_up, down):
    """sum_k w * down_e(silu(gate_e(x)) * up_e(x)) in float64, no intermediate rounding."""
    x, gate_up, down, w = x.double(), gate_up.double(), down.double(), w.double()
    gate, up = torch.einsum("th,tkoh->tko", x, gate_up[ids]).chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    return torch.einsum("tkh,tk->th", torch.einsum("tki,tkhi->tkh", act, down[ids]), w)


# (tokens, top_k, experts, hidden, intermediate, launch, pool, routing-weights dtype)
CASES = [
    pytest.param(1, 1, 8, 64, 32, BIG, None, torch.float32, id="T1-k1"),
    pytest.param(1, 8, 16, 96, 40, SMALL, None, torch.float32, id="T1-k8-masked-small-blocks"),
    pytest.param(3, 2, 16, 96, 40, SMALL_PIPELINED, None, torch.bfloat16, id="T3-k2-masked-small-blocks-stages-bf16w"),
    pytest.param(3, 8, 24, 96, 40, BIG, None, torch.float32, id="T3-k8-masked"),
    pytest.param(8, 2, 32, 64, 48, BIG, 3, torch.float32, id="T8-k2-repeated"),
    pytest.param(8, 8, 8, 64, 32, BIG, None, torch.bfloat16, id="T8-k8-all-experts-bf16w"),
]


@pytest.mark.parametrize("tokens, top_k, experts, hidden, inter, launch, pool, weights_dtype", CASES)
def test_kernel_matches_torch_path_and_float64(tokens, top_k, experts, hidden, inter, launch, pool, weights_dtype):
    x, ids, w, gate_up, down = _inputs(tokens, top_k, experts, hidden, inter, seed=tokens * 100 + top_k,
                                       pool=pool, weights_dtype=weights_dtype)  # fmt: skip
    if pool is not None:  # experts really are repeated across tokens
        assert ids.unique().numel() < ids.numel()
    out = K.small_batch_experts(x, ids, w, gate_up, down, launch)
    assert out.shape == x.shape and out.dtype == x.dtype and bool(out.isfinite().all())
    torch_path = moe.routed_experts(x, ids, w, gate_up, down, grouped=False)
    assert relative_error(out, torch_path) <= SAME_ROUNDING_TOLERANCE
    # the float64 sum, against which the torch path itself is held to the same bound
    exact = _float64_reference(x, ids, w, gate_up, down)
    assert relative_error(out, exact) <= TOLERANCE
    assert relative_error(torch_path, exact) <= TOLERANCE


def test_kernel_non_contiguous_routing_and_default_launch():
    """ids / weights as strided views (the launcher makes them contiguous), the launch shape by
    ``default_config``, and the result deterministic (two calls, equal bits)."""
    x, ids, w, gate_up, down = _inputs(2, 2, 8, 64, 32, seed=7)
    ids_t, w_t = ids.t().contiguous().t(), w.t().contiguous().t()
    assert not ids_t.is_contiguous() and not w_t.is_contiguous()
    out = K.small_batch_experts(x, ids_t, w_t, gate_up, down)
    assert torch.equal(out, K.small_batch_experts(x, ids, w, gate_up, down))
    assert relative_error(out, moe.routed_experts(x, ids, w, gate_up, down, grouped=False)) <= TOLERANCE


def test_launcher_rejects_what_it_does_not_take():
    x, ids, w, gate_up, down = _inputs(1, 2, 8, 64, 32, seed=1)
    assert K.supports(x, ids, gate_up, down)
    assert not K.supports(x, ids, gate_up.float(), down)  # weights in another dtype
    assert not K.supports(x, ids, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)  # rows not contiguous
    assert not K.supports(x, ids.float(), gate_up, down)
    with pytest.raises(ValueError):
        K.small_batch_experts(x, ids, w, gate_up, down[:, :, :16])


@pytest.mark.skipif(HAS_CUDA, reason="the CPU dispatch")
def test_routed_experts_keeps_the_torch_paths_on_cpu():
    x, ids, w, gate_up, down = _inputs(1, 2, 8, 64, 32, seed=3)
    assert moe._small_batch_kernel(x, ids, gate_up, down) is None
    out = moe.routed_experts(x, ids, w, gate_up, down, grouped=True)
    assert torch.equal(out, moe._grouped_experts(x, ids, w, gate_up, down))


REAL_SHAPES = {  # (experts, top_k, hidden, intermediate)
    "minimax-m2.5": (256, 8, 3072, 1536),
    "qwen3.5": (512, 10, 4096, 1024),
    "deepseek-v3.2": (256, 8, 7168, 2048),
}


@pytest.mark.parametrize("model", REAL_SHAPES)
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_default_config_fills_an_h200(model, tokens):
    """>= 2 programs per SM (132) for each kernel, powers of two, kernel 1's tiles unmasked
    (kernel 2's 1024-wide step masks half of MiniMax's last one: measured faster)."""
    _, top_k, hidden, inter = REAL_SHAPES[model]
    c = K.default_config(tokens, top_k, hidden, inter)
    for n in (c.gate_up_block_n, c.gate_up_block_k, c.down_block_n, c.down_block_k):
        assert n & (n - 1) == 0
    assert tokens * top_k * (inter // c.gate_up_block_n) >= 264
    assert tokens * (hidden // c.down_block_n) >= 264
    assert hidden % c.gate_up_block_k == 0 and c.down_block_k == min(1024, inter)
    assert inter % c.gate_up_block_n == 0 and hidden % c.down_block_n == 0


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_minimax_real_shape_matches_grouped_path_on_cuda(tokens):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    experts, top_k, hidden, inter = REAL_SHAPES["minimax-m2.5"]
    x, ids, w, gate_up, down = _inputs(tokens, top_k, experts, hidden, inter, seed=tokens, device="cuda")
    grouped = moe._grouped_experts(x, ids, w, gate_up, down)
    out = K.small_batch_experts(x, ids, w, gate_up, down)
    assert relative_error(out, grouped) <= SAME_ROUNDING_TOLERANCE
    assert torch.equal(out, K.small_batch_experts(x, ids, w, gate_up, down))  # deterministic
    pipelined = K.LaunchConfig(gate_up_stages=3, down_stages=3)
    assert (
        relative_error(K.small_batch_experts(x, ids, w, gate_up, down, pipelined), grouped) <= SAME_ROUNDING_TOLERANCE
    )
    # the op takes the kernel at <= SMALL_BATCH_MAX_PAIRS pairs
    assert tokens * top_k <= moe.SMALL_BATCH_MAX_PAIRS
    assert torch.equal(moe.routed_experts(x, ids, w, gate_up, down, grouped=True), out)
    # and a CUDA graph captures it (no host sync)
    static_out = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        K.small_batch_experts(x, ids, w, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = K.small_batch_experts(x, ids, w, gate_up, down)
    ids.copy_((ids + 1) % experts)  # new experts, still distinct per token
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, K.small_batch_experts(x, ids, w, gate_up, down))
    del gate_up, down
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_routed_experts_takes_grouped_path_past_the_threshold_on_cuda():
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    tokens = moe.SMALL_BATCH_MAX_PAIRS // 2 + 1  # top 2: just past the threshold
    x, ids, w, gate_up, down = _inputs(tokens, 2, 16, 256, 128, seed=5, device="cuda")
    assert moe._small_batch_kernel(x, ids, gate_up, down) is None
    assert moe._small_batch_kernel(x[:4], ids[:4], gate_up, down) is K.small_batch_experts
    out = moe.routed_experts(x, ids, w, gate_up, down, grouped=True)
    assert torch.equal(out, moe._grouped_experts(x, ids, w, gate_up, down))
