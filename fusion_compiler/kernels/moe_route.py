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

Design.  The routing body (``_route_rows``) works on a [R, G_PAD, GS_PAD] tile: R tokens x
group x expert-in-group, each padded to a power of two (one row of next_power_of_2(E) without
groups), so per-group reductions run over axis 2.  Every choice score becomes one int64 key,
``(order-preserving int32 of the fp32 score) << 32 | (NP - 1 - expert)``: one max-reduction
then yields the best score *and* the lowest expert index among equal scores, and keys are
unique, so a pick is removed by key equality.  A group's top-2 sum is two such reductions
over axis 2 (two equal maxima both count).  Groups are kept by rank: group g is kept iff fewer
than ``topk_group`` valid groups beat it (higher score, or equal score and lower index), one
[G_PAD, G_PAD] comparison.  Experts are picked in ``top_k`` unrolled rounds of one reduction
each; their unbiased scores are then recomputed from the logits gathered at the picked ids,
with the same formula (so bit-identical to the in-register scores), instead of one more
reduction per round.

Launches: ``moe_route_fwd``, one program per token from logits; ``moe_router_fwd``, the router
GEMM and the routing in one launch for a few tokens (each program computes the logits of its
experts for all tokens; the last program to finish routes them; see ``_moe_router_kernel``).

Math in fp32: sigmoid is ``1 / (1 + exp(-x))`` and softmax ``exp(x - max) / sum`` with
correctly rounded divisions (``div_rn``: plain ``/`` is approximate on the GPU), and the
renormalisation is ``w / (sum + renorm_eps)`` then ``* scale``, in the reference's order.
``exp`` may differ from torch's in the last ulp, so weights match to a few ulp and ids match
exactly wherever scores are not within an ulp of a tie (and exactly on true ties).
NaN logits: ids stay distinct and in [0, E); a NaN score ranks above +inf (torch's sort puts
NaN first too), but with several NaNs or a NaN group score the choice is unspecified.

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
KERNEL_VERSION = "moe_route-3"

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUP_TOP = 2  # DeepSeek V3 scores a group by the sum of its 2 best experts

_NO_KEY = tl.constexpr(-(2**63))  # below every score's key: padding, picked experts


@triton.jit
def _score_key(c, e, NP: tl.constexpr):
    """int64 key ordered like (score c descending, expert e ascending); -0.0 counts as +0.0."""
    bits = (c + 0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse their order
    return (ordered.to(tl.int64) << 32) | (NP - 1 - e).to(tl.int64)


@triton.jit
def _key_score(key):
    """The fp32 score a key was made from."""
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _scores(x, row_max, total, SCORING: tl.constexpr):
    """sigmoid(x), or softmax's exp(x - max) / sum with the row's max and sum (in registers
    and for gathered logits alike, so both give the same bits)."""
    if SCORING == 0:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))
    else:
        return tl.math.div_rn(tl.exp(x - row_max), tl.full(x.shape, 0.0, tl.float32) + total)


