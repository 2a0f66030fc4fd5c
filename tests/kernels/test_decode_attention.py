"""The decode attention kernel (kernels/decode_attention.py) against ``decode_attention_reference``.

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py), so shapes are small: S up to 70
(never a multiple of the tile), D and Dv 16-64 and not powers of two, G = H / Hkv of 1, 2 and
6. q is a transposed [B, 1, H, D] view; masks are None, bool or additive (with -inf or HF's
``finfo.min``), per batch (causal prefixes of different lengths) or expanded from [1, 1, 1, S]
(stride 0), or a slice of a longer mask. One split (direct write) and several (workspace +
combine) are forced. Outputs start as NaN with a NaN guard slab on each side: every element
of a row with an unmasked position is written, and nothing outside. bf16 agrees with the
reference to ~1e-2 relative error (p is rounded to V's dtype for the P @ V product), fp16 to
~2e-3, fp32 to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernel_fixtures import DEVICE, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis_profile import examples  # noqa: E402

skip_unless_kernels_can_run()

from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.kernels import decode_attention as K  # noqa: E402
from fusion_compiler.ops import decode_attention as op  # noqa: E402
from fusion_compiler.ops.decode_attention import decode_attention_reference  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
MASKS = ("none", "bool", "add_inf", "add_min", "bool_expanded", "add_expanded", "add_sliced")


def _inputs(c):
    gen = torch.Generator().manual_seed(c["seed"])
    b, hkv, g, s, d, dv, dtype = c["batch"], c["kv_heads"], c["group"], c["seq"], c["d"], c["dv"], c["dtype"]
    q = torch.randn(b, 1, hkv * g, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)  # [B, H, 1, D] view
    k = torch.randn(b, hkv, s, d, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(b, hkv, s, dv, generator=gen).to(dtype).to(DEVICE)
    return q, k, v, _mask(c["mask"], b, s, dtype, gen), d**-0.5


def _mask(kind, b, s, dtype, gen):
    if kind == "none":
        return None
    if kind.endswith("expanded"):  # one row for the whole batch: stride 0 on dim 0
        keep = torch.rand(1, s, generator=gen) < 0.7
        keep[0, 0] = True
    else:  # causal prefixes of different lengths per batch, plus a few holes
        lengths = torch.randint(1, s + 1, (b,), generator=gen)
        keep = (torch.arange(s)[None, :] < lengths[:, None]) & (torch.rand(b, s, generator=gen) < 0.9)
        keep[:, 0] = True
    if kind.startswith("bool"):
        mask = keep
    else:
        masked = torch.finfo(dtype).min if kind == "add_min" else float("-inf")
        mask = torch.where(keep, torch.randn(keep.shape, generator=gen) * 0.5, masked).to(dtype)
    if kind == "add_sliced":  # a [B, 1, 1, S] slice of a longer mask: dim 3 stops short of its row
        mask = torch.cat([mask, torch.zeros(b, 5, dtype=dtype)], dim=1)[:, :s]
    mask = mask.to(DEVICE)[:, None, None, :]
    return mask.expand(b, 1, 1, s) if kind.endswith("expanded") else mask


def _run(c, splits=None, block_s=None, skip_masked=False):
    q, k, v, mask, scale = _inputs(c)
    ref = decode_attention_reference(q, k, v, mask, scale)
    buf, out = poisoned(tuple(ref.shape), c["dtype"])
    K.decode_attention_fwd(q, k, v, mask, scale, out, splits=splits, block_s=block_s, skip_masked=skip_masked)
    assert_guards_untouched(buf)
    assert not bool(torch.isnan(out).any()), "an output element was not written"
    err = relative_error(out, ref)
    assert err < TOLERANCE[c["dtype"]], f"relative error {err:.3g} ({c}, splits={splits}, block_s={block_s})"


def _case(**kw):
    c = dict(batch=3, kv_heads=2, group=6, seq=70, d=24, dv=40, dtype=torch.bfloat16, mask="bool", seed=0)
    return {**c, **kw}


# Splits: 1 (direct write), 3 over 5 tiles of 16 (a short last split), and the default rule.
@pytest.mark.parametrize(
    "c, splits, block_s",
    [
        (_case(mask="none", group=1, batch=1), 1, None),
        (_case(mask="bool", dtype=torch.float32), 3, 16),
        (_case(mask="add_inf", group=2, d=48, dv=16), None, 16),
        (_case(mask="add_min", dtype=torch.float16, seq=37), 1, 16),
        (_case(mask="bool_expanded", dtype=torch.float32, group=2, d=16, dv=24, seq=65), 2, None),
        (_case(mask="add_expanded", group=1, kv_heads=3, d=64, dv=48), 3, 16),
        (_case(mask="add_sliced", dtype=torch.float32, group=6, seq=70), 1, None),
        (_case(mask="bool", group=6, seq=70, d=40, dv=24), None, None),
    ],
    ids=lambda x: x["mask"] + "-" + str(x["dtype"]).split(".")[1] if isinstance(x, dict) else str(x),
)
def test_kernel_matches_reference(c, splits, block_s):
    _run(c, splits, block_s)


@st.composite
def configs(draw):
    return dict(
        batch=draw(st.sampled_from([1, 3])), kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 2, 6])), seq=draw(st.integers(1, 70)),
        d=draw(st.sampled_from([16, 24, 48, 64])), dv=draw(st.sampled_from([16, 24, 40])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        mask=draw(st.sampled_from(MASKS)), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@settings(max_examples=examples(8), deadline=None)
@given(c=configs(), splits=st.sampled_from([None, 1, 2, 4]), block_s=st.sampled_from([None, 16]),
       skip_masked=st.booleans())  # fmt: skip
def test_kernel_matches_reference_random(c, splits, block_s, skip_masked):
    _run(c, splits, block_s, skip_masked)


def _kept_rows_case(keep: torch.Tensor, mask_kind: str):
    """(q, k, v NaN at the rows ``keep`` [B, S] rules out, the mask, scale, the reference over
    the clean cache, the dtype): bf16, 2 kv heads of 2 query heads, D 24, Dv 40."""
    batch, seq = keep.shape
    c = _case(batch=batch, kv_heads=2, group=2, seq=seq, d=24, dv=40, dtype=torch.bfloat16, mask="bool")
    q, k, v, _, scale = _inputs(c)
    keep = keep.to(DEVICE)
    mask = keep if mask_kind == "bool" else torch.where(keep, 0.0, float("-inf")).to(c["dtype"])
    mask = mask[:, None, None, :]
    ref = decode_attention_reference(q, k, v, mask, scale)
    ruled_out = ~keep[:, None, :, None]
    return q, k.masked_fill(ruled_out, float("nan")), v.masked_fill(ruled_out, float("nan")), mask, scale, ref, c["dtype"]


def _run_skipping(case, splits: int, skip: bool = True) -> torch.Tensor:
    q, k, v, mask, scale, ref, dtype = case
    buf, out = poisoned(tuple(ref.shape), dtype)
    K.decode_attention_fwd(q, k, v, mask, scale, out, splits=splits, block_s=16, skip_masked=skip)
    assert_guards_untouched(buf)
    return out


@pytest.mark.parametrize("mask_kind", ["bool", "add_inf"])
@pytest.mark.parametrize("splits", [1, 3])
def test_skip_masked_loads_no_row_the_mask_rules_out(mask_kind, splits):
    """A top-k mask's unselected K / V rows (and a static cache's tail) are NaN here: with
    ``skip_masked`` the kernel never loads them, so the output equals the reference over the
    clean cache; without it they reach the output (masked scores get weight 0, but 0 * NaN
    rows of V are NaN), so the poison does reach the kernel."""
    gen = torch.Generator().manual_seed(11)
    keep = torch.zeros(2, 70, dtype=torch.bool)
    for row, length in enumerate((70, 45)):  # row 1: a cache written up to 45 of 70
        keep[row, torch.randperm(length, generator=gen)[:20]] = True  # top 20 of the written
    case = _kept_rows_case(keep, mask_kind)
    out = _run_skipping(case, splits)
    assert not bool(torch.isnan(out).any())
    assert relative_error(out, case[5]) < TOLERANCE[case[6]]
    assert bool(torch.isnan(_run_skipping(case, splits, skip=False)).all())


@pytest.mark.parametrize("mask_kind", ["bool", "add_inf"])
@pytest.mark.parametrize("splits", [1, 2])
def test_skip_masked_passes_over_whole_tiles_the_mask_rules_out(mask_kind, splits):
    """Tiles of 16 over 80 positions: row 0 keeps positions in its last tile only (every tile
    before it ruled out whole: the softmax state must come through them empty), row 1 in its
    first tile only (a static cache's tail), row 2 one position in the middle tile. The rows
    ruled out are NaN; with ``skip_masked`` the output equals the clean reference."""
    keep = torch.zeros(3, 80, dtype=torch.bool)
    keep[0, 70:75] = True
    keep[1, 0:9] = True
    keep[2, 40] = True
    case = _kept_rows_case(keep, mask_kind)
    out = _run_skipping(case, splits)
    assert not bool(torch.isnan(out).any())
    assert relative_error(out, case[5]) < TOLERANCE[case[6]]


@triton.jit
def _kept_tiles_probe(MASK, OUT, S, count, scans, MASK_KIND: tl.constexpr, BLOCK_S: tl.constexpr,
                      SCAN: tl.constexpr, INTERP_SCANS: tl.constexpr):  # fmt: skip
    split = tl.program_id(0)
    lo, hi = K._kept_tiles(MASK, split * count, count, S, scans, 1, MASK_KIND, BLOCK_S, SCAN, INTERP_SCANS)
    tl.store(OUT + split * 2, lo)
    tl.store(OUT + split * 2 + 1, hi)


@pytest.mark.parametrize("mask_kind", ["bool", "add_inf", "add_min"])
def test_skip_loop_runs_only_the_tiles_between_the_first_and_last_kept_position(mask_kind):
    """The skip's tile loop runs [lo, hi) of each split (``_kept_tiles``), read 16 mask positions
    a step here so a split takes several steps: 100 positions in tiles of 8, 3 splits of 5 tiles
    (the last one past S). A tile with no kept position outside that range is never visited; an
    empty split gets lo == hi; HF's ``finfo.min`` keeps its positions (they are loaded)."""
    seq, block, count, scan = 100, 8, 5, 16
    keep = torch.zeros(seq, dtype=torch.bool)
    keep[[13, 17, 33]] = True  # split 0: tiles 1..2; split 1 (tiles 5-9, positions 40-79): none
    keep[[83, 99]] = True  # split 2: tiles 10..12
    if mask_kind == "bool":
        mask = keep.view(torch.uint8)
    else:
        ruled_out = float("-inf") if mask_kind == "add_inf" else torch.finfo(torch.bfloat16).min
        mask = torch.where(keep, 0.0, ruled_out).to(torch.bfloat16)
    splits, scans = 3, triton.cdiv(count * block, scan)
    out = torch.full((splits * 2,), -7, dtype=torch.int32, device=DEVICE)
    _kept_tiles_probe[(splits,)](mask.to(DEVICE), out, seq, count, scans,
                                 MASK_KIND=K.MASK_BOOL if mask_kind == "bool" else K.MASK_ADD, BLOCK_S=block,
                                 SCAN=scan, INTERP_SCANS=scans)  # fmt: skip
    if mask_kind == "add_min":  # finfo.min is kept: every tile of every split is visited
        assert out.view(splits, 2).tolist() == [[0, 5], [5, 10], [10, 13]]
    else:
        assert out.view(splits, 2).tolist() == [[1, 5], [5, 5], [10, 13]]


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_fully_masked_rows_are_nan_like_sdpa(splits, skip):
    """Batch 1's row is masked everywhere (bool False / additive -inf): NaN there, as in the
    reference and sdpa; the other batches' rows are unaffected. With ``skip_masked`` that row's
    programs visit no tile at all."""
    c = _case(batch=3, seq=40, dtype=torch.float32)
    q, k, v, _, scale = _inputs(c)
    keep = torch.ones(3, 40, dtype=torch.bool, device=DEVICE)
    keep[1] = False
    for mask in (keep[:, None, None, :], torch.where(keep, 0.0, float("-inf"))[:, None, None, :]):
        ref = decode_attention_reference(q, k, v, mask, scale)
        out = torch.full_like(ref, float("nan"))
        K.decode_attention_fwd(q, k, v, mask, scale, out, splits=splits, block_s=16, skip_masked=skip)
        assert bool(torch.isnan(out[1]).all()) and bool(torch.isnan(ref[1]).all())
        assert not bool(torch.isnan(out[[0, 2]]).any())
        assert relative_error(out, ref) < 1e-5


def test_op_cuda_impl_runs_the_kernel():
    """The op's CUDA implementation (validation, output allocation, launch) on this tier's
    tensors: the registered function called directly."""
    c = _case(batch=2, kv_heads=2, group=2, seq=50, d=24, dv=24, dtype=torch.bfloat16, mask="add_inf")
    q, k, v, mask, scale = _inputs(c)
    out = op._cuda(q, k, v, mask, scale)
    assert out.shape == (2, 4, 1, 24) and out.is_contiguous() and out.dtype == torch.bfloat16
    assert relative_error(out, decode_attention_reference(q, k, v, mask, scale)) < 1e-2


def test_split_rule_depends_on_shapes_only():
    # MiniMax (Hkv 8), Qwen3.5 (Hkv 2), DeepSeek expanded MLA (Hkv 128) at S 4096, tiles of 64.
    assert K.num_splits(1, 8, 4096, 64) == (16, 4)
    assert K.num_splits(1, 2, 4096, 64) == (32, 2)
    assert K.num_splits(1, 128, 4096, 64) == (2, 32)
    assert K.num_splits(8, 8, 4096, 64) == (3, 22)
    assert K.num_splits(64, 8, 4096, 64) == (1, 64)
    assert K.num_splits(1, 8, 70, 64) == (1, 2)
    assert K.num_splits(3, 2, 1, 64) == (1, 1)
    for b, hkv, s in ((1, 8, 4096), (8, 2, 1000), (1, 1, 131072), (5, 3, 77)):
        splits, per = K.num_splits(b, hkv, s, 64)
        tiles = -(-s // 64)
        assert (splits - 1) * per < tiles <= splits * per, "an empty split"
    assert K.block_s_for(128, 128) == K.block_s_for(256, 256) == K.block_s_for(192, 128) == 64


def test_kernel_version_registered():
    assert KERNEL_VERSIONS["decode_attention"] == K.KERNEL_VERSION == "decode_attention-3"
