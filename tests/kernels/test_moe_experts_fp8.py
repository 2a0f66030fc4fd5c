"""``fusion_compiler::moe_experts_fp8``'s small-batch kernels (kernels/moe_experts_fp8.py).

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py), tiny shapes with H and I multiples of 128
and not (a masked last group, and I % 128 != 0 puts a gate/up scale block across the gate / up
boundary), fresh random weights quantised by ``quantize_weight``, each launch writing into a
NaN-poisoned output with guard rows (tests/kernel_fixtures.py). Against
``moe_experts_fp8_reference`` (same quantisation and rounding points, fp32 GEMMs: 3e-3 allows a
rare act code flipped by a different fp32 summation order; observed 0) and against the float64
dequantised product (``accumulate=torch.float64``: 1e-2). T = 1, 3, 8; top_k 1, 2, 8; launch
shapes with one and with several row blocks and loop steps, loop steps narrower than a 128-group
(64) and wider (256); experts repeated across tokens and never hit; padding ids -1 and >= E (a
token of only padding gets exact zeros); an all-zero token (zero groups, no NaN); int32 ids, bf16
routing weights, strided ids / weights; two calls equal bits; launch shapes the kernels refuse.

GPU tier (``-m gpu``): DeepSeek V3's real expert shape (256 experts, top 8, H 7168, I 2048) at
1 and 8 tokens against the reference in fp32 on the GPU, and the op through ``torch.ops``.
"""

from __future__ import annotations

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
SMALL = K.LaunchConfig(gate_up_block_n=128, gate_up_block_k=64, down_block_n=32, down_block_k=64)
SMALL_PIPELINED = K.LaunchConfig(128, 64, 2, 32, 64, 2, gate_up_stages=2, down_stages=3)


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


def _run(args, config=None):
    """The kernels into a NaN-poisoned output with guard rows: every element written, nothing
    outside."""
    x = args[0]
    buf, out = poisoned(tuple(x.shape), x.dtype)
    result = K.small_batch_experts_fp8(*args, config=config, out=out)
    assert result.data_ptr() == out.data_ptr() and result.shape == x.shape and result.dtype == x.dtype
    assert not bool(result.isnan().any()), "an output element was not written"
    assert_guards_untouched(buf)
    return result


def _check(out, args):
    """Against the reference (same rounding points) and the float64 dequantised product."""
    assert relative_error(out, op.moe_experts_fp8_reference(*args)) <= SAME_ROUNDING_TOLERANCE
    assert relative_error(out, op.moe_experts_fp8_reference(*args, accumulate=torch.float64)) <= TOLERANCE


# (tokens, top_k, experts, hidden, intermediate, launch, pool, routing-weights dtype, id)
CASES = [
    (1, 1, 4, 256, 128, BIG, None, torch.float32, "T1-k1-multiples"),
    (1, 8, 8, 200, 72, SMALL, None, torch.float32, "T1-k8-masked-groups-small-blocks"),
    (3, 2, 8, 256, 256, SMALL, None, torch.bfloat16, "T3-k2-multiples-small-blocks-bf16w"),
    (3, 2, 8, 200, 200, BIG, None, torch.float32, "T3-k2-masked-groups-big-steps"),
    (8, 2, 16, 256, 200, BIG, 3, torch.float32, "T8-k2-repeated-most-never-hit"),
    (8, 8, 8, 128, 128, BIG, None, torch.bfloat16, "T8-k8-all-experts-bf16w"),
]


@pytest.mark.parametrize("tokens, top_k, experts, hidden, inter, config, pool, weights_dtype",
                         [pytest.param(*c[:-1], id=c[-1]) for c in CASES])  # fmt: skip
def test_kernels_match_reference_and_float64(tokens, top_k, experts, hidden, inter, config, pool, weights_dtype):
    args = _inputs(tokens, top_k, experts, hidden, inter, seed=tokens * 100 + top_k + hidden, pool=pool,
                   weights_dtype=weights_dtype)  # fmt: skip
    if pool is not None:  # experts really are repeated across tokens
        assert args[1].unique().numel() < args[1].numel()
    _check(_run(args, config), args)


