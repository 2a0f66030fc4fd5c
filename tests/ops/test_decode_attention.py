"""fusion_compiler::decode_attention's contract: the reference against HF's decode step
(``repeat_kv`` + ``scaled_dot_product_attention``) in float64, argument checks with clear
messages (reference, op and fake impl alike), and the fake impl's shapes under FakeTensorMode
and torch.compile (dynamic S)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from fusion_compiler.ops import decode_attention as op
from fusion_compiler.ops.decode_attention import decode_attention_reference
from fusion_compiler.verify import relative_error

OP = torch.ops.fusion_compiler.decode_attention


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF transformers' repeat_kv, verbatim: [B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]."""
    b, hkv, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, hkv, n_rep, s, d).reshape(b, hkv * n_rep, s, d)


def _inputs(b=3, hkv=2, g=3, s=19, d=24, dv=40, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, hkv * g, d, generator=gen).to(dtype).transpose(1, 2)  # [B, H, 1, D] view
    k = torch.randn(b, hkv, s, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, s, dv, generator=gen).to(dtype)
    return q, k, v


def _masks(b, s, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, s + 1, (b,), generator=gen)
    keep = torch.arange(s)[None, :] < lengths[:, None]  # causal prefixes of different lengths
    one = torch.rand(1, s, generator=gen) < 0.6
    one[0, 0] = True
    return {
        "none": None,
        "bool": keep[:, None, None, :],
        "additive": torch.where(keep, torch.randn(b, s, generator=gen) * 0.5, -torch.inf).to(dtype)[:, None, None, :],
        "hf_min": torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :],
        "bool_expanded": one[:, None, None, :].expand(b, 1, 1, s),
        "additive_one_row": torch.where(one, 0.0, float("-inf")).to(dtype)[:, None, None, :],  # broadcast on B
    }


def _sdpa64(q, k, v, mask, scale):
    """HF's decode attention in float64: repeat_kv, then sdpa with the mask as given."""
    g = q.shape[1] // k.shape[1]
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return F.scaled_dot_product_attention(q.double(), repeat_kv(k.double(), g), repeat_kv(v.double(), g),
                                          attn_mask=m, scale=scale)  # fmt: skip


@pytest.mark.parametrize("mask_kind", list(_masks(1, 4, torch.float32)))
@pytest.mark.parametrize("g", [1, 2, 6])
def test_reference_is_hf_repeat_kv_sdpa_fp32(mask_kind, g):
    q, k, v = _inputs(g=g)
    mask = _masks(3, 19, torch.float32)[mask_kind]
    scale = 0.37
    out = decode_attention_reference(q, k, v, mask, scale)
    assert out.shape == (3, 2 * g, 1, 40) and out.dtype == torch.float32 and out.is_contiguous()
    assert relative_error(out, _sdpa64(q, k, v, mask, scale)) < 1e-6


