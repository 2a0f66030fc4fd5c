"""What the GPU tier's kernel tests share: float64 references written from each op's contract
(the docstrings in ``fusion_compiler/ops``; not the ops' own reference code, and never our
kernels), shape parameters, output poisoning and the comparisons.

Shapes: each test takes real-width cases (the three models' dims, docs/MODELS.md), which need
CUDA, and tiny ones (ids starting ``tiny``) that run the same body on CPU under
TRITON_INTERPRET=1: ``python -m pytest -m gpu tests/gpu -k tiny``. The whole module of a GPU
test is marked ``gpu``, so the CPU tier deselects both and ``make gpu-test`` runs both.

Tolerances: a bf16 result is compared element-wise, ``|got - want| <= rtol * (|want| + rms)``
with the rms of the element's row: rounding to bf16 costs up to 2**-8 of an element, and a chain of
roundings a few of those, while a value read from the wrong place or left unwritten is off by
about the row's rms. FP8 codes are compared with ``assert_fp8_close`` (equal except a few one
code apart: a bf16 rounding upstream flipped a tie).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_fixtures import DEVICE, FP8, HAS_CUDA

# A real-width case on a machine without CUDA would run for hours under the interpreter.
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="real widths run on the GPU tier; on CPU run -k tiny")


def cases(real: dict, tiny: dict) -> list:
    """pytest params: ``real`` (name -> value) need CUDA; ``tiny`` run under the interpreter too."""
    assert all(name.startswith("tiny") for name in tiny)
    return [pytest.param(v, id=k, marks=needs_cuda) for k, v in real.items()] + [
        pytest.param(v, id=k) for k, v in tiny.items()
    ]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen, *shape, scale=1.0, dtype=torch.bfloat16) -> torch.Tensor:
    """Fresh random values made on the CPU generator (the same on every machine), on DEVICE."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def device_randn(seed, *shape, scale=1.0, dtype=torch.bfloat16) -> torch.Tensor:
    """Fresh random values drawn on DEVICE itself: for the GB-sized weights of a real lm_head."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 and back to float64 (a rounding point of the op's contract)."""
    return x.to(torch.bfloat16).double()


def assert_rows_close(got, want, rtol, what):
    """Element-wise: ``|got - want| <= rtol * (|want| + rms of the row)``; rows are the last dim."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite values (unwritten poison?)"
    rms = want.pow(2).mean(-1, keepdim=True).sqrt()
    bad = (got - want).abs() > rtol * (want.abs() + rms)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements off, first at {index}: "
                             f"{float(got[index])} vs {float(want[index])}")  # fmt: skip


def assert_bytes_equal(got, want, what):
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), what


def fp8_codes(x64: torch.Tensor, scale: float) -> torch.Tensor:
    """The contract's FP8 store: ``x / scale`` correctly rounded to fp32, clamped, to e4m3."""
    return (x64.double() / scale).float().clamp(-448.0, 448.0).to(FP8)


# ---------------------------------------------------------------------------------------------
# RMSNorm + partial NeoX RoPE (ops/gqa_prologue.py's contract), float64
# ---------------------------------------------------------------------------------------------


def norm64(x, weight, eps, offset, full_width, round_normalized=False):
    """x [T, heads, D] -> x * rsqrt(mean(x^2) + eps) * (w + offset), over all heads or per head,
    rounded to x's dtype (the contract's rounding point before RoPE); with ``round_normalized``
    ``x * rsqrt(...)`` is rounded to x's dtype first (HF's MiniMax norm)."""
    h = x.double().reshape(x.shape[0], -1) if full_width else x.double()
    normalized = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if round_normalized:
        normalized = normalized.to(x.dtype).double()
    return (normalized * (weight.double() + offset)).to(x.dtype).double().view(x.shape)


