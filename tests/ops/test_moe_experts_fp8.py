"""``fusion_compiler::moe_experts_fp8`` (ops/moe_experts_fp8.py): the reference against the FP8
contract written out per pair and per 128-group in float64, the weight and activation quantisers
(round trip, zero blocks and groups, a masked last group), padding ids, the fake, and the
argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.ops import moe_experts as B
from fusion_compiler.ops import moe_experts_fp8 as M

FP8 = torch.float8_e4m3fn


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _inputs(tokens=4, top_k=3, experts=6, hidden=200, inter=72, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return (x, ids, w, *M.quantize_weight(gate_up), *M.quantize_weight(down))


def _act_quant_loop(v):
    """DeepSeek's act_quant, one 128-group at a time: fp32 values -> (e4m3 values, scales) in float64."""
    codes, scales = torch.zeros_like(v, dtype=torch.float64), []
    for start in range(0, v.numel(), 128):
        group = v[start:start + 128].float()
        amax = max(float(group.abs().max()), 1e-4)
        scale = torch.tensor(amax / 448.0, dtype=torch.float64).float()  # fp32, correctly rounded
        codes[start:start + 128] = (group / scale).clamp(-448, 448).to(FP8).double()
        scales.append(float(scale))
    return codes, scales


def _fp8_gemv(v, wq, sw):
    """y[n] = sum_kb (sum_{k in kb} xq[k] wq[n, k]) * sx[kb] * sw[n // 128, kb], in float64."""
    xq, sx = _act_quant_loop(v)
    rows = torch.arange(wq.shape[0]) // 128
    y = torch.zeros(wq.shape[0], dtype=torch.float64)
    for kb, start in enumerate(range(0, v.numel(), 128)):
        inner = wq[:, start:start + 128].double() @ xq[start:start + 128]
        y += inner * sx[kb] * sw[rows, kb].double()
    return y


def _contract_loop(x, ids, w, gate_up, gate_up_scale, down, down_scale):
    dtype, inter = x.dtype, down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < gate_up.shape[0]:
                continue
            gate, up = _fp8_gemv(x[t].float(), gate_up[e], gate_up_scale[e]).to(dtype).float().split(inter)
            act = (F.silu(gate).to(dtype).float() * up).to(dtype)
            y = _fp8_gemv(act.float(), down[e], down_scale[e]).to(dtype)
            out[t] += float(w[t, k]) * y.double()
    return out.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden, inter", [(256, 128), (200, 72)], ids=["multiples-of-128", "masked-last-group"])
def test_reference_equals_the_contract_per_pair_with_padding(hidden, inter, dtype):
    args = _inputs(hidden=hidden, inter=inter, dtype=dtype)
    x, ids, experts = args[0], args[1], args[3].shape[0]
    ids[0, 1], ids[2, 0] = -1, experts  # padding: -1 and HF's sentinel >= E
    ids[3] = torch.tensor([-1, experts + 5, -1])  # a token of only padding gets zeros
    loop = _contract_loop(*args)
    assert _rel(M.moe_experts_fp8_reference(*args, accumulate=torch.float64), loop) <= 1e-6
    out = M.moe_experts_fp8(*args)  # the op (CPU: the reference, fp32 GEMMs)
    assert out.dtype == dtype and _rel(out, loop) <= 2e-3
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_fp8_experts_are_close_to_the_unquantised_experts():
    """The FP8 format and contract, not just self-consistency: within FP8's error of the bf16 op's
    reference on the dequantised weights and unquantised activations (float64): x and act each
    rounded to e4m3 (~2.5% RMS each), 4.4% at this seed."""
    x, ids, w, gu, gus, dn, dns = _inputs(hidden=256, inter=128, dtype=torch.float32)
    exact = B.moe_experts_reference(x.double(), ids, w.double(), M.dequantize_weight(gu, gus, torch.float64),
                                    M.dequantize_weight(dn, dns, torch.float64))  # fmt: skip
    assert _rel(M.moe_experts_fp8(x, ids, w, gu, gus, dn, dns), exact) <= 0.08


