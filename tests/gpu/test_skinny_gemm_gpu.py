"""GPU tier: the skinny GEMM (kernels/skinny_gemm.py, ``x @ w.T`` at decode sizes) as an lm_head
at the real vocabularies, and over hypothesis-drawn shapes, against float64.

Real: one token through DeepSeek V3.2's (129,280 x 7168), MiniMax-M2.5's (200,064 x 3072) and
Qwen3.5's (248,320 x 4096) lm_heads: 64k-124k programs on the grid's x axis (the y axis stops at
65,535), weights of 1.2-2 GB streamed once. Hypothesis: 1-4 tokens (a config above the shipped
MAX_TOKENS, as the bench times), ragged and even N and K, bf16 and fp32 with a bf16 weight
widened in registers, block shapes of 1-8 rows and 32-1024 columns.

The float64 reference is computed in row chunks; each output element must be within a bf16
rounding (fp32: 1e-5) of it plus the fp32 summation's slack, 2**-16 of sum |x| |w| over its row.
The output starts NaN with a guard row on each side.
"""

from __future__ import annotations

import pytest
import torch

from gpu.gpu_reference import cases, device_randn, generator, randn
from kernel_fixtures import DEVICE, HAS_CUDA, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu
skip_unless_kernels_can_run()

from fusion_compiler.kernels import skinny_gemm as K  # noqa: E402

LM_HEADS = {"deepseek-v3.2": (129_280, 7168), "minimax-m2.5": (200_064, 3072), "qwen3.5": (248_320, 4096)}
TINY = {"tiny-lm-head": (1_003, 96)}


def _assert_matches_float64(out, x, w, chunk=32_768):
    assert not bool(torch.isnan(out).any()), "an output element was left unwritten"
    rounding = torch.finfo(out.dtype).eps / 2 if out.dtype != torch.float32 else 1e-5
    for start in range(0, w.shape[0], chunk):
        rows = w[start : start + chunk].double()
        want = x.double() @ rows.t()
        slack = 2**-16 * (x.double().abs() @ rows.abs().t())
        got = out[:, start : start + chunk].double()
        bad = (got - want).abs() > rounding * want.abs() + slack * (1 + rounding)
        if bool(bad.any()):
            t, n = (int(i) for i in bad.nonzero()[0])
            raise AssertionError(f"{int(bad.sum())} outputs off float64; first [{t}, {start + n}]: "
                                 f"{float(got[t, n])} vs {float(want[t, n])}")  # fmt: skip


@pytest.mark.parametrize("shape", cases(LM_HEADS, TINY))
def test_lm_head_at_real_vocabulary_matches_float64(shape):
    vocab, hidden = shape
    gen = generator(vocab)
    x = randn(gen, 1, hidden)
    w = device_randn(vocab, vocab, hidden, scale=hidden**-0.5)
    buf, out = poisoned((1, vocab), torch.bfloat16)
    assert K.supports(x, w)
    K.skinny_gemm(x, w, out)
    assert_guards_untouched(buf)
    _assert_matches_float64(out, x, w)


@pytest.mark.skipif(not HAS_CUDA, reason="hypothesis shapes up to 70k rows: the GPU tier")
@settings(max_examples=12, deadline=None)
@given(
    tokens=st.integers(1, 4), n=st.integers(1, 70_000), k=st.integers(1, 6_000),
    dtypes=st.sampled_from([(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                            (torch.float32, torch.bfloat16)]),
    block_n=st.sampled_from([1, 2, 4, 8]), block_k=st.sampled_from([32, 256, 1024]), seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_hypothesis_shapes_match_float64(tokens, n, k, dtypes, block_n, block_k, seed):
    x_dtype, w_dtype = dtypes
    config = K.SkinnyConfig(block_n=block_n, block_k=block_k, max_tokens=4)
    x = device_randn(seed, tokens, k, dtype=x_dtype)
    w = device_randn(seed + 1, n, k, scale=k**-0.5, dtype=w_dtype)
    buf, out = poisoned((tokens, n), x_dtype)
    K.skinny_gemm(x, w, out, config=config)
    assert_guards_untouched(buf)
    _assert_matches_float64(out, x, w)