def rope64(x, cos, sin, round_products=None):
    """NeoX rotate-half on each head's first 2 * cos.shape[-1] dims; cos / sin [T, rot / 2]. With
    ``round_products`` (a dtype) each product and each sum is rounded to it (HF's bf16 RoPE)."""
    half = cos.shape[-1]
    cos, sin = cos.double()[:, None, :], sin.double()[:, None, :]
    first, second = x[..., :half], x[..., half : 2 * half]

    def r(t):
        return t if round_products is None else t.to(round_products).double()

    rotated = [r(r(first * cos) - r(second * sin)), r(r(second * cos) + r(first * sin))]
    return torch.cat(rotated + [x[..., 2 * half :]], dim=-1)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet decode step (ops/gdn_decode.py's contract), float64
# ---------------------------------------------------------------------------------------------


def _near_a_bf16_midpoint(x64: torch.Tensor) -> torch.Tensor:
    """Where ``x64`` is within about 2**-16 (relative) of a midpoint between two bf16 values: the
    16 bits fp32 keeps below bf16 are within 256 of 0x8000 (one unit is 2**-23 of the value's
    power of two)."""
    low_bits = x64.float().view(torch.int32) & 0xFFFF
    return (low_bits - 0x8000).abs() <= 256


def gdn_step64(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_eps, conv_rows, state_rows,
               key_heads, hf_roundings, vllm_roundings=False, ties=None):  # fmt: skip
    """One step of n live rows: conv_rows [n, conv_dim, W] (act dtype), state_rows [n, Hv, Dk, Dv]
    float64. Returns (out [n, Hv * Dv] float64, new conv rows (act dtype, exact), new states
    float64). The conv output is rounded to the activation dtype, where every lowering rounds it;
    with ``hf_roundings`` (the op's contract, HF's code: the "triton" lowering) also the conv sum
    before the SiLU and beta, to bf16; fla's kernels keep both in fp32. With ``vllm_roundings``
    (vLLM's causal_conv1d_update) each conv product is rounded to the weight's dtype first.

    ``ties``, a list, receives the [n, conv_dim] mask of the q / k / v elements whose float64 value
    lies within about 2**-16 of a half-way point between two bf16 values: an fp32 conv sum or SiLU
    rounds those either way (one bf16 step, up to 2**-7 of the value)."""
    n, conv_dim = mixed_qkv.shape
    _, hv, dk, dv = state_rows.shape
    kernel = conv_weight.shape[-1]
    w = conv_weight.reshape(conv_dim, kernel).double()
    window = torch.cat([conv_rows, mixed_qkv.unsqueeze(-1)], dim=-1)
    products = window[..., -kernel:].double() * w
    if vllm_roundings:
        products = products.to(conv_weight.dtype).double()
    conv = products.sum(-1)
    if hf_roundings:
        conv = conv.to(conv_weight.dtype).double()
    exact = torch.nn.functional.silu(conv)
    qkv = exact.to(mixed_qkv.dtype).double()
    if ties is not None:
        ties.append(_near_a_bf16_midpoint(exact))
    q, k, v = qkv.split([key_heads * dk, key_heads * dk, hv * dv], dim=-1)
    ratio = hv // key_heads
    q = q.reshape(n, key_heads, dk).repeat_interleave(ratio, dim=1)
    k = k.reshape(n, key_heads, dk).repeat_interleave(ratio, dim=1)
    v = v.reshape(n, hv, dv)
    beta = torch.sigmoid(b.double())
    if hf_roundings:
        beta = beta.to(b.dtype).double()
    g = -A_log.double().exp() * torch.nn.functional.softplus(a.double() + dt_bias.double())
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + qk_eps) / math.sqrt(dk)
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + qk_eps)
    state = state_rows * g.exp()[..., None, None]
    kv_mem = torch.einsum("nhkv,nhk->nhv", state, k)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    o = torch.einsum("nhkv,nhk->nhv", state, q).to(mixed_qkv.dtype).double()
    h = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    out = h * torch.nn.functional.silu(z.double().reshape(n, hv, dv))
    return out.reshape(n, hv * dv), window[..., 1:], state


# ---------------------------------------------------------------------------------------------
# Single-query attention over un-repeated K / V (ops/decode_attention.py's contract), float64
# ---------------------------------------------------------------------------------------------


