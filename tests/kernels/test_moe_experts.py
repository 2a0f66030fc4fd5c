"""The ``moe_experts`` stage's Triton kernels: kernels/moe_experts.py (small batch, GEMV pairs)
and kernels/moe_experts_grouped.py (pairs grouped by expert, ``tl.dot`` tiles).

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py), tiny shapes, fresh random inputs (weights
N(0, 1/fan_in), routing weights renormalised like the routers'), each kernel writing into a
NaN-poisoned output with guard rows (tests/kernel_fixtures.py): against ``moe_experts_reference``
at the inputs' own dtype (the same rounding points: 1.5e-3, a rounding point left out shows as
~4.5e-3) and against the same reference run in float64 on the same inputs (no rounding in
between: 1e-2). T = 1, 3, 8 (small batch), 17, 40 (grouped; both kernels run every case: the
op's 16-token split is a speed choice, not a contract); top_k 1, 2, 8; H and I not powers of two
(masked tiles); launch shapes with several row blocks and loop steps; experts repeated across
tokens, all pairs on one expert (a run longer than BLOCK_M), experts never hit; padding ids -1
and >= E (a token of only padding gets zeros); int32 ids; fp32 and bf16 routing weights;
non-contiguous ids / weights; two calls equal bits. A small Hypothesis test over tokens, top_k,
experts hit and padding. ``default_config`` of both at the three models' real shapes.

GPU tier (``-m gpu``): both kernels at MiniMax's and Qwen3.5's real shapes at 1, 8, 64 and 256
tokens against the reference run in fp32 on the GPU; CUDA graph capture and replay of
``torch.ops.fusion_compiler.moe_experts`` at 1 and 64 tokens, equal bits to the eager call.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kernel_fixtures import DEVICE, HAS_CUDA, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import moe_experts as K  # noqa: E402
from fusion_compiler.kernels import moe_experts_grouped as G  # noqa: E402
from fusion_compiler.ops import moe_experts as op  # noqa: E402  (registers fusion_compiler::moe_experts)
from fusion_compiler.verify import relative_error  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis_profile import examples  # noqa: E402

TOLERANCE = 1e-2
SAME_ROUNDING_TOLERANCE = 1.5e-3
# Small batch: BIG one row block and one loop step at the tiny shapes; SMALL several row blocks
# and several (masked) loop steps.
BIG = K.LaunchConfig(64, 128, 4, 128, 64, 4)
SMALL = K.LaunchConfig(16, 32, 2, 32, 16, 2)
SMALL_PIPELINED = K.LaunchConfig(16, 32, 2, 32, 16, 2, gate_up_stages=2, down_stages=3)
# Grouped: G_BIG one column block and one loop step; G_SMALL several of each, BLOCK_M 16.
G_BIG = G.GroupedConfig(16, 64, 128, 4, 1, 128, 64, 4, 1, 128, 4)
G_SMALL = G.GroupedConfig(16, 16, 32, 2, 2, 32, 16, 2, 1, 32, 2, scan_max_pairs=4096)  # scan mode
LAUNCHES = {"small": (K.small_batch_experts, BIG, SMALL), "grouped": (G.grouped_experts, G_BIG, G_SMALL)}


def _inputs(tokens, top_k, experts, hidden, inter, seed, *, pool=None, weights_dtype=torch.float32,
            ids_dtype=torch.int64, device=DEVICE, dtype=torch.bfloat16):  # fmt: skip
    """Random inputs; each token's ids distinct, drawn from the first ``pool`` experts (default
    all), so a small pool repeats experts across tokens and leaves the others never hit."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen, device=device) * inter**-0.5).to(dtype)
    pool = pool or experts
    ids = torch.rand(tokens, pool, generator=gen, device=device).argsort(dim=-1)[:, :top_k].to(ids_dtype)
    w = torch.rand(tokens, top_k, generator=gen, device=device) + 0.1
    w = (w / w.sum(dim=-1, keepdim=True)).to(weights_dtype)
    return x, ids, w, gate_up, down


def _run(kernel, x, ids, w, gate_up, down, config=None):
    """The kernel into a NaN-poisoned output with guard rows: every element written, nothing
    outside."""
    buf, out = poisoned(tuple(x.shape), x.dtype)
    result = LAUNCHES[kernel][0](x, ids, w, gate_up, down, config, out=out)
    assert result.data_ptr() == out.data_ptr() and result.shape == x.shape and result.dtype == x.dtype
    assert not bool(result.isnan().any()), "an output element was not written"
    assert_guards_untouched(buf)
    return result


