"""fusion_compiler::gqa_prologue's reference against the MiniMax-M2.5 serving-engine reference
attention (full-width norm), against a per-head Gemma composition (Qwen3.5's form), and against
HF's own RoPE without q/k norms (Mixtral, GLM-4-MoE without use_qk_norm; GLM-4's interleaved
GPT-J pairs with ``interleaved_rope``)."""

from __future__ import annotations

import pytest
import torch

from fusion_compiler.model_adapters.reference import minimax_m2 as ref
from fusion_compiler.ops import gqa_prologue as op
from fusion_compiler.verify import relative_error


def _caches(cfg, blocks=5, dtype=torch.bfloat16):
    k = torch.randn(blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim).to(dtype)
    return k, torch.randn_like(k, dtype=torch.float32).to(dtype)


def test_matches_the_minimax_reference_prologue():
    cfg = ref.TINY
    torch.manual_seed(0)
    attn = ref.Attention(cfg).to(torch.bfloat16)
    with torch.no_grad():
        attn.q_norm_weight.normal_(1.0, 0.1)
        attn.k_norm_weight.normal_(1.0, 0.1)
    x = torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16)
    positions, slots = torch.tensor([7, 0, 33]), torch.tensor([9, 41, 40])
    table = ref.rope_cos_sin_cache(cfg)
    k_ref, v_ref = _caches(cfg)
    k_op, v_op = k_ref.clone(), v_ref.clone()
    with torch.no_grad():
        q_ref = attn.prologue(x, table, positions, slots, k_ref, v_ref, 1.0, 1.0)
        q, k, v = attn.qkv_proj(x).split([cfg.q_width, cfg.kv_width, cfg.kv_width], dim=-1)
        half = cfg.rotary_dim // 2
        q_out = torch.ops.fusion_compiler.gqa_prologue(
            q.view(3, cfg.num_heads, -1), k.view(3, cfg.num_kv_heads, -1), v.view(3, cfg.num_kv_heads, -1),
            attn.q_norm_weight, attn.k_norm_weight, cfg.rms_norm_eps, 0.0, True, table[:, :half], table[:, half:],
            positions, k_op, v_op, slots, 1.0, 1.0, False, round_normalized=True,
        )  # fmt: skip
    # The reference's norm rounds as HF's (``weight * x.to(dtype)``), its RoPE once in fp32 as
    # vLLM's: the op with round_normalized gives its bits.
    assert torch.equal(q_out, q_ref)
    assert torch.equal(k_op, k_ref)
    assert torch.equal(v_op, v_ref)  # v is copied as it is
    untouched = torch.ones(k_op.shape[0] * k_op.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_op.view(-1, *k_op.shape[2:])[untouched], k_ref.view(-1, *k_ref.shape[2:])[untouched])


def test_per_head_gemma_norm_and_fp8_cache():
    cfg = ref.ReferenceConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=8, block_size=4)
    q = torch.randn(2, 4 * 32, dtype=torch.bfloat16)
    k, v = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(2, 64, dtype=torch.bfloat16)
    qw, kw = torch.randn(32) * 0.1, torch.randn(32) * 0.1
    table = ref.rope_cos_sin_cache(cfg)
    k_cache, v_cache = _caches(cfg, dtype=torch.float8_e4m3fn)
    positions, slots = torch.tensor([3, 11]), torch.tensor([0, 13])
    q_out = op.gqa_prologue_reference(
        q.view(2, 4, 32), k.view(2, 2, 32), v.view(2, 2, 32), qw, kw, 1e-6, 1.0, False, table[:, :4], table[:, 4:],
        positions, k_cache, v_cache, slots, 0.5, 0.25,
    )  # fmt: skip
    # The same math spelled out: Gemma x * (1 + w) per head, then RoPE on 8 of 32 dims.
    h = q.float().view(2, 4, 32)
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + qw)).bfloat16()
    cos, sin = table[positions].chunk(2, dim=-1)
    first, second = normed[..., :4].float(), normed[..., 4:8].float()
    c, s = cos[:, None], sin[:, None]
    expected = torch.cat([(first * c - second * s).bfloat16(), (second * c + first * s).bfloat16(), normed[..., 8:]], -1)
    assert torch.equal(q_out, expected)
    v_rows = v_cache.view(-1, 2, 32)[slots].float() * 0.25
    assert (v_rows - v.float().view(2, 2, 32)).abs().max() <= 0.0625 * v.float().abs().max()  # e4m3 step