def decode_attention64(q, k, v, mask, scale):
    """q [B, H, 1, D], k / v [B, Hkv, S, D / Dv], mask None / bool / additive [B or 1, 1, 1, S]."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k64.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return torch.softmax(scores, dim=-1) @ v64


# ---------------------------------------------------------------------------------------------
# MoE routing (ops/moe_route.py's contract), float64, and which tokens a kernel must route alike
# ---------------------------------------------------------------------------------------------

GROUP_TOP = 2  # DeepSeek V3 scores a group by the sum of its 2 best experts


def route64(logits, bias, top_k, n_group, topk_group, scoring, renormalize, renorm_eps, scale, logit_slack):
    """Route float64 ``logits`` [T, E]. ``logit_slack`` [T, E]: how far each logit the kernel
    routed may be from these (its rounding to the logits' dtype and its summation order).

    Returns a dict: ``scores`` (unbiased, [T, E]), ``ids`` [T, top_k] (a set: any order),
    ``decisive`` [T] bool: the k-th and (k+1)-th choice scores, and with groups the topk_group-th
    and next group scores, lie further apart than logits moved by their slack could bring them
    (first order, both sides), so every correct kernel picks exactly these experts."""
    h = logits.double()
    if scoring == 0:
        s = torch.sigmoid(h)
        slack = s * (1 - s) * logit_slack
    else:
        s = torch.softmax(h, dim=-1)
        slack = s * (logit_slack + (s * logit_slack).sum(-1, keepdim=True))
    slack = slack + 1e-6 * s + 1e-12  # the kernels' exp and division may differ in the last fp32 ulp
    choice = s + bias.double() if bias is not None else s
    decisive = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    if n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        group_scores = grouped.topk(GROUP_TOP, dim=-1).values.sum(-1)
        ranked = group_scores.sort(dim=-1, descending=True).values
        group_slack = 2 * GROUP_TOP * slack.view(tokens, n_group, -1).amax(-1).amax(-1)
        decisive &= ranked[:, topk_group - 1] - ranked[:, topk_group] > group_slack
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)
    order = choice.sort(dim=-1, descending=True)
    ids = order.indices[:, :top_k]
    kth, next_ = order.values[:, top_k - 1], order.values[:, top_k]
    pair_slack = slack.gather(1, order.indices[:, top_k - 1 : top_k + 1]).sum(-1)
    decisive &= (kth - next_ > pair_slack) | torch.isinf(next_)
    return {"scores": s, "slack": slack, "ids": ids, "decisive": decisive}


def routed_weights64(scores, ids, renormalize, renorm_eps, scale):
    """The contract's weights for the experts ``ids`` from float64 unbiased scores."""
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + renorm_eps)
    return w * scale


def assert_routes(weights, ids, ref, routing, what):
    """Every token: ids distinct and in range, and weights those of the float64 scores at the
    kernel's own ids (to the weights dtype's rounding plus what the scores' slack moves them);
    every decisive token (all of them here: the tests redraw the others): the reference's expert
    set (ids in any order: near-equal picked scores may swap places)."""
    top_k, renormalize, renorm_eps, scale, weights_dtype = (routing[0], routing[4], routing[5], routing[6],
                                                            routing[7])  # fmt: skip
    experts = ref["scores"].shape[1]
    ids = ids.to(ref["ids"].device)
    assert bool(((ids >= 0) & (ids < experts)).all()), f"{what}: ids out of range {ids.tolist()}"
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all()), f"{what}: repeated ids"
    decisive = ref["decisive"]
    got_sets, want_sets = ids[decisive].sort(-1).values, ref["ids"][decisive].sort(-1).values
    rows = (got_sets != want_sets).any(-1).nonzero().flatten().tolist()
    assert not rows, f"{what}: tokens {rows} routed to {got_sets[rows].tolist()}, expected {want_sets[rows].tolist()}"
    want_w = routed_weights64(ref["scores"], ids, renormalize, renorm_eps, scale)
    moved = float((ref["slack"].gather(1, ids) / ref["scores"].gather(1, ids)).amax())
    rtol = (1e-6 if weights_dtype == torch.float32 else 2**-8) + 2 * moved  # a score and the sum
    assert_rows_close(weights.to(want_w.device), want_w, rtol, f"{what}: weights")