def test_pipelined_loops_match_reference():
    args = _inputs(3, 2, 8, 200, 72, seed=11)
    _check(_run(args, SMALL_PIPELINED), args)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_padding_ids_contribute_nothing(ids_dtype):
    """-1 and >= E (HF's expert-parallel sentinel E, and far past it) are padding: a token of only
    padding gets exact zeros; the rest as the reference, and as dropping the padding pairs'
    weights to zero with a valid id."""
    experts = 8
    args = list(_inputs(5, 3, experts, 200, 72, seed=9, ids_dtype=ids_dtype))
    ids = args[1]
    ids[0, 1] = -1
    ids[1, 2] = experts
    ids[2, 0] = experts + 1000
    ids[3] = torch.tensor([-1, experts, -1], dtype=ids_dtype)  # only padding
    padding = (ids < 0) | (ids >= experts)
    out = _run(args, SMALL)
    assert bool((out[3] == 0).all())
    _check(out, args)
    zeroed = [args[0], torch.where(padding, 0, ids), torch.where(padding, 0.0, args[2]), *args[3:]]
    assert relative_error(out, op.moe_experts_fp8_reference(*zeroed)) <= SAME_ROUNDING_TOLERANCE


def test_zero_token_is_zero_groups_not_nan():
    """An all-zero token: every x and act group of its pairs is a zero group (scale 1e-4 / 448,
    codes 0): its output is exact zeros, the other tokens as the reference."""
    args = _inputs(3, 2, 8, 200, 72, seed=4)
    args[0][1] = 0
    out = _run(args, BIG)
    assert bool((out[1] == 0).all())
    _check(out, args)


def test_non_contiguous_routing_default_launch_deterministic():
    """ids / weights as strided views, int32 ids, ``default_config``, two calls giving equal bits."""
    x, ids, w, *weights = _inputs(1, 2, 8, 128, 128, seed=7, ids_dtype=torch.int32)
    ids_t, w_t = torch.stack((ids, ids), dim=-1)[..., 0], torch.stack((w, w), dim=-1)[..., 1]  # stride 2 along k
    assert not ids_t.is_contiguous() and not w_t.is_contiguous()
    out = _run((x, ids_t, w_t, *weights))
    assert torch.equal(out, _run((x, ids, w, *weights)))
    _check(out, (x, ids, w, *weights))


def test_launcher_rejects_what_it_does_not_take():
    args = _inputs(1, 2, 4, 128, 128, seed=1)
    for bad in (K.LaunchConfig(gate_up_block_n=64), K.LaunchConfig(gate_up_block_k=96),
                K.LaunchConfig(down_block_k=192)):  # fmt: skip
        with pytest.raises(ValueError, match="block"):
            K.small_batch_experts_fp8(*args, config=bad)
    with pytest.raises(ValueError, match="down_scale"):
        K.small_batch_experts_fp8(*args[:6], args[6][:, :, :0])
    with pytest.raises(ValueError, match="not like hidden"):
        K.small_batch_experts_fp8(*args, out=torch.empty(1, 128, dtype=torch.float32, device=DEVICE))


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
@pytest.mark.parametrize("tokens", [1, 8])
def test_deepseek_shape_matches_reference_on_cuda(tokens):
    if not HAS_CUDA:
        pytest.skip("needs CUDA")
    experts, top_k, hidden, _ = DEEPSEEK
    weights = _deepseek_weights()
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    ids = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(dim=-1)[:, :top_k]
    w = torch.rand(tokens, top_k, generator=gen, device="cuda").softmax(dim=-1)
    args = (x, ids, w, *weights)
    out = K.small_batch_experts_fp8(*args)
    assert relative_error(out, op.moe_experts_fp8_reference(*args)) <= SAME_ROUNDING_TOLERANCE
    assert relative_error(out, op.moe_experts_fp8_reference(*args, accumulate=torch.float64)) <= TOLERANCE
    assert torch.equal(out, K.small_batch_experts_fp8(*args))  # deterministic
    assert torch.equal(out, op.moe_experts_fp8(*args))  # the op dispatches to these kernels on CUDA