# ------------------------------------------------------------------------------------------
# Tensor parallelism: the means of squares given (q_variance / k_variance / variance_divisor)
# ------------------------------------------------------------------------------------------


def _tp_case(world: int = 2, tokens: int = 3):
    """A single-rank MiniMax layout split over ``world`` ranks: per rank its heads, weight shards
    and caches; the all-reduced sums of the ranks' local means, as the graph has them."""
    cfg = ref.TINY
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(tokens, cfg.q_width, generator=gen).bfloat16()
    k, v = (torch.randn(tokens, cfg.kv_width, generator=gen).bfloat16() for _ in range(2))
    qw, kw = ((torch.randn(w, generator=gen) * 0.1 + 1).bfloat16() for w in (cfg.q_width, cfg.kv_width))
    table = ref.rope_cos_sin_cache(cfg)
    positions, slots = torch.tensor([7, 0, 33]), torch.tensor([9, 41, 40])
    half = cfg.rotary_dim // 2
    ranks = []
    for r in range(world):
        qs, ks = q.chunk(world, -1)[r], k.chunk(world, -1)[r]
        ranks.append(dict(q=qs, k=ks, v=v.chunk(world, -1)[r], qw=qw.chunk(world)[r], kw=kw.chunk(world)[r],
                          local=op.gqa_prologue_variance_reference(qs, ks)))  # fmt: skip
    sums = sum(r["local"] for r in ranks)
    common = (cfg.rms_norm_eps, 0.0, True, table[:, :half], table[:, half:], positions)
    return cfg, q, k, v, qw, kw, ranks, sums, common, slots


def test_given_variances_on_every_rank_gather_to_the_single_rank_op():
    world = 2
    cfg, q, k, v, qw, kw, ranks, sums, common, slots = _tp_case(world)
    hd = cfg.head_dim
    caches = _caches(cfg)
    k_full, v_full = caches[0].clone(), caches[1].clone()
    q_full = op.gqa_prologue_reference(
        q.view(3, -1, hd), k.view(3, -1, hd), v.view(3, -1, hd), qw, kw, *common, k_full, v_full, slots, 1.0, 1.0
    )
    outs, k_rows = [], []
    for r, rank in enumerate(ranks):
        heads = cfg.num_kv_heads // world
        k_c, v_c = caches[0][:, :, r * heads : (r + 1) * heads].clone(), caches[1][:, :, r * heads : (r + 1) * heads].clone()
        outs.append(op.gqa_prologue_reference(
            rank["q"].view(3, -1, hd), rank["k"].view(3, -1, hd), rank["v"].view(3, -1, hd), rank["qw"], rank["kw"],
            *common, k_c, v_c, slots, 1.0, 1.0, False, sums[:, :1], sums[:, 1:], float(world),
        ))  # fmt: skip
        k_rows.append(k_c.view(-1, heads, hd)[slots])
    # The global mean is the ranks' local means summed and divided: fp32 sums in another order.
    assert relative_error(torch.cat(outs, dim=1), q_full) < 2e-3
    assert relative_error(torch.cat(k_rows, dim=1), k_full.view(-1, cfg.num_kv_heads, hd)[slots]) < 2e-3