@triton.jit
def _load_logits(ptrs, mask, CACHE_GLOBAL: tl.constexpr):
    if CACHE_GLOBAL:  # written by other programs of this launch: read through L2, not L1
        return _upcast(tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg"))
    else:
        return _upcast(tl.load(ptrs, mask=mask, other=0.0))


@triton.jit
def _route_rows(LOGITS, rows, row_mask, stride_lt, stride_le, BIAS, stride_b, renorm_eps, scale,
                GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                TOP_K: tl.constexpr, G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr,
                SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                CACHE_GLOBAL: tl.constexpr):
    """Route the logits rows ``rows`` [R] (int64, ``row_mask`` in range); returns ([R, K_PAD]
    fp32 weights, [R, K_PAD] int32 ids)."""
    NP: tl.constexpr = G_PAD * GS_PAD  # power of two > every expert index
    g = tl.arange(0, G_PAD)[None, :, None]
    j = tl.arange(0, GS_PAD)[None, None, :]
    e = g * GROUP_SIZE + j  # padded lanes alias real experts: always mask with valid
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    lanes = valid & row_mask[:, None, None]
    row_base = LOGITS + rows[:, None, None] * stride_lt
    x = _load_logits(row_base + e * stride_le, lanes, CACHE_GLOBAL)

    row_max = tl.zeros([x.shape[0]], dtype=tl.float32)
    total = tl.zeros([x.shape[0]], dtype=tl.float32)
    if SCORING == 1:
        xm = tl.where(valid, x, float("-inf"))
        row_max = tl.max(tl.max(xm, axis=2), axis=1)
        p = tl.exp(xm - row_max[:, None, None])  # padded lanes: exp(-inf) = 0
        total = tl.sum(tl.sum(p, axis=2), axis=1)
    s = _scores(x, row_max[:, None, None], total[:, None, None], SCORING)
    if HAS_BIAS:
        s += tl.load(BIAS + e * stride_b, mask=valid, other=0.0).to(tl.float32)
    key = tl.where(valid, _score_key(s, e, NP), _NO_KEY)

    if N_GROUP > 1:
        first = tl.max(key, axis=2)  # [R, G_PAD]
        second = tl.max(tl.where(key == first[:, :, None], _NO_KEY, key), axis=2)
        gscore = _key_score(first) + _key_score(second)
        gi = tl.arange(0, G_PAD)
        a = gscore[:, :, None]  # challenger h (axis 1)
        c = gscore[:, None, :]  # group g (axis 2)
        beats = (a > c) | ((a == c) & (gi[None, :, None] < gi[None, None, :]))
        beats = beats & (gi[None, :, None] < N_GROUP)
        rank = tl.sum(beats.to(tl.int32), axis=1)  # [R, G_PAD]
        keep = (rank < TOPK_GROUP)[:, :, None]
        key = tl.where(valid, _score_key(tl.where(keep, s, float("-inf")), e, NP), _NO_KEY)

    kk = tl.arange(0, K_PAD)[None, :]
    ids = tl.zeros([x.shape[0], K_PAD], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(key, axis=2), axis=1)  # [R]
        key = tl.where(key == best[:, None, None], _NO_KEY, key)
        ids = tl.where(kk == i, (NP - 1 - (best & (NP - 1))).to(tl.int32)[:, None], ids)

    picked = row_mask[:, None] & (kk < TOP_K)
    xk = _load_logits(LOGITS + rows[:, None] * stride_lt + ids * stride_le, picked, CACHE_GLOBAL)
    w = tl.where(picked, _scores(xk, row_max[:, None], total[:, None], SCORING), 0.0)
    if RENORMALIZE:
        w_sum = tl.sum(w, axis=1)
        w = tl.math.div_rn(w, tl.full(w.shape, 0.0, tl.float32) + (w_sum + renorm_eps)[:, None])
    return w * scale, ids


@triton.jit
def _store_routes(WEIGHTS, IDS, rows, row_mask, out_w, out_id, stride_wt, stride_wk,
                  stride_it, stride_ik, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    kk = tl.arange(0, K_PAD)[None, :]
    mask = row_mask[:, None] & (kk < TOP_K)
    tl.store(WEIGHTS + rows[:, None] * stride_wt + kk * stride_wk,
             _downcast(out_w, WEIGHTS.dtype.element_ty), mask=mask)
    tl.store(IDS + rows[:, None] * stride_it + kk * stride_ik, out_id.to(tl.int64), mask=mask)


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
    """Routing from logits: one program per token."""
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # int64: T * stride can pass 2**31
    in_range = rows >= 0
    out_w, out_id = _route_rows(LOGITS, rows, in_range, stride_lt, stride_le, BIAS, stride_b,
                                renorm_eps, scale, GROUP_SIZE, N_GROUP, TOPK_GROUP, TOP_K, G_PAD,
                                GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE, False)
    _store_routes(WEIGHTS, IDS, rows, in_range, out_w, out_id, stride_wt, stride_wk,
                  stride_it, stride_ik, TOP_K, K_PAD)


@triton.jit
def _gemm_chunk(acc, HIDDEN, ROUTER_W, t, ex, c, T, H, E, stride_ht, stride_we, BLOCK_H: tl.constexpr):
    """acc [T_PAD, BLOCK_E] += hidden[t, chunk c] . router_weight[ex, chunk c], in fp32."""
    h = c * BLOCK_H + tl.arange(0, BLOCK_H)
    w_tile = tl.load(ROUTER_W + ex[:, None] * stride_we + h[None, :],
                     mask=(ex[:, None] < E) & (h[None, :] < H), other=0.0)
    x_tile = tl.load(HIDDEN + t[:, None] * stride_ht + h[None, :],
                     mask=(t[:, None] < T) & (h[None, :] < H), other=0.0)
    return acc + tl.sum(_upcast(x_tile)[:, None, :] * _upcast(w_tile)[None, :, :], axis=2)


@triton.jit(do_not_specialize=["T"])
def _moe_router_kernel(
    HIDDEN, ROUTER_W, BIAS, LOGITS, WEIGHTS, IDS, DONE,
    T, H, E,
    stride_ht, stride_we, stride_lt, stride_b,
    stride_wt, stride_wk, stride_it, stride_ik,
    renorm_eps, scale,
    T_PAD: tl.constexpr,  # next_power_of_2(T) <= MAX_FUSED_TOKENS
    BLOCK_E: tl.constexpr,  # experts per program
    BLOCK_H: tl.constexpr,  # hidden chunk
    NUM_CHUNKS: tl.constexpr,  # cdiv(H, BLOCK_H)
    GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """Router GEMM and routing in one launch, for a few tokens.

    Program p computes the logits of experts [p * BLOCK_E, (p + 1) * BLOCK_E) for every token
    (it reads its slice of the router weight once) and stores them, rounded to the logits
    dtype, to LOGITS.  The last program to finish (a counter in DONE, acq_rel) routes all
    tokens from LOGITS and resets the counter for the next launch."""
    pid = tl.program_id(0)
    t = tl.arange(0, T_PAD)
    ex = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros([T_PAD, BLOCK_E], dtype=tl.float32)
    # Unrolled, so the weight loads of every chunk can issue up front (a runtime loop made
    # each chunk wait for the previous one's DRAM round trip: 57 us at 16 tokens, NOTES.md).
    for c in tl.static_range(NUM_CHUNKS):
        acc = _gemm_chunk(acc, HIDDEN, ROUTER_W, t, ex, c, T, H, E, stride_ht, stride_we, BLOCK_H)
    tl.store(LOGITS + t[:, None] * stride_lt + ex[None, :],
             _downcast(acc, LOGITS.dtype.element_ty), mask=(t[:, None] < T) & (ex[None, :] < E))

    # Every thread's logits are stored before the counter moves (bar.sync, then a gpu-scope
    # release); the last program's acquire makes all programs' logits visible to it.
    tl.debug_barrier()
    done = tl.atomic_add(DONE, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        rows = t.to(tl.int64)
        out_w, out_id = _route_rows(LOGITS, rows, rows < T, stride_lt, 1, BIAS, stride_b,
                                    renorm_eps, scale, GROUP_SIZE, N_GROUP, TOPK_GROUP, TOP_K,
                                    G_PAD, GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE, True)
        _store_routes(WEIGHTS, IDS, rows, rows < T, out_w, out_id, stride_wt, stride_wk,
                      stride_it, stride_ik, TOP_K, K_PAD)
        tl.store(DONE, 0)


def launch_config(experts: int, n_group: int, top_k: int) -> tuple[int, int, int, int]:
    """(G_PAD, GS_PAD, K_PAD, num_warps) for a row of ``experts`` in ``n_group`` groups."""
    if n_group > 1:
        g_pad = triton.next_power_of_2(n_group)
        gs_pad = triton.next_power_of_2(experts // n_group)
    else:
        g_pad, gs_pad = 1, triton.next_power_of_2(experts)
    num_warps = 8 if experts >= 512 else 4  # not tuned
    return g_pad, gs_pad, triton.next_power_of_2(top_k), num_warps


# The router GEMM is fused into the routing launch up to this many tokens; above it, cuBLAS
# computes the logits and the routing kernel reads them. Measured on the H200 with moe_route-3
# (results/moe_router_check_h200.json, µs in CUDA graphs, fused vs cuBLAS + routing):
#   tokens          1            2            4             8             16
#   DeepSeek    6.2 vs 9.9   7.8 vs 9.8   11.3 vs 9.8   18.0 vs 9.9   51.4 vs 10.2
#   MiniMax     5.5 vs 9.4   6.4 vs 9.5    9.0 vs 9.4   12.0 vs 9.6   34.5 vs 9.8
#   Qwen3.5     7.4 vs 11.2  8.9 vs 11.1  12.4 vs 11.1  25.8 vs 11.4  57.7 vs 11.6
# The fused launch accepts up to MAX_FUSED_TOKENS; its GEMM does not scale with tokens yet.
FUSED_GEMM_MAX_TOKENS = 2
MAX_FUSED_TOKENS = 16


def gemm_launch_config(tokens: int, experts: int, hidden: int) -> tuple[int, int, int, int]:
    """(T_PAD, BLOCK_E, BLOCK_H, num_warps) of the GEMM-fused launch: one program per expert
    (E programs), each reading its router-weight row once, in unrolled hidden chunks."""
    t_pad = triton.next_power_of_2(max(tokens, 1))
    block_e = 1  # 1 expert per program was best at 1 and 16 tokens (bench/NOTES.md)
    # Keep the [T_PAD, BLOCK_E, BLOCK_H] product at <= 8K fp32 values per chunk.
    block_h = max(64, min(triton.next_power_of_2(hidden), 8192 // (t_pad * block_e)))
    return t_pad, block_e, block_h, 4


def _routing_meta(named: dict, experts: int) -> dict:
    """Checked routing scalars -> the kernels' routing constexprs."""
    top_k, n_group, topk_group = int(named["top_k"]), int(named["n_group"]), int(named["topk_group"])
    scoring = int(named["scoring"])
    bias = named["bias"]
    if bias is not None and (bias.dtype not in _LOGIT_DTYPES or tuple(bias.shape) != (experts,)):
        raise ValueError(f"bias must be float [{experts}], got {tuple(bias.shape)} {bias.dtype}")
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
    g_pad, gs_pad, k_pad, _ = launch_config(experts, n_group, top_k)
    return dict(
        GROUP_SIZE=experts // n_group, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        G_PAD=g_pad, GS_PAD=gs_pad, K_PAD=k_pad, SCORING=scoring, HAS_BIAS=bias is not None,
        RENORMALIZE=bool(named["renormalize"]),
    )


def _check_outputs(weights: torch.Tensor, ids: torch.Tensor, tokens: int, top_k: int) -> None:
    if tuple(weights.shape) != (tokens, top_k) or weights.dtype not in _WEIGHT_DTYPES:
        raise ValueError(
            f"weights must be [{tokens}, {top_k}] fp32/bf16/fp16, got {tuple(weights.shape)} {weights.dtype}"
        )
    if tuple(ids.shape) != (tokens, top_k) or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 [{tokens}, {top_k}], got {tuple(ids.shape)} {ids.dtype}")


def moe_route_fwd(named: dict, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Launch the routing kernel; fills ``weights`` [T, top_k] and ``ids`` [T, top_k] in place.

    ``named`` maps the op's argument names (logits, bias, top_k, n_group, topk_group,
    scoring, renormalize, renorm_eps, scale, weights_dtype) to their values.  ``logits`` is
    [T, E] fp32/bf16/fp16 with any strides; ``bias`` None or float [E]; ``weights`` has
    ``weights_dtype`` and ``ids`` int64 (any strides, must not overlap the inputs).
    No host syncs: only shapes, strides, dtypes and Python scalars are read.
    """
    logits, bias = named["logits"], named["bias"]
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits must be [T, E] fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    tokens, experts = logits.shape
    meta = _routing_meta(named, experts)
    _check_outputs(weights, ids, tokens, meta["TOP_K"])
    tensors = [logits, weights, ids] + ([bias] if bias is not None else [])
    if any(t.device != logits.device for t in tensors):
        raise ValueError(f"all tensors must be on {logits.device}")
    if tokens == 0:
        return
    num_warps = launch_config(experts, meta["N_GROUP"], meta["TOP_K"])[3]
    bias_arg = bias if bias is not None else logits  # dummy, never read without HAS_BIAS

    def _launch():
        _moe_route_kernel[(tokens,)](
            logits, bias_arg, weights, ids,
            logits.stride(0), logits.stride(1), bias.stride(0) if bias is not None else 0,
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
            float(named["renorm_eps"]), float(named["scale"]),
            num_warps=num_warps, **meta,
        )

    launch_on_device(logits, _launch)


# One completion counter per device. The GEMM-fused launch's last program resets it to zero, so
# it is allocated (zeroed) once, outside any CUDA-graph capture, and every later launch, in a
# graph or not and on whichever stream, finds it at zero. Launches on one device must not
# overlap in time (two streams routing concurrently would share the counter).
_DONE_COUNTERS: dict[int, torch.Tensor] = {}


def _done_counter(device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.zeros(1, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    counter = _DONE_COUNTERS.get(index)
    if counter is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fusion_compiler.moe_router: its first call on this device is inside CUDA-graph capture; "
                "run it once before capturing (its completion counter must be zeroed outside the graph)"
            )
        counter = _DONE_COUNTERS[index] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def moe_router_fwd(named: dict, hidden: torch.Tensor, router_weight: torch.Tensor,
                   logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Router GEMM + routing in one launch (``tokens <= MAX_FUSED_TOKENS``; the op uses it up to
    ``FUSED_GEMM_MAX_TOKENS``).

    ``hidden`` [T, H] and ``router_weight`` [E, H] (unit stride along H) are read in their own
    dtypes and multiplied in fp32; the logits are rounded to ``logits.dtype`` ([T, E], unit
    stride along E, written) before routing, as an ``F.linear`` in that dtype would round them.
    So each input's dtype must be the logits dtype or a narrower float (an exact widening).
    ``named`` holds the routing arguments as in :func:`moe_route_fwd`.
    """
    tokens, hid = hidden.shape
    experts = router_weight.shape[0]
    if not 1 <= tokens <= MAX_FUSED_TOKENS:
        raise ValueError(f"the GEMM-fused launch takes 1..{MAX_FUSED_TOKENS} tokens, got {tokens}")
    if tuple(router_weight.shape) != (experts, hid) or tuple(logits.shape) != (tokens, experts):
        raise ValueError(
            f"shapes disagree: hidden {tuple(hidden.shape)}, router_weight {tuple(router_weight.shape)}, "
            f"logits {tuple(logits.shape)}"
        )
    for name, t in (("hidden", hidden), ("router_weight", router_weight)):
        if t.dtype not in _LOGIT_DTYPES or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a float tensor with unit stride on its last dim, got {t.dtype} {t.stride()}")
        if t.element_size() > logits.element_size() or (t.element_size() == logits.element_size() and t.dtype != logits.dtype):
            raise ValueError(f"{name} {t.dtype} does not widen exactly to the {logits.dtype} logits")
    if logits.stride(-1) != 1:
        raise ValueError(f"logits must have unit stride on the expert dim, got {logits.stride()}")
    meta = _routing_meta(named, experts)
    _check_outputs(weights, ids, tokens, meta["TOP_K"])
    bias = named["bias"]
    tensors = [hidden, router_weight, logits, weights, ids] + ([bias] if bias is not None else [])
    if any(t.device != hidden.device for t in tensors):
        raise ValueError(f"all tensors must be on {hidden.device}")

    t_pad, block_e, block_h, num_warps = gemm_launch_config(tokens, experts, hid)
    done = _done_counter(hidden.device)
    bias_arg = bias if bias is not None else logits

    def _launch():
        _moe_router_kernel[(triton.cdiv(experts, block_e),)](
            hidden, router_weight, bias_arg, logits, weights, ids, done,
            tokens, hid, experts,
            hidden.stride(0), router_weight.stride(0), logits.stride(0), bias.stride(0) if bias is not None else 0,
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
            float(named["renorm_eps"]), float(named["scale"]),
            T_PAD=t_pad, BLOCK_E=block_e, BLOCK_H=block_h, NUM_CHUNKS=triton.cdiv(hid, block_h),
            num_warps=num_warps, **meta,
        )

    launch_on_device(hidden, _launch)
