"""The paged decode attention kernel (kernels/paged_decode_attention.py) against ``_attention64``,
the module docstring's formula in float64 written here, apart from ``paged_kv``'s fp32 reference.

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py), so shapes are small: heads / kv heads
12 / 2, 16 / 1 and 32 / 2 (G 6, 16, 16), tiny D 64 / 128 and 96 (not a power of two), caches
in bf16 and FP8 e4m3 with scales, sequences' blocks shuffled over the cache (``random_block_table``)
and each token's context padded to its block table (``padded_context_of``), contexts that are
not multiples of BLOCK_S, holes (context_valid False mid-context) and per-token lengths, one
split (direct write) and several (workspace + combine). Outputs start as NaN with a NaN guard
slab on each side: every element is written, nothing outside; q, the caches, the slots and the
flags are left bit-identical (the kernel only reads the caches). q is bf16, so the MMAs take
bf16 operands and p is rounded to bf16 for P @ V: errors of 1-2e-3 against float64 (norm-wise
and in the worst (token, head) row), checked under 1e-2 for every row.

GPU tier (``-m gpu``): MiniMax-M2.5's real attention shape (48 / 8 / 128, context 4096, block
size 16) at T 1 and 64, bf16 and FP8, through the op itself (its CUDA path is the kernel).
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, HAS_CUDA, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import paged_decode_attention as K  # noqa: E402
from fusion_compiler.model_adapters.reference import paged_kv  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

FP8 = paged_kv.FP8
TOLERANCE = 1e-2


def _inputs(tokens, heads, kv_heads, d, context, cache_dtype, seed, block_size=4, holes=False, dv=None):
    """q [T, heads, D] bf16, K/V caches (random everywhere: stale slots would show), the
    padded context of each token (lengths context + 1 for token 0, shorter for the others),
    scales (1 for bf16: the op takes the scales for FP8 caches only, as vLLM)."""
    gen = torch.Generator().manual_seed(seed)
    dv = dv or d
    num_blocks, table = paged_kv.random_block_table(tokens, context, block_size, gen)
    seq_lens = table["seq_lens"] - torch.randint(0, max(1, context // 2), (tokens,), generator=gen)
    seq_lens[0] = context + 1
    slots, valid = paged_kv.padded_context_of(table["block_table"], seq_lens, block_size)
    if holes:  # positions masked in the middle of a context as well as past its end
        valid &= torch.rand(valid.shape, generator=gen) < 0.8
        valid[:, 0] = True
    fp8 = cache_dtype == FP8
    k_scale, v_scale = (0.37, 0.011) if fp8 else (1.0, 1.0)

    def cache(width, scale):
        values = torch.randn(num_blocks, block_size, kv_heads, width, generator=gen) * (3.0 if fp8 else 1.0)
        return values.to(cache_dtype).to(DEVICE), scale

    (k_cache, k_scale), (v_cache, v_scale) = cache(d, k_scale), cache(dv, v_scale)
    q = torch.randn(tokens, heads, d, generator=gen).bfloat16().to(DEVICE)
    return q, k_cache, v_cache, k_scale, v_scale, slots.to(DEVICE), valid.to(DEVICE)


def _attention64(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid):
    """The module docstring's formula in float64, one token at a time, written apart from
    ``paged_kv``'s reference: gather the valid positions' rows (a slot below 0 reads slot 0),
    dequantise (FP8 code * scale), softmax over them, query head h reading kv head h // G."""
    tokens, heads, d = q.shape
    kv_heads, dv = v_cache.shape[2], v_cache.shape[3]
    k_rows, v_rows = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, dv)
    kv_of_head = torch.arange(heads, device=q.device) // (heads // kv_heads)
    out = torch.empty(tokens, heads, dv, dtype=torch.float64, device=q.device)
    for t in range(tokens):
        slots = context_slots[t][context_valid[t]].clamp(min=0).long()
        keys = k_rows[slots].double() * k_scale  # [n, Hkv, D]
        values = v_rows[slots].double() * v_scale
        scores = torch.einsum("hd,nhd->hn", q[t].double(), keys[:, kv_of_head]) * d**-0.5
        p = torch.softmax(scores, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", p, values[:, kv_of_head])
    return out


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _assert_close64(out, want, what=""):
    """Relative error under TOLERANCE norm-wise and in every (token, head) row (a single wrong
    row would hide in the norm over all of them)."""
    err = out.double() - want
    rel = (err.norm() / want.norm()).item()
    assert rel < TOLERANCE, f"relative error {rel:.3g} {what}"
    rows = err.norm(dim=-1) / want.norm(dim=-1)
    worst = int(rows.argmax())
    assert rows.max().item() < TOLERANCE, \
        f"row (token, head) {divmod(worst, rows.shape[1])}: relative error {rows.max().item():.3g} {what}"


def _check(args, splits=None, block_s=None):
    """Kernel into a NaN-poisoned output with guard slabs, against ``_attention64``; every input
    (the caches included: the kernel only reads them) left bit-identical."""
    q, k_cache, v_cache, k_scale, v_scale, slots, valid = args
    before = [_bytes(t).clone() for t in (q, k_cache, v_cache, slots, valid)]
    want = _attention64(*args)
    buf, out = poisoned((q.shape[0], q.shape[1], v_cache.shape[3]), torch.float32)
    got = K.paged_decode_attention_fwd(*args, out=out, splits=splits, block_s=block_s)
    assert got is out
    assert_guards_untouched(buf)
    assert not bool(torch.isnan(out).any()), "an output element was not written"
    _assert_close64(out, want, f"(splits={splits}, block_s={block_s})")
    for name, t, b in zip(("q", "k_cache", "v_cache", "context_slots", "context_valid"), args[:3] + args[5:], before):
        assert torch.equal(_bytes(t), b), f"{name} changed"
    return out


# (tokens, heads, kv_heads, d, context, cache dtype, splits, block_s, holes): contexts 37..70 in
# tiles of 16 / 64 (never a multiple), G 6 / 16 / 16.
CASES = [
    (3, 12, 2, 64, 45, torch.bfloat16, 1, 16, False),
    (3, 12, 2, 64, 45, FP8, 3, 16, True),
    (2, 16, 1, 128, 70, torch.bfloat16, None, 16, True),
    (2, 16, 1, 128, 70, FP8, 1, None, False),
    (1, 32, 2, 96, 37, torch.bfloat16, 2, 16, True),
    (2, 32, 2, 96, 50, FP8, None, None, True),
]


@pytest.mark.parametrize(
    "tokens, heads, kv_heads, d, context, cache_dtype, splits, block_s, holes",
    CASES,
    ids=[f"{c[1]}x{c[2]}-d{c[3]}-ctx{c[4]}-{str(c[5]).split('.')[1]}-splits{c[6]}" for c in CASES],
)
def test_kernel_matches_reference(tokens, heads, kv_heads, d, context, cache_dtype, splits, block_s, holes):
    args = _inputs(tokens, heads, kv_heads, d, context, cache_dtype, seed=context + d, holes=holes)
    _check(args, splits, block_s)


def test_mha_and_separate_value_width():
    """G = 1 (one query head per kv head) and Dv != D; block size 16 as the references use."""
    args = _inputs(2, 3, 3, 64, 40, torch.bfloat16, seed=5, block_size=16, dv=32)
    _check(args, splits=2, block_s=16)


def test_split_counts_agree():
    """One split, a short last split and one split per tile give the same attention."""
    args = _inputs(2, 12, 2, 64, 70, FP8, seed=7, holes=True)
    outs = [_check(args, splits, 16) for splits in (1, 3, 5)]
    for other in outs[1:]:
        assert relative_error(other, outs[0]) < 2e-3  # p rounds to bf16 against each split's own max


def test_negative_slots_are_never_read_at_padded_positions():
    """vLLM pads with slot -1: masked positions with slot -1 (or a slot past the cache) take no
    weight and load nothing."""
    q, k_cache, v_cache, k_scale, v_scale, slots, valid = _inputs(3, 12, 2, 64, 30, torch.bfloat16, seed=11, holes=True)
    bad = torch.where(torch.rand(slots.shape) < 0.5, -1, 10**9).to(slots)
    _check((q, k_cache, v_cache, k_scale, v_scale, torch.where(valid, slots, bad), valid), splits=2, block_s=16)


def test_fp8_nan_codes_propagate():
    """An FP8 NaN (0x7F) in a K row a token reads makes that token's output NaN for the query
    heads of that kv head (the interpreter would decode it as 480); every other row as float64."""
    args = _inputs(2, 12, 2, 64, 20, FP8, seed=13)
    q, k_cache, v_cache, k_scale, v_scale, slots, valid = args
    k_cache.view(-1, 2, 64).view(torch.uint8)[slots[0, 3], 1, 5] = 0x7F
    buf, out = poisoned((2, 12, 64), torch.float32)
    K.paged_decode_attention_fwd(*args, out=out)
    want = _attention64(*args)
    assert_guards_untouched(buf)
    assert bool(torch.isnan(want[0, 6:]).all()) and bool(torch.isnan(out[0, 6:]).all())
    assert not bool(torch.isnan(out[0, :6]).any()) and not bool(torch.isnan(out[1]).any())
    _assert_close64(torch.cat([out[0, :6], out[1]])[None], torch.cat([want[0, :6], want[1]])[None])


def test_unsupported_arguments_are_named():
    q, k_cache, v_cache, _, _, slots, valid = _inputs(1, 12, 2, 64, 10, torch.bfloat16, seed=1)
    assert K.unsupported(q, k_cache, v_cache, slots, valid) is None
    dtypes = "q must be fp16 / bf16 / fp32 and each cache q's dtype or FP8 e4m3"
    assert K.unsupported(q, k_cache, v_cache.float(), slots, valid).startswith(dtypes)  # neither q's dtype nor FP8
    assert K.unsupported(q.float(), k_cache, v_cache, slots, valid).startswith(dtypes)
    assert K.unsupported(q.double(), k_cache.double(), v_cache.double(), slots, valid).startswith(dtypes)
    assert K.unsupported(q, k_cache, v_cache, slots[:, :0], valid[:, :0]) == "an empty context (C = 0)"
    assert "head dims up to 256" in K.unsupported(q.new_zeros(1, 12, 320), k_cache.new_zeros(3, 4, 2, 320),
                                                  v_cache.new_zeros(3, 4, 2, 320), slots, valid)  # fmt: skip
    assert "shapes do not fit" in K.unsupported(q[:, :11], k_cache, v_cache, slots, valid)  # 11 heads over 2
    assert "context_valid bool" in K.unsupported(q, k_cache, v_cache, slots, valid.int())
    with pytest.raises(ValueError, match="q must be"):
        K.paged_decode_attention_fwd(q.half(), k_cache, v_cache, 1.0, 1.0, slots, valid)


def test_op_cpu_path_still_gathers():
    """The op on CPU tensors keeps the gather + SDPA path (the kernel path is for CUDA)."""
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in _inputs(2, 12, 2, 64, 30, FP8, seed=3, holes=True)]
    out = paged_kv.paged_decode_attention(*args, 2)
    assert out.dtype == torch.float32 and out.shape == (2, 12, 64)
    assert relative_error(out, _attention64(*args)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_minimax_shape_on_cuda(tokens, cache_dtype):
    """MiniMax-M2.5's attention (48 query heads over 8 kv heads, D 128), context 4096 in blocks
    of 16, through the op (whose CUDA path is the kernel) and the kernel with forced splits."""
    args = _inputs(tokens, 48, 8, 128, 4096, cache_dtype, seed=tokens, block_size=16, holes=True)
    out = torch.ops.fusion_compiler_ref.paged_decode_attention(*args)
    assert out.dtype == torch.float32 and out.shape == (tokens, 48, 128)
    _assert_close64(out, _attention64(*args), "(the op)")
    for splits in (1, 7):
        _check(args, splits=splits)
