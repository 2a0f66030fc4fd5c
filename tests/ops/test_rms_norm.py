"""fusion_compiler::rms_norm / add_rms_norm / gated_rms_norm: reference semantics, validation,
opcheck, compile."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from fusion_compiler.ops.rms_norm import (
    add_rms_norm,
    add_rms_norm_reference,
    gated_rms_norm,
    gated_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)

OPS = torch.ops.fusion_compiler
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def float64_math(x, weight, eps, weight_offset, residual=None):
    s = x + residual if residual is not None else x
    h = s.double()
    return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps) * (weight.double() + weight_offset)


def assert_same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# Error of an output against float64 math on the same rounded inputs: norm-wise, and element-wise
# two units in the last place of the output dtype (one for the final rounding, one for the fp32
# math) plus a little absolute slack near zero.
NORM_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ELEM_RTOL = {torch.float32: 2**-21, torch.float16: 2**-10, torch.bfloat16: 2**-7}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_close_to_float64(out, want, what):
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = out.double() - want
    rel = (err.norm() / want.norm()).item()
    assert rel <= NORM_TOL[out.dtype], f"{what}: norm-wise relative error {rel:.3g} ({out.dtype})"
    worst = (err.abs() - (ELEM_RTOL[out.dtype] * want.abs() + 1e-6)).max().item()
    assert worst <= 0, f"{what}: element-wise error exceeds {ELEM_RTOL[out.dtype]:.3g} relative by {worst:.3g}"


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_ops_match_float64_math(x_dtype, w_dtype, out_dtype, weight_offset):
    """The dispatched ops (``torch.ops.fusion_compiler.*``: on CPU their impl is the reference,
    on CUDA the Triton kernel) against ``float64_math`` above, written apart from both, on the
    same rounded random inputs; the sum is eager's add, bit for bit."""
    seed = DTYPES.index(x_dtype) * 8 + int(w_dtype == torch.float32) * 4 + int(out_dtype is None) * 2 + int(weight_offset)
    g = torch.Generator().manual_seed(100 + seed)
    x = (torch.randn(2, 5, 96, generator=g) * 3).to(x_dtype).to(DEVICE)
    r = torch.randn(2, 5, 96, generator=g).to(x_dtype).to(DEVICE)
    z = (torch.randn(2, 5, 96, generator=g) * 2).to(x_dtype).to(DEVICE)
    w = (torch.randn(96, generator=g) * 0.5 + 0.2).to(w_dtype).to(DEVICE)
    eps = 1e-6 if seed % 2 else 1e-2  # a visible eps: its place in the formula counts
    want_dtype = out_dtype or x_dtype

    out = OPS.rms_norm(x, w, eps, weight_offset, want_dtype)
    assert out.dtype == want_dtype and out.shape == x.shape
    assert_close_to_float64(out, float64_math(x, w, eps, weight_offset), "rms_norm")

    o, s = OPS.add_rms_norm(x, r, w, eps, weight_offset, want_dtype)
    assert o.dtype == want_dtype and s.dtype == x_dtype
    assert_same(s, x + r)  # the sum is eager's add, rounded to x.dtype
    assert_close_to_float64(o, float64_math(x, w, eps, weight_offset, r), "add_rms_norm")

    gated = OPS.gated_rms_norm(x, z, w, eps, weight_offset, want_dtype)
    assert gated.dtype == want_dtype
    want = float64_math(x, w, eps, weight_offset) * torch.nn.functional.silu(z.double())
    assert_close_to_float64(gated, want, "gated_rms_norm")


@pytest.mark.parametrize("x_dtype", DTYPES)
def test_reference_is_fp32_math_of_the_contract(x_dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 200, generator=g) * 3).to(x_dtype)
    r = torch.randn(7, 200, generator=g).to(x_dtype)
    w = torch.randn(200, generator=g).to(torch.bfloat16)
    out, _ = add_rms_norm_reference(x, r, w, 1e-5, 1.0, torch.float32)
    ref = float64_math(x, w, 1e-5, 1.0, r)
    assert (out.double() - ref).norm() / ref.norm() < 1e-6
    # Gemma x*(1+w) equals the plain norm with weight (1 + w) in fp32.
    plain = rms_norm_reference((x + r), w.float() + 1.0, 1e-5, 0.0, torch.float32)
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=1e-6)