def test_variance_divisor_divides_the_given_sums():
    """(sums, world) and (sums / world, 1) are the same norm: the division rounds once either way."""
    cfg, q, k, v, qw, kw, ranks, sums, common, slots = _tp_case()
    rank, hd = ranks[0], cfg.head_dim
    args = (rank["q"].view(3, -1, hd), rank["k"].view(3, -1, hd), rank["v"].view(3, -1, hd), rank["qw"], rank["kw"], *common)
    c1 = [c[:, :, :1].clone() for c in _caches(cfg)]
    c2 = [c.clone() for c in c1]
    a = op.gqa_prologue_reference(*args, *c1, slots, 1.0, 1.0, False, sums[:, :1], sums[:, 1:], 2.0)
    b = op.gqa_prologue_reference(*args, *c2, slots, 1.0, 1.0, False, sums[:, :1] / 2, sums[:, 1:] / 2, 1.0)
    assert torch.equal(a, b) and torch.equal(c1[0], c2[0])


def test_canonical_decomposition_takes_the_variances_too():
    cfg, q, k, v, qw, kw, ranks, sums, common, slots = _tp_case()
    rank, hd = ranks[1], cfg.head_dim
    kwargs = dict(zip(op.ARG_NAMES, (
        rank["q"].view(3, -1, hd), rank["k"].view(3, -1, hd), rank["v"].view(3, -1, hd), rank["qw"], rank["kw"], *common,
        *[c[:, :, :1].clone() for c in _caches(cfg)], slots, 1.0, 1.0, False, sums[:, :1], sums[:, 1:], 2.0,
    )))  # fmt: skip
    q_out, k_new, v_new = op.gqa_prologue_canonical(**kwargs)
    k_ref, v_ref = kwargs["k_cache"].clone(), kwargs["v_cache"].clone()
    q_ref = op.gqa_prologue_reference(**{**kwargs, "k_cache": k_ref, "v_cache": v_ref})
    assert torch.equal(q_out, q_ref) and torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)


def test_variance_op_is_each_side_s_local_mean_of_squares():
    qkv = torch.randn(3, 96 + 2 * 32, dtype=torch.bfloat16)
    q, k = qkv[:, :96], qkv[:, 96:128]
    out = torch.ops.fusion_compiler.gqa_prologue_variance(q, k)
    assert out.shape == (3, 2) and out.dtype == torch.float32
    assert torch.equal(out[:, 0], q.float().pow(2).mean(-1)) and torch.equal(out[:, 1], k.float().pow(2).mean(-1))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ops.fusion_compiler.gqa_prologue_variance(mode.from_tensor(q), mode.from_tensor(k))
    assert fake.shape == (3, 2) and fake.dtype == torch.float32


def test_variance_arguments_are_checked():
    import pytest

    cfg, q, k, v, qw, kw, ranks, sums, common, slots = _tp_case()
    rank, hd = ranks[0], cfg.head_dim
    args = (rank["q"].view(3, -1, hd), rank["k"].view(3, -1, hd), rank["v"].view(3, -1, hd), rank["qw"], rank["kw"], *common)
    caches = [c[:, :, :1].clone() for c in _caches(cfg)]
    tail = (slots, 1.0, 1.0, False)
    with pytest.raises(ValueError, match="come together"):
        op.gqa_prologue_reference(*args, *caches, *tail, sums[:, :1], None, 2.0)
    with pytest.raises(ValueError, match="q_variance dim 0"):
        op.gqa_prologue_reference(*args, *caches, *tail, sums[:2, :1], sums[:2, 1:], 2.0)
    with pytest.raises(ValueError, match="q_variance dtype"):
        op.gqa_prologue_reference(*args, *caches, *tail, sums[:, :1].double(), sums[:, 1:], 2.0)
    with pytest.raises(ValueError, match="variance_divisor"):
        op.gqa_prologue_reference(*args, *caches, *tail, sums[:, :1], sums[:, 1:], 0.0)
    per_head = (*args[:5], cfg.rms_norm_eps, 1.0, False, *common[3:])
    with pytest.raises(ValueError, match="full_width_norm is False"):
        op.gqa_prologue_reference(*per_head[:3], torch.ones(hd), torch.ones(hd), *per_head[5:], *caches, *tail,
                                  sums[:, :1], sums[:, 1:], 2.0)  # fmt: skip


