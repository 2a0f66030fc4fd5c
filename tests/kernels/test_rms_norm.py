"""The Triton (residual add +) RMSNorm kernel against a float64 reference.

CPU tier: the launcher runs on CPU tensors under TRITON_INTERPRET=1 (set by tests/conftest.py
before this module imports the kernel).  With CUDA present the same tests run on the GPU;
the `gpu`-marked tests add real model shapes, NaN propagation and CUDA-graph capture.
"""

from __future__ import annotations

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis_profile import examples  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

from fusion_compiler.kernels import rms_norm as K  # noqa: E402
from launch_counter import count_launches  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"

# Norm-wise relative tolerance of the output, by output dtype (fp16 lies between the two
# given in the contract: it has 3 more mantissa bits than bf16).
NORM_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Element-wise: two units in the last place of the output dtype (one for the final rounding,
# one for fp32 accumulation-order differences), plus a little absolute slack near zero.
ELEM_RTOL = {torch.float32: 2 ** -21, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def reference64(x, weight, eps, weight_offset, residual=None):
    """float64 reference from the same rounded inputs: returns (out64, sum in x.dtype)."""
    s = x + residual if residual is not None else x  # eager add, rounded to x.dtype
    h = s.double()
    rstd = torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + eps)
    return h * rstd * (weight.double() + weight_offset), s


def assert_bitwise_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    ai, bi = a.contiguous().view(INT_VIEW[a.dtype]), b.contiguous().view(INT_VIEW[b.dtype])
    bad = (ai != bi) & ~(torch.isnan(a) & torch.isnan(b))
    assert not bad.any(), f"{int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}"


def assert_close_to_ref(out, ref64):
    dt = out.dtype
    assert torch.isfinite(out).all(), "output has non-finite values (unwritten NaN poison?)"
    err = out.double() - ref64
    rel = (err.norm() / ref64.norm().clamp_min(1e-300)).item()
    assert rel <= NORM_TOL[dt], f"norm-wise relative error {rel:.3g} > {NORM_TOL[dt]:.3g} ({dt})"
    limit = ELEM_RTOL[dt] * ref64.abs() + 1e-6
    worst = (err.abs() - limit).max().item()
    assert worst <= 0, f"element-wise error exceeds {ELEM_RTOL[dt]:.3g} relative by {worst:.3g}"


def poisoned_rows(shape, dtype):
    """NaN-filled output with one guard row on each side; returns (buffer, view of `shape`)."""
    n = shape[-1]
    m = 1
    for d in shape[:-1]:
        m *= d
    buf = torch.full((m + 2, n), float("nan"), dtype=dtype, device=DEVICE)
    return buf, buf[1 : m + 1].view(shape)


def make_input(shape, dtype, layout, gen, scale):
    """x of `shape` in one of the layouts the launcher must handle."""
    n = shape[-1]
    if layout == "contiguous":
        t = torch.randn(shape, generator=gen)
    elif layout == "row_strided":  # rows of a wider buffer: viewable as [M, N], no copy
        t = torch.randn(*shape[:-1], n + 5, generator=gen)[..., :n]
    elif layout == "lead_transposed":  # unit last stride, but leading dims do not collapse
        t = torch.randn(tuple(reversed(shape[:-1])) + (n,), generator=gen)
        t = t.permute(*reversed(range(len(shape) - 1)), len(shape) - 1)
    elif layout == "last_dim_strided":  # stride(-1) != 1: the launcher must copy
        t = torch.randn((n,) + tuple(shape[:-1]), generator=gen).movedim(0, -1)
    else:
        raise AssertionError(layout)
    assert t.shape == tuple(shape)
    return (t * scale).to(dtype).to(DEVICE)


def run_case(shape, n_dtype, w_dtype, out_dtype, eps, weight_offset, with_residual, layout, seed,
             scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = make_input(shape, n_dtype, layout, gen, scale)
    n = shape[-1]
    weight = (torch.randn(n, generator=gen) * 0.5).to(w_dtype).to(DEVICE)
    residual = make_input(shape, n_dtype, "contiguous", gen, scale) if with_residual else None

    out_buf, out = poisoned_rows(x.shape, out_dtype)
    sum_buf, sum_out = poisoned_rows(x.shape, n_dtype) if with_residual else (None, None)
    x_before = x.clone()

    K.rms_norm_fwd(x, weight, eps, weight_offset, out, residual=residual, sum_out=sum_out)

    ref64, ref_sum = reference64(x, weight, eps, weight_offset, residual)
    assert_close_to_ref(out, ref64)
    assert torch.isnan(out_buf[0]).all() and torch.isnan(out_buf[-1]).all(), "wrote outside out"
    assert_bitwise_equal(x, x_before)
    if with_residual:
        assert_bitwise_equal(sum_out, ref_sum)
        assert torch.isnan(sum_buf[0]).all() and torch.isnan(sum_buf[-1]).all()


N_VALUES = [1, 7, 64, 96, 128, 200, 256, 384, 1000, 1024]
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@settings(max_examples=examples(25), deadline=None)
@given(
    m=st.integers(1, 40),
    n=st.sampled_from(N_VALUES),
    split_rows=st.booleans(),
    x_dtype=st.sampled_from(FLOAT_DTYPES),
    w_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    out_is_x_dtype=st.booleans(),
    eps=st.floats(1e-6, 1e-2),
    weight_offset=st.sampled_from([0.0, 1.0]),
    with_residual=st.booleans(),
    layout=st.sampled_from(["contiguous", "row_strided", "lead_transposed", "last_dim_strided"]),
    scale=st.sampled_from([1e-3, 1.0, 20.0]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_float64_reference(m, n, split_rows, x_dtype, w_dtype, out_is_x_dtype, eps,
                                          weight_offset, with_residual, layout, scale, seed):
    shape = (2, m, n) if split_rows else (m, n)
    out_dtype = x_dtype if out_is_x_dtype else torch.float32
    run_case(shape, x_dtype, w_dtype, out_dtype, eps, weight_offset, with_residual, layout, seed,
             scale)


@pytest.mark.parametrize("n", [16385, 20000])
def test_wide_rows_use_the_chunked_path(n):
    assert K.launch_config(n)[3], "expected the looped (chunked) kernel for this width"
    run_case((3, n), torch.bfloat16, torch.float32, torch.bfloat16, 1e-6, 1.0, True, "contiguous", 0)
    run_case((2, n), torch.float32, torch.bfloat16, torch.float32, 1e-5, 0.0, False, "row_strided", 1)


def run_gated_case(shape, x_dtype, gate_dtype, w_dtype, eps, weight_offset, layout, seed, scale=1.0):
    """The gated norm: ``rms(x) * w * silu(gate)`` against float64, one output rounding."""
    gen = torch.Generator().manual_seed(seed)
    x = make_input(shape, x_dtype, layout, gen, scale)
    gate = make_input(shape, gate_dtype, "row_strided", gen, 3.0)
    weight = (torch.randn(shape[-1], generator=gen) * 0.5 + 1).to(w_dtype).to(DEVICE)
    out_buf, out = poisoned_rows(x.shape, x_dtype)
    x_before, gate_before = x.clone(), gate.clone()

    K.rms_norm_fwd(x, weight, eps, weight_offset, out, gate=gate)

    ref64, _ = reference64(x, weight, eps, weight_offset)
    ref64 = ref64 * torch.nn.functional.silu(gate.double())
    assert_close_to_ref(out, ref64)
    assert torch.isnan(out_buf[0]).all() and torch.isnan(out_buf[-1]).all(), "wrote outside out"
    assert_bitwise_equal(x, x_before)
    assert_bitwise_equal(gate, gate_before)


@settings(max_examples=examples(15), deadline=None)
@given(
    rows=st.integers(1, 12),
    heads=st.integers(1, 4),
    n=st.sampled_from([7, 64, 128, 200, 256]),
    x_dtype=st.sampled_from(FLOAT_DTYPES),
    gate_dtype=st.sampled_from(FLOAT_DTYPES),
    w_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    weight_offset=st.sampled_from([0.0, 1.0]),
    layout=st.sampled_from(["contiguous", "lead_transposed", "last_dim_strided"]),
    scale=st.sampled_from([1e-3, 1.0, 20.0]),
    seed=st.integers(0, 2**16),
)
def test_gated_kernel_matches_float64_reference(rows, heads, n, x_dtype, gate_dtype, w_dtype, weight_offset,
                                                layout, scale, seed):
    run_gated_case((rows, heads, n), x_dtype, gate_dtype, w_dtype, 1e-6, weight_offset, layout, seed, scale)


def test_gated_wide_rows_use_the_chunked_path():
    assert K.launch_config(16400)[3]
    run_gated_case((2, 16400), torch.bfloat16, torch.bfloat16, torch.bfloat16, 1e-6, 0.0, "contiguous", 3)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_residual_sum_is_bitwise_eager_add_for_any_bit_pattern(dtype):
    # Random bit patterns cover subnormals, huge values (overflow to inf), inf and NaN.
    gen = torch.Generator().manual_seed(1234)
    m, n = 16, 200
    it = INT_VIEW[dtype]
    info = torch.iinfo(it)
    x = torch.randint(info.min, info.max, (m, n), generator=gen, dtype=torch.int64).to(it).view(dtype)
    r = torch.randint(info.min, info.max, (m, n), generator=gen, dtype=torch.int64).to(it).view(dtype)
    x, r = x.to(DEVICE), r.to(DEVICE)
    w = torch.ones(n, dtype=torch.float32, device=DEVICE)
    out = torch.empty(m, n, dtype=dtype, device=DEVICE)
    s = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    K.rms_norm_fwd(x, w, 1e-6, 0.0, out, residual=r, sum_out=s)
    assert_bitwise_equal(s, x + r)


def test_bf16_sum_rounds_ties_to_even():
    one_ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    # 1+ulp (odd mantissa) + half an ulp is a tie: RTNE gives 1+2ulp, truncation 1+ulp.
    # 1 (even) + half an ulp: RTNE keeps 1.  1 + 0.75 ulp rounds up either way.
    x = torch.tensor([[1 + one_ulp, 1.0, 1.0, -(1 + one_ulp)]], dtype=torch.bfloat16, device=DEVICE)
    r = torch.tensor([[one_ulp / 2, one_ulp / 2, 0.75 * one_ulp, -one_ulp / 2]],
                     dtype=torch.bfloat16, device=DEVICE)
    s = torch.empty_like(x)
    out = torch.empty_like(x)
    K.rms_norm_fwd(x, torch.ones(4, device=DEVICE), 1e-6, 0.0, out, residual=r, sum_out=s)
    expected = torch.tensor([[1 + 2 * one_ulp, 1.0, 1 + one_ulp, -(1 + 2 * one_ulp)]],
                            dtype=torch.bfloat16, device=DEVICE)
    assert_bitwise_equal(s, expected)
    assert_bitwise_equal(s, x + r)


def test_bf16_output_is_round_to_nearest_even_of_fp32_result():
    # h = +-1 and a negligible eps make rstd exactly 1, so the fp32 result is +-w; w sits on
    # and beside bf16 ties, where truncation (the interpreter's cast) would differ from RTNE.
    n = 4
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float32, device=DEVICE)
    ulp = 2.0 ** -7
    w = torch.tensor([1 + ulp / 2, 1 + 1.5 * ulp, 1 + 0.25 * ulp, 1 + 0.75 * ulp],
                     dtype=torch.float32, device=DEVICE)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE)
    K.rms_norm_fwd(x, w, 1e-30, 0.0, out)
    expected = (x * w).to(torch.bfloat16)  # torch's fp32 -> bf16 is RTNE
    assert_bitwise_equal(out, expected)


def test_empty_input_launches_nothing():
    weight = torch.ones(128, device=DEVICE)
    x = torch.randn(3, 128, dtype=torch.bfloat16, device=DEVICE)
    with count_launches() as launches:
        K.rms_norm_fwd(x, weight, 1e-6, 0.0, torch.empty_like(x))
    assert len(launches) == 1  # the counter sees this launcher's kernel
    x = torch.empty(0, 128, dtype=torch.bfloat16, device=DEVICE)
    with count_launches() as launches:
        K.rms_norm_fwd(x, weight, 1e-6, 0.0, torch.empty_like(x))
    assert launches.names == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weight_n=64), "weight must have shape"),
        (dict(out_shape=(4, 127)), "out must have shape"),
        (dict(residual_only=True), "together"),
        (dict(eps=0.0), "eps"),
        (dict(out_transposed=True), "cannot be viewed|unit stride"),
    ],
)
def test_launcher_rejects_bad_arguments(kwargs, match):
    n = 128
    x = torch.randn(4, n, device=DEVICE)
    w = torch.ones(kwargs.get("weight_n", n), device=DEVICE)
    if kwargs.get("out_transposed"):
        out = torch.empty(n, 4, device=DEVICE).t()
    else:
        out = torch.empty(kwargs.get("out_shape", (4, n)), device=DEVICE)
    residual = torch.randn(4, n, device=DEVICE) if kwargs.get("residual_only") else None
    with pytest.raises(ValueError, match=match):
        K.rms_norm_fwd(x, w, kwargs.get("eps", 1e-6), 0.0, out, residual=residual)


