"""The GQA prologue kernel (kernels/gqa_prologue.py) against ``gqa_prologue_reference``.

CPU tier: under TRITON_INTERPRET=1 (tests/conftest.py). q/k/v are [T, heads, D] views of one
fused qkv tensor (row stride > width; with ``gated`` q sits inside Qwen3.5's per-head [q | gate]
rows, head stride 2D), caches are paged, HF's heads-first static layout or HF continuous
batching's flat [slots, kv_heads, D] (the op hands the kernel blocks of one row), poisoned outside the
written slots and checked unchanged there, slots include -1; cos / sin are fp32 tables read at
positions (vLLM) or per-token rows in the activation dtype (HF; with ``cos_rows`` fewer rows than
tokens, each serving the tokens t with t % rows equal: HF's [1, S] position_ids broadcast over the
batch). Outputs: bf16 equal to the reference except a few elements one ulp apart (rsqrt's last
bit), FP8 codes equal except a few one code apart; every output is also checked against the
reference's math in float64 (fp32 activations to 2e-6, bf16 to bf16 tolerance), and the cache
bytes outside the written slots against their poison. The rounding flags (``round_normalized``:
MiniMax's HF norm, and HF's plain per-head norm of Qwen3-MoE / GLM-4-MoE; ``round_rope_products``: HF's bf16 RoPE), full-head RoPE and fp32 activations
are drawn too. With ``tp`` the full-width norm takes its means of squares as inputs (a
tensor-parallel rank: the all-reduced [T, 2] sums' columns, strided, and the world size), which
are *not* those of its own rows, so a kernel that summed its rows anyway would fail. The local
means (``_variance_kernel``) equal torch's mean to fp32 rounding of the sum.
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, INT_VIEW, assert_fp8_close, skip_unless_kernels_can_run

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis_profile import examples  # noqa: E402

skip_unless_kernels_can_run()

from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.kernels import gqa_prologue as K  # noqa: E402
from fusion_compiler.ops import gqa_prologue as ops  # noqa: E402
from fusion_compiler.ops.gqa_prologue import gqa_prologue_reference, gqa_prologue_variance_reference  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

FP8 = torch.float8_e4m3fn


def _cos_sin(max_pos, rot, gen):
    angles = torch.rand(max_pos, rot // 2, generator=gen) * 6.28
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)


def _assert_bf16_close(out, ref, what):
    a, b = out.cpu().view(INT_VIEW[out.dtype]).int(), ref.cpu().view(INT_VIEW[ref.dtype]).int()
    diff = (a - b).abs()
    assert int((diff > 0).sum()) <= max(2, a.numel() // 100), f"{what}: {int((diff > 0).sum())} of {a.numel()} differ"
    assert int(diff.max()) <= 1, f"{what}: differs by more than one ulp"


def _run(c, config=None):
    gen = torch.Generator().manual_seed(c["seed"])
    t, hq, hkv, d, rot = c["tokens"], c["kv_heads"] * c["group"], c["kv_heads"], c["head_dim"], c["rotary_dim"]
    act = c.get("dtype", torch.bfloat16)
    q_width = 2 * hq * d if c.get("gated") else hq * d
    qkv = (torch.randn(t, q_width + 2 * hkv * d + 8, generator=gen) * 2).to(act).to(DEVICE)
    q = qkv[:, :q_width].view(t, hq, -1)[..., :d]  # gated: q is each head's first half
    k = qkv[:, q_width : q_width + hkv * d].view(t, hkv, d)
    v = qkv[:, q_width + hkv * d : q_width + 2 * hkv * d].view(t, hkv, d)
    width_q, width_k = (hq * d, hkv * d) if c["full_width"] else (d, d)
    qw = (torch.randn(width_q, generator=gen) * 0.3 + (0 if c["offset"] else 1)).to(act).to(DEVICE)
    kw = (torch.randn(width_k, generator=gen) * 0.3 + (0 if c["offset"] else 1)).to(act).to(DEVICE)
    if c.get("no_norm"):  # an attention without q/k norms: q/k enter RoPE as they are
        qw = kw = None
    blocks, block_size = 3 + t, 4
    heads_first = c.get("heads_first", False)
    cache_dtype = FP8 if c["fp8"] else act
    shape = (blocks, hkv, block_size, d) if heads_first else (blocks, block_size, hkv, d)
    flat = c.get("flat", False)  # HF continuous batching: one row a slot
    shape = (blocks * block_size, hkv, d) if flat else shape
    k_cache = torch.randn(*shape, generator=gen).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(*shape, generator=gen).to(cache_dtype).to(DEVICE)
    slots = torch.randperm(blocks * block_size, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.25] = -1
    if c.get("hf_angles"):  # HF: rows of cat(freqs, freqs) in x's dtype; the op reads the first half
        angles = (torch.rand(c.get("cos_rows") or t, rot // 2, generator=gen) * 6.28).repeat(1, 2)
        cos, sin, positions = angles.cos().to(act)[:, : rot // 2], angles.sin().to(act)[:, : rot // 2], None
    else:
        table = _cos_sin(64, rot, gen)
        cos, sin, positions = table[:, : rot // 2], table[:, rot // 2 :], torch.randint(0, 64, (t,), generator=gen)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    positions = None if positions is None else positions.to(DEVICE)
    args = (q, k, v, qw, kw, 1e-6, 1.0 if c["offset"] else 0.0, c["full_width"], cos, sin, positions)
    tail = (slots.to(DEVICE), 0.5, 0.25, heads_first, *_variances(c, t, gen), c.get("round_normalized", False),
            c.get("round_rope", False))  # fmt: skip
    pairs = c.get("interleaved_rope", False)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = gqa_prologue_reference(*args, k_ref, v_ref, *tail, pairs)
    q_out = torch.full((t, hq, d), float("nan"), dtype=act, device=DEVICE)
    pristine = k_cache.clone(), v_cache.clone()
    kernel_caches = [ops.paged_view(x, False) if flat else x for x in (k_cache, v_cache)]  # as the op's body does
    K.gqa_prologue_fwd(*args, *kernel_caches, *tail, q_out, config=config, interleaved_rope=pairs)
    _assert_against_float64(q_out, k_cache, v_cache, pristine, args, tail, pairs)
    if act == torch.float32:  # fp32: another summation order is another last bit; float64 decides
        return
    _assert_bf16_close(q_out, q_ref, "q_out")
    for name, got, want in (("k_cache", k_cache, k_ref), ("v_cache", v_cache, v_ref)):
        if c["fp8"]:
            assert_fp8_close(got, want, name)
        else:
            _assert_bf16_close(got, want, name)


def _assert_against_float64(q_out, k_cache, v_cache, pristine, args, tail, pairs=False):
    """The kernel's q and written K / V rows against the reference's math on float64 copies of
    its inputs (the rounding flags then round nothing: the exact values), and every cache byte
    outside the written slots equal to its poison."""
    q, k, v, qw, kw, eps, offset, full_width, cos, sin, positions = args
    slots, k_scale, v_scale, heads_first, q_var, k_var, divisor, round_normalized, round_rope = tail
    q64, k64, v64, cos64, sin64 = (x.cpu().double() for x in (q, k, v, cos, sin))
    qw64, kw64 = (None if w is None else w.cpu().double() for w in (qw, kw))
    variances = [None if x is None else x.cpu().double() for x in (q_var, k_var)]
    cos64, sin64 = ops._cos_sin(cos64, sin64, None if positions is None else positions.cpu(), q.shape[0])
    rot = 2 * cos.shape[-1]
    norm = (eps, offset, full_width, round_normalized)
    want_q = ops._rope(ops._norm(q64, qw64, *norm, variances[0], divisor), cos64, sin64, rot, round_rope, pairs)
    want_k = ops._rope(ops._norm(k64, kw64, *norm, variances[1], divisor), cos64, sin64, rot, round_rope, pairs)
    tolerance = 2e-6 if q.dtype == torch.float32 else 1e-2
    slots = slots.cpu()
    written = slots[slots >= 0]
    assert torch.isfinite(q_out).all(), "q_out left unwritten (poisoned NaN)"
    assert relative_error(q_out.cpu().double(), want_q) < tolerance
    for cache, before, want, scale in ((k_cache, pristine[0], want_k, k_scale), (v_cache, pristine[1], v64, v_scale)):
        paged, paged_before = ops.paged_view(cache, heads_first).cpu(), ops.paged_view(before, heads_first).cpu()
        rows = paged.reshape(-1, *paged.shape[2:])
        untouched = torch.ones(rows.shape[0], dtype=torch.bool)
        untouched[written] = False
        before_rows = paged_before.reshape(-1, *paged.shape[2:])
        assert torch.equal(rows[untouched].view(torch.uint8), before_rows[untouched].view(torch.uint8))
        got = rows[written].double() * (scale if cache.dtype == FP8 else 1.0)
        step = 2**-3 if cache.dtype == FP8 else tolerance  # e4m3: 3 mantissa bits
        assert relative_error(got, want[slots >= 0]) < step


def _variances(c, tokens, gen):
    """(q_variance, k_variance, divisor): with ``tp``, columns of an all-reduced [T, 2] of sums
    of the ranks' means (stride 2, as the graph's split hands them over) and the world size."""
    if not c.get("tp"):
        return None, None, 1.0
    world = c["tp"]
    sums = (torch.rand(tokens, 2, generator=gen) * 3 + 0.05) * world
    sums = sums.to(DEVICE)
    return sums[:, :1], sums[:, 1:], float(world)


@st.composite
def configs(draw):
    head_dim = draw(st.sampled_from([16, 32, 48]))
    tokens = draw(st.integers(1, 6))
    return dict(
        tokens=tokens, kv_heads=draw(st.sampled_from([1, 2, 3])), group=draw(st.sampled_from([1, 2, 3])),
        head_dim=head_dim, rotary_dim=draw(st.sampled_from([r for r in (8, 16, head_dim) if r <= head_dim])),
        full_width=draw(st.booleans()), offset=draw(st.booleans()), fp8=draw(st.booleans()),
        gated=draw(st.booleans()), heads_first=draw(st.booleans()), hf_angles=draw(st.booleans()),
        cos_rows=draw(st.sampled_from([r for r in range(1, tokens + 1) if tokens % r == 0])),
        round_normalized=draw(st.booleans()), round_rope=draw(st.booleans()), interleaved_rope=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


@st.composite
def tp_configs(draw):
    """A tensor-parallel rank's full-width prologue: paged cache, vLLM tables (the TP patterns'
    layout), given means of squares over 2-8 ranks."""
    return {**draw(configs()), "full_width": True, "offset": False, "gated": False, "heads_first": False,
            "hf_angles": False, "round_rope": False, "tp": draw(st.sampled_from([2, 3, 8]))}  # fmt: skip


@settings(max_examples=examples(20), deadline=None)
@given(c=configs())
def test_kernel_matches_reference(c):
    _run(c)


@pytest.mark.parametrize("model", ["minimax", "qwen"])
def test_model_layouts(model):
    """MiniMax: 6 q / 2 kv heads of 64, full-width norm, RoPE on 32 of 64 (the tiny layout of
    48 / 8 x 128, 64 of 128); Qwen3.5: per-head Gemma norm, RoPE on 16 of 64 (1/4, like 64 of 256)."""
    c = dict(tokens=4, kv_heads=2, group=3, head_dim=64, seed=7, fp8=False)
    if model == "minimax":
        c.update(rotary_dim=32, full_width=True, offset=False)
    else:
        c.update(rotary_dim=16, full_width=False, offset=True, gated=True)
    _run(c)
    _run({**c, "fp8": True})
    # HF's static cache, per-token angles and HF's roundings (MiniMax's norm rounds x * rstd first)
    hf = {**c, "heads_first": True, "hf_angles": True, "round_rope": True, "round_normalized": model == "minimax"}
    _run(hf)
    _run({**hf, "cos_rows": 2})  # HF's default [1, S] position_ids: 2 sequences of 2 tokens, rows by position
    _run({**hf, "cos_rows": 1, "rotary_dim": 64, "dtype": torch.float32})  # full RoPE, fp32, one row for all


@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["qwen3-moe-full-rope", "glm4-moe-half-rope"])
def test_hf_per_head_plain_norm(rotary_dim):
    """Qwen3-MoE's and GLM-4-MoE's HF prologue: per-head plain norm (weight [D], offset 0) that
    rounds x * rstd before the weight multiply, HF's static cache, angles and RoPE roundings;
    RoPE over the whole head (Qwen3-MoE) or half of it (GLM-4-MoE). bf16 and fp32, each also
    against float64."""
    c = dict(tokens=4, kv_heads=2, group=2, head_dim=64, rotary_dim=rotary_dim, seed=11, fp8=False,
             full_width=False, offset=False, heads_first=True, hf_angles=True, round_rope=True,
             round_normalized=True)  # fmt: skip
    _run(c)
    _run({**c, "cos_rows": 2, "dtype": torch.float32})


@settings(max_examples=examples(15), deadline=None)
@given(c=tp_configs())
def test_kernel_with_given_variances_matches_reference(c):
    _run(c)


def _head_blocks_of(lanes: int) -> K.GqaPrologueConfig:
    """Head blocks of ``lanes`` lanes at any token count (whole tiles never)."""
    return K.GqaPrologueConfig(whole_tiles_up_to=0, block_lanes_full_width_norm=lanes, block_lanes_per_head_norm=lanes)


def test_given_variances_over_head_blocks():
    """The given rstd holds for every head block (MiniMax's 6 / tp heads of 128 at 4096 tokens)."""
    _run(dict(tokens=3, kv_heads=2, group=3, head_dim=64, seed=5, fp8=True, rotary_dim=32, full_width=True,
              offset=False, tp=2), _head_blocks_of(64))  # fmt: skip


@settings(max_examples=examples(15), deadline=None)
@given(tokens=st.integers(1, 5), q_width=st.integers(1, 2600), k_width=st.integers(1, 300),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_variance_kernel_matches_reference(tokens, q_width, k_width, dtype, seed):
    """Local means of squares of q and k rows read in place from one qkv row (row stride > width)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, q_width + 2 * k_width + 3, generator=gen) * 3).to(dtype).to(DEVICE)
    q, k = qkv[:, :q_width], qkv[:, q_width : q_width + k_width]
    out = torch.full((tokens, 2), float("nan"), device=DEVICE)
    K.gqa_prologue_variance_fwd(q, k, out)
    torch.testing.assert_close(out.cpu(), gqa_prologue_variance_reference(q, k).cpu(), rtol=2e-6, atol=0)


@settings(max_examples=examples(12), deadline=None)
@given(c=configs())
def test_kernel_without_qk_norms_matches_reference(c):
    """No q/k norms (Mixtral, Qwen2-MoE, GLM-4-MoE without use_qk_norm): RoPE and the cache write
    alone, every layout, rotary width, cache dtype and rounding flag drawn (the norm's are moot)."""
    _run({**c, "no_norm": True, "full_width": False, "offset": False})


@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["mixtral-full-rope", "glm4-moe-half-rope"])
def test_hf_without_qk_norms(rotary_dim):
    """HF's prologue with no q/k norms: the projections' bf16 rows straight into HF's RoPE
    (every product rounded), HF's static cache; full RoPE (Mixtral, Qwen2-MoE, Llama) or half the
    head (GLM-4-MoE's default). bf16 and fp32, against float64 too; one head a block (the launch
    above WHOLE_TILES_UP_TO tokens) as well."""
    c = dict(tokens=4, kv_heads=2, group=2, head_dim=32, rotary_dim=rotary_dim, seed=17, fp8=False,
             full_width=False, offset=False, heads_first=True, hf_angles=True, round_rope=True, no_norm=True)  # fmt: skip
    _run(c)
    _run({**c, "cos_rows": 2, "dtype": torch.float32})
    _run(c, _head_blocks_of(32))


@pytest.mark.parametrize("rotary_dim", [16, 32], ids=["glm4-half-rope", "full-rope"])
def test_hf_gptj_pairs_without_qk_norms(rotary_dim):
    """HF GLM-4's prologue: no q/k norms, GPT-J pairs (2i, 2i + 1) over half the head (or all of
    it), every bf16 product rounded, HF's static cache. bf16 and fp32, against float64 too, whole
    tiles and one head a block; an FP8 paged cache with vLLM's tables as well."""
    c = dict(tokens=4, kv_heads=2, group=2, head_dim=32, rotary_dim=rotary_dim, seed=19, fp8=False,
             full_width=False, offset=False, heads_first=True, hf_angles=True, round_rope=True, no_norm=True,
             interleaved_rope=True)  # fmt: skip
    _run(c)
    _run({**c, "cos_rows": 2, "dtype": torch.float32})
    _run(c, _head_blocks_of(32))
    _run({**c, "heads_first": False, "hf_angles": False, "round_rope": False, "fp8": True})


@pytest.mark.parametrize("norm", ["none", "per_head", "gemma"])
def test_hf_continuous_batching_flat_cache(norm):
    """HF's ``generate_batch``: HF's prologue (no q/k norms as Qwen2 / Llama, Qwen3's plain per-head
    norm, or a Gemma one), full NeoX RoPE in the activation dtype, K / V written into a flat [slots,
    kv_heads, D] cache at slots. bf16 and fp32 against float64 and the reference, RoPE over half
    the head as well."""
    c = dict(tokens=5, kv_heads=2, group=2, head_dim=32, rotary_dim=32, seed=23, fp8=False, full_width=False,
             offset=norm == "gemma", hf_angles=True, round_rope=True, no_norm=norm == "none", flat=True,
             round_normalized=norm == "per_head")  # fmt: skip
    _run(c)
    _run({**c, "cos_rows": 5, "dtype": torch.float32, "rotary_dim": 16})


def test_padding_tokens_share_a_trash_slot_of_a_flat_cache():
    """HF's continuous batching pads the step and writes every padding token to one trash slot
    (never read back): the op writes the real slots as the reference does, and the trash slot
    with one of the padding tokens' rows, as ``index_copy_`` with repeated indices does."""
    from fusion_compiler.ops.gqa_prologue import _cuda

    gen = torch.Generator().manual_seed(5)
    t, hq, hkv, d, trash = 6, 4, 2, 32, 19
    q = torch.randn(t, hq, d, generator=gen).bfloat16().to(DEVICE)
    k, v = (torch.randn(t, hkv, d, generator=gen).bfloat16().to(DEVICE) for _ in range(2))
    angles = torch.rand(t, d // 2, generator=gen) * 6.28
    cos, sin = angles.cos().bfloat16().to(DEVICE), angles.sin().bfloat16().to(DEVICE)
    slots = torch.tensor([7, 2, 11, trash, trash, trash]).to(DEVICE)
    cache = torch.randn(20, hkv, d, generator=gen).bfloat16().to(DEVICE)
    caches, ref_caches = [cache.clone(), cache.clone()], [cache.clone(), cache.clone()]
    args = [q, k, v, None, None, 1e-6, 0.0, False, cos, sin, None]
    tail = [slots, 1.0, 1.0, False, None, None, 1.0, False, True]
    q_out = _cuda(*args, *caches, *tail)
    q_ref = gqa_prologue_reference(*args, *ref_caches, *tail)
    _assert_bf16_close(q_out, q_ref, "q_out")
    # Each token's own K / V rows: the reference on a scratch cache, one slot a token.
    rows = [torch.zeros_like(cache), torch.zeros_like(cache)]
    gqa_prologue_reference(*args, *rows, torch.arange(t).to(DEVICE), *tail[1:])
    others = torch.ones(20, dtype=torch.bool)
    others[slots.cpu()] = False
    for got, want, own in zip(caches, ref_caches, rows):
        got, want, own = got.cpu(), want.cpu(), own.cpu()
        _assert_bf16_close(got[slots[:3].cpu()], want[slots[:3].cpu()], "real slots")
        assert torch.equal(got[others].view(torch.int16), cache[others].cpu().view(torch.int16))
        diffs = [(got[trash].float() - own[i].float()).abs().max().item() for i in range(3, t)]
        assert min(diffs) <= 2 ** -6 * own[3:t].abs().max().item(), f"trash slot is no padding row: {diffs}"


def test_kernel_version_registered():
    assert KERNEL_VERSIONS["gqa_prologue"] == K.KERNEL_VERSION == "gqa_prologue-16"


@pytest.mark.parametrize("lanes", [64, 256])  # 1 and 4 heads a block: q in 6 and 2 (one ragged) blocks
@pytest.mark.parametrize("model", ["minimax", "qwen"])
def test_head_blocks(model, lanes):
    """The kernel walks heads a block at a time (the full-width sum over every block first);
    the real widths take several blocks (48 x 128 -> 6 of 8), the tiny tests above take one."""
    c = dict(tokens=3, kv_heads=2, group=3, head_dim=64, seed=11, fp8=model == "minimax", rotary_dim=32 if model == "minimax" else 16)
    c.update(full_width=model == "minimax", offset=model == "qwen", gated=model == "qwen", heads_first=model == "qwen")
    _run(c, _head_blocks_of(lanes))


@pytest.mark.parametrize("tp", [False, True])
def test_op_device_body_with_and_without_variances(tp):
    """The op's CUDA registration (defaults filled in, q_out allocated) on this tier's tensors:
    called with the 17 single-rank arguments only, and with the TP ones."""
    from fusion_compiler.ops.gqa_prologue import _cuda

    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 3, 4, 2, 32
    q = torch.randn(t, hq, d, generator=gen).bfloat16().to(DEVICE)
    k, v = (torch.randn(t, hkv, d, generator=gen).bfloat16().to(DEVICE) for _ in range(2))
    qw, kw = torch.rand(hq * d, generator=gen).to(DEVICE), torch.rand(hkv * d, generator=gen).to(DEVICE)
    table = _cos_sin(16, 16, gen)
    cache = torch.randn(4, 4, hkv, d, generator=gen).bfloat16().to(DEVICE)
    args = [q, k, v, qw, kw, 1e-6, 0.0, True, table[:, :8], table[:, 8:], torch.tensor([1, 7, 3]).to(DEVICE)]
    tail = [torch.tensor([0, -1, 9]).to(DEVICE), 1.0, 1.0, False]
    extra = [(torch.rand(t, 1, generator=gen) + 0.5).to(DEVICE), (torch.rand(t, 1, generator=gen) + 0.5).to(DEVICE), 2.0] if tp else []
    caches, ref_caches = [cache.clone(), cache.clone()], [cache.clone(), cache.clone()]
    q_out = _cuda(*args, *caches, *tail, *extra)
    q_ref = gqa_prologue_reference(*args, *ref_caches, *tail, *extra)
    _assert_bf16_close(q_out, q_ref, "q_out")
    for got, want in zip(caches, ref_caches):
        _assert_bf16_close(got, want, "cache")


@pytest.mark.parametrize("interleaved, kv_one_program", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("model", ["minimax", "qwen"])
def test_grid_orders(model, interleaved, kv_one_program):
    """The role-fastest 1-D grid, and k's program also caching v, compute what the (tokens, 3)
    grid does, with an FP8 cache (``_run`` gives about a quarter of the tokens slot -1 and
    compares the whole caches)."""
    c = dict(tokens=5, kv_heads=2, group=3, head_dim=64, seed=13, fp8=model == "minimax", rotary_dim=32 if model == "minimax" else 16)
    c.update(full_width=model == "minimax", offset=model == "qwen", gated=model == "qwen")
    _run(c, K.GqaPrologueConfig(interleave_roles=interleaved, kv_one_program=kv_one_program))

