"""The Triton mla_q_prologue kernel against the op's plain-torch reference.

CPU tier: the launcher runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it
before this module imports the kernel); the op's CPU dispatch runs the reference, so the tests
call ``mla_q_prologue_fwd`` directly with outputs allocated from ``output_shapes``.  With CUDA
present the same tests run on the GPU; the ``gpu``-marked tests add NaN propagation (the
interpreter's reductions drop NaN) and the real DeepSeek V3.2 sizes.

This op has no reductions before its roundings (RoPE is elementwise; the FP8 amax is exact),
so every output is expected bit-identical to the reference; fp32 weights_out is compared to a
few ulps (the GPU may contract ``w * scale * q_scale`` differently).
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, FP8, HAS_CUDA, INT_VIEW, assert_fp8_close, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis_profile import examples  # noqa: E402

skip_unless_kernels_can_run()

from fusion_compiler.kernels import mla_q_prologue as K  # noqa: E402
from fusion_compiler.ops import mla_q_prologue as op  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402
from launch_counter import count_launches  # noqa: E402



def assert_bits_equal(out, ref, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    view = torch.uint8 if out.dtype == FP8 else INT_VIEW[out.dtype]
    a, b = out.contiguous().view(view), ref.contiguous().view(view)
    bad = a != b
    if out.dtype != FP8:
        bad &= ~(torch.isnan(out) & torch.isnan(ref))
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {out.numel()} elements differ"




def lanes_per_program(n):
    """Fewer lanes per program: the tiny test heads are split over several programs."""
    return K.MlaQPrologueConfig(q_lanes=n, index_q_lanes=n)


def build_args(cfg, gen):
    T, dt, H, rot = cfg["tokens"], cfg["dtype"], cfg["heads"], cfg["rot"]

    def randn(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    args = dict(zip(op._ARG_NAMES, op.mla_q_prologue_reference.__defaults__))
    if cfg["q"]:
        # q_other / q_pe: slices of one q_b output [T, H, D_other + rot] with padding.
        d_other = cfg["d_other"]
        qb = randn(T, H, d_other + rot + 3)
        args.update(q_pe=qb[:, :, d_other:d_other + rot], deinterleave_rope=cfg["deinterleave"])
        if d_other:
            args["q_other"] = qb[:, :, :d_other]
    if cfg["index_q"]:
        hi, d = cfg["index_heads"], cfg["index_dim"]
        if cfg["head_major"]:  # token stride < head stride
            index_q = randn(hi, T, d + 2, scale=3.0).transpose(0, 1)[:, :, :d]
        else:
            index_q = randn(T, hi, d + 2, scale=3.0)[:, :, :d]
        args.update(index_q=index_q, index_q_fp8=cfg["fp8"], ue8m0=cfg["ue8m0"])
        if cfg["weights"] or cfg["fp8"]:
            w = randn(hi, T, dtype=cfg["weights_dtype"]).t()  # strided [T, Hi]
            args.update(index_weights=w, index_weights_scale=cfg["weights_scale"])
    rows = 11 if cfg["positions"] else T
    cs_dt = cfg["cos_dtype"] or dt
    args["cos"] = randn(rows, rot // 2 + 1, dtype=cs_dt)[:, : rot // 2]
    args["sin"] = randn(rows, rot // 2 + 1, dtype=cs_dt)[:, : rot // 2]
    if cfg["positions"]:
        args["positions"] = torch.randint(0, rows, (T,), generator=gen).to(cfg["positions"])
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def run_and_compare(args, config=None):
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    ref = op.mla_q_prologue_reference(**args)
    bufs, outs = zip(*(poisoned(shape, dtype) for shape, dtype in op.output_shapes(args)))
    K.mla_q_prologue_fwd(args, *outs, config=config)
    for name, buf, out, r in zip(("q_out", "index_q_out", "index_weights_out"), bufs, outs, ref):
        assert_guards_untouched(buf)
        if out.numel() == 0:
            assert r.numel() == 0, name
        elif name == "index_weights_out":
            assert out.dtype == r.dtype == torch.float32
            torch.testing.assert_close(out, r, rtol=2**-21, atol=0, equal_nan=True)
        elif out.dtype == FP8 and out.is_cuda:
            # On the GPU, Triton's fp32 -> e4m3 conversion can round twice (via fp16) where
            # torch rounds once: a code one step apart, only at ties (bench/NOTES.md).
            assert_fp8_close(out, r, name)
        else:
            assert_bits_equal(out, r, name)
    for k, v in before.items():
        assert torch.equal(args[k], v), f"input {k} changed"
    return outs


BASE = dict(
    tokens=3, dtype=torch.bfloat16, cos_dtype=None, heads=4, rot=32, q=True, d_other=32,
    deinterleave=False, index_q=True, index_heads=4, index_dim=64, head_major=False, fp8=True,
    ue8m0=False, weights=True, weights_dtype=torch.bfloat16, weights_scale=0.125,
    positions=torch.int64,
)


@st.composite
def configs(draw):
    cfg = dict(BASE)
    cfg["tokens"] = draw(st.integers(1, 9))
    roles = draw(st.sampled_from(["q", "index_q", "both", "both"]))
    cfg["q"], cfg["index_q"] = roles in ("q", "both"), roles in ("index_q", "both")
    cfg["dtype"] = draw(st.sampled_from([torch.bfloat16] * 2 + [torch.float16, torch.float32]))
    cfg["cos_dtype"] = draw(st.sampled_from([None, torch.float32]))
    cfg["heads"] = draw(st.integers(1, 8))
    cfg["rot"] = draw(st.sampled_from([32, 24, 48]))
    cfg["d_other"] = draw(st.sampled_from([0, 32, 48, 96]))
    cfg["deinterleave"] = draw(st.booleans())
    cfg["index_heads"] = draw(st.integers(1, 8))
    cfg["index_dim"] = draw(st.sampled_from([64, 48, 32]))
    cfg["head_major"] = draw(st.booleans())
    cfg["fp8"] = draw(st.booleans())
    cfg["ue8m0"] = draw(st.booleans())
    cfg["weights"] = draw(st.booleans())
    cfg["weights_dtype"] = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    cfg["weights_scale"] = draw(st.sampled_from([1.0, 0.125, 0.3]))
    cfg["positions"] = draw(st.sampled_from([None, torch.int32, torch.int64]))
    cfg["lanes"] = draw(st.sampled_from([32, 64, 128, 2048]))
    return cfg


@settings(max_examples=examples(20), deadline=None)
@given(cfg=configs(), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    run_and_compare(build_args(cfg, gen), lanes_per_program(cfg["lanes"]))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_extreme_heads(ue8m0):
    """Heads whose amax is under the 1e-4 floor, and heads of huge values."""
    gen = torch.Generator().manual_seed(5)
    args = build_args(dict(BASE, tokens=3, index_heads=4, ue8m0=ue8m0), gen)
    iq = args["index_q"]
    iq[:, 0] *= 1e-7      # tiny: amax floored, small codes
    iq[:, 1] *= 1e-11     # far under the floor
    iq[:, 2] *= 1e30      # huge
    outs = run_and_compare(args, lanes_per_program(64))  # one head per program
    codes = outs[1].view(torch.uint8) & 0x7F
    assert bool((codes[:, 1] < 0x08).all())  # |x / scale| < 2**-6: subnormal codes or zero
    if not ue8m0:  # without ue8m0 each head's amax maps to the top code, 448 (0x7E)
        assert bool((codes[:, 2:].amax(dim=-1) == 0x7E).all())


def test_index_q_without_weights_and_q_alone():
    gen = torch.Generator().manual_seed(6)
    run_and_compare(build_args(dict(BASE, q=False, fp8=False, weights=False), gen))
    run_and_compare(build_args(dict(BASE, index_q=False, d_other=0, deinterleave=True), gen))


def test_zero_tokens_launches_nothing():
    args = build_args(dict(BASE, tokens=1, positions=None), torch.Generator().manual_seed(1))
    outs = [torch.empty(s, dtype=d, device=DEVICE) for s, d in op.output_shapes(args)]
    with count_launches() as launches:
        K.mla_q_prologue_fwd(args, *outs)
    assert launches.names == ["_mla_q_prologue_kernel"]  # the counter sees this launcher's kernel
    for name in ("q_pe", "q_other", "index_q", "index_weights", "cos", "sin"):
        args[name] = args[name][:0]
    outs = [torch.empty(s, dtype=d, device=DEVICE) for s, d in op.output_shapes(args)]
    with count_launches() as launches:
        K.mla_q_prologue_fwd(args, *outs)
    assert launches.names == []


@pytest.mark.parametrize("rot, d_other", [(32, 96), (48, 96), (48, 64), (48, 192)])
@pytest.mark.parametrize("deinterleave", [False, True])
def test_q_at_other_rope_and_nope_widths_matches_the_reference_and_float64(rot, d_other, deinterleave):
    """q_pe RoPE + concat at widths that are no power of two and no multiple of 128 (qk_rope_head_dim
    48, qk_nope_head_dim 96, or a serving engine's absorbed q of kv_lora_rank 64 / 192): masked
    tiles, several heads a program; bits equal to the reference, and within bf16 of float64."""
    gen = torch.Generator().manual_seed(rot + d_other)
    cfg = dict(BASE, tokens=3, heads=5, rot=rot, d_other=d_other, deinterleave=deinterleave, index_q=False)
    args = build_args(cfg, gen)
    q_out = run_and_compare(args, lanes_per_program(256))[0]
    q_pe, cos, sin = (args[n].cpu().double() for n in ("q_pe", "cos", "sin"))
    cos, sin = cos[args["positions"].cpu()][:, None], sin[args["positions"].cpu()][:, None]
    even, odd = q_pe[..., 0::2], q_pe[..., 1::2]
    first, second = even * cos - odd * sin, odd * cos + even * sin
    roped = torch.cat([first, second], -1) if deinterleave else torch.stack([first, second], -1).flatten(-2)
    want = torch.cat([args["q_other"].cpu().double(), roped], -1)
    assert relative_error(q_out.cpu().double(), want) < 1e-2


def test_launch_config_real_sizes():
    cfg = K.launch_config(128, 512, 64, 64, 128)
    assert cfg["OTHER_BLOCK"] == 512 and cfg["ROT_BLOCK"] == 64 and cfg["IQ_BLOCK"] == 128
    assert cfg["Q_HPP"] == 2 and cfg["n_q_programs"] == 64
    assert cfg["IQ_HPP"] == 8 and cfg["n_index_q_programs"] == 8
    cfg = K.launch_config(128, 512, 64, 64, 128, tokens=4096)  # many tokens: 16 + 16 heads per program
    assert cfg["Q_HPP"] == 16 and cfg["n_q_programs"] == 8
    assert cfg["IQ_HPP"] == 16 and cfg["n_index_q_programs"] == 4
    cfg = K.launch_config(0, 0, 64, 64, 128)
    assert cfg["n_q_programs"] == 0 and cfg["n_index_q_programs"] == 8
    cfg = K.launch_config(3, 32, 32, 5, 64)  # heads not a multiple of the heads per program
    assert cfg["Q_HPP"] == 4 and cfg["n_q_programs"] == 1
    assert isinstance(K.KERNEL_VERSION, str) and K.KERNEL_VERSION


# ---------------------------------------------------------------------------------------------
# GPU tier
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("ue8m0", [False, True])
def test_gpu_nan_poisons_only_its_head(ue8m0):
    gen = torch.Generator().manual_seed(12)
    args = build_args(dict(BASE, tokens=4, index_heads=8, ue8m0=ue8m0, positions=None), gen)
    args["index_q"][1, 3, 50] = float("nan")  # past rot: no RoPE mixing, one head of one token
    outs = [torch.empty(s, dtype=d, device=DEVICE) for s, d in op.output_shapes(args)]
    K.mla_q_prologue_fwd(args, *outs)
    q, w = outs[1].float(), outs[2]
    assert torch.isnan(q[1, 3]).all() and torch.isnan(w[1, 3])
    mask = torch.ones(4, 8, dtype=torch.bool, device=DEVICE)
    mask[1, 3] = False
    assert torch.isfinite(q[mask]).all() and torch.isfinite(w[mask]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_real_sizes(tokens, fp8):
    gen = torch.Generator().manual_seed(tokens)
    cfg = dict(BASE, tokens=tokens, heads=128, d_other=512, rot=64, index_heads=64,
               index_dim=128, fp8=fp8, deinterleave=True)
    run_and_compare(build_args(cfg, gen))
