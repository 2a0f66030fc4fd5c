"""GPU tier: the GQA prologue kernel (q/k RMSNorm + partial NeoX RoPE + K/V cache write) at
MiniMax-M2.5's and Qwen3.5's full-attention widths, against float64.

MiniMax-M2.5: 48 q / 8 kv heads of 128, one RMSNorm over the whole q (6144) and k (1024) rows,
RoPE on 64 of 128 dims; Qwen3.5: 32 q / 2 kv heads of 256 read inside the [q | gate] head rows
(head stride 512), per-head Gemma norm (1 + w), RoPE on 64 of 256. Each in the layouts the
patterns emit: vLLM's paged cache with an fp32 cos / sin table read at positions (bf16 cache, and
FP8 with per-tensor scales), and HF's heads-first static cache with per-token bf16 angles and
HF's rounding flags. 1 token, 300 tokens (past WHOLE_TILES_UP_TO: the kernel walks head blocks)
and 4 sequences of HF's static cache.

The float64 reference (gpu_reference.norm64 / rope64) is the contract's math with its rounding
points (the normalized rows in bf16; with the flags, x * rstd and each RoPE product and sum);
bf16 results within a bf16 rounding or two element-wise, FP8 codes equal to the float64
values' codes (rounded to the activation dtype first, as the contract stores them) except a few
one code apart. q_out starts NaN with guard rows; every cache byte outside the written slots
(slot -1 included: about a quarter of the tokens) must equal its random pre-launch contents.
"""

from __future__ import annotations

import pytest
import torch

from gpu.gpu_reference import assert_bytes_equal, assert_rows_close, bf16, cases, fp8_codes, generator, norm64, randn
from gpu.gpu_reference import rope64
from kernel_fixtures import DEVICE, FP8, assert_fp8_close, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

pytestmark = pytest.mark.gpu
skip_unless_kernels_can_run()

from fusion_compiler.kernels import gqa_prologue as K  # noqa: E402

MINIMAX = dict(heads=48, kv_heads=8, head_dim=128, rotary_dim=64, full_width=True, offset=0.0, gated=False,
               rope_theta=5e6)  # fmt: skip
QWEN = dict(heads=32, kv_heads=2, head_dim=256, rotary_dim=64, full_width=False, offset=1.0, gated=True,
            rope_theta=1e7)  # fmt: skip
TINY_MINIMAX = {**MINIMAX, "heads": 6, "kv_heads": 2, "head_dim": 64, "rotary_dim": 32}
TINY_QWEN = {**QWEN, "heads": 4, "kv_heads": 2, "head_dim": 32, "rotary_dim": 8}
# (model, tokens, layout): layout "paged" (vLLM: fp32 table at positions, serving's roundings:
# MiniMax's norm rounds x * rstd), "paged-fp8" likewise into FP8 caches, "hf" (heads-first static
# cache, per-token bf16 angles, HF's roundings)
REAL = {
    "minimax-1-paged": (MINIMAX, 1, "paged"),
    "minimax-300-paged-fp8": (MINIMAX, 300, "paged-fp8"),
    "minimax-4-hf": (MINIMAX, 4, "hf"),
    "qwen3.5-1-paged-fp8": (QWEN, 1, "paged-fp8"),
    "qwen3.5-300-paged": (QWEN, 300, "paged"),
    "qwen3.5-4-hf": (QWEN, 4, "hf"),
}
TINY = {
    "tiny-minimax-3-paged-fp8": (TINY_MINIMAX, 3, "paged-fp8"),
    "tiny-qwen-3-hf": (TINY_QWEN, 3, "hf"),
}
BLOCK_SIZE, MAX_POSITION = 16, 4096