def _attention64(q, k, v, mask, scale):
    """Decode attention in float64, written out per query head (head h reads kv head h // G),
    apart from both the op's reference and HF's repeat_kv + sdpa."""
    b, heads = q.shape[0], q.shape[1]
    group = heads // k.shape[1]
    out = torch.empty(b, heads, 1, v.shape[3], dtype=torch.float64)
    for i in range(b):
        for h in range(heads):
            kk, vv = k[i, h // group].double(), v[i, h // group].double()  # [S, D], [S, Dv]
            s = kk @ q[i, h, 0].double() * scale
            if mask is not None:
                m = mask[min(i, mask.shape[0] - 1), 0, 0]
                s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
            p = torch.exp(s - s.max())
            out[i, h, 0] = (p / p.sum()) @ vv
    return out


OP_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("mask_kind", list(_masks(1, 4, torch.float32)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_op_matches_float64_attention(dtype, mask_kind):
    """The dispatched op (on CPU its impl is the reference, on CUDA the Triton kernel) against
    ``_attention64`` on fresh random inputs rounded to ``dtype``: norm-wise and per output row
    (a query head), to the dtype's tolerance (bf16 1e-2 relative)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seed = 10 * [torch.bfloat16, torch.float16, torch.float32].index(dtype) + list(_masks(1, 4, dtype)).index(mask_kind)
    q, k, v = _inputs(b=3, hkv=2, g=4, s=37, d=32, dv=24, dtype=dtype, seed=200 + seed)
    mask = _masks(3, 37, dtype, seed=300 + seed)[mask_kind]
    scale = 32**-0.5
    args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (q, k, v, mask)]
    out = OP(*args, scale)
    assert out.shape == (3, 8, 1, 24) and out.dtype == dtype and out.is_contiguous()
    want = _attention64(q, k, v, mask, scale)
    assert bool(torch.isfinite(want).all())
    err = (out.cpu().double() - want).squeeze(2)  # [B, H, Dv]
    tol = OP_TOL[dtype]
    assert (err.norm() / want.norm()).item() < tol
    row_rel = err.norm(dim=-1) / want.squeeze(2).norm(dim=-1)
    assert row_rel.max().item() < 2 * tol, f"worst row relative error {row_rel.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_half_precision_rounds_once(dtype):
    q, k, v = _inputs(b=2, hkv=2, g=6, s=33, d=48, dv=16, dtype=dtype)
    mask = _masks(2, 33, dtype)["additive"]
    out = decode_attention_reference(q, k, v, mask, 48**-0.5)
    assert out.dtype == dtype
    # fp32 math on the half inputs, one rounding at the end: the float64 truth to half precision.
    assert relative_error(out, _sdpa64(q, k, v, mask, 48**-0.5)) < (4e-3 if dtype == torch.bfloat16 else 5e-4)


def test_fully_masked_rows():
    """All-False bool / all -inf rows give NaN (sdpa's 0 / 0); HF's finfo.min masks average v."""
    q, k, v = _inputs(b=2, s=8)
    keep = torch.tensor([[True] * 8, [False] * 8])[:, None, None, :]
    out = decode_attention_reference(q, k, v, keep, 0.5)
    assert bool(torch.isnan(out[1]).all()) and not bool(torch.isnan(out[0]).any())
    out = decode_attention_reference(q, k, v, torch.where(keep, 0.0, float("-inf")), 0.5)
    assert bool(torch.isnan(out[1]).all())
    hf = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    out = decode_attention_reference(q, k, v, hf, 0.5)
    assert relative_error(out, _sdpa64(q, k, v, hf, 0.5)) < 1e-6


_BAD = {
    "per_head_mask": (dict(mask=torch.zeros(3, 6, 1, 19)), "per-head masks are not supported"),
    "per_query_mask": (dict(mask=torch.zeros(3, 1, 2, 19)), "per-query masks are not supported"),
    "mask_batch": (dict(mask=torch.zeros(2, 1, 1, 19)), "mask dim 0 must be 1 or the batch 3"),
    "mask_len": (dict(mask=torch.zeros(3, 1, 1, 18)), r"mask dim 3 \(seq_len\): got 18, expected 19"),
    "mask_3d": (dict(mask=torch.zeros(3, 1, 19)), r"mask must be 4-D \[B or 1, 1, 1, S\]"),
    "mask_int": (dict(mask=torch.zeros(3, 1, 1, 19, dtype=torch.int32)), "mask dtype torch.int32 not supported"),
    "two_queries": (dict(q=torch.zeros(3, 6, 2, 24)), "one query per sequence"),
    "uneven_heads": (dict(q=torch.zeros(3, 5, 1, 24)), "5 query heads do not share 2 kv heads evenly"),
    "head_dim": (dict(q=torch.zeros(3, 6, 1, 32)), r"k dim 3 \(head_dim, q's\): got 24, expected 32"),
    "kv_len": (dict(v=torch.zeros(3, 2, 18, 40)), r"v dim 2 \(seq_len, k's\): got 18, expected 19"),
    "k_batch": (dict(k=torch.zeros(2, 2, 19, 24)), r"k dim 0 \(batch, q's\): got 2, expected 3"),
    "v_heads": (dict(v=torch.zeros(3, 1, 19, 40)), r"v dim 1 \(kv_heads, k's\): got 1, expected 2"),
    "v_batch": (dict(v=torch.zeros(1, 2, 19, 40)), r"v dim 0 \(batch, k's\): got 1, expected 3"),
    "mixed_dtypes": (dict(k=torch.zeros(3, 2, 19, 24, dtype=torch.bfloat16)), "must share one dtype"),
    "float64": (dict(q=torch.zeros(3, 6, 1, 24, dtype=torch.float64)), "q dtype torch.float64 not supported"),
    "q_3d": (dict(q=torch.zeros(3, 6, 24)), "q must be 4-D"),
    "scale_nan": (dict(scale=float("nan")), "scale must be finite"),
    "empty_cache": (dict(k=torch.zeros(3, 2, 0, 24), v=torch.zeros(3, 2, 0, 40), mask=None), "at least one position"),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_arguments_raise_clear_errors(case):
    q, k, v = _inputs(s=19)
    args = dict(q=q, k=k, v=v, mask=torch.zeros(3, 1, 1, 19), scale=0.5)
    overrides, match = _BAD[case]
    args.update(overrides)
    with pytest.raises(ValueError, match=match):
        decode_attention_reference(**args)
    with pytest.raises(ValueError, match=match):
        OP(*args.values())
    # The fake impl validates too, so bad calls fail when traced, not only when run.
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args.values()]
        with pytest.raises(ValueError, match=match):
            OP(*fake)


def test_fake_gives_contiguous_output_of_q_dtype():
    q, k, v = _inputs(b=2, hkv=2, g=6, s=11, d=48, dv=16, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, 11, dtype=torch.bool).expand(2, 1, 1, 11)
    with FakeTensorMode() as mode:
        out = OP(*(mode.from_tensor(t) for t in (q, k, v, mask)), 0.125)
    assert out.shape == (2, 12, 1, 16) and out.dtype == torch.bfloat16 and out.is_contiguous()
    meta = OP(q.to("meta"), k.to("meta"), v.to("meta"), None, 0.125)
    assert meta.shape == (2, 12, 1, 16) and meta.dtype == torch.bfloat16


def _step(q, k, v, mask):
    # HF's decode attention call site shape: q from a [B, 1, H, D] projection, output back to it.
    out = OP(q.transpose(1, 2), k, v, mask, 0.25)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1) * 2.0


def test_op_under_torch_compile_with_dynamic_seq_len():
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_step, backend=counter, fullgraph=True)
    for s in (9, 17):
        q, k, v = _inputs(b=2, hkv=2, g=2, s=s, d=16, dv=24)
        q = q.transpose(1, 2).contiguous()  # [B, 1, H, D]
        mask = _masks(2, s, torch.float32)["additive"]
        for t, dim in ((k, 2), (v, 2), (mask, 3)):
            torch._dynamo.mark_dynamic(t, dim)
        got = compiled(q, k, v, mask)
        assert got.shape == (2, 1, 4 * 24)
        torch.testing.assert_close(got, _step(q, k, v, mask), rtol=0, atol=0)
    assert counter.frame_count == 1, "the second cache length recompiled: S is not dynamic"


def test_module_exports():
    assert op.SUPPORTED_DTYPES == (torch.float16, torch.bfloat16, torch.float32)
    assert hasattr(torch.ops.fusion_compiler, "decode_attention")
