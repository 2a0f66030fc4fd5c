"""GPU tier: the Gated DeltaNet decode step at Qwen3.5's widths (16 key / 64 value heads of 128,
conv over 12288 channels, 4 taps), both lowerings: ``gdn_decode`` (our kernel,
kernels/gdn_decode.py) and ``gdn_decode_fla`` (fla-core's kernels, kernels/gdn_fla.py; the
device gets fla-core as a carried wheel, `bench/gpu_run.sh tier`: without it this test fails, it
does not skip), against float64.

Each case runs two consecutive steps on fresh projections: the second reads the states the first
wrote (and, for our kernel, the arrival counters its first launch left). The float64 reference
(gpu_reference.gdn_step64) carries its own states. Checked per step: live output rows element-wise
to bf16 tolerance, padding rows (slot -1) exactly zero, the conv state's written rows bit-equal to
the shifted window (a copy), the recurrent state's written rows to fp32-level tolerance, and
every other slot of both states bit-equal to before. Our kernel's output starts NaN with guard
rows. HF's conv state (width 4) for both lowerings; vLLM's (width 3, channels contiguous) for
ours, which fla's conv update cannot take. And ours as ops/gdn_decode_vllm.py launches it inside
vLLM ("vllm_math"): vLLM's SSM layout [slot, Hv, Dv, Dk], slot 0 as padding (``min_slot=1``), a
last row past ``rows`` (vLLM's CUDA-graph padding), vLLM's arithmetic, against the float64 step
with vLLM's roundings (each conv product to bf16, no HF rounding of the conv sum or beta).
"""

from __future__ import annotations

import pytest
import torch

from gpu.gpu_reference import assert_bytes_equal, assert_rows_close, cases, gdn_step64, generator, randn
from kernel_fixtures import DEVICE, HAS_CUDA, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

pytestmark = pytest.mark.gpu
skip_unless_kernels_can_run()

from fusion_compiler.kernels import gdn_decode as K  # noqa: E402
from fusion_compiler.ops import gdn_decode as _ops  # noqa: E402,F401  (registers gdn_decode_fla)

QWEN = dict(key_heads=16, value_heads=64, key_dim=128, value_dim=128, kernel=4)
TINY = dict(key_heads=2, value_heads=4, key_dim=16, value_dim=16, kernel=4)
# (dims, tokens, conv state layout): "hf" [slots, conv_dim, 4]; "vllm" [slots, 3, conv_dim]
# transposed to [slots, conv_dim, 3]
TRITON_CASES = cases(
    {"qwen3.5-1-hf": (QWEN, 1, "hf"), "qwen3.5-8-vllm": (QWEN, 8, "vllm"), "qwen3.5-8-hf": (QWEN, 8, "hf")},
    {"tiny-3-vllm": (TINY, 3, "vllm")},
)
VLLM_MATH_CASES = cases({"qwen3.5-1-vllm_math": (QWEN, 2, "vllm_math"), "qwen3.5-65-vllm_math": (QWEN, 65, "vllm_math")},
                        {"tiny-5-vllm_math": (TINY, 5, "vllm_math")})  # fmt: skip
FLA_CASES = [pytest.param((QWEN, t, "hf"), id=f"qwen3.5-{t}-hf") for t in (1, 8)]
STEPS = 2


def _make(dims, tokens, layout, gen):
    hk, hv, dk, dv, kernel = (dims[n] for n in ("key_heads", "value_heads", "key_dim", "value_dim", "kernel"))
    conv_dim, num_slots = 2 * hk * dk + hv * dv, tokens + 3
    if layout == "hf":
        conv_state = randn(gen, num_slots, conv_dim, kernel)
    else:
        conv_state = randn(gen, num_slots, kernel - 1, conv_dim).transpose(1, 2)
    if layout == "vllm_math":  # vLLM's [slot, Hv, Dv, Dk], passed as its transpose; slot 0 is padding
        recurrent_state = randn(gen, num_slots, hv, dv, dk, scale=0.2, dtype=torch.float32).transpose(-1, -2)
        slots = torch.randperm(num_slots - 1, generator=gen)[:tokens] + 1
    else:
        recurrent_state = randn(gen, num_slots, hv, dk, dv, scale=0.2, dtype=torch.float32)
        slots = torch.randperm(num_slots, generator=gen)[:tokens]
    if tokens > 1:
        slots[1] = 0 if layout == "vllm_math" else -1  # a padding row
    weights = [randn(gen, conv_dim, 1, kernel, scale=0.5), (torch.rand(hv, generator=gen) * 2).to(DEVICE),
               randn(gen, hv), randn(gen, dv, scale=0.2) + 1]  # fmt: skip
    return weights, conv_state, recurrent_state, slots.to(DEVICE)