def test_launch_table_covers_every_width():
    for n in list(range(1, 300)) + [384, 1000, 1536, 3072, 4096, 6144, 7168, 8192, 16384]:
        block_n, rows, warps, looped = K.launch_config(n)
        assert not looped and block_n >= n and block_n & (block_n - 1) == 0
        assert rows >= 1 and rows & (rows - 1) == 0 and warps in (1, 2, 4, 8, 16, 32)
    assert isinstance(K.KERNEL_VERSION, str) and K.KERNEL_VERSION


# ---------------------------------------------------------------------------------------------
# GPU tier
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("hidden", [3072, 4096, 6144, 7168])
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
def test_gpu_real_hidden_sizes(tokens, hidden, weight_offset):
    run_case((tokens, hidden), torch.bfloat16, torch.bfloat16, torch.bfloat16, 1e-6, weight_offset,
             True, "contiguous", tokens + hidden)
    run_case((tokens, hidden), torch.bfloat16, torch.float32, torch.float32, 1e-6, weight_offset,
             False, "contiguous", tokens * hidden)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("head_dim, heads", [(128, 64), (256, 32)])
def test_gpu_per_head_norm(tokens, head_dim, heads):
    # q/k norm: [tokens, heads, head_dim], Gemma offset for the 256 case as in Qwen3.5.
    offset = 1.0 if head_dim == 256 else 0.0
    run_case((tokens, heads, head_dim), torch.bfloat16, torch.bfloat16, torch.bfloat16, 1e-6,
             offset, False, "contiguous", tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n", [128, 4096, 7168, 20000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_nan_poisons_only_its_row(n, with_residual):
    m, bad_row = 64, 37
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    x[bad_row, n // 3] = float("nan")
    residual = torch.randn_like(x) if with_residual else None
    out = torch.empty_like(x)
    s = torch.empty_like(x) if with_residual else None
    K.rms_norm_fwd(x, torch.randn(n, device="cuda"), 1e-6, 0.0, out, residual=residual, sum_out=s)
    assert torch.isnan(out[bad_row]).all()
    others = torch.cat([out[:bad_row], out[bad_row + 1 :]])
    assert torch.isfinite(others).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_capture_and_replay():
    m, n = 16, 7168
    x = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    r = torch.randn_like(x)
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    out, s = torch.empty_like(x), torch.empty_like(x)
    K.rms_norm_fwd(x, w, 1e-6, 1.0, out, residual=r, sum_out=s)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K.rms_norm_fwd(x, w, 1e-6, 1.0, out, residual=r, sum_out=s)
    x.copy_(torch.randn_like(x))
    r.copy_(torch.randn_like(r))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref64, ref_sum = reference64(x, w, 1e-6, 1.0, r)
    assert_close_to_ref(out, ref64)
    assert_bitwise_equal(s, ref_sum)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
def test_gpu_gated_norm_at_qwen35_gdn_dims(tokens):
    # Qwen3.5-397B's GDN output norm: 64 value heads x 128, bf16 x and gate, fp32 or bf16 weight.
    run_gated_case((tokens, 64, 128), torch.bfloat16, torch.bfloat16, torch.bfloat16, 1e-6, 0.0, "contiguous", tokens)
    run_gated_case((tokens, 64, 128), torch.bfloat16, torch.bfloat16, torch.float32, 1e-6, 0.0, "contiguous", tokens + 1)