def _inputs(m, tokens, layout, gen):
    hq, hkv, d, rot = m["heads"], m["kv_heads"], m["head_dim"], m["rotary_dim"]
    q_width = 2 * hq * d if m["gated"] else hq * d
    qkv = randn(gen, tokens, q_width + 2 * hkv * d + 8, scale=2.0)  # one fused GEMM output, row stride > width
    q = qkv[:, :q_width].view(tokens, hq, -1)[..., :d]
    k = qkv[:, q_width : q_width + hkv * d].view(tokens, hkv, d)
    v = qkv[:, q_width + hkv * d : q_width + 2 * hkv * d].view(tokens, hkv, d)
    widths = (hq * d, hkv * d) if m["full_width"] else (d, d)
    qw, kw = (randn(gen, n, scale=0.3) + (1.0 - m["offset"]) for n in widths)
    heads_first = layout == "hf"
    if heads_first:  # HF's static cache: [batch, kv_heads, max_len, D]; sequence t writes position p_t
        max_len = 64
        cache_shape = (tokens, hkv, max_len, d)
        positions = torch.randint(0, max_len, (tokens,), generator=gen)
        slots = torch.arange(tokens) * max_len + positions
        angles = positions[:, None].double() * m["rope_theta"] ** (-torch.arange(0, rot, 2).double() / rot)
        cos, sin, table_positions = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16), None
    else:
        blocks = tokens // 4 + 8
        cache_shape = (blocks, BLOCK_SIZE, hkv, d)
        slots = torch.randperm(blocks * BLOCK_SIZE, generator=gen)[:tokens]
        if tokens > 1:
            slots[torch.rand(tokens, generator=gen) < 0.25] = -1  # a serving engine's padding rows
        table_positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen)
        angles = torch.arange(MAX_POSITION).double()[:, None] * m["rope_theta"] ** (-torch.arange(0, rot, 2).double() / rot)
        cos, sin = angles.cos().float(), angles.sin().float()
    fp8 = layout == "paged-fp8"
    caches = [randn(gen, *cache_shape).to(FP8 if fp8 else torch.bfloat16) for _ in range(2)]
    round_normalized = m["full_width"]  # MiniMax's norm, in HF's code and in serving code alike
    return dict(
        q=q, k=k, v=v, qw=qw, kw=kw, cos=cos.to(DEVICE), sin=sin.to(DEVICE),
        positions=None if table_positions is None else table_positions.to(DEVICE), k_cache=caches[0],
        v_cache=caches[1], slots=slots.to(DEVICE), scales=(0.5, 0.25) if fp8 else (1.0, 1.0), heads_first=heads_first,
        round_normalized=round_normalized, round_rope=layout == "hf",
    )  # fmt: skip


@pytest.mark.parametrize("case", cases(REAL, TINY))
def test_prologue_matches_float64(case):
    m, tokens, layout = case
    gen = generator(tokens * 7 + len(layout))
    c = _inputs(m, tokens, layout, gen)
    pristine = c["k_cache"].clone(), c["v_cache"].clone()
    buf, q_out = poisoned((tokens, m["heads"], m["head_dim"]), torch.bfloat16)
    K.gqa_prologue_fwd(
        c["q"], c["k"], c["v"], c["qw"], c["kw"], 1e-6, m["offset"], m["full_width"], c["cos"], c["sin"],
        c["positions"], c["k_cache"], c["v_cache"], c["slots"], *c["scales"], c["heads_first"], None, None, 1.0,
        c["round_normalized"], c["round_rope"], q_out,
    )  # fmt: skip
    assert_guards_untouched(buf)

    # float64: the exact math, with the per-token cos / sin rows each layout reads
    if c["positions"] is None:
        cos, sin = c["cos"], c["sin"]
    else:
        cos, sin = c["cos"][c["positions"]], c["sin"][c["positions"]]
    norm = (1e-6, m["offset"], m["full_width"], c["round_normalized"])
    rope = (cos, sin, torch.bfloat16 if c["round_rope"] else None)
    want_q = rope64(norm64(c["q"], c["qw"], *norm), *rope)
    want_k = rope64(norm64(c["k"], c["kw"], *norm), *rope)
    rtol = 2**-7  # the last rounding to bf16, and a rounding point that fp32 crossed where float64 did not
    assert_rows_close(q_out.flatten(1), want_q.flatten(1), rtol, "q_out")

    slots = c["slots"].cpu()
    written = slots[slots >= 0]
    live = (slots >= 0).to(DEVICE)
    k_scale, v_scale = c["scales"]
    for name, cache, before, want, scale in (("k_cache", c["k_cache"], pristine[0], want_k, k_scale),
                                             ("v_cache", c["v_cache"], pristine[1], c["v"].double(), v_scale)):  # fmt: skip
        rows = _slot_rows(cache, c["heads_first"])
        before_rows = _slot_rows(before, c["heads_first"])
        untouched = torch.ones(rows.shape[0], dtype=torch.bool)
        untouched[written] = False
        assert_bytes_equal(rows[untouched.to(DEVICE)], before_rows[untouched.to(DEVICE)], f"{name}: rows outside the slots")
        got = rows[written.to(DEVICE)]
        if cache.dtype == FP8:  # the contract stores the activation-dtype value / scale
            assert_fp8_close(got, fp8_codes(bf16(want[live]), scale), name)
        elif name == "v_cache":
            assert_bytes_equal(got, c["v"][live], "v_cache: v copied")
        else:
            assert_rows_close(got.flatten(1), want[live].flatten(1), rtol, name)


def _slot_rows(cache, heads_first):
    """[slots, kv_heads, D]: row s = block s // block_size, row s % block_size (a copy)."""
    paged = cache.transpose(1, 2) if heads_first else cache
    return paged.reshape(-1, *paged.shape[2:])
