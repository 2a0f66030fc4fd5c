"""``fusion_compiler::moe_experts_fp8``'s kernels (kernels/moe_experts_fp8.py): small batch
(GEMV pairs) and grouped by expert.

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py), tiny shapes with H and I multiples of 128
and not (a masked last group, and I % 128 != 0 puts a gate/up scale block across the gate / up
boundary), fresh random weights quantised by ``quantize_weight``, each launch writing into a
NaN-poisoned output with guard rows (tests/kernel_fixtures.py). Against
``moe_experts_fp8_reference`` (same quantisation and rounding points, fp32 GEMMs: 3e-3 allows a
rare act code flipped by a different fp32 summation order; observed 0) and against the float64
dequantised product (``accumulate=torch.float64``: 1e-2). T = 1, 3, 8 (both paths where the
groups are masked: the op's 8-token split is a speed choice, not a contract), 9, 17, 40 (grouped); top_k 1, 2, 8; launch shapes
with one and several row blocks and loop steps, small-batch steps narrower than a 128-group (64)
and wider (256), grouped runs longer than BLOCK_M; experts repeated across tokens and never hit;
padding ids -1 and >= E (a token of only padding gets exact zeros); an all-zero token (zero
groups, no NaN); int32 ids, bf16 routing weights, strided ids / weights; two calls equal bits;
scan mode, the align kernel's plan and the plan from torch giving the same bits; launch shapes the kernels refuse.

GPU tier (``-m gpu``): DeepSeek V3's real expert shape (256 experts, top 8, H 7168, I 2048),
small batch at 1 and 8 tokens, grouped at 8 and 64, against the reference in fp32 and in
float64 on the GPU, and ``torch.ops.fusion_compiler.moe_experts_fp8`` on the path it takes.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from kernel_fixtures import DEVICE, HAS_CUDA, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import moe_experts_fp8 as K  # noqa: E402
from fusion_compiler.ops import moe_experts_fp8 as op  # noqa: E402  (registers fusion_compiler::moe_experts_fp8)
from fusion_compiler.verify import relative_error  # noqa: E402

TOLERANCE = 1e-2
SAME_ROUNDING_TOLERANCE = 3e-3
# BIG: one row block and one loop step at the tiny shapes (steps of two 128-groups); SMALL:
# several row blocks and loop steps, steps of half a group. Kernel 2's rows kept >= 32: the
# interpreter's cost is per program.
BIG = K.LaunchConfig(gate_up_block_n=256, gate_up_block_k=256, down_block_n=256, down_block_k=256)
SMALL = K.LaunchConfig(gate_up_block_n=128, gate_up_block_k=64, down_block_n=64, down_block_k=64)
SMALL_PIPELINED = K.LaunchConfig(128, 64, 2, 64, 64, 2, gate_up_stages=2, down_stages=3)
# Grouped: G_BIG one column block; G_SMALL BLOCK_M 16 (runs loop) and several down column blocks.
G_BIG = K.GroupedConfig(block_m=64, down_block_n=256, combine_block=256)
G_SMALL = K.GroupedConfig(block_m=16, down_block_n=32, combine_block=64, scan_max_pairs=4096)  # scan mode
LAUNCHES = {"small": (K.small_batch_experts_fp8, BIG, SMALL), "grouped": (K.grouped_experts_fp8, G_BIG, G_SMALL)}


def _inputs(tokens, top_k, experts, hidden, inter, seed, *, pool=None, weights_dtype=torch.float32,
            ids_dtype=torch.int64, device=DEVICE):  # fmt: skip
    """Random bf16 hidden, FP8 weights; each token's ids distinct, drawn from the first ``pool``
    experts (default all), so a small pool repeats experts and leaves the others never hit."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    gate_up = op.quantize_weight(torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5)
    down = op.quantize_weight(torch.randn(experts, hidden, inter, generator=gen, device=device) * inter**-0.5)
    ids = torch.rand(tokens, pool or experts, generator=gen, device=device).argsort(dim=-1)[:, :top_k].to(ids_dtype)
    w = torch.rand(tokens, top_k, generator=gen, device=device) + 0.1
    w = (w / w.sum(dim=-1, keepdim=True)).to(weights_dtype)
    return x, ids, w, *gate_up, *down


def _run(args, config=None, kernel="small"):
    """The kernels into a NaN-poisoned output with guard rows: every element written, nothing
    outside."""
    x = args[0]
    buf, out = poisoned(tuple(x.shape), x.dtype)
    result = LAUNCHES[kernel][0](*args, config=config, out=out)
    assert result.data_ptr() == out.data_ptr() and result.shape == x.shape and result.dtype == x.dtype
    assert not bool(result.isnan().any()), "an output element was not written"
    assert_guards_untouched(buf)
    return result


def _check(out, args):
    """Against the reference (same rounding points) and the float64 dequantised product."""
    assert relative_error(out, op.moe_experts_fp8_reference(*args)) <= SAME_ROUNDING_TOLERANCE
    assert relative_error(out, op.moe_experts_fp8_reference(*args, accumulate=torch.float64)) <= TOLERANCE