# ------------------------------------------------------------------------------------------
# HF's code: its roundings and its position forms
# ------------------------------------------------------------------------------------------


def _hf_case(model: str, batch: int = 4, seq: int = 2, cos_batch: int = 1, full_rope: bool = False):
    """HF's own q/k norms and RoPE on [batch, seq] tokens (cos / sin [cos_batch, seq, rot]: 1 is
    HF's default [1, S] position_ids, broadcast over the batch): (eager q [T, H, D], eager k rows,
    the op's arguments)."""
    if model == "minimax":
        from transformers.models.minimax_m2 import modeling_minimax_m2 as hf

        heads, kv_heads, d, rot = 4, 2, 32, 32 if full_rope else 16
        q_norm, k_norm = hf.MiniMaxM2RMSNorm(heads * d), hf.MiniMaxM2RMSNorm(kv_heads * d)
    else:
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

        heads, kv_heads, d, rot = 4, 2, 32, 32 if full_rope else 8
        q_norm, k_norm = hf.Qwen3_5MoeRMSNorm(d), hf.Qwen3_5MoeRMSNorm(d)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            offset = 1.0 if model == "minimax" else 0.0  # HF's init: ones, Gemma's zeros
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=gen) * 0.1 + offset)
    q_norm, k_norm = q_norm.bfloat16(), k_norm.bfloat16()
    tokens = batch * seq
    q_in = (torch.randn(batch, seq, heads * d, generator=gen) * 3).bfloat16()
    k_in, v_in = ((torch.randn(batch, seq, kv_heads * d, generator=gen) * 3).bfloat16() for _ in range(2))
    freqs = torch.rand(cos_batch, seq, rot // 2, generator=gen) * 100
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()  # HF: cat(freqs, freqs), cast to x's dtype
    with torch.no_grad():
        if model == "minimax":
            q = q_norm(q_in).view(batch, seq, heads, d).transpose(1, 2)
            k = k_norm(k_in).view(batch, seq, kv_heads, d).transpose(1, 2)
        else:
            q = q_norm(q_in.view(batch, seq, heads, d)).transpose(1, 2)
            k = k_norm(k_in.view(batch, seq, kv_heads, d)).transpose(1, 2)
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
    full_width, weight_offset = (True, 0.0) if model == "minimax" else (False, 1.0)
    args = dict(
        q=q_in.view(tokens, heads, d), k=k_in.view(tokens, kv_heads, d), v=v_in.view(tokens, kv_heads, d),
        q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, eps=1e-6, weight_offset=weight_offset,
        full_width_norm=full_width,
        cos=cos.reshape(-1, rot)[:, : rot // 2], sin=sin.reshape(-1, rot)[:, : rot // 2], positions=None,
        k_cache=torch.randn(batch, kv_heads, seq + 3, d, generator=gen).bfloat16(), slots=None, k_scale=1.0,
        v_scale=1.0, cache_heads_first=True,
    )  # fmt: skip
    args["v_cache"] = args["k_cache"].clone()
    args["slots"] = (torch.arange(batch)[:, None] * (seq + 3) + torch.arange(seq) + 1).reshape(-1)
    return q.transpose(1, 2).reshape(tokens, heads, d), k.transpose(1, 2).reshape(tokens, kv_heads, d), args


def _call(args: dict, **flags):
    named = {**op.DEFAULTS, **args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone(), **flags}
    q_out = op.gqa_prologue_reference(**{name: named[name] for name in op.ARG_NAMES})
    k_rows = op.paged_view(named["k_cache"], True).flatten(0, 1)
    return q_out, k_rows[named["slots"]]


def test_rounds_like_hf_minimax_and_qwen_for_every_position_form():
    """With HF's roundings (MiniMax: x * rstd rounded before the weight multiply; both models:
    every bf16 RoPE product rounded) the op is eager's bits: for HF's default [1, S] cos / sin
    (rows by position, repeated over the batch), per-row [B, S] ones, and full RoPE. Rounding
    once (the flags off) is not: HF MiniMax's q then differs in more than 5% of its elements."""
    for model, flags in (("minimax", dict(round_normalized=True, round_rope_products=True)),
                         ("qwen", dict(round_rope_products=True))):  # fmt: skip
        for case in (dict(), dict(cos_batch=4), dict(full_rope=True)):
            q_hf, k_hf, args = _hf_case(model, **case)
            q_out, k_rows = _call(args, **flags)
            assert torch.equal(q_out, q_hf) and torch.equal(k_rows, k_hf), (model, case)
    q_hf, k_hf, args = _hf_case("minimax")
    q_once, _ = _call(args)
    assert (q_once != q_hf).float().mean() > 0.05


def test_canonical_decomposition_reads_broadcast_rows_and_rounds_alike():
    _, _, args = _hf_case("minimax")
    flags = dict(round_normalized=True, round_rope_products=True)
    named = {**op.DEFAULTS, **args, **flags}
    q_out, k_new, _ = op.gqa_prologue_canonical(**named)
    k_ref = args["k_cache"].clone()
    q_ref = op.gqa_prologue_reference(**{**named, "k_cache": k_ref, "v_cache": args["v_cache"].clone()})
    assert torch.equal(q_out, q_ref) and torch.equal(k_new, k_ref)


def test_checks_read_as_miss_reasons():
    """The op's ValueErrors become a site's miss reason when the compiler declines on them."""
    import pytest

    _, _, args = _hf_case("minimax", batch=3, seq=2)
    named = {**op.DEFAULTS, **args}

    def call(**over):
        return op.gqa_prologue_reference(**{n: {**named, **over}[n] for n in op.ARG_NAMES})

    with pytest.raises(ValueError, match="cos / sin have 4 rows for 6 tokens: without positions each row must serve"):
        call(cos=torch.cat([args["cos"]] * 2), sin=torch.cat([args["sin"]] * 2))
    call(cos=args["cos"][:1], sin=args["sin"][:1])  # one row for every token: HF's [1, 1] at decode
    with pytest.raises(ValueError, match="q dtype torch.float64 is not one the fused GQA prologue takes"):
        call(q=args["q"].double())


@pytest.mark.parametrize("model", ["mixtral", "glm4_moe", "glm4"])
def test_without_norm_weights_is_hf_s_rope_and_cache_write_bit_for_bit(model):
    """No q/k norms (both weights None): HF's own ``apply_rotary_pos_emb`` on the projections'
    bf16 rows, full (Mixtral) or over half the head (GLM-4-MoE without use_qk_norm; GLM-4, whose
    pairs are GPT-J's (2i, 2i + 1): ``interleaved_rope``), every product rounded: the op with
    ``round_rope_products`` is eager's bits, its canonical decomposition too, v's rows are copied,
    and every other cache row is unchanged. Half the weights is an error."""
    if model == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as hf
    elif model == "glm4_moe":
        from transformers.models.glm4_moe import modeling_glm4_moe as hf
    else:
        from transformers.models.glm4 import modeling_glm4 as hf
    batch, seq, heads, kv_heads, d = 2, 3, 4, 2, 32
    rot = d if model == "mixtral" else d // 2
    gen = torch.Generator().manual_seed(9)
    q_in = (torch.randn(batch, seq, heads, d, generator=gen) * 3).bfloat16()
    k_in, v_in = ((torch.randn(batch, seq, kv_heads, d, generator=gen) * 3).bfloat16() for _ in range(2))
    freqs = torch.rand(batch, seq, rot // 2, generator=gen) * 100
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q_hf, k_hf = hf.apply_rotary_pos_emb(q_in.transpose(1, 2), k_in.transpose(1, 2), cos, sin)
    tokens = batch * seq
    k_cache = torch.randn(batch, kv_heads, seq + 2, d, generator=gen).bfloat16()
    named = {
        **op.DEFAULTS, "q": q_in.view(tokens, heads, d), "k": k_in.view(tokens, kv_heads, d),
        "v": v_in.view(tokens, kv_heads, d), "q_norm_weight": None, "k_norm_weight": None, "eps": 1e-6,
        "weight_offset": 0.0, "full_width_norm": False, "cos": cos.reshape(-1, rot)[:, : rot // 2],
        "sin": sin.reshape(-1, rot)[:, : rot // 2], "positions": None, "k_cache": k_cache.clone(),
        "v_cache": k_cache.clone(), "slots": (torch.arange(batch)[:, None] * (seq + 2) + torch.arange(seq) + 1).reshape(-1),
        "k_scale": 1.0, "v_scale": 1.0, "cache_heads_first": True, "round_rope_products": True,
        "interleaved_rope": model == "glm4",
    }  # fmt: skip
    q_out = op.gqa_prologue_reference(**{n: named[n] for n in op.ARG_NAMES})
    assert torch.equal(q_out, q_hf.transpose(1, 2).reshape(tokens, heads, d))
    k_rows, v_rows = (op.paged_view(named[c], True).flatten(0, 1) for c in ("k_cache", "v_cache"))
    assert torch.equal(k_rows[named["slots"]], k_hf.transpose(1, 2).reshape(tokens, kv_heads, d))
    assert torch.equal(v_rows[named["slots"]], named["v"])
    others = torch.ones(k_rows.shape[0], dtype=torch.bool)
    others[named["slots"]] = False
    assert torch.equal(k_rows[others], op.paged_view(k_cache, True).flatten(0, 1)[others])
    q_canon, k_canon, _ = op.gqa_prologue_canonical(**{**named, "k_cache": k_cache.clone(), "v_cache": k_cache.clone()})
    assert torch.equal(q_canon, q_out) and torch.equal(k_canon, named["k_cache"])
    fake = torch.ops.fusion_compiler.gqa_prologue(*(named[n] for n in op.ARG_NAMES))
    assert torch.equal(fake, q_out)  # the registered op (CPU: the reference) takes None weights
    with pytest.raises(ValueError, match="come together"):
        op.gqa_prologue_reference(**{**{n: named[n] for n in op.ARG_NAMES}, "k_norm_weight": torch.ones(d)})


def test_interleaved_pairs_are_hf_glm4_s_rope_in_float64():
    """GPT-J pairs against HF GLM-4's own ``apply_rotary_pos_emb`` in float64 (the math, not the
    bits: the op computes in fp32), RoPE over 16 of 32 dims; NeoX pairs on the same rows are not
    it."""
    from transformers.models.glm4 import modeling_glm4 as hf

    gen = torch.Generator().manual_seed(4)
    tokens, heads, d, rot = 5, 3, 32, 16
    x = torch.randn(tokens, heads, d, generator=gen, dtype=torch.float64)
    freqs = torch.rand(tokens, rot // 2, generator=gen, dtype=torch.float64) * 100
    emb = torch.cat([freqs, freqs], dim=-1)
    want, _ = hf.apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    got = op._rope(x, freqs.cos(), freqs.sin(), rot, False, interleaved=True)
    assert relative_error(got, want.transpose(0, 1)) < 1e-7
    assert relative_error(op._rope(x, freqs.cos(), freqs.sin(), rot, False), want.transpose(0, 1)) > 0.1


@pytest.mark.parametrize("norm", ["none", "per_head"])
def test_a_flat_cache_is_hf_continuous_batching_s_write_bit_for_bit(norm):
    """HF's continuous batching (``generate_batch``): one packed [1, T] step, Qwen2's prologue (no
    q/k norms) or Qwen3's (``Qwen3RMSNorm`` per head), HF's ``apply_rotary_pos_emb``, then
    ``cache.index_copy_(0, slots, k.transpose(1, 2).squeeze(0))`` into a flat [slots, kv_heads, D]
    cache, the padding tokens all at one trash slot. On a flat cache the op (and its canonical
    decomposition) writes eager's bits at every real slot and leaves every other row alone; the
    trash slot holds a padding row. A flat cache with ``cache_heads_first`` is an error."""
    from transformers.models.qwen3 import modeling_qwen3 as hf

    tokens, heads, kv_heads, d, trash = 6, 4, 2, 32, 21
    gen = torch.Generator().manual_seed(13)
    q_in = (torch.randn(1, tokens, heads, d, generator=gen) * 3).bfloat16()
    k_in, v_in = ((torch.randn(1, tokens, kv_heads, d, generator=gen) * 3).bfloat16() for _ in range(2))
    weights = {}
    if norm == "per_head":
        q_norm, k_norm = hf.Qwen3RMSNorm(d, 1e-6).bfloat16(), hf.Qwen3RMSNorm(d, 1e-6).bfloat16()
        for w in (q_norm.weight, k_norm.weight):
            w.data = (torch.randn(d, generator=gen) * 0.3 + 1).bfloat16()
        with torch.no_grad():
            q_normed, k_normed = q_norm(q_in), k_norm(k_in)
        weights = {"q_norm_weight": q_norm.weight.data, "k_norm_weight": k_norm.weight.data, "round_normalized": True}
    else:
        q_normed, k_normed = q_in, k_in
    freqs = torch.rand(1, tokens, d // 2, generator=gen) * 100
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q_hf, k_hf = hf.apply_rotary_pos_emb(q_normed.transpose(1, 2), k_normed.transpose(1, 2), cos, sin)
    slots = torch.tensor([3, 17, 4, trash, trash, trash])
    cache = torch.randn(24, kv_heads, d, generator=gen).bfloat16()
    hf_k, hf_v = cache.clone(), cache.clone()
    hf_k.index_copy_(0, slots, k_hf.transpose(1, 2).squeeze(0))
    hf_v.index_copy_(0, slots, v_in.squeeze(0))
    named = {
        **op.DEFAULTS, "q": q_in.view(tokens, heads, d), "k": k_in.view(tokens, kv_heads, d),
        "v": v_in.view(tokens, kv_heads, d), "q_norm_weight": None, "k_norm_weight": None, "eps": 1e-6,
        "weight_offset": 0.0, "full_width_norm": False, "cos": cos[0, :, : d // 2], "sin": sin[0, :, : d // 2],
        "positions": None, "k_cache": cache.clone(), "v_cache": cache.clone(), "slots": slots, "k_scale": 1.0,
        "v_scale": 1.0, "cache_heads_first": False, "round_rope_products": True, **weights,
    }  # fmt: skip
    q_out = op.gqa_prologue_reference(**{n: named[n] for n in op.ARG_NAMES})
    assert torch.equal(q_out, q_hf.transpose(1, 2).reshape(tokens, heads, d))
    real = slots[:3]
    others = torch.ones(24, dtype=torch.bool)
    others[slots] = False
    q_canon, k_canon, v_canon = op.gqa_prologue_canonical(**{**named, "k_cache": cache.clone(), "v_cache": cache.clone()})
    assert torch.equal(q_canon, q_out)
    for got, want in ((named["k_cache"], hf_k), (named["v_cache"], hf_v), (k_canon, hf_k), (v_canon, hf_v)):
        assert got.shape == cache.shape
        assert torch.equal(got[real], want[real]) and torch.equal(got[others], cache[others])
    assert any(torch.equal(named["k_cache"][trash], k_hf.transpose(1, 2)[0, i]) for i in range(3, tokens))
    with pytest.raises(ValueError, match="cache_heads_first must be False"):
        op.gqa_prologue_reference(**{**{n: named[n] for n in op.ARG_NAMES}, "cache_heads_first": True})
