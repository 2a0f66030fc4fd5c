"""fusion_compiler::gqa_prologue's reference against the MiniMax-M2.5 serving-engine reference
attention (full-width norm) and against a per-head Gemma composition (Qwen3.5's form)."""

from __future__ import annotations

import torch

from fusion_compiler.model_adapters.minimax_m2 import reference as ref
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
            positions, k_op, v_op, slots, 1.0, 1.0, False,
        )  # fmt: skip
    # One rounding per norm here, two in HF's `weight * x.to(dtype)`: bf16 tolerance.
    assert relative_error(q_out, q_ref) < 1e-2
    assert relative_error(k_op, k_ref) < 1e-2
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