# (tokens, top_k, experts, hidden, intermediate, launch: "big" / "small", pool, routing-weights dtype, id)
CASES = [
    (1, 1, 4, 256, 128, "big", None, torch.float32, "T1-k1-multiples"),
    (1, 8, 8, 200, 72, "small", None, torch.float32, "T1-k8-masked-groups-small-blocks"),
    (3, 2, 8, 256, 256, "small", None, torch.bfloat16, "T3-k2-multiples-small-blocks-bf16w"),
    (3, 2, 8, 200, 200, "big", None, torch.float32, "T3-k2-masked-groups-big-steps"),
    (8, 2, 16, 256, 200, "big", 3, torch.float32, "T8-k2-repeated-most-never-hit"),
    (8, 8, 8, 128, 128, "big", None, torch.bfloat16, "T8-k8-all-experts-bf16w"),
]
# Past the op's 8-token split only the grouped kernels (the small-batch ones interpret slowly).
GROUPED_CASES = [
    (17, 2, 16, 200, 72, "small", 4, torch.float32, "T17-k2-repeated-runs-over-block-m"),
    (40, 8, 12, 128, 128, "big", None, torch.bfloat16, "T40-k8-bf16w"),
]
# The grouped kernels on the small-batch cases with masked groups (the others add interpreter time only).
KERNEL_CASES = [pytest.param(kernel, *c[:-1], id=f"{kernel}-{c[-1]}") for c in CASES for kernel in LAUNCHES
                if kernel == "small" or c[4] % 128]  # fmt: skip
KERNEL_CASES += [pytest.param("grouped", *c[:-1], id=f"grouped-{c[-1]}") for c in GROUPED_CASES]


@pytest.mark.parametrize("kernel, tokens, top_k, experts, hidden, inter, launch, pool, weights_dtype", KERNEL_CASES)
def test_kernels_match_reference_and_float64(kernel, tokens, top_k, experts, hidden, inter, launch, pool,
                                             weights_dtype):  # fmt: skip
    args = _inputs(tokens, top_k, experts, hidden, inter, seed=tokens * 100 + top_k + hidden, pool=pool,
                   weights_dtype=weights_dtype)  # fmt: skip
    if pool is not None:  # experts really are repeated across tokens
        assert args[1].unique().numel() < args[1].numel()
    config = LAUNCHES[kernel][1 if launch == "big" else 2]
    _check(_run(args, config, kernel), args)


def test_pipelined_loops_match_reference():
    args = _inputs(3, 2, 8, 200, 72, seed=11)
    _check(_run(args, SMALL_PIPELINED), args)


@pytest.mark.parametrize("kernel, ids_dtype", [("small", torch.int64), ("grouped", torch.int32)])
def test_padding_ids_contribute_nothing(kernel, ids_dtype):
    """-1 and >= E (HF's expert-parallel sentinel E, and far past it) are padding: a token of only
    padding gets exact zeros; the rest as the reference, and as dropping the padding pairs'
    weights to zero with a valid id."""
    experts = 8
    args = list(_inputs(9 if kernel == "grouped" else 5, 3, experts, 200, 72, seed=9, ids_dtype=ids_dtype))
    ids = args[1]
    ids[0, 1] = -1
    ids[1, 2] = experts
    ids[2, 0] = experts + 1000
    ids[3] = torch.tensor([-1, experts, -1], dtype=ids_dtype)  # only padding
    padding = (ids < 0) | (ids >= experts)
    out = _run(args, LAUNCHES[kernel][1 if kernel == "small" else 2], kernel)
    assert bool((out[3] == 0).all())
    _check(out, args)
    zeroed = [args[0], torch.where(padding, 0, ids), torch.where(padding, 0.0, args[2]), *args[3:]]
    assert relative_error(out, op.moe_experts_fp8_reference(*zeroed)) <= SAME_ROUNDING_TOLERANCE


@pytest.mark.parametrize("kernel", LAUNCHES)
def test_zero_token_is_zero_groups_not_nan(kernel):
    """An all-zero token: every x and act group of its pairs is a zero group (scale 1e-4 / 448,
    codes 0): its output is exact zeros, the other tokens as the reference."""
    args = _inputs(3, 2, 8, 200, 72, seed=4)
    args[0][1] = 0
    out = _run(args, LAUNCHES[kernel][1], kernel)
    assert bool((out[1] == 0).all())
    _check(out, args)


@pytest.mark.parametrize("kernel", LAUNCHES)
def test_non_contiguous_routing_default_launch_deterministic(kernel):
    """ids / weights as strided views, int32 ids, the default launch shape, two calls giving
    equal bits."""
    tokens = 17 if kernel == "grouped" else 1
    x, ids, w, *weights = _inputs(tokens, 2, 8, 128, 128, seed=7, ids_dtype=torch.int32)
    ids_t, w_t = torch.stack((ids, ids), dim=-1)[..., 0], torch.stack((w, w), dim=-1)[..., 1]  # stride 2 along k
    assert not ids_t.is_contiguous() and not w_t.is_contiguous()
    out = _run((x, ids_t, w_t, *weights), kernel=kernel)
    assert torch.equal(out, _run((x, ids, w, *weights), kernel=kernel))
    _check(out, (x, ids, w, *weights))