def test_weight_quantiser_round_trip_blocks_and_zero_block():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2, 300, 200, generator=gen)  # partial last blocks both ways
    weight[1, 128:256, :128] = 0  # an all-zero block
    codes, scale = M.quantize_weight(weight.bfloat16())
    assert codes.dtype == FP8 and codes.shape == weight.shape and codes.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 2)
    assert scale[1, 1, 0] == 1.0 and bool((codes[1, 128:256, :128].float() == 0).all())
    w = weight.bfloat16().float()
    amax = w[0, 256:, 128:].abs().max()  # the partial corner block
    assert scale[0, 2, 1] == torch.tensor(float(amax) / 448.0, dtype=torch.float64).float()
    back = M.dequantize_weight(codes, scale)
    # e4m3: 3 mantissa bits, half an ulp of relative error for normals; subnormals 2**-10 of the scale.
    bound = w.abs() * 2**-4 + scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :300, :200] * 2**-10
    assert bool(((back - w).abs() <= bound).all())
    assert float(codes.float().abs().max()) == 448.0  # each block's amax lands on 448


def test_activation_quantiser_zero_group_and_masked_last_group():
    x = torch.randn(3, 200)
    x[1, :128] = 0  # an all-zero group: scale 1e-4 / 448, codes 0, no NaN
    x[2, 128:] = 0  # an all-zero masked last group
    codes, scale = M.quantize_activation(x.bfloat16())
    assert codes.shape == (3, 200) and scale.shape == (3, 2)
    assert scale[1, 0] == torch.tensor(1e-4 / 448, dtype=torch.float64).float() and scale[2, 1] == scale[1, 0]
    assert bool((codes[1, :128].float() == 0).all()) and not bool(codes.float().isnan().any())
    for r in range(3):
        loop_codes, loop_scales = _act_quant_loop(x[r].bfloat16().float())
        assert torch.equal(codes[r].double(), loop_codes) and scale[r].tolist() == loop_scales


def test_zero_token_gives_zeros():
    """An all-zero token: every group of x and of act is a zero group; its output is exact zeros."""
    x, *rest = _inputs()
    x[1] = 0
    out = M.moe_experts_fp8(x, *rest)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and not bool(out.isnan().any())


def test_fake_gives_hidden_shaped_output():
    args = _inputs()
    with torch._subclasses.FakeTensorMode() as mode:
        out = torch.ops.fusion_compiler.moe_experts_fp8(*(mode.from_tensor(t) for t in args))
    assert out.shape == args[0].shape and out.dtype == args[0].dtype


@pytest.mark.parametrize("change, message", [
    (lambda a: (a[0].double(), *a[1:]), "hidden dtype"),
    (lambda a: (a[0], a[1].float(), *a[2:]), "top_k_ids dtype"),
    (lambda a: (a[0], a[1], a[2][:, :1], *a[3:]), "top_k_weights dim 1"),
    (lambda a: (*a[:3], a[3].bfloat16(), *a[4:]), "gate_up_proj dtype"),
    (lambda a: (*a[:3], a[3][:, :-1], a[4][:, :1], *a[5:]), "gate and up halves"),
    (lambda a: (*a[:4], a[4][:, :, :1], *a[5:]), "gate_up_scale dim 2"),
    (lambda a: (*a[:4], a[4].double(), *a[5:]), "gate_up_scale dtype"),
    (lambda a: (*a[:5], a[5][:, :, :-1], a[6]), "down_proj dim 2"),
    (lambda a: (*a[:6], a[6][:1]), "down_scale dim 0"),
    (lambda a: (*a[:5], a[5].transpose(1, 2).contiguous().transpose(1, 2), a[6]), "down_proj must have unit"),
    (lambda a: (a[0][None], *a[1:]), "hidden must be"),
], ids=["fp64-hidden", "float-ids", "weights-shape", "bf16-weights", "odd-gate-up", "gate-up-scale-shape",
        "fp64-scale", "down-shape", "down-scale-experts", "column-major", "3d-hidden"])  # fmt: skip
def test_checks_name_what_the_op_does_not_take(change, message):
    with pytest.raises(ValueError, match=message):
        M.moe_experts_fp8(*change(_inputs()))
