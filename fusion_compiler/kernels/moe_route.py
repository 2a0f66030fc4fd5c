"""MoE routing (router logits -> top-k weights and expert ids): one Triton kernel and its launcher.

Semantics (the reference is ``fusion_compiler.ops.moe_route.moe_route_reference``; this file
must match it):

    s      = sigmoid(logits.float())  (scoring 0)   or  softmax(logits.float(), -1)  (scoring 1)
    choice = s + bias                 (optional fp32 [E])
    if n_group > 1: group score = sum of the 2 largest ``choice`` of each group of E / n_group
                    experts; the experts of all but the ``topk_group`` best groups get -inf
    ids    = the ``top_k`` largest ``choice``, descending                   int64 [T, top_k]
    w      = s[ids]; if renormalize: w = w / (w.sum(-1) + renorm_eps)
    w      = (w * scale).to(weights_dtype)

Ties (experts and groups alike) go to the lower index, like the reference's stable sort.

Design: one program per token; the whole expert row sits in registers as a
[G_PAD, GS_PAD] tile (group x expert-in-group, each padded to a power of two; one row of
next_power_of_2(E) without groups), so the per-group top-2 is an axis-1 reduction.
Groups are kept by rank: group g is kept iff fewer than ``topk_group`` valid groups beat it
(higher score, or equal score and lower index), one [G_PAD, G_PAD] comparison.
Experts are picked in ``top_k`` unrolled rounds: the max of the live experts, then the
lowest live expert index equal to it (one min-reduction of a key that is the expert index for
a match, index + NP for any other live expert and 2 * NP for dead lanes, so a round always
picks a live, in-range expert even when the max is NaN); its unbiased score is read out of
registers and the expert is marked dead.

Math in fp32: sigmoid is ``1 / (1 + exp(-x))`` and softmax ``exp(x - max) / sum`` with
correctly rounded divisions (``div_rn``: plain ``/`` is approximate on the GPU), and the
renormalisation is ``w / (sum + renorm_eps)`` then ``* scale``, in the reference's order.
``exp`` may differ from torch's in the last ulp, so weights match to a few ulp and ids match
exactly wherever scores are not within an ulp of a tie (and exactly on true ties).
NaN logits: ids stay distinct and in [0, E) but their order does not follow torch's
NaN-first sort.

bf16 loads/stores go through ``_device.upcast`` / ``_device.downcast`` (bit-level casts under
the interpreter, native casts on the GPU).  No host syncs in the launcher.

This module imports only torch and triton.  Set ``TRITON_INTERPRET=1`` *before* importing it
to run the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import downcast as _downcast
from ._device import launch_on_device
from ._device import upcast as _upcast

# Bump whenever the kernel or its launch configuration changes: the compiler hashes it into
# the Inductor cache key.
KERNEL_VERSION = "moe_route-1"

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUP_TOP = 2  # DeepSeek V3 scores a group by the sum of its 2 best experts


@triton.jit
def _moe_route_kernel(
    LOGITS, BIAS, WEIGHTS, IDS,
    stride_lt, stride_le, stride_b,
    stride_wt, stride_wk, stride_it, stride_ik,
    renorm_eps, scale,
    GROUP_SIZE: tl.constexpr,  # experts per group (E when N_GROUP == 1)
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    G_PAD: tl.constexpr,  # next_power_of_2(N_GROUP)
    GS_PAD: tl.constexpr,  # next_power_of_2(GROUP_SIZE)
    K_PAD: tl.constexpr,  # next_power_of_2(TOP_K)
    SCORING: tl.constexpr,  # 0 sigmoid, 1 softmax
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    NP: tl.constexpr = G_PAD * GS_PAD  # power of two > every expert index
    t = tl.program_id(0).to(tl.int64)  # int64: T * stride can pass 2**31
    g = tl.arange(0, G_PAD)[:, None]
    j = tl.arange(0, GS_PAD)[None, :]
    e = g * GROUP_SIZE + j  # expert index of each lane (padded lanes alias: always mask)
    valid = (g < N_GROUP) & (j < GROUP_SIZE)

    x = _upcast(tl.load(LOGITS + t * stride_lt + e * stride_le, mask=valid, other=0.0))
    if SCORING == 0:
        s = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))
    else:
        xm = tl.where(valid, x, float("-inf"))
        row_max = tl.max(tl.max(xm, axis=1), axis=0)
        p = tl.exp(xm - row_max)  # padded lanes: exp(-inf) = 0
        total = tl.sum(tl.sum(p, axis=1), axis=0)
        s = tl.math.div_rn(p, tl.full(p.shape, 0.0, tl.float32) + total)

    if HAS_BIAS:
        b = tl.load(BIAS + e * stride_b, mask=valid, other=0.0).to(tl.float32)
        choice = s + b
    else:
        choice = s
    choice = tl.where(valid, choice, float("-inf"))

    if N_GROUP > 1:
        # Per-group top-2 sum (two equal maxima both count: only the first copy is removed).
        top1 = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == top1[:, None], j, GS_PAD), axis=1)
        top2 = tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
        gscore = top1 + top2
        gi = tl.arange(0, G_PAD)
        a = gscore[:, None]  # challenger h (rows)
        c = gscore[None, :]  # group g (columns)
        beats = (a > c) | ((a == c) & (gi[:, None] < gi[None, :]))
        beats = beats & (gi[:, None] < N_GROUP)
        rank = tl.sum(beats.to(tl.int32), axis=0)
        keep = (rank < TOPK_GROUP) & (gi < N_GROUP)
        choice = tl.where(keep[:, None], choice, float("-inf"))

    kk = tl.arange(0, K_PAD)
    out_w = tl.zeros([K_PAD], dtype=tl.float32)
    out_id = tl.zeros([K_PAD], dtype=tl.int32)
    live = valid
    for i in tl.static_range(TOP_K):
        cand = tl.where(live, choice, float("-inf"))
        best = tl.max(tl.max(cand, axis=1), axis=0)
        key = tl.where(live, tl.where(cand == best, e, e + NP), 2 * NP)
        idx = tl.min(tl.min(key, axis=1), axis=0) & (NP - 1)
        hit = valid & (e == idx)
        w = tl.sum(tl.sum(tl.where(hit, s, 0.0), axis=1), axis=0)  # exact: one term
        live = live & (e != idx)
        out_w = tl.where(kk == i, w, out_w)
        out_id = tl.where(kk == i, idx, out_id)

    if RENORMALIZE:
        total_w = tl.sum(out_w, axis=0)  # padded entries are +0
        out_w = tl.math.div_rn(out_w, tl.full(out_w.shape, 0.0, tl.float32) + (total_w + renorm_eps))
    out_w = out_w * scale

    kmask = kk < TOP_K
    tl.store(WEIGHTS + t * stride_wt + kk * stride_wk,
             _downcast(out_w, WEIGHTS.dtype.element_ty), mask=kmask)
    tl.store(IDS + t * stride_it + kk * stride_ik, out_id.to(tl.int64), mask=kmask)


def launch_config(experts: int, n_group: int, top_k: int) -> tuple[int, int, int, int]:
    """(G_PAD, GS_PAD, K_PAD, num_warps) for a row of ``experts`` in ``n_group`` groups."""
    if n_group > 1:
        g_pad = triton.next_power_of_2(n_group)
        gs_pad = triton.next_power_of_2(experts // n_group)
    else:
        g_pad, gs_pad = 1, triton.next_power_of_2(experts)
    num_warps = 8 if experts >= 512 else 4  # not tuned
    return g_pad, gs_pad, triton.next_power_of_2(top_k), num_warps


def moe_route_fwd(named: dict, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Launch the routing kernel; fills ``weights`` [T, top_k] and ``ids`` [T, top_k] in place.

    ``named`` maps the op's argument names (logits, bias, top_k, n_group, topk_group,
    scoring, renormalize, renorm_eps, scale, weights_dtype) to their values.  ``logits`` is
    [T, E] fp32/bf16/fp16 with any strides; ``bias`` None or fp32 [E]; ``weights`` has
    ``weights_dtype`` and ``ids`` int64 (any strides, must not overlap the inputs).
    No host syncs: only shapes, strides, dtypes and Python scalars are read.
    """
    logits, bias = named["logits"], named["bias"]
    top_k, n_group, topk_group = int(named["top_k"]), int(named["n_group"]), int(named["topk_group"])
    scoring, renormalize = int(named["scoring"]), bool(named["renormalize"])
    renorm_eps, scale = float(named["renorm_eps"]), float(named["scale"])

    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits must be [T, E] fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    tokens, experts = logits.shape
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (experts,)):
        raise ValueError(f"bias must be fp32 [{experts}], got {tuple(bias.shape)} {bias.dtype}")
    if scoring not in (0, 1):
        raise ValueError(f"scoring must be 0 (sigmoid) or 1 (softmax), got {scoring}")
    if n_group < 1 or experts % n_group:
        raise ValueError(f"n_group {n_group} must divide the {experts} experts")
    if n_group > 1:
        if experts // n_group < _GROUP_TOP or not 1 <= topk_group <= n_group:
            raise ValueError(f"bad grouping: {experts} experts, n_group {n_group}, topk_group {topk_group}")
        available = topk_group * (experts // n_group)
    else:
        topk_group = 1
        available = experts
    if not 1 <= top_k <= available:
        raise ValueError(f"top_k {top_k} must be in [1, {available}]")
    if tuple(weights.shape) != (tokens, top_k) or weights.dtype not in _WEIGHT_DTYPES:
        raise ValueError(
            f"weights must be [{tokens}, {top_k}] fp32/bf16/fp16, got {tuple(weights.shape)} {weights.dtype}"
        )
    if tuple(ids.shape) != (tokens, top_k) or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 [{tokens}, {top_k}], got {tuple(ids.shape)} {ids.dtype}")
    tensors = [logits, weights, ids] + ([bias] if bias is not None else [])
    if any(t.device != logits.device for t in tensors):
        raise ValueError(f"all tensors must be on {logits.device}")

    if tokens == 0:
        return

    g_pad, gs_pad, k_pad, num_warps = launch_config(experts, n_group, top_k)
    bias_arg = bias if bias is not None else logits  # dummy, never read without HAS_BIAS

    def _launch():
        _moe_route_kernel[(tokens,)](
            logits, bias_arg, weights, ids,
            logits.stride(0), logits.stride(1), bias.stride(0) if bias is not None else 0,
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
            renorm_eps, scale,
            GROUP_SIZE=experts // n_group,
            N_GROUP=n_group,
            TOPK_GROUP=topk_group,
            TOP_K=top_k,
            G_PAD=g_pad,
            GS_PAD=gs_pad,
            K_PAD=k_pad,
            SCORING=scoring,
            HAS_BIAS=bias is not None,
            RENORMALIZE=renormalize,
            num_warps=num_warps,
        )

    launch_on_device(logits, _launch)