def _float64(x, ids, w, gate_up, down):
    return op.moe_experts_reference(x.double(), ids, w.double(), gate_up.double(), down.double())


def _check(out, x, ids, w, gate_up, down):
    """Against the reference at the inputs' dtype (same rounding points) and in float64."""
    assert relative_error(out, op.moe_experts_reference(x, ids, w, gate_up, down)) <= SAME_ROUNDING_TOLERANCE
    assert relative_error(out, _float64(x, ids, w, gate_up, down)) <= TOLERANCE


# (tokens, top_k, experts, hidden, intermediate, launch: "big" / "small", pool, routing-weights dtype)
CASES = [
    (1, 1, 8, 64, 32, "big", None, torch.float32, "T1-k1"),
    (1, 8, 16, 96, 40, "small", None, torch.float32, "T1-k8-masked-small-blocks"),
    (3, 2, 16, 96, 40, "small", None, torch.bfloat16, "T3-k2-masked-small-blocks-bf16w"),
    (8, 2, 32, 64, 48, "big", 3, torch.float32, "T8-k2-repeated-most-never-hit"),
    (8, 8, 8, 64, 32, "big", None, torch.bfloat16, "T8-k8-all-experts-bf16w"),
]
# Past the op's 16-token split only the grouped kernels (the small-batch ones interpret slowly).
GROUPED_CASES = [
    (17, 2, 16, 96, 40, "small", 4, torch.float32, "T17-k2-repeated-runs-over-block-m"),
    (40, 8, 12, 48, 24, "big", None, torch.float32, "T40-k8-runs-over-block-m"),
]
KERNEL_CASES = [pytest.param(kernel, *case[:-1], id=f"{kernel}-{case[-1]}") for case in CASES for kernel in LAUNCHES]
KERNEL_CASES += [pytest.param("grouped", *case[:-1], id=f"grouped-{case[-1]}") for case in GROUPED_CASES]


@pytest.mark.parametrize("kernel, tokens, top_k, experts, hidden, inter, launch, pool, weights_dtype", KERNEL_CASES)
def test_kernel_matches_reference_and_float64(kernel, tokens, top_k, experts, hidden, inter, launch, pool,
                                              weights_dtype):  # fmt: skip
    x, ids, w, gate_up, down = _inputs(tokens, top_k, experts, hidden, inter, seed=tokens * 100 + top_k,
                                       pool=pool, weights_dtype=weights_dtype)  # fmt: skip
    if pool is not None:  # experts really are repeated across tokens
        assert ids.unique().numel() < ids.numel()
    config = LAUNCHES[kernel][1 if launch == "big" else 2]
    _check(_run(kernel, x, ids, w, gate_up, down, config), x, ids, w, gate_up, down)


def test_small_batch_pipelined_loops_match_reference():
    x, ids, w, gate_up, down = _inputs(3, 2, 16, 96, 40, seed=11)
    _check(_run("small", x, ids, w, gate_up, down, SMALL_PIPELINED), x, ids, w, gate_up, down)


@pytest.mark.parametrize("kernel", LAUNCHES)
def test_all_pairs_on_one_expert(kernel):
    """Top 2, every first pair on expert 5 (grouped: 40 tokens, a 40-pair run in three BLOCK_M 16
    chunks), the second pairs spread; the other experts partly never hit."""
    x, ids, w, gate_up, down = _inputs(40 if kernel == "grouped" else 6, 2, 8, 48, 24, seed=5)
    ids[:, 0] = 5
    ids[:, 1] = torch.where(ids[:, 1] == 5, 6, ids[:, 1])
    _check(_run(kernel, x, ids, w, gate_up, down, LAUNCHES[kernel][2]), x, ids, w, gate_up, down)
    one = ids[:, :1].clone()  # top 1: every pair on one expert
    _check(_run(kernel, x, one, w[:, :1], gate_up, down, LAUNCHES[kernel][1]), x, one, w[:, :1], gate_up, down)


