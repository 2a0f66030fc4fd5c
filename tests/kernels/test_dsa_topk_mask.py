"""The DSA top-k mask kernels (kernels/dsa_topk_mask.py) against the float64 truth.

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py), so shapes are small: T up to 100
(never a multiple of a block), H 6 and 16, D 24 and 32, S 1 and 2. Masks: None, bool
(causal-style prefixes of different lengths per batch row, some shorter than topk), additive
(with -inf or bf16's finfo.min), expanded from [1, 1, T] (stride 0). q is a transposed
[B, H, S, D] view and k a transposed [B, D, T] view in some cases. The select runs in
registers and, with a forced small chunk, looped over several chunks, with 1-, 2- and 4-bit
digits. ``keep`` starts as a 0xA5 byte pattern inside a strided buffer with guard bytes on
every side: every element must become 0 or 1, and nothing outside may change.

The truth is ``index_scores_reference(..., dtype=float64)`` then ``keep_from_scores``. keep
must equal it exactly except at positions whose float64 score lies within ``REL *
max|score|`` of the row's k-th score (the kernel sums in fp32, in another order, so those
may swap); the number kept per row must be exactly min(topk, T), or the allowed count when a
bool mask allows fewer, and nothing masked may be kept. The select alone (``select_fwd``) is
checked exactly on crafted fp32 scores: heavy ties, signed zeros, +-inf, negatives.

The ``gpu`` tests run DeepSeek V3.2's indexer shapes on the H200 (H 64, D 128, T 4096, topk
2048, B 1 / 8 / 64, bf16), a row longer than the register select, and CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.kernels import dsa_topk_mask as K  # noqa: E402
from fusion_compiler.ops import dsa_topk_mask as op  # noqa: E402
from fusion_compiler.ops.dsa_topk_mask import index_scores_reference, keep_from_scores  # noqa: E402

REL = {torch.bfloat16: 1e-3, torch.float16: 1e-3, torch.float32: 1e-5}
POISON = 0xA5


def _case(**kw):
    c = dict(batch=3, seq=1, heads=6, dim=24, keys=70, topk=20, dtype=torch.bfloat16, mask="bool",
             q_view=False, k_view=False, k_dtype=None, w_dtype=torch.float32, seed=0)  # fmt: skip
    return {**c, **kw}


def _mask(kind, b, s, t, gen, topk):
    if kind == "none":
        return None
    if kind == "bool_expanded":  # one [T] row for every (b, s): stride 0 on dims 0 and 1
        keep = torch.rand(1, 1, t, generator=gen) < 0.6
        keep[..., 0] = True
        return keep.to(DEVICE).expand(b, s, t)
    # Causal-style prefixes, a different length per batch row; row 0 allows fewer than topk.
    lengths = torch.randint(min(topk + 1, t), t + 1, (b, 1, 1), generator=gen)
    lengths[0] = max(1, min(topk, t) // 2)
    lengths = lengths + torch.arange(s).view(1, s, 1)  # later queries see one key more
    keep = torch.arange(t).view(1, 1, t) < lengths.clamp(max=t)
    if kind == "bool":
        return keep.to(DEVICE)
    masked = torch.finfo(torch.bfloat16).min if kind == "add_min" else float("-inf")
    add = torch.where(keep, torch.randn(keep.shape, generator=gen), masked)
    return add.to(torch.bfloat16 if kind == "add_min" else torch.float32).to(DEVICE)


def _inputs(c):
    gen = torch.Generator().manual_seed(c["seed"])
    b, s, h, d, t, dtype = c["batch"], c["seq"], c["heads"], c["dim"], c["keys"], c["dtype"]
    if c["q_view"]:  # [B, S, H, D] view of a [B, H, S, D] tensor
        q = torch.randn(b, h, s, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    else:
        q = torch.randn(b, s, h, d, generator=gen).to(dtype).to(DEVICE)
    if c["k_view"]:  # [B, T, D] view of a [B, D, T] tensor
        k = torch.randn(b, d, t, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    else:
        k = torch.randn(b, t, d, generator=gen).to(dtype).to(DEVICE)
    k = k if c["k_dtype"] is None else k.to(c["k_dtype"])
    w = torch.randn(b, s, h, generator=gen).to(c["w_dtype"]).to(DEVICE)
    return q, k, w, _mask(c["mask"], b, s, t, gen, c["topk"]), d**-0.5, h**-0.5


def _poisoned_keep(b, s, t):
    """keep [B, S, T] as a strided view into a POISON-filled buffer with guards on each side."""
    buf = torch.empty((b + 2, s, t + 3), dtype=torch.bool, device=DEVICE)
    buf.view(torch.uint8).fill_(POISON)
    return buf, buf[1:-1, :, :t]


def _assert_written(buf, t):
    u = buf.view(torch.uint8)
    inner = u[1:-1, :, :t]
    assert bool(((inner == 0) | (inner == 1)).all()), "a keep element was not written"
    for guard in (u[0], u[-1], u[1:-1, :, t:]):
        assert bool((guard == POISON).all()), "wrote outside keep"


def _assert_keep_ok(keep, q, k, w, mask, scale, wscale, topk, rel):
    truth = index_scores_reference(q, k, w, mask, scale, wscale, dtype=torch.float64)
    ref = keep_from_scores(truth, mask, topk)
    t = truth.shape[-1]
    count = min(topk, t)
    kth = truth.sort(dim=-1, descending=True).values[..., count - 1 : count]
    mag = index_scores_reference(q, k, w, None, scale, wscale, dtype=torch.float64).abs().amax(-1, keepdim=True)
    near = (truth - kth).abs() <= rel * mag  # -inf - -inf is NaN: exact ties at -inf are not "near"
    wrong = (keep != ref) & ~near
    assert not bool(wrong.any()), f"{int(wrong.sum())} positions differ from the truth away from the k-th score"
    if mask is not None and mask.dtype == torch.bool:
        assert not bool((keep & ~mask).any()), "kept a masked position"
        expected = mask.sum(-1).clamp(max=count)
    else:
        expected = torch.full(keep.shape[:-1], count, device=keep.device)
    assert torch.equal(keep.sum(-1), expected), (keep.sum(-1), expected)


def _run(c, **launch):
    q, k, w, mask, scale, wscale = _inputs(c)
    b, s, t = c["batch"], c["seq"], c["keys"]
    buf, keep = _poisoned_keep(b, s, t)
    K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, c["topk"], keep, **launch)
    _assert_written(buf, t)
    rel = REL[c["dtype"]] if q.dtype == k.dtype else REL[torch.float32]  # mixed: fp32 IEEE dot
    _assert_keep_ok(keep, q, k, w, mask, scale, wscale, c["topk"], rel)


def _id(x):
    if isinstance(x, dict) and "mask" in x:
        return f"{x['mask']}-{str(x['dtype']).split('.')[1]}-T{x['keys']}-k{x['topk']}"
    return "-".join(f"{key}{value}" for key, value in x.items()) or "default"


@pytest.mark.parametrize(
    "c, launch",
    [
        # Register select (one block), bool causal mask, row 0 allows fewer than topk.
        (_case(), {}),
        # Looped select over 4 chunks of 16, 4-bit digits, S 2, q a transposed view, -inf mask.
        (_case(mask="add_inf", dtype=torch.float32, seq=2, keys=53, topk=9, q_view=True),
         dict(select_block=16, block_t=16)),
        # HF's finfo.min additive mask with topk beyond the allowed counts (masked positions
        # then tie at finfo.min and go lowest first), k a transposed view, 2-bit looped digits.
        (_case(mask="add_min", keys=45, topk=30, k_view=True, w_dtype=torch.bfloat16),
         dict(select_block=16, radix_bits=2)),
        # No mask, topk 1, 1-bit digits, H 16 and D 32 (no padding), fp16.
        (_case(mask="none", dtype=torch.float16, heads=16, dim=32, keys=100, topk=1, batch=2),
         dict(radix_bits=1, block_t=32)),
        # One bool row expanded over batch and queries (stride 0), looped, S 2.
        (_case(mask="bool_expanded", seq=2, keys=61, topk=12, q_view=True, k_view=True), dict(select_block=32)),
        # bf16 q with fp32 k (the op allows mixed dtypes: IEEE fp32 dot).
        (_case(mask="bool", keys=37, topk=5, batch=2, k_view=True, k_dtype=torch.float32),
         dict(select_block=16, radix_bits=1)),
    ],
    ids=_id,
)
def test_kernel_matches_truth(c, launch):
    _run(c, **launch)


@pytest.mark.parametrize("mask", ["bool", "none", "add_inf"])
@pytest.mark.parametrize("topk, select_block", [(37, None), (50, 16)])
def test_topk_at_least_t_keeps_everything_allowed(mask, topk, select_block):
    """topk >= T: no scores; keep is the bool mask, else all True."""
    c = _case(mask=mask, keys=37, topk=topk, seq=2, batch=2)
    q, k, w, m, scale, wscale = _inputs(c)
    buf, keep = _poisoned_keep(2, 2, 37)
    K.dsa_topk_mask_fwd(q, k, w, m, scale, wscale, topk, keep, select_block=select_block)
    _assert_written(buf, 37)
    expected = m if m is not None and m.dtype == torch.bool else torch.ones_like(keep)
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("select_block, radix_bits", [(None, None), (16, None), (16, 1)])
def test_exact_ties_go_to_the_lower_position(select_block, radix_bits):
    """k holds 12 distinct rows, each repeated at 5 scattered positions: the scores tie exactly
    in groups of 5 (identical products), and topk 13 splits the third group, whose 3 lowest
    positions must be kept, across chunk boundaries when looped. The groups are far apart."""
    gen = torch.Generator().manual_seed(3)
    b, h, d, t, distinct, topk = 2, 6, 24, 60, 12, 13
    q = torch.randn(b, 1, h, d, generator=gen).to(DEVICE)
    w = torch.rand(b, 1, h, generator=gen).add(0.5).to(DEVICE)
    base = torch.randn(b, distinct, d, generator=gen)
    which = torch.stack([torch.randperm(t, generator=gen) % distinct for _ in range(b)])
    k = torch.gather(base, 1, which[..., None].expand(b, t, d)).to(DEVICE)
    truth = index_scores_reference(q, k, w, None, d**-0.5, 1.0, dtype=torch.float64)
    levels = truth[:, 0].sort(dim=-1, descending=True).values[:, ::5]  # one per group
    assert bool((levels[:, :-1] - levels[:, 1:] > 1e-3 * levels.abs().amax(-1, keepdim=True)).all())
    buf, keep = _poisoned_keep(b, 1, t)
    K.dsa_topk_mask_fwd(q, k, w, None, d**-0.5, 1.0, topk, keep, select_block=select_block, radix_bits=radix_bits)
    _assert_written(buf, t)
    assert torch.equal(keep, keep_from_scores(truth, None, topk))


@pytest.mark.parametrize(
    "select_block, radix_bits, topks",
    [(128, 2, (1, 9, 40, 76)), (16, 4, (9, 76)), (128, 1, (40,))],
)
def test_select_exact_on_crafted_scores(select_block, radix_bits, topks):
    """The select alone on fp32 scores with many exact ties, -0.0 and +0.0 (equal: the lower
    position first), negatives, +inf and -inf: exactly keep_from_scores."""
    gen = torch.Generator().manual_seed(5)
    b, s, t = 2, 2, 77
    levels = torch.tensor([float("-inf"), -3.5, -1.0, -0.0, 0.0, 1e-30, 0.25, 2.0, 7.0, float("inf")])
    scores = levels[torch.randint(0, len(levels), (b, s, t), generator=gen)]
    scores[1, 1] = torch.randn(t, generator=gen)  # one row without ties
    scores = scores.to(DEVICE)
    mask = (torch.rand(b, s, t, generator=gen) < 0.8).to(DEVICE)
    for topk in topks:
        for m in (None, mask):
            buf, keep = _poisoned_keep(b, s, t)
            K.select_fwd(scores, m, topk, keep, select_block=select_block, radix_bits=radix_bits)
            _assert_written(buf, t)
            assert torch.equal(keep, keep_from_scores(scores.double(), m, topk)), (topk, m is None)


def test_op_cuda_impl_runs_the_kernel():
    """The op's CUDA implementation (validation, output allocation, launch) on this tier's
    tensors: the registered function called directly."""
    c = _case(batch=2, keys=50, topk=11, mask="bool")
    q, k, w, mask, scale, wscale = _inputs(c)
    keep = op._cuda(q, k, w, mask, scale, wscale, 11)
    assert keep.shape == (2, 1, 50) and keep.dtype == torch.bool and keep.is_contiguous()
    _assert_keep_ok(keep, q, k, w, mask, scale, wscale, 11, REL[torch.bfloat16])


def test_launch_configs_depend_on_shapes_only():
    # DeepSeek V3.2 at T 4096: B 1 has 64 tiles of 64 (< 132 SMs) -> 32; B 8 and 64 keep 64.
    assert K.score_config(1, 4096, True) == (32, 4)
    assert K.score_config(8, 4096, True) == (64, 4)
    assert K.score_config(64, 4096, True) == (64, 4)
    assert K.score_config(1, 4096, False) == (64, 8)
    assert K.select_config(4096) == (4096, 2, True)
    assert K.select_config(70) == (1024, 2, True)
    assert K.select_config(4097) == (1024, 4, False)
    assert K.select_config(163840) == (1024, 4, False)


def test_bad_arguments_are_rejected():
    c = _case(keys=20, topk=5)
    q, k, w, mask, scale, wscale = _inputs(c)
    keep = torch.empty(3, 1, 20, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="keep must be"):
        K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, 5, keep[:, :, :10])
    with pytest.raises(ValueError, match="topk"):
        K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, 0, keep)
    with pytest.raises(ValueError, match="radix_bits"):
        K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, 5, keep, radix_bits=3)


def test_kernel_version_registered():
    assert KERNEL_VERSIONS["dsa_topk_mask"] == K.KERNEL_VERSION == "dsa_topk_mask-1"


# ---------------------------------------------------------------------------------------------
# GPU tier: DeepSeek V3.2's indexer (H 64, D 128, topk 2048) at T 4096 on the H200.
# ---------------------------------------------------------------------------------------------


def _real_inputs(batch, keys, allowed, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 1, 64, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(batch, keys, 128, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.randn(batch, 1, 64, generator=gen, device="cuda").to(torch.bfloat16)
    mask = (torch.arange(keys, device="cuda") < allowed).view(1, 1, keys).expand(batch, 1, keys).contiguous()
    return q, k, w, mask, 128**-0.5, 64**-0.5


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("allowed", [4096, 3000])
def test_gpu_real_shapes(batch, allowed):
    q, k, w, mask, scale, wscale = _real_inputs(batch, 4096, allowed)
    buf, keep = _poisoned_keep(batch, 1, 4096)
    K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, 2048, keep)
    _assert_written(buf, 4096)
    _assert_keep_ok(keep, q, k, w, mask, scale, wscale, 2048, REL[torch.bfloat16])
    # The op's CUDA implementation is the same launch.
    assert torch.equal(torch.ops.fusion_compiler.dsa_topk_mask(q, k, w, mask, scale, wscale, 2048), keep)


@pytest.mark.gpu
@pytest.mark.parametrize("keys", [4097, 40000])
def test_gpu_long_rows_loop_the_select(keys):
    """Rows longer than the register select (SELECT_ROW_MAX) take the looped path."""
    q, k, w, mask, scale, wscale = _real_inputs(4, keys, keys - 123, seed=1)
    buf, keep = _poisoned_keep(4, 1, keys)
    K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, 2048, keep)
    _assert_written(buf, keys)
    _assert_keep_ok(keep, q, k, w, mask, scale, wscale, 2048, REL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    q, k, w, mask, scale, wscale = _real_inputs(8, 4096, 3000, seed=2)
    keep = torch.empty(8, 1, 4096, dtype=torch.bool, device="cuda")
    K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, 2048, keep)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        K.dsa_topk_mask_fwd(q, k, w, mask, scale, wscale, 2048, keep)
    q2, k2, w2, _, _, _ = _real_inputs(8, 4096, 3000, seed=3)
    q.copy_(q2)
    k.copy_(k2)
    w.copy_(w2)
    keep.fill_(False)
    graph.replay()
    torch.cuda.synchronize()
    _assert_keep_ok(keep, q, k, w, mask, scale, wscale, 2048, REL[torch.bfloat16])