def test_outputs_are_contiguous_for_strided_inputs():
    x = torch.randn(64, 3, 8).permute(1, 2, 0)  # [3, 8, 64], last dim strided
    r = torch.randn(3, 8, 64)
    w = torch.randn(64)
    out = rms_norm(x, w, 1e-6)
    assert out.is_contiguous()
    # Same values up to fp32 summation order (the mean reduces a strided row).
    torch.testing.assert_close(out, rms_norm(x.contiguous(), w, 1e-6), rtol=1e-6, atol=1e-6)
    o, s = add_rms_norm(x, r, w, 1e-6)
    assert o.is_contiguous() and s.is_contiguous()


def test_outputs_do_not_alias_inputs():
    x = torch.randn(4, 32)
    w = torch.ones(32)
    out = rms_norm(x, w, 1e-6, 0.0, torch.float32)
    assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize(
    "case, match",
    [
        ("weight_size", "63"),
        ("weight_2d", r"\(1, 64\)"),
        ("eps_zero", "eps.*0.0"),
        ("eps_negative", "eps.*-1e-06"),
        ("eps_nan", "eps.*nan"),
        ("eps_inf", "eps.*inf"),
        ("residual_shape", "residual shape.*got 5"),
        ("residual_dtype", "residual dtype"),
        ("x_dtype", "float64"),
        ("out_dtype", "int32"),
    ],
)
def test_invalid_arguments_raise_value_error(case, match):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    r = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(64)
    eps, out_dtype = 1e-6, None
    if case == "weight_size":
        w = torch.randn(63)
    elif case == "weight_2d":
        w = torch.randn(1, 64)
    elif case.startswith("eps_"):
        eps = {"eps_zero": 0.0, "eps_negative": -1e-6, "eps_nan": float("nan"),
               "eps_inf": float("inf")}[case]
    elif case == "residual_shape":
        r = torch.randn(5, 64, dtype=torch.bfloat16)
    elif case == "residual_dtype":
        r = r.float()
    elif case == "x_dtype":
        x, r = x.double(), r.double()
    elif case == "out_dtype":
        out_dtype = torch.int32

    with pytest.raises(ValueError, match=match):
        add_rms_norm(x, r, w, eps, 0.0, out_dtype)
    with pytest.raises(ValueError, match=match):
        add_rms_norm_reference(x, r, w, eps, 0.0, out_dtype)
    if not case.startswith("residual"):
        with pytest.raises(ValueError, match=match):
            rms_norm(x, w, eps, 0.0, out_dtype)
    # The fake impl validates too, so bad calls fail when traced, not only when run.
    with FakeTensorMode() as mode:
        fx, fr, fw = (mode.from_tensor(t) for t in (x, r, w))
        with pytest.raises(ValueError, match=match):
            OPS.add_rms_norm(fx, fr, fw, eps, 0.0, out_dtype or x.dtype)


def test_fake_and_meta_give_contiguous_outputs_of_right_dtype():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(64, 3, 128, dtype=torch.bfloat16).transpose(0, 1))
        w = mode.from_tensor(torch.randn(128))
        out = OPS.rms_norm(x, w, 1e-6, 1.0, torch.float32)
        o, s = OPS.add_rms_norm(x, x, w, 1e-6, 1.0, torch.float32)
    for t, dt in ((out, torch.float32), (o, torch.float32), (s, torch.bfloat16)):
        assert t.shape == (3, 64, 128) and t.dtype == dt and t.is_contiguous()
    m = torch.empty(5, 256, device="meta", dtype=torch.float16)
    o, s = OPS.add_rms_norm(m, m, torch.empty(256, device="meta"), 1e-6, 0.0, torch.bfloat16)
    assert o.shape == s.shape == (5, 256) and o.dtype == torch.bfloat16 and s.dtype == torch.float16


def _opcheck_cases():
    g = torch.Generator().manual_seed(2)
    bf = torch.bfloat16
    x = torch.randn(3, 4, 96, generator=g).to(bf)
    r = torch.randn(3, 4, 96, generator=g).to(bf)
    return [
        (x, r, torch.randn(96, generator=g).to(bf), 1e-6, 0.0, bf),
        (x, r, torch.randn(96, generator=g), 1e-5, 1.0, torch.float32),
        (x.transpose(0, 1), r.transpose(0, 1), torch.randn(96, generator=g), 1e-6, 1.0, bf),
        (x[0].float(), r[0].float(), torch.randn(96, generator=g).to(bf), 1e-2, 0.0, torch.float32),
    ]