@pytest.mark.parametrize("kernel", LAUNCHES)
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_padding_ids_contribute_nothing(kernel, ids_dtype):
    """-1 and >= E (HF's expert-parallel sentinel E, and far past it) are padding: nothing read for
    them, a token of only padding gets exact zeros, the rest as the reference (which skips them);
    the same as dropping the padding pairs' weights to zero with a valid id."""
    experts = 8
    tokens = 17 if kernel == "grouped" else 5
    x, ids, w, gate_up, down = _inputs(tokens, 3, experts, 48, 24, seed=9, ids_dtype=ids_dtype)
    ids[0, 1] = -1
    ids[1, 2] = experts
    ids[2, 0] = experts + 1000
    ids[3] = torch.tensor([-1, experts, -1], dtype=ids_dtype)  # only padding
    padding = (ids < 0) | (ids >= experts)
    out = _run(kernel, x, ids, w, gate_up, down, LAUNCHES[kernel][2])
    assert bool((out[3] == 0).all())
    _check(out, x, ids, w, gate_up, down)
    zeroed = torch.where(padding, 0, ids), torch.where(padding, 0.0, w)
    assert relative_error(out, op.moe_experts_reference(x, *zeroed, gate_up, down)) <= SAME_ROUNDING_TOLERANCE


def test_grouped_scan_and_plan_modes_give_the_same_bits():
    """The grouped kernels' three ways to group the pairs: scan mode (each program finds its
    expert's pairs in the ids, the down kernel combines on the last arrival), plan mode with the
    align kernel's plan and the combine launch, and plan mode past ``align_max_pairs`` (the plan
    from torch ops, every expert a slot): the same bits, padding included (token 2 only
    padding: zeros)."""
    x, ids, w, gate_up, down = _inputs(17, 2, 8, 48, 24, seed=13, pool=5)
    ids[0, 0], ids[1, 1], ids[2] = -1, 8, -1
    scan = _run("grouped", x, ids, w, gate_up, down, G_SMALL)
    align = _run("grouped", x, ids, w, gate_up, down, dataclasses.replace(G_SMALL, scan_max_pairs=0))
    torch_plan = _run("grouped", x, ids, w, gate_up, down, dataclasses.replace(G_SMALL, scan_max_pairs=0,
                                                                                 align_max_pairs=16))  # fmt: skip
    assert torch.equal(scan, align) and torch.equal(scan, torch_plan)
    assert bool((scan[2] == 0).all())
    _check(scan, x, ids, w, gate_up, down)


def test_grouped_scan_mode_chunks_and_long_runs():
    """Scan mode with the ids read 16 at a time over 96 pairs (several chunks, a hit's rank
    carried across them) and one expert holding every token's first pair (a 48-pair run in three
    BLOCK_M tiles): the plan mode's bits."""
    x, ids, w, gate_up, down = _inputs(48, 2, 8, 48, 24, seed=21)
    ids[:, 0] = 3
    ids[:, 1] = torch.where(ids[:, 1] == 3, 5, ids[:, 1])
    chunked = dataclasses.replace(G_SMALL, scan_chunk=16)
    scan = _run("grouped", x, ids, w, gate_up, down, chunked)
    assert torch.equal(scan, _run("grouped", x, ids, w, gate_up, down, dataclasses.replace(chunked, scan_max_pairs=0)))
    _check(scan, x, ids, w, gate_up, down)


@pytest.mark.parametrize("kernel", LAUNCHES)
def test_non_contiguous_routing_default_launch_deterministic(kernel):
    """ids / weights as strided views (the launchers make them contiguous), int32 ids, the launch
    shape by ``default_config``, and two calls giving equal bits."""
    tokens = 17 if kernel == "grouped" else 1
    x, ids, w, gate_up, down = _inputs(tokens, 2, 8, 64, 32, seed=7, ids_dtype=torch.int32)
    ids_t, w_t = torch.stack((ids, ids), dim=-1)[..., 0], torch.stack((w, w), dim=-1)[..., 1]  # stride 2 along k
    assert not ids_t.is_contiguous() and not w_t.is_contiguous()
    out = _run(kernel, x, ids_t, w_t, gate_up, down)
    assert torch.equal(out, _run(kernel, x, ids, w, gate_up, down))
    _check(out, x, ids, w, gate_up, down)