def _projections(dims, tokens, gen):
    """mixed_qkv (a column slice of a wider GEMM output), z, and b / a (slices of one [b | a])."""
    hk, hv, dk, dv = (dims[n] for n in ("key_heads", "value_heads", "key_dim", "value_dim"))
    conv_dim = 2 * hk * dk + hv * dv
    ba = randn(gen, tokens, 2 * hv + 3)
    return [randn(gen, tokens, conv_dim + 8)[:, :conv_dim], randn(gen, tokens, hv * dv), ba[:, :hv], ba[:, hv : 2 * hv]]


def _tipped_state(ties, dims):
    """[n, Hv, Dk, Dv]: the state elements a near-tie of k (its row, in every value head of the key
    head) or of v (its column) reaches."""
    hk, hv, dk, dv = (dims[n] for n in ("key_heads", "value_heads", "key_dim", "value_dim"))
    n = ties.shape[0]
    _, k_ties, v_ties = ties.split([hk * dk, hk * dk, hv * dv], dim=-1)
    k_rows = k_ties.reshape(n, hk, dk).repeat_interleave(hv // hk, dim=1)[..., :, None]
    v_cols = v_ties.reshape(n, hv, dv)[..., None, :]
    return (k_rows | v_cols).to(DEVICE)


def _run_steps(case, lowering):
    dims, tokens, layout = case
    gen = generator(31 * tokens + len(layout))
    weights, conv_state, recurrent_state, slots = _make(dims, tokens, layout, gen)
    vllm_math = layout == "vllm_math"
    # vLLM's contract: slots below 1 are padding, and the last row is past ``rows`` (dead)
    rows = tokens - 1 if vllm_math else tokens
    live = (slots >= (1 if vllm_math else 0)) & (torch.arange(tokens, device=DEVICE) < rows)
    written = slots[live].long()
    untouched = torch.ones(conv_state.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    ref_conv, ref_state = conv_state[written].clone(), recurrent_state[written].double()
    tipped = torch.zeros((), dtype=torch.bool, device=DEVICE)  # grows: a state carries its ties on
    for step in range(STEPS):
        proj = _projections(dims, tokens, gen)
        args = proj + weights + [1e-6, 1e-6, conv_state, recurrent_state, slots]
        before = conv_state.clone(), recurrent_state.clone()
        if lowering == "triton":
            buf, out = poisoned((tokens, dims["value_heads"] * dims["value_dim"]), torch.bfloat16)
            K.gdn_decode_fwd(*args, out, rows=rows, min_slot=1 if vllm_math else 0, vllm_math=vllm_math)
            assert_guards_untouched(buf)
        else:
            out = torch.ops.fusion_compiler.gdn_decode_fla(*args)
        ties = []
        want, ref_conv, ref_state = gdn_step64(
            *[p[live] for p in proj], *weights, 1e-6, 1e-6, ref_conv, ref_state, dims["key_heads"],
            hf_roundings=lowering == "triton" and not vllm_math, vllm_roundings=vllm_math, ties=ties,
        )  # fmt: skip
        what = f"{lowering} step {step}"
        # out: a few bf16 roundings (o, the normalized o, the weight product, the gated result)
        assert_rows_close(out[live], want, 2**-5, f"{what}: out")
        assert torch.equal(out[~live], torch.zeros_like(out[~live])), f"{what}: padding rows are zero"
        assert_bytes_equal(conv_state[written], ref_conv, f"{what}: conv state rows (a shift: exact)")
        got_state = recurrent_state[written].double()
        # fp32 sums against float64; the state rows of a k element and the columns of a v element
        # whose bf16 rounding fp32 may tip the other way (a near-tie) take one bf16 step more, in
        # this step and every later one (each step reads the state the last one wrote)
        tipped = tipped | _tipped_state(ties[0], dims)
        assert_rows_close(got_state.where(~tipped, ref_state), ref_state, 2**-8, f"{what}: recurrent state rows")
        assert_rows_close(got_state, ref_state, 2**-5, f"{what}: recurrent state rows (near-ties)")
        assert_bytes_equal(conv_state[untouched], before[0][untouched], f"{what}: conv state outside the slots")
        assert_bytes_equal(recurrent_state[untouched], before[1][untouched], f"{what}: recurrent state outside the slots")


@pytest.mark.parametrize("case", TRITON_CASES)
def test_gdn_decode_kernel_matches_float64(case):
    _run_steps(case, "triton")


@pytest.mark.parametrize("case", VLLM_MATH_CASES)
def test_gdn_decode_vllm_math_matches_float64(case):
    _run_steps(case, "triton")


@pytest.mark.skipif(not HAS_CUDA, reason="fla-core's kernels run on CUDA only")
@pytest.mark.parametrize("case", FLA_CASES)
def test_gdn_decode_fla_matches_float64(case):
    import fla  # noqa: F401  (fails, not skips, when the device lacks fla-core: the tier needs it)

    _run_steps(case, "fla")
