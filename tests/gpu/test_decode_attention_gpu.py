"""GPU tier: dense decode attention (kernels/decode_attention.py: one query per sequence over an
un-repeated K / V cache, split-KV with a combine) at the real widths, against float64.

MiniMax-M2.5: 48 q / 8 kv heads of 128; Qwen3.5 full attention: 32 / 2 of 256; DeepSeek V3.2 as
HF runs it (K / V expanded per head): 128 / 128, D 192, Dv 128. Layouts as HF hands them over:
q a transposed [B, 1, H, D] view, K / V the first S positions of a longer static cache (row
stride > S), masks bool per sequence (causal prefixes of different lengths, with holes) or
additive with HF's finfo.min, or one row expanded over the batch. One sequence of 4096 positions
(several splits and the combine), four ragged ones (S not a multiple of the tile).

DeepSeek's sparse variant (``skip_masked``: DSA's top 2048 of 4096, the unselected K / V rows NaN,
so a loaded one would show) at batch 1 and 8, bool and SDPA's additive -inf mask.

The float64 reference (gpu_reference.decode_attention64) is the contract's math; the kernel
rounds p to bf16 for the P @ V product and the output to bf16, so element-wise within 2**-6 of
(|want| + the row's rms). The output starts NaN with guard slabs, and every element must be
written.
"""

from __future__ import annotations

import pytest
import torch

from gpu.gpu_reference import assert_rows_close, cases, decode_attention64, device_randn, generator, needs_cuda, randn
from kernel_fixtures import DEVICE, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

pytestmark = pytest.mark.gpu
skip_unless_kernels_can_run()

from fusion_compiler.kernels import decode_attention as K  # noqa: E402

MODELS = {"minimax-m2.5": (48, 8, 128, 128), "qwen3.5": (32, 2, 256, 256), "deepseek-v3.2": (128, 128, 192, 128)}
REAL = {f"{name}-{batch}x{seq}-{mask}": (dims, batch, seq, mask)
        for name, dims in MODELS.items()
        for batch, seq, mask in ((1, 4096, "add_min"), (4, 1000, "bool"), (3, 77, "bool_expanded"))}  # fmt: skip
TINY = {"tiny-2x70-bool": ((6, 2, 24, 40), 2, 70, "bool"), "tiny-1x50-add_min": ((4, 4, 16, 16), 1, 50, "add_min")}


def _mask(kind, batch, seq, gen):
    if kind == "bool_expanded":  # one row for the whole batch: stride 0 on dim 0
        keep = torch.rand(1, seq, generator=gen) < 0.8
        keep[0, 0] = keep[0, -1] = True
        return keep.to(DEVICE)[:, None, None, :].expand(batch, 1, 1, seq)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
    lengths[0] = seq  # the longest sequence attends to every position, the last tile's included
    keep = (torch.arange(seq)[None, :] < lengths[:, None]) & (torch.rand(batch, seq, generator=gen) < 0.9)
    keep[:, 0] = keep[0, -1] = True
    if kind == "bool":
        return keep.to(DEVICE)[:, None, None, :]
    mask = torch.where(keep, torch.zeros(()), torch.tensor(torch.finfo(torch.bfloat16).min))  # HF's additive mask
    return mask.to(torch.bfloat16).to(DEVICE)[:, None, None, :]


@pytest.mark.parametrize("case", cases(REAL, TINY))
def test_decode_attention_matches_float64(case):
    (heads, kv_heads, d, dv), batch, seq, kind = case
    gen = generator(batch * 10_000 + seq)
    q = randn(gen, batch, 1, heads, d).transpose(1, 2)
    max_len = seq + 13  # HF's static cache is longer than the positions attended
    k = device_randn(2 * seq, batch, kv_heads, max_len, d)[:, :, :seq]  # drawn on the device: 100M values
    v = device_randn(2 * seq + 1, batch, kv_heads, max_len, dv)[:, :, :seq]
    mask = _mask(kind, batch, seq, gen)
    scale = d**-0.5
    buf, out = poisoned((batch, heads, 1, dv), torch.bfloat16)
    K.decode_attention_fwd(q, k, v, mask, scale, out)
    assert_guards_untouched(buf)
    assert_rows_close(out, decode_attention64(q, k, v, mask, scale), 2**-6, "out")


@needs_cuda
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["bool", "add_inf"])
def test_sparse_decode_attention_loads_only_kept_rows(batch, kind):
    heads, kv_heads, d, dv = MODELS["deepseek-v3.2"]
    seq, top_k = 4096, 2048
    gen = generator(batch * 7 + len(kind))
    q = randn(gen, batch, 1, heads, d).transpose(1, 2)
    k = device_randn(3 * batch, batch, kv_heads, seq, d)
    v = device_randn(3 * batch + 1, batch, kv_heads, seq, dv)
    keep = torch.zeros(batch, seq, dtype=torch.bool)
    for row in range(batch):
        keep[row, torch.randperm(seq, generator=gen)[:top_k]] = True
    keep = keep.to(DEVICE)
    mask = keep if kind == "bool" else torch.where(keep, 0.0, float("-inf")).to(torch.bfloat16)
    mask = mask[:, None, None, :]
    scale = d**-0.5
    want = decode_attention64(q, k, v, mask, scale)
    ruled_out = ~keep[:, None, :, None]
    k.masked_fill_(ruled_out, float("nan"))
    v.masked_fill_(ruled_out, float("nan"))
    buf, out = poisoned((batch, heads, 1, dv), torch.bfloat16)
    K.decode_attention_fwd(q, k, v, mask, scale, out, skip_masked=True)
    assert_guards_untouched(buf)
    assert_rows_close(out, want, 2**-6, "out")