@pytest.mark.parametrize("i", range(4))
def test_opcheck_rms_norm(i):
    x, _, w, eps, off, out_dtype = _opcheck_cases()[i]
    torch.library.opcheck(OPS.rms_norm.default, (x, w, eps, off, out_dtype))


@pytest.mark.parametrize("i", range(4))
def test_opcheck_add_rms_norm(i):
    torch.library.opcheck(OPS.add_rms_norm.default, _opcheck_cases()[i])


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_gated_op_is_fp32_math_with_one_rounding(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 4, 128, generator=g) * 3).to(x_dtype)
    z = (torch.randn(3, 4, 128, generator=g) * 3).to(x_dtype)
    w = (torch.randn(128, generator=g) * 0.2 + 1).to(w_dtype)
    out = gated_rms_norm(x, z, w, 1e-6)
    assert_same(out, gated_rms_norm_reference(x, z, w, 1e-6))
    want = float64_math(x, w, 1e-6, 0.0) * torch.nn.functional.silu(z.double())
    assert out.dtype == x_dtype
    assert ((out.double() - want).norm() / want.norm()).item() < {torch.float32: 1e-6}.get(x_dtype, 5e-3)


@pytest.mark.parametrize(
    "gate_shape, match", [((3, 1, 128), "gate shape must equal x shape"), ((3, 4), r"gate shape \(3, 4\) must equal")]
)
def test_gated_op_rejects_a_gate_of_another_shape(gate_shape, match):
    x = torch.randn(3, 4, 128)
    with pytest.raises((ValueError, RuntimeError), match=match):
        gated_rms_norm(x, torch.randn(gate_shape), torch.randn(128), 1e-6)


@pytest.mark.parametrize("i", range(4))
def test_opcheck_gated_rms_norm(i):
    x, z, w, eps, off, out_dtype = _opcheck_cases()[i]
    torch.library.opcheck(OPS.gated_rms_norm.default, (x, z, w, eps, off, out_dtype))


def _block(x, r, w_gemma, w_plain):
    # Two chained norms as in a decoder layer: residual add + Gemma norm, then a plain norm
    # of the new residual stream, plus ordinary ops Inductor fuses around the custom ops.
    h, resid = add_rms_norm(x, r, w_gemma, 1e-6, 1.0, torch.float32)
    y = rms_norm(resid, w_plain, 1e-6)
    return h * 2.0, resid, y, y.float().sum(-1)


def test_ops_under_torch_compile_inductor_with_dynamic_rows():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_block, backend=counter)
    g = torch.Generator().manual_seed(3)
    w_gemma = torch.randn(128, generator=g).to(torch.bfloat16)
    w_plain = torch.randn(128, generator=g)
    for rows in (3, 8):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        r = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        got = compiled(x, r, w_gemma, w_plain)
        want = _block(x, r, w_gemma, w_plain)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert_same(got[1], x + r)  # op output passed through untouched
    assert counter.frame_count == 1, "the second row count recompiled: dim 0 is not dynamic"
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_gpu_ops_match_reference_and_capture_in_cuda_graph(tokens):
    dev = "cuda"
    x = torch.randn(tokens, 4096, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    o, s = add_rms_norm(x, r, w, 1e-6, 1.0)
    ro, rs = add_rms_norm_reference(x, r, w, 1e-6, 1.0)
    assert_same(s, rs)
    torch.testing.assert_close(o, ro, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(rms_norm(x, w.float(), 1e-6, 0.0, torch.float32),
                               rms_norm_reference(x, w.float(), 1e-6, 0.0, torch.float32),
                               rtol=1e-5, atol=1e-5)

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, gs = add_rms_norm(x, r, w, 1e-6, 1.0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ro, rs = add_rms_norm_reference(x, r, w, 1e-6, 1.0)
    assert_same(gs, rs)
    torch.testing.assert_close(go, ro, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ops_under_torch_compile_reduce_overhead():
    # Inductor on CUDA with CUDA-graph trees: the ops are captured and replayed.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(_block, backend="inductor", mode="reduce-overhead", dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(4)
    w_gemma = torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16)
    w_plain = torch.randn(4096, device="cuda", generator=g)
    for _ in range(4):  # warm-up, record, replays
        x = torch.randn(16, 4096, device="cuda", generator=g).to(torch.bfloat16)
        r = torch.randn(16, 4096, device="cuda", generator=g).to(torch.bfloat16)
        got = [t.clone() for t in compiled(x, r, w_gemma, w_plain)]
        want = _block(x, r, w_gemma, w_plain)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)  # row sums: fp32 order
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
