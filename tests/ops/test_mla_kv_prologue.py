"""The mla_kv_prologue op's width rules: the latent (kv_lora_rank) may be any width on the bf16
path, and only the FP8 ``fp8_ds_mla`` cache layout, whose scales cover 128-wide groups, declines
another width, with that reason. The kernel at these widths: tests/kernels/test_mla_kv_prologue.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from fusion_compiler.ops import mla_kv_prologue as op
from fusion_compiler.ops.mla_kv_prologue import mla_kv_prologue, mla_kv_prologue_canonical, mla_kv_prologue_reference
from fusion_compiler.verify import relative_error

ROT = 16


def _kv_args(width: int, cache_dtype: torch.dtype, tokens: int = 4, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    row = op.latent_cache_width(width, ROT, cache_dtype)
    cache = torch.randint(0, 256, (3, 4, row * (1 if cache_dtype == torch.uint8 else 2)), generator=gen, dtype=torch.uint8)
    # A live write to slot 0 before a padding slot (-1): CPU's index_put applies duplicates in
    # order, so a padding row that wrote slot 0's old bytes back would win here.
    slots = torch.randperm(11, generator=gen)[:tokens] + 1
    slots[0], slots[1] = 0, -1
    return dict(
        kv_c=torch.randn(tokens, width, generator=gen).to(torch.bfloat16),
        k_pe=torch.randn(tokens, ROT, generator=gen).to(torch.bfloat16),
        kv_weight=(1 + 0.3 * torch.randn(width, generator=gen)).to(torch.bfloat16), kv_eps=1e-6,
        cos=torch.randn(tokens, ROT // 2, generator=gen), sin=torch.randn(tokens, ROT // 2, generator=gen),
        slots=slots, latent_cache=cache.view(cache_dtype),
    )  # fmt: skip


@pytest.mark.parametrize("width", [64, 96, 192])
def test_bf16_latent_of_any_width_matches_float64(width):
    """Reference and canonical decomposition at kv_lora_rank widths that are no multiple of 128:
    kv_out and the written cache rows within bf16 of the float64 math, rows outside the written
    slots (and the padding slot's) unchanged, byte for byte."""
    args = _kv_args(width, torch.bfloat16)
    before = args["latent_cache"].clone()
    _, _, kv_out, _, _ = mla_kv_prologue_reference(**args)
    kv_c, w, k_pe = (args[n].double() for n in ("kv_c", "kv_weight", "k_pe"))
    kv64 = kv_c * torch.rsqrt((kv_c * kv_c).mean(-1, keepdim=True) + 1e-6) * w
    cos, sin = args["cos"].double(), args["sin"].double()
    even, odd = k_pe[:, 0::2], k_pe[:, 1::2]
    pe64 = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)
    assert relative_error(kv_out.double(), kv64) < 1e-2
    slots = args["slots"]
    rows, rows_before = args["latent_cache"].view(-1, width + ROT), before.view(-1, width + ROT)
    keep = slots >= 0
    assert relative_error(rows[slots[keep]].double(), torch.cat([kv64, pe64], -1)[keep]) < 1e-2
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert torch.equal(rows[untouched].view(torch.uint8), rows_before[untouched].view(torch.uint8))
    canonical = mla_kv_prologue_canonical(**{**args, "latent_cache": before.clone()})
    assert torch.equal(canonical[2], kv_out)
    assert torch.equal(canonical[5].view(torch.uint8), args["latent_cache"].view(torch.uint8))


@pytest.mark.parametrize("width", [64, 192])
def test_fp8_ds_mla_latent_not_a_multiple_of_128_is_declined_with_its_reason(width):
    """Reference, fake (what the pattern's replacement traces, so the site is a reported miss)
    and canonical decomposition all refuse it in one sentence naming the layout's groups."""
    args = _kv_args(width, torch.uint8)
    reason = (
        f"the latent kv_c is {width} wide (kv_lora_rank), not a multiple of 128: "
        "the FP8 fp8_ds_mla cache layout quantises it in 128-wide groups"
    )
    with pytest.raises(ValueError, match=re.escape(reason)):
        mla_kv_prologue_reference(**args)
    with pytest.raises(ValueError, match=re.escape(reason)):
        mla_kv_prologue_canonical(**args)
    with pytest.raises(ValueError, match=re.escape(reason)):
        mla_kv_prologue(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()})


def test_fp8_ds_mla_latent_of_128_groups_is_taken():
    args = _kv_args(256, torch.uint8)
    mla_kv_prologue_reference(**args)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    assert mla_kv_prologue(**meta)[2].shape == (4, 256)