def test_grouped_scan_and_plan_modes_give_the_same_bits():
    """Scan mode (two launches), plan mode with the align kernel's plan, and plan mode past
    ``align_max_pairs`` (the plan from torch ops): the same bits, token 2 only padding (zeros)."""
    args = _inputs(9, 2, 8, 128, 128, seed=13, pool=5)
    args[1][0, 0], args[1][2] = -1, 8
    out = _run(args, G_SMALL, "grouped")
    plan = dataclasses.replace(G_SMALL, scan_max_pairs=0)
    assert torch.equal(out, _run(args, plan, "grouped"))
    assert torch.equal(out, _run(args, dataclasses.replace(plan, align_max_pairs=16), "grouped"))
    assert bool((out[2] == 0).all())
    _check(out, args)


def test_launcher_rejects_what_it_does_not_take():
    args = _inputs(1, 2, 4, 128, 128, seed=1)
    for bad in (K.LaunchConfig(gate_up_block_n=64), K.LaunchConfig(gate_up_block_k=96),
                K.LaunchConfig(down_block_k=192)):  # fmt: skip
        with pytest.raises(ValueError, match="block"):
            K.small_batch_experts_fp8(*args, config=bad)
    with pytest.raises(ValueError, match="down_scale"):
        K.small_batch_experts_fp8(*args[:6], args[6][:, :, :0])
    for bad in (K.GroupedConfig(block_m=8), K.GroupedConfig(down_block_n=24)):
        with pytest.raises(ValueError, match="block"):
            K.grouped_experts_fp8(*args, config=bad)
    for launcher, _, _ in LAUNCHES.values():
        with pytest.raises(ValueError, match="not like hidden"):
            launcher(*args, out=torch.empty(1, 128, dtype=torch.float32, device=DEVICE))


DEEPSEEK = (256, 8, 7168, 2048)  # experts, top_k, hidden, intermediate (DeepSeek V3 / V3.2)


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_default_config_is_a_valid_launch_at_deepseeks_shape(tokens):
    """Whole act groups per kernel-1 program, steps that tile the 128-groups, powers of two, and
    unmasked tiles at DeepSeek's shape."""
    experts, top_k, hidden, inter = DEEPSEEK
    c = K.default_config(tokens, top_k, hidden, inter)
    assert c.gate_up_block_n % 128 == 0 and inter % c.gate_up_block_n == 0
    for block_k, dim in ((c.gate_up_block_k, hidden), (c.down_block_k, inter)):
        assert block_k & (block_k - 1) == 0 and (block_k % 128 == 0 or 128 % block_k == 0) and dim % block_k == 0
    assert c.down_block_n & (c.down_block_n - 1) == 0 and hidden % c.down_block_n == 0
    g = K.default_grouped_config(tokens, top_k, experts, hidden, inter)
    assert 16 <= g.block_m <= 64 and hidden % g.down_block_n == 0 and hidden % g.combine_block == 0


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------


@functools.cache
def _deepseek_weights():
    """256 experts' FP8 weights at the real shape, quantised 16 experts at a time (fp32 temporaries)."""
    experts, _, hidden, inter = DEEPSEEK
    gen = torch.Generator(device="cuda").manual_seed(0)
    parts = []
    for _ in range(experts // 16):
        gate_up = op.quantize_weight(torch.randn(16, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5)
        down = op.quantize_weight(torch.randn(16, hidden, inter, generator=gen, device="cuda") * inter**-0.5)
        parts.append((*gate_up, *down))
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, tokens", [("small", 1), ("small", 8), ("grouped", 8), ("grouped", 64)])
def test_deepseek_shape_matches_reference_on_cuda(kernel, tokens):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    experts, top_k, hidden, _ = DEEPSEEK
    weights = _deepseek_weights()
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=-1)[:, :top_k]
    w = torch.rand(tokens, top_k, generator=gen, device="cuda").softmax(dim=-1)
    args = (x, ids, w, *weights)
    out = LAUNCHES[kernel][0](*args)
    assert relative_error(out, op.moe_experts_fp8_reference(*args)) <= SAME_ROUNDING_TOLERANCE
    assert relative_error(out, op.moe_experts_fp8_reference(*args, accumulate=torch.float64)) <= TOLERANCE
    assert torch.equal(out, LAUNCHES[kernel][0](*args))  # deterministic
    if (kernel == "small") == (tokens <= op.SMALL_BATCH_MAX_TOKENS):
        assert torch.equal(out, op.moe_experts_fp8(*args))  # the op dispatches to this path on CUDA