# The three models' routers (model_adapters, patterns/moe_routing.py's replacement arguments):
# name -> (hidden, experts, routing args after the bias: top_k, n_group, topk_group, scoring,
# renormalize, renorm_eps, scale, weights_dtype; logits dtype, has bias, has Qwen's shared gate)
ROUTERS = {
    "deepseek-v3.2": (7168, 256, (8, 8, 4, 0, True, 1e-20, 2.5, torch.float32), torch.float32, True, False),
    "minimax-m2.5": (3072, 256, (8, 1, 1, 0, True, 0.0, 1.0, torch.float32), torch.bfloat16, True, False),
    "qwen3.5": (4096, 512, (10, 1, 1, 1, True, 0.0, 1.0, torch.bfloat16), torch.bfloat16, False, True),
}
TINY_ROUTERS = {
    "tiny-grouped": (96, 32, (4, 4, 2, 0, True, 1e-20, 2.5, torch.float32), torch.float32, True, False),
    "tiny-softmax-gate": (64, 24, (3, 1, 1, 1, True, 0.0, 1.0, torch.bfloat16), torch.bfloat16, False, True),
    "tiny-sigmoid-bias-renorm-eps": (64, 32, (4, 1, 1, 0, True, 1e-20, 2.826, torch.float32), torch.float32, True, False),
    "tiny-sigmoid-bias-renorm-eps-bf16": (64, 32, (4, 1, 1, 0, True, 1e-20, 2.0, torch.float32), torch.bfloat16, True, False),
    "tiny-softmax-bias-unnormalised": (64, 32, (4, 1, 1, 1, False, 0.0, 6.0, torch.float32), torch.float32, True, False),
}


def router_weights(spec, gen):
    """(router_weight [E, H] bf16, bias fp32 [E] or None, gate_weight [1, H] bf16 or None)."""
    hidden, experts, _, _, has_bias, has_gate = spec
    w = randn(gen, experts, hidden, scale=0.02)
    bias = (torch.rand(experts, generator=gen) * 0.1).to(DEVICE) if has_bias else None
    gate_w = randn(gen, 1, hidden, scale=0.02) if has_gate else None
    return w, bias, gate_w


def router_logits64(x, w):
    """Independent router logits: the GEMM in float64 from the same bf16 inputs, and each
    logit's slack before the logits dtype's rounding (summation order in fp32: well inside
    2**-16 of sum |x| |w|)."""
    return x.double() @ w.double().t(), 2**-16 * (x.double().abs() @ w.double().abs().t())


def logit_slack(logits64, accumulation, logits_dtype):
    """How far the kernel's logits may be from the float64 ones: its summation order, then the
    rounding to the logits dtype (half a unit in the last place: 2**-8 relative for bf16)."""
    rounding = torch.finfo(logits_dtype).eps / 2
    return accumulation * (1 + rounding) + rounding * logits64.abs()


def decisive_hidden(spec, w, bias, tokens, gen, tries=100):
    """Fresh hidden states [tokens, H] whose float64 routing is decisive for every token (rows
    that are not are redrawn), with that routing and the float64 logits and their slack."""
    hidden, _, routing, logits_dtype, _, _ = spec
    x = randn(gen, tokens, hidden)
    for _ in range(tries):
        logits64, accumulation = router_logits64(x, w)
        slack = logit_slack(logits64, accumulation, logits_dtype)
        ref = route64(logits64, bias, *routing[:7], slack)
        redo = ~ref["decisive"]
        if not bool(redo.any()):
            return x, ref, logits64, slack
        x[redo] = randn(gen, int(redo.sum()), hidden)
    raise AssertionError(f"no decisive routing in {tries} draws: is the margin too wide?")