@pytest.mark.parametrize("kernel", LAUNCHES)
def test_launcher_rejects_what_it_does_not_take(kernel):
    launcher = LAUNCHES[kernel][0]
    x, ids, w, gate_up, down = _inputs(1, 2, 8, 64, 32, seed=1)
    assert K.supports(x, ids, gate_up, down) and K.supports(x, ids.int(), gate_up, down)
    assert not K.supports(x, ids, gate_up.float(), down)  # weights in another dtype
    assert not K.supports(x, ids, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down)  # rows not contiguous
    assert not K.supports(x, ids.float(), gate_up, down)
    assert not K.supports(x, ids.to(torch.int16), gate_up, down)
    with pytest.raises(ValueError):
        launcher(x, ids, w, gate_up, down[:, :, :16])
    with pytest.raises(ValueError):  # out not like hidden
        launcher(x, ids, w, gate_up, down, out=torch.empty(1, 64, dtype=torch.float32, device=DEVICE))


@st.composite
def routings(draw):
    """tokens, top_k, experts, how many of them can be hit, padding pairs (any id outside [0, E))."""
    tokens = draw(st.integers(1, 18))
    top_k = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 10))
    hit = draw(st.integers(1, experts))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, hit, (tokens, top_k), generator=gen)
    padding = torch.rand(tokens, top_k, generator=gen) < draw(st.sampled_from([0.0, 0.2, 0.6]))
    ids = torch.where(padding, torch.tensor([-1, experts, experts + 7])[torch.randint(0, 3, ids.shape, generator=gen)],
                      ids)  # fmt: skip
    return tokens, top_k, experts, ids, seed


@settings(max_examples=examples(20), deadline=None)
@given(routing=routings(), weights_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_both_kernels_match_reference_over_routings(routing, weights_dtype):
    """Ids drawn with repeats (within a token too) from the first ``hit`` experts, some pairs
    padding; both kernels at small launch shapes against the reference."""
    tokens, top_k, experts, ids, seed = routing
    x, _, w, gate_up, down = _inputs(tokens, top_k, experts, 48, 24, seed=seed, weights_dtype=weights_dtype)
    ids = ids.to(DEVICE)
    for kernel in LAUNCHES:
        out = _run(kernel, x, ids, w, gate_up, down, LAUNCHES[kernel][2])
        assert relative_error(out, op.moe_experts_reference(x, ids, w, gate_up, down)) <= SAME_ROUNDING_TOLERANCE
        exact = _float64(x, ids, w, gate_up, down)
        assert relative_error(out, exact) <= TOLERANCE or bool((exact == 0).all() and (out == 0).all())


REAL_SHAPES = {  # (experts, top_k, hidden, intermediate)
    "minimax-m2.5": (256, 8, 3072, 1536),
    "qwen3.5": (512, 10, 4096, 1024),  # model_adapters/qwen35: num_experts, num_experts_per_tok, ...
    "deepseek-v3.2": (256, 8, 7168, 2048),
}


@pytest.mark.parametrize("model", REAL_SHAPES)
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_small_batch_default_config_fills_an_h200(model, tokens):
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


@pytest.mark.parametrize("model", REAL_SHAPES)
@pytest.mark.parametrize("tokens", [17, 64, 256, 4096])
def test_grouped_default_config_fills_an_h200(model, tokens):
    """Powers of two, BLOCK_M 16..64 for tl.dot, unmasked tiles at the real shapes, and >= 2
    programs per SM of an H200 (132) for each GEMM kernel counting only the expert slots that
    can be touched (min(E, T * k))."""
    experts, top_k, hidden, inter = REAL_SHAPES[model]
    c = G.default_config(tokens, top_k, experts, hidden, inter)
    sizes = (c.block_m, c.gate_up_block_n, c.gate_up_block_k, c.down_block_n, c.down_block_k, c.combine_block)
    assert all(n & (n - 1) == 0 and n >= 16 for n in sizes)
    assert 16 <= c.block_m <= 64
    assert inter % c.gate_up_block_n == 0 and hidden % c.gate_up_block_k == 0
    assert hidden % c.down_block_n == 0 and inter % c.down_block_k == 0 and hidden % c.combine_block == 0
    slots = min(experts, tokens * top_k)
    assert slots * (inter // c.gate_up_block_n) >= 264 and slots * (hidden // c.down_block_n) >= 264


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------


@functools.cache
def _cuda_weights(model):
    experts, _, hidden, inter = REAL_SHAPES[model]
    _, _, _, gate_up, down = _inputs(1, 1, experts, hidden, inter, seed=0, device="cuda")
    return gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", LAUNCHES)
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
@pytest.mark.parametrize("model", ["minimax-m2.5", "qwen3.5"])
def test_real_shape_matches_fp32_reference_on_cuda(model, tokens, kernel):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    experts, top_k, hidden, inter = REAL_SHAPES[model]
    gate_up, down = _cuda_weights(model)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=-1)[:, :top_k]
    w = torch.rand(tokens, top_k, generator=gen, device="cuda").softmax(dim=-1)
    out = LAUNCHES[kernel][0](x, ids, w, gate_up, down)
    exact = op.moe_experts_reference(x.float(), ids, w, gate_up.float(), down.float())
    assert relative_error(out, exact) <= TOLERANCE
    assert torch.equal(out, LAUNCHES[kernel][0](x, ids, w, gate_up, down))  # deterministic


@pytest.mark.gpu
def test_grouped_long_prefill_on_cuda():
    """8192 tokens x top 8: past ``align_max_pairs`` (the plan from torch), against fp32."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    experts, top_k, hidden, inter = REAL_SHAPES["minimax-m2.5"]
    gate_up, down = _cuda_weights("minimax-m2.5")
    tokens = 8192
    assert triton_next_pow2(tokens * top_k) > G.default_config(tokens, top_k, experts, hidden, inter).align_max_pairs
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = torch.rand(tokens, experts, device="cuda").argsort(dim=-1)[:, :top_k]
    w = torch.rand(tokens, top_k, device="cuda").softmax(dim=-1)
    out = G.grouped_experts(x, ids, w, gate_up, down)
    assert relative_error(out, op.moe_experts_reference(x.float(), ids, w, gate_up.float(), down.float())) <= TOLERANCE


def triton_next_pow2(n):
    return 1 << (n - 1).bit_length()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_op_is_captured_by_a_cuda_graph(tokens):
    """``torch.ops.fusion_compiler.moe_experts`` (small batch at 1 token, grouped at 64) captured
    once, replayed on new routing copied into the captured inputs: the eager call's bits."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    experts, top_k, hidden, inter = REAL_SHAPES["minimax-m2.5"]
    gate_up, down = _cuda_weights("minimax-m2.5")

    def routing(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
        ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=-1)[:, :top_k]
        w = torch.rand(tokens, top_k, generator=gen, device="cuda").softmax(dim=-1)
        return x, ids, w

    x, ids, w = routing(1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        op.moe_experts(x, ids, w, gate_up, down)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = op.moe_experts(x, ids, w, gate_up, down)
    for seed in (2, 3):
        new = routing(seed)
        for static, value in zip((x, ids, w), new, strict=True):
            static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, op.moe_experts(*new, gate_up, down))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [17, 64, 256])
@pytest.mark.parametrize("model", ["minimax-m2.5", "qwen3.5"])
def test_grouped_scan_mode_equals_plan_mode_on_cuda(model, tokens):
    """Scan mode (2 launches: the down kernel's last arrival per token and column block combines)
    against plan mode (align, gate/up, down, combine) at real shapes over 5 routings, one expert
    taking every token's first pair in the last (a long run, many arrivals per counter block):
    equal bits, so no arrival is lost or seen early on the GPU."""
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    experts, top_k, hidden, inter = REAL_SHAPES[model]
    gate_up, down = _cuda_weights(model)
    plan = dataclasses.replace(G.default_config(tokens, top_k, experts, hidden, inter), scan_max_pairs=0)
    for seed in range(5):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
        ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=-1)[:, :top_k]
        if seed == 4:
            ids[:, 0] = 7
            ids[:, 1:] = torch.where(ids[:, 1:] == 7, 8, ids[:, 1:])
        w = torch.rand(tokens, top_k, generator=gen, device="cuda").softmax(dim=-1)
        scan = G.grouped_experts(x, ids, w, gate_up, down, dataclasses.replace(plan, scan_max_pairs=4096))
        assert torch.equal(scan, G.grouped_experts(x, ids, w, gate_up, down, plan)), f"seed {seed}"
