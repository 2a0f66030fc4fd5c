"""MoE routing (router GEMM and logits -> top-k weights and expert ids): Triton kernels and launchers.

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
reduction per round.  Or, by the row's shape (``routing_tail``, measured): all top_k picks by
tl.topk's bitonic network, and without a bias the picked scores read off their keys in the
registers; with a bias and 16-bit logits the picked logit rides in the key's low 16 bits below
the index, so nothing is reloaded.  Where the score is a monotone function of a 16-bit logit
alone (no bias, no groups: Qwen3.5's softmax), the keys are int32, ``ordered logit << 16 | (NP -
1 - expert)``: the top_k are picked per warp (one REDUX a round, no bar.sync) and the warps'
candidates merged by rank, and only the picked experts' scores are computed.  Their ties differ
in one documented way: distinct logits whose fp32 scores are equal go to the larger logit.

Launches: ``moe_route_fwd``, one program per token from logits; ``moe_router_fwd``, the router
GEMM (``_router_gemm_kernel``: the hidden dim split so ~128 programs stream the router weight,
each its span in one tile: tl.dot, or at one token fp32 multiply-adds; fp32 partial sums) and
the routing kernel, which sums them; or, up to
``FUSED_GEMM_MAX_TOKENS`` tokens, one launch whose last T programs to finish sum them and route
one token each (an acq_rel arrival counter); at one token, the program with the last id routes
without any counter, polling the partial sums until none holds the unwritten bits
(``_UNWRITTEN``), then writing those bits back for the next launch.
Qwen3.5's shared-expert gate ``sigmoid(hidden . gate_weight)`` rides along as GEMM column E.

Math in fp32: sigmoid is ``1 / (1 + exp(-x))`` and softmax ``exp(x - max) / sum`` with
correctly rounded divisions (``div_rn``: plain ``/`` is approximate on the GPU), and the
renormalisation is ``w / (sum + renorm_eps)`` then ``* scale``, in the reference's order.
``exp`` may differ from torch's in the last ulp, so weights match to a few ulp and ids match
exactly wherever scores are not within an ulp of a tie (and exactly on true ties).
NaN logits: ids stay distinct and in [0, E); a NaN score ranks above +inf (torch's sort puts
NaN first too), but with several NaNs or a NaN group score the choice is unspecified.  With
int32 logit keys a NaN logit ranks by its sign bit: above +inf if clear, below -inf if set.

bf16 loads/stores go through ``_device.upcast`` / ``_device.downcast`` (bit-level casts under
the interpreter, native casts on the GPU).  No host syncs in the launcher.

This module imports only torch and triton.  Set ``TRITON_INTERPRET=1`` *before* importing it
to run the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import INTERPRETER, INTERPRETER_BIT_CASTS
from ._device import downcast as _downcast
from ._device import launch_on_device
from ._device import round_trip as _round_trip
from ._device import upcast as _upcast

# Bump whenever the kernel or its launch configuration changes: the compiler hashes it into
# the Inductor cache key.
KERNEL_VERSION = "moe_route-16"

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUP_TOP = 2  # DeepSeek V3 scores a group by the sum of its 2 best experts

_NO_KEY = tl.constexpr(-(2**63))  # below every score's key: padding, picked experts
_NO_KEY32 = tl.constexpr(-(2**31))  # ... and below every int32 logit key (>= -32767 * 2**16)
# A partial sum not yet written (the one-token launch's polling router): the bits of a negative
# NaN with every payload bit set, which no GPU arithmetic produces (its NaNs are 0x7FFFFFFF).
_UNWRITTEN = tl.constexpr(-1)

# The routing tail after the GEMM is latency at one token: TOP_K dependent block-wide reductions
# (a bar.sync each), then an L2 round trip for the picked logits, then (Qwen) another for the
# gate's partials.  SELECT 0: TOP_K rounds of one max-reduction; 1: tl.topk; 2: rounds within
# each warp, then the warps' candidates merged by rank (``_top_keys``).  TAIL_LOADS 0: the picked
# scores recomputed from reloaded logits, the gate's partials summed after the routing; 1: the
# picked scores from the registers (the keys themselves without a bias, else one masked sum) and
# the gate's partials loaded with the experts'; 2: as 1, from the 16-bit logit carried in the
# int64 key's low bits.  KEYS 0: int64 keys of the fp32 scores; 1: int32 keys of the 16-bit
# logits, where the score is a monotone function of the logit alone (``_logit_key``).
# ``routing_tail`` picks all three by shape; the bench's A/B (bench/moe_router_check.py) overrides
# them here (None: by shape).
_SELECT: int | None = None
_TAIL_LOADS: int | None = None
_KEYS: int | None = None
TOPK_SELECT_MAX_EXPERTS = 256


def routing_tail(padded_experts: int, has_bias: bool, n_group: int, logits_dtype: torch.dtype) -> tuple[int, int, int]:
    """(SELECT, TAIL_LOADS, KEYS) for a row of ``padded_experts`` lanes.

    H200, one token through the GEMM-fused launch, CUDA-graph µs (session 11, bench/NOTES.md;
    DeepSeek / MiniMax / Qwen3.5): rounds + reload 7.14 / 6.02 / 9.88; tl.topk 6.71 / 5.05 /
    10.12 (its network grows with the 512 lanes of Qwen's row); registers 7.78 / 6.56 / 9.28
    (with a bias, the masked sum costs more than the reload it saves; without one it is free).
    Session 15 (moe_route-15): int32 logit keys selected per warp without a bias and groups
    (Qwen3.5), the logit carried in the key with a bias (MiniMax); see bench/NOTES.md."""
    narrow = logits_dtype.itemsize == 2 and padded_experts <= 1 << 16
    logit_keys = narrow and not has_bias and n_group == 1
    keys = int(logit_keys) if _KEYS is None else _KEYS
    if keys and not logit_keys:
        raise ValueError("int32 logit keys (KEYS 1) need 16-bit logits, no bias, no groups and <= 65536 experts")
    if keys:
        select, tail_loads = 2, 1
    else:
        select = 1 if padded_experts <= TOPK_SELECT_MAX_EXPERTS else 0
        tail_loads = (2 if narrow else 0) if has_bias else 1
    tail_loads = tail_loads if _TAIL_LOADS is None else _TAIL_LOADS
    if tail_loads == 2 and not narrow:
        raise ValueError("the logit in the key (TAIL_LOADS 2) needs 16-bit logits and <= 65536 experts")
    return (select if _SELECT is None else _SELECT), tail_loads, keys


@triton.jit
def _score_key(c, low):
    """int64 key ordered like (score c descending, then ``low`` descending); -0.0 counts as +0.0.
    ``low`` (int64, < 2**32) is the expert's tie-break ``NP - 1 - e``, or (TAIL_LOADS 2 in
    ``_route_rows``) that shifted left by 16 over the raw bits of its 16-bit logit."""
    bits = (c + 0.0).to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse their order
    return (ordered.to(tl.int64) << 32) | low


@triton.jit
def _key_score(key):
    """The fp32 score a key was made from."""
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _bits16(v):
    """The raw bits of a 16-bit float as int32 in [0, 65536)."""
    return v.to(tl.uint16, bitcast=True).to(tl.int32)


@triton.jit
def _from_bits16(bits, DTYPE: tl.constexpr):
    """fp32 of the 16-bit float of DTYPE whose raw bits are ``bits`` (int32 in [0, 65536))."""
    return _upcast(bits.to(tl.uint16).to(DTYPE, bitcast=True))


@triton.jit
def _logit_key(bits, e, NP: tl.constexpr):
    """int32 key ordered like (16-bit logit descending, expert e ascending), from the logit's raw
    bits; -0.0 counts as +0.0, a NaN with the sign bit set ranks below -inf. For a score that is
    a monotone function of the logit alone (softmax or sigmoid, no bias, no groups), this is the
    score's order wherever the fp32 scores differ; where distinct logits round to one fp32 score
    (exp underflow, or |x| below the fp32 score's resolution) the larger logit wins, not the
    lower index. Needs NP <= 2**16."""
    ordered = tl.where(bits >= 0x8000, -(bits & 0x7FFF), bits)  # sign-magnitude -> ordered
    return (ordered << 16) | (NP - 1 - e)


@triton.jit
def _logit_key_value(key, DTYPE: tl.constexpr):
    """The logit an int32 ``_logit_key`` was made from, as fp32 (-0.0 comes back as +0.0)."""
    ordered = key >> 16
    return _from_bits16(tl.where(ordered < 0, (-ordered) | 0x8000, ordered), DTYPE)


@triton.jit
def _scores(x, row_max, total, SCORING: tl.constexpr):
    """sigmoid(x), or softmax's exp(x - max) / sum with the row's max and sum (in registers
    and for gathered logits alike, so both give the same bits)."""
    if SCORING == 0:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))
    else:
        return tl.math.div_rn(tl.exp(x - row_max), tl.full(x.shape, 0.0, tl.float32) + total)


@triton.jit
def _sum_partials(PARTIALS, offsets, mask, stride_ps, SPLIT: tl.constexpr, POLL: tl.constexpr = False):
    """Sum of the SPLIT fp32 partial GEMMs at ``offsets``, in split order (other programs or
    launches wrote them: read through L2).  POLL: other programs of this launch are still writing
    them over ``_UNWRITTEN`` (the one-token launch's polling router): reload until no lane of the
    block reads it.  The count is one reduction over the block, so every thread leaves the loop
    in the same iteration with its own values written, provided no lane is held by two threads
    (a replicated layout, where Triton may count one copy only): the launcher polls only rows of
    at least 32 x num_warps lanes (``poll_rows``).  The gate column's [1] value is held by every
    thread, and each thread counts its own copy."""
    if POLL and not INTERPRETER:  # the interpreter runs the router after every other program
        total, unwritten = _load_partials(PARTIALS, offsets, mask, stride_ps, SPLIT)
        while unwritten > 0:
            total, unwritten = _load_partials(PARTIALS, offsets, mask, stride_ps, SPLIT)
    else:
        total = tl.zeros(offsets.shape, dtype=tl.float32)
        for part in tl.static_range(SPLIT):
            total += tl.load(PARTIALS + part * stride_ps + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _load_partials(PARTIALS, offsets, mask, stride_ps, SPLIT: tl.constexpr):
    """(the sum in split order, how many lanes of the block still read ``_UNWRITTEN``)."""
    total = tl.zeros(offsets.shape, dtype=tl.float32)
    unwritten = tl.zeros(offsets.shape, dtype=tl.int32)
    for part in tl.static_range(SPLIT):
        v = tl.load(PARTIALS + part * stride_ps + offsets, mask=mask, other=0.0, volatile=True)
        unwritten += (v.to(tl.int32, bitcast=True) == _UNWRITTEN).to(tl.int32)
        total += v
    return total, tl.sum(tl.reshape(unwritten, [unwritten.numel]), axis=0)


@triton.jit
def _group_top2(key, SELECT: tl.constexpr):
    """The two largest keys of each group (axis 2): ([R, G_PAD], [R, G_PAD])."""
    if SELECT == 0:
        first = tl.max(key, axis=2)
        second = tl.max(tl.where(key == first[:, :, None], _NO_KEY, key), axis=2)
    else:
        first, second = tl.split(tl.topk(key, 2))
    return first, second


@triton.jit
def _warp_max(lanes):
    """Max of each row of ``lanes`` [rows, n] (int32 or int64 keys): an int64 one as two 32-bit
    maxima (its high word, then the low word among the lanes that hold that high word), each one
    REDUX a warp where 64-bit values would take a shuffle tree."""
    if tl.constexpr(lanes.dtype == tl.int32):  # a constexpr: the other branch is not compiled
        best = tl.max(lanes, axis=1)
    else:
        hi = (lanes >> 32).to(tl.int32)
        lo = (lanes & 0xFFFFFFFF).to(tl.uint32)
        best_hi = tl.max(hi, axis=1)
        best_lo = tl.max(tl.where(hi == best_hi[:, None], lo, 0), axis=1)
        best = (best_hi.to(tl.int64) << 32) | best_lo.to(tl.int64)
    return best


@triton.jit
def _top_keys(key, TOP_K: tl.constexpr, K_PAD: tl.constexpr, SELECT: tl.constexpr, NO: tl.constexpr,
              WARPS: tl.constexpr):
    """The TOP_K largest keys of ``key`` [R, G_PAD, GS_PAD] (int64 or int32, ``NO`` below every
    real key), descending, in [R, K_PAD] (slots from TOP_K on unspecified).

    SELECT 0: TOP_K rounds of one block-wide max, each removing its pick: TOP_K dependent
    reductions (each crossing the warps: a bar.sync).  1: tl.topk's bitonic top-k over all keys
    (pairwise exchanges along the bits of the lane index, no chain of block-wide reductions).
    2 (one row, R == 1): the row as [WARPS, lanes / WARPS], which keeps the loads' layout (each
    warp holds a contiguous quarter of the row at 4 warps), so each of the TOP_K rounds is a max
    within each warp (an int32 max is one REDUX) with no bar.sync; then the WARPS x K_PAD
    candidates are merged by rank (each candidate's count of larger ones; keys are unique), one
    all-pairs comparison and two reductions instead of TOP_K block-wide rounds of ~3 bar.syncs
    each. Falls back to the rounds where a warp would hold fewer than 32 lanes."""
    kk = tl.arange(0, K_PAD)[None, :]
    NPL: tl.constexpr = key.shape[1] * key.shape[2]
    top = tl.full([key.shape[0], K_PAD], NO, key.dtype)
    if SELECT == 2 and NPL >= 32 * WARPS:
        tl.static_assert(key.shape[0] == 1)
        lanes = tl.reshape(key, [WARPS, NPL // WARPS])
        candidates = tl.full([WARPS, K_PAD], NO, key.dtype)
        for i in tl.static_range(TOP_K):
            best = _warp_max(lanes)  # [WARPS]
            lanes = tl.where(lanes == best[:, None], NO, lanes)
            candidates = tl.where(kk == i, best[:, None], candidates)
        flat = tl.reshape(candidates, [WARPS * K_PAD])
        rank = tl.sum((flat[None, :] > flat[:, None]).to(tl.int32), axis=1)  # larger candidates
        slot = rank[:, None] == tl.arange(0, K_PAD)[None, :]  # [WARPS * K_PAD, K_PAD]
        top = tl.max(tl.where(slot, flat[:, None], NO), axis=0)[None, :]  # NO where no rank fits
    elif SELECT == 1 and K_PAD > 1:  # tl.topk(x, 1) fails in the interpreter
        top = tl.topk(tl.reshape(key, [key.shape[0], NPL]), K_PAD)
    else:
        for i in tl.static_range(TOP_K):
            best = tl.max(tl.max(key, axis=2), axis=1)  # [R]
            key = tl.where(key == best[:, None, None], NO, key)
            top = tl.where(kk == i, best[:, None], top)
    return top


@triton.jit
def _route_rows(LOGITS, rows, row_mask, stride_lt, stride_le, BIAS, stride_b, renorm_eps, scale,
                PARTIALS, stride_ps, stride_pt,
                GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                TOP_K: tl.constexpr, G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr,
                SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                SPLIT: tl.constexpr, SELECT: tl.constexpr, TAIL_LOADS: tl.constexpr,
                KEYS: tl.constexpr, WARPS: tl.constexpr, POLL: tl.constexpr = False):
    """Route the logits rows ``rows`` [R] (int64, ``row_mask`` in range); returns ([R, K_PAD]
    fp32 weights, [R, K_PAD] int32 ids).

    SPLIT == 0: the logits are read from LOGITS.  SPLIT > 0: they are the sum, in split order, of
    SPLIT fp32 partial GEMMs in PARTIALS [SPLIT, T, E] (written by other programs or launches:
    read through L2), rounded to LOGITS' dtype and stored there (unit expert stride) first.
    KEYS 0: int64 keys of the (biased, group-masked) fp32 scores; 1: int32 keys of the 16-bit
    logits (``_logit_key``; no bias, no groups), and no per-lane score at all: only the picked
    experts' scores are computed.  SELECT: how the top_k are picked (``_top_keys``).  TAIL_LOADS:
    where the picked experts' unbiased scores come from: 0 reloaded logits; 1 the registers (the
    key itself: its score, or with KEYS 1 its logit; with a bias and int64 keys, a masked sum);
    2 (int64 keys, 16-bit logits) the logit's raw bits carried in the key's low 16 bits."""
    NP: tl.constexpr = G_PAD * GS_PAD  # power of two > every expert index
    LOGIT_DTYPE: tl.constexpr = LOGITS.dtype.element_ty
    g = tl.arange(0, G_PAD)[None, :, None]
    j = tl.arange(0, GS_PAD)[None, None, :]
    e = g * GROUP_SIZE + j  # padded lanes alias real experts: always mask with valid
    valid = (g < N_GROUP) & (j < GROUP_SIZE)
    lanes = valid & row_mask[:, None, None]
    row_base = LOGITS + rows[:, None, None] * stride_lt
    bias = tl.zeros(e.shape, dtype=tl.float32)
    if HAS_BIAS:  # issued first: nothing it waits for
        bias = tl.load(BIAS + e * stride_b, mask=valid, other=0.0).to(tl.float32)
    if SPLIT > 0:
        x = _sum_partials(PARTIALS, rows[:, None, None] * stride_pt + e, lanes, stride_ps, SPLIT, POLL)
        rounded = _downcast(x, LOGIT_DTYPE)
        tl.store(row_base + e * stride_le, rounded, mask=lanes)
    else:
        rounded = tl.load(row_base + e * stride_le, mask=lanes, other=0.0)
    x = _upcast(rounded)

    row_max = tl.zeros([x.shape[0]], dtype=tl.float32)
    total = tl.zeros([x.shape[0]], dtype=tl.float32)
    if SCORING == 1:
        xm = tl.where(valid, x, float("-inf"))
        row_max = tl.max(tl.max(xm, axis=2), axis=1)
        p = tl.exp(xm - row_max[:, None, None])  # padded lanes: exp(-inf) = 0
        total = tl.sum(tl.sum(p, axis=2), axis=1)
    if KEYS == 1:
        tl.static_assert(N_GROUP == 1 and not HAS_BIAS and NP <= 65536 and LOGIT_DTYPE.primitive_bitwidth == 16)
        key = tl.where(valid, _logit_key(_bits16(rounded), e, NP), _NO_KEY32)
        s = x  # unused: no per-lane scores
    else:
        low = (NP - 1 - e).to(tl.int64)
        if TAIL_LOADS == 2:
            tl.static_assert(NP <= 65536 and LOGIT_DTYPE.primitive_bitwidth == 16)
            low = (low << 16) | _bits16(rounded).to(tl.int64)
        s = _scores(x, row_max[:, None, None], total[:, None, None], SCORING)
        choice = s
        if HAS_BIAS:
            choice = s + bias
        key = tl.where(valid, _score_key(choice, low), _NO_KEY)

        if N_GROUP > 1:
            first, second = _group_top2(key, SELECT)  # [R, G_PAD] each
            gscore = _key_score(first) + _key_score(second)
            gi = tl.arange(0, G_PAD)
            a = gscore[:, :, None]  # challenger h (axis 1)
            c = gscore[:, None, :]  # group g (axis 2)
            beats = (a > c) | ((a == c) & (gi[None, :, None] < gi[None, None, :]))
            beats = beats & (gi[None, :, None] < N_GROUP)
            rank = tl.sum(beats.to(tl.int32), axis=1)  # [R, G_PAD]
            keep = (rank < TOPK_GROUP)[:, :, None]
            key = tl.where(valid, _score_key(tl.where(keep, choice, float("-inf")), low), _NO_KEY)

    top = _top_keys(key, TOP_K, K_PAD, SELECT, _NO_KEY32 if KEYS == 1 else _NO_KEY, WARPS)  # [R, K_PAD]
    SHIFT: tl.constexpr = 16 if (KEYS == 0 and TAIL_LOADS == 2) else 0
    ids = (NP - 1 - ((top >> SHIFT) & (NP - 1))).to(tl.int32)
    kk = tl.arange(0, K_PAD)[None, :]
    picked = row_mask[:, None] & (kk < TOP_K)
    if TAIL_LOADS == 0:
        # The picked experts' unbiased scores, recomputed from their logits with the same
        # formula (bit-identical to the in-register scores). Reloading the logits (L1 / L2; the
        # partials path stored them above, so after a bar.sync) measured faster than one
        # tl.gather from the registers (H200, session 6: 0.3-0.9 µs at 1 token; bench/NOTES.md).
        tl.debug_barrier()
        xk = tl.load(LOGITS + rows[:, None] * stride_lt + ids * stride_le, mask=picked, other=0.0,
                     cache_modifier=".cg")
        sk = _scores(_upcast(xk), row_max[:, None], total[:, None], SCORING)
    elif KEYS == 1:
        # The picked logits are in the keys: their scores by the same formula, only TOP_K of them.
        sk = _scores(_logit_key_value(top, LOGIT_DTYPE), row_max[:, None], total[:, None], SCORING)
    elif TAIL_LOADS == 2:
        sk = _scores(_from_bits16((top & 0xFFFF).to(tl.int32), LOGIT_DTYPE), row_max[:, None], total[:, None], SCORING)
    elif HAS_BIAS:
        # One masked sum over the experts per pick (all picks in one reduction), no memory
        # round trip: exactly one lane matches, so the sum is that lane's score.
        hit = valid[:, None] & (e[:, None] == ids[:, :, None, None])  # [R, K_PAD, G_PAD, GS_PAD]
        sk = tl.sum(tl.sum(tl.where(hit, s[:, None], 0.0), axis=3), axis=2)
    else:
        # Without a bias the key's score is the unbiased score itself (never -0.0): free.
        sk = _key_score(top)
    w = tl.where(picked, sk, 0.0)
    if RENORMALIZE:
        w_sum = tl.sum(w, axis=1)
        w = tl.math.div_rn(w, tl.full(w.shape, 0.0, tl.float32) + (w_sum + renorm_eps)[:, None])
    return w * scale, ids


@triton.jit
def _gate_value(PARTIALS, rows, row_mask, stride_ps, stride_pt, column, GATE_DTYPE: tl.constexpr,
                SPLIT: tl.constexpr, POLL: tl.constexpr = False):
    """sigmoid(the gate row's logit, rounded to GATE_DTYPE), from the split partials."""
    logit = _sum_partials(PARTIALS, rows * stride_pt + column, row_mask, stride_ps, SPLIT, POLL)
    return _scores(_round_trip(logit, GATE_DTYPE), 0.0, 0.0, 0)  # sigmoid


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
    LOGITS, BIAS, WEIGHTS, IDS, PARTIALS, GATE,
    stride_lt, stride_le, stride_b,
    stride_wt, stride_wk, stride_it, stride_ik, stride_ps, stride_pt, stride_g,
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
    SPLIT: tl.constexpr,  # 0: read LOGITS; > 0: sum SPLIT partial GEMMs into LOGITS first
    HAS_GATE: tl.constexpr,  # partials column E is the shared-expert gate's logit (SPLIT > 0)
    SELECT: tl.constexpr,  # how the top_k are picked (_top_keys)
    TAIL_LOADS: tl.constexpr,  # picked scores: 0 reloaded logits, 1 registers (and the gate's loads first), 2 key bits
    KEYS: tl.constexpr,  # 0 int64 score keys, 1 int32 logit keys (_route_rows)
    WARPS: tl.constexpr,  # the launch's num_warps (SELECT 2)
):
    """Routing from logits (or from the router GEMM's partial sums): one program per token."""
    row = tl.program_id(0)
    # T = row + 1: the grid has one program per token, so this program's row is always in range.
    _route_row(row, PARTIALS, LOGITS, BIAS, WEIGHTS, IDS, GATE, row + 1, N_GROUP * GROUP_SIZE,
               stride_ps, stride_pt, stride_lt, stride_le, stride_b, stride_wt, stride_wk, stride_it, stride_ik,
               stride_g, renorm_eps, scale, SPLIT, HAS_GATE, GROUP_SIZE, N_GROUP, TOPK_GROUP, TOP_K,
               G_PAD, GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE, SELECT, TAIL_LOADS, KEYS, WARPS)


@triton.jit
def _route_row(row, PARTIALS, LOGITS, BIAS, WEIGHTS, IDS, GATE, T, E,
               stride_ps, stride_pt, stride_lt, stride_le, stride_b, stride_wt, stride_wk, stride_it, stride_ik,
               stride_g, renorm_eps, scale,
               SPLIT: tl.constexpr, HAS_GATE: tl.constexpr,
               GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
               G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr,
               SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
               SELECT: tl.constexpr, TAIL_LOADS: tl.constexpr, KEYS: tl.constexpr, WARPS: tl.constexpr,
               POLL: tl.constexpr = False, COLS_PAD: tl.constexpr = 1):
    """Route token ``row`` (summing its split partials first when SPLIT > 0), + its
    shared-expert gate.  POLL (one token, the GEMM-fused launch): the partials are polled while
    other programs write them, and put back to ``_UNWRITTEN`` (all E + HAS_GATE <= COLS_PAD
    columns of the SPLIT parts) for the next launch once every thread has read them."""
    rows = row.to(tl.int64) + tl.arange(0, 1)  # int64: T * stride can pass 2**31
    in_range = rows < T
    GATE_DTYPE: tl.constexpr = GATE.dtype.element_ty
    gate = tl.zeros([1], dtype=tl.float32)
    if HAS_GATE and TAIL_LOADS != 0:
        # Issued with the experts' partials rather than after the routing's barriers: one L2
        # round trip fewer on the way out.
        gate = _gate_value(PARTIALS, rows, in_range, stride_ps, stride_pt, E, GATE_DTYPE, SPLIT, POLL)
    out_w, out_id = _route_rows(LOGITS, rows, in_range, stride_lt, stride_le, BIAS, stride_b, renorm_eps,
                                scale, PARTIALS, stride_ps, stride_pt, GROUP_SIZE, N_GROUP, TOPK_GROUP,
                                TOP_K, G_PAD, GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE, SPLIT,
                                SELECT, TAIL_LOADS, KEYS, WARPS, POLL)
    _store_routes(WEIGHTS, IDS, rows, in_range, out_w, out_id, stride_wt, stride_wk,
                  stride_it, stride_ik, TOP_K, K_PAD)
    if HAS_GATE:
        if TAIL_LOADS == 0:
            gate = _gate_value(PARTIALS, rows, in_range, stride_ps, stride_pt, E, GATE_DTYPE, SPLIT, POLL)
        tl.store(GATE + rows * stride_g, _downcast(gate, GATE_DTYPE), mask=in_range)
    if POLL:
        tl.debug_barrier()  # every thread has read the partials (their poll ends in one iteration)
        cols = tl.arange(0, COLS_PAD)
        unwritten = tl.full([COLS_PAD], _UNWRITTEN, tl.int32).to(tl.float32, bitcast=True)
        for part in tl.static_range(SPLIT):
            tl.store(PARTIALS + part * stride_ps + cols, unwritten, mask=cols < E + HAS_GATE)


@triton.jit
def _gemm_step(acc, kb, HIDDEN, ROUTER_W, GATE_W, t, ex, T, H, E, stride_ht, stride_we,
               BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, HAS_GATE: tl.constexpr, GEMV: tl.constexpr,
               W_CACHE: tl.constexpr, W_EVICT: tl.constexpr):
    """acc plus hidden[t] . router_weight[ex]^T over hidden block ``kb`` (BLOCK_K wide).

    tl.dot: acc [BLOCK_T, BLOCK_E] (fp32 accumulate; IEEE fp32 for FP32_DOT).  GEMV (one token,
    BLOCK_T == 1): acc [BLOCK_K, BLOCK_E] += x[k] * w[k, e] in fp32, lane by lane (the caller sums
    over K once at the end): no 16-row token padding, no operand shuffle through shared memory."""
    k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    if GEMV:  # x as [BLOCK_K, 1]
        x = tl.load(HIDDEN + t[None, :].to(tl.int64) * stride_ht + k[:, None],
                    mask=(t[None, :] < T) & (k[:, None] < H), other=0.0)
    else:
        x = tl.load(HIDDEN + t[:, None].to(tl.int64) * stride_ht + k[None, :],
                    mask=(t[:, None] < T) & (k[None, :] < H), other=0.0)
    w_ptrs = ROUTER_W + ex[None, :].to(tl.int64) * stride_we + k[:, None]  # [BLOCK_K, BLOCK_E]
    if HAS_GATE:  # column E reads the gate's weight row
        w_ptrs = tl.where(ex[None, :] < E, w_ptrs, GATE_W + k[:, None])
    w = tl.load(w_ptrs, mask=(ex[None, :] < E + HAS_GATE) & (k[:, None] < H), other=0.0,
                cache_modifier=W_CACHE, eviction_policy=W_EVICT)
    if GEMV:
        acc += _upcast(x) * _upcast(w)
    elif FP32_DOT or INTERPRETER_BIT_CASTS:  # the interpreter's bf16 dot multiplies raw bits
        acc = tl.dot(_upcast(x), _upcast(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit(do_not_specialize=["T"])
def _router_gemm_kernel(
    HIDDEN, ROUTER_W, GATE_W, PARTIALS, LOGITS, BIAS, WEIGHTS, IDS, GATE, COUNTERS,
    T, H, E,
    stride_ht, stride_we, stride_ps, stride_pt, stride_lt, stride_b,
    stride_wt, stride_wk, stride_it, stride_ik, stride_g,
    renorm_eps, scale,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    K_STEPS: tl.constexpr,  # BLOCK_K steps per split of the hidden dim
    SPLIT: tl.constexpr,  # hidden-dim splits (grid axis 2)
    FP32_DOT: tl.constexpr,  # operands are not both bf16 / both fp16: fp32 dot, IEEE
    ROUTE: tl.constexpr,  # the GEMM's programs also route the T <= BLOCK_T tokens (below)
    HAS_GATE: tl.constexpr,  # GATE_W [1, H] is GEMM column E (Qwen's shared-expert gate)
    GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    SELECT: tl.constexpr, TAIL_LOADS: tl.constexpr, KEYS: tl.constexpr, WARPS: tl.constexpr,
    GEMV: tl.constexpr = False,  # BLOCK_T == 1: fp32 multiply-adds, no tl.dot (_gemm_step)
    UNROLL: tl.constexpr = False,  # the K_STEPS loop unrolled (static_range) instead of a loop
    W_CACHE: tl.constexpr = "",  # the router weight loads' cache modifier ("", ".cg", ".ca")
    W_EVICT: tl.constexpr = "",  # ... and eviction policy ("", "evict_last", "evict_first")
    ARRIVE_ONLY: tl.constexpr = False,  # diagnostics (_TAIL_DIAG "arrive"): count arrivals, route nothing
    POLL: tl.constexpr = False,  # one token: the last program routes, polling PARTIALS (no counters)
    COLS_PAD: tl.constexpr = 1,  # next_power_of_2(E + HAS_GATE) (POLL's reset)
):
    """The router GEMM as partial sums: program (i, j, s) computes hidden[tile i] .
    router_weight[tile j]^T over split s of the hidden dim (a tl.dot, fp32 accumulate) and
    stores it to PARTIALS[s].  Without ROUTE, the routing kernel sums the splits.

    With ROUTE, the GEMM and the routing are one launch.  Each program counts itself done on
    COUNTERS[0] (acq_rel).  The last R = min(T, programs) programs to arrive route the tokens:
    router r = programs - 1 - arrival takes tokens r, r + R, ..., after waiting until every
    program has arrived.  Only programs that
    have finished their GEMM wait, and they are at most R - 1 <= 15, so the programs they wait
    for always find a free slot on the GPU: no grid-wide co-residency is assumed.  The last one
    to leave (COUNTERS[1]; with one router, no second atomic) zeroes both
    counters for the next launch.  With POLL (one token) there are no counters: see below.
    Triton's interpreter runs
    programs one after another, where a waiting program would never be joined, so there the
    last program routes the tokens in turn."""
    pid_t, pid_e, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    ex = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    if GEMV:  # per-lane products, summed over K once after the loop
        acc = tl.zeros([BLOCK_K, BLOCK_E], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if UNROLL:
        for step in tl.static_range(K_STEPS):
            acc = _gemm_step(acc, pid_s * K_STEPS + step, HIDDEN, ROUTER_W, GATE_W, t, ex, T, H, E, stride_ht,
                             stride_we, BLOCK_K, FP32_DOT, HAS_GATE, GEMV, W_CACHE, W_EVICT)
    else:
        for step in range(K_STEPS):
            acc = _gemm_step(acc, pid_s * K_STEPS + step, HIDDEN, ROUTER_W, GATE_W, t, ex, T, H, E, stride_ht,
                             stride_we, BLOCK_K, FP32_DOT, HAS_GATE, GEMV, W_CACHE, W_EVICT)
    if GEMV:
        acc = tl.sum(acc, axis=0)[None, :]  # [1, BLOCK_E]
    tl.store(PARTIALS + pid_s * stride_ps + t[:, None].to(tl.int64) * stride_pt + ex[None, :], acc,
             mask=(t[:, None] < T) & (ex[None, :] < E + HAS_GATE))

    if ROUTE and POLL:
        # One token: no counter, no fence. The program with the last id routes. It is the only
        # program that waits and none of the others waits on anything, so its wait ends
        # whatever the order the programs are scheduled in (no co-residency assumed). It
        # polls the partials, which hold _UNWRITTEN until their program's store lands, and puts
        # them back to _UNWRITTEN when done (so the buffer must start that way: _poll_partials).
        last = (pid_t == tl.num_programs(0) - 1) & (pid_e == tl.num_programs(1) - 1) & (pid_s == tl.num_programs(2) - 1)
        if last:
            _route_row(tl.full([], 0, tl.int32), PARTIALS, LOGITS, BIAS, WEIGHTS, IDS, GATE, T, E,
                       stride_ps, stride_pt, stride_lt, 1, stride_b, stride_wt, stride_wk, stride_it,
                       stride_ik, stride_g, renorm_eps, scale, SPLIT, HAS_GATE, GROUP_SIZE, N_GROUP,
                       TOPK_GROUP, TOP_K, G_PAD, GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE,
                       SELECT, TAIL_LOADS, KEYS, WARPS, True, COLS_PAD)
    elif ROUTE:
        # Every thread's partials are stored before the counter moves (bar.sync, then a
        # gpu-scope release); the routers' acquires make all of them visible to them.
        tl.debug_barrier()
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        arrival = tl.atomic_add(COUNTERS, 1, sem="acq_rel", scope="gpu")
        if ARRIVE_ONLY:
            if arrival == programs - 1:
                tl.store(COUNTERS, 0)
        elif INTERPRETER:
            if arrival == programs - 1:
                for row in tl.static_range(BLOCK_T):
                    _route_row(tl.full([], row, tl.int32), PARTIALS, LOGITS, BIAS, WEIGHTS, IDS, GATE, T, E,
                               stride_ps, stride_pt, stride_lt, 1, stride_b, stride_wt, stride_wk, stride_it,
                               stride_ik, stride_g, renorm_eps, scale, SPLIT, HAS_GATE, GROUP_SIZE, N_GROUP,
                               TOPK_GROUP, TOP_K, G_PAD, GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE,
                               SELECT, TAIL_LOADS, KEYS, WARPS)
                tl.store(COUNTERS, 0)
        elif arrival >= programs - tl.minimum(T, programs):
            routers = tl.minimum(T, programs)  # a narrow GEMM can have fewer programs than tokens
            seen = arrival + 1
            while seen < programs:
                seen = tl.atomic_add(COUNTERS, 0, sem="acquire", scope="gpu")
            for row in range(programs - 1 - arrival, T, routers):
                _route_row(row, PARTIALS, LOGITS, BIAS, WEIGHTS, IDS, GATE, T, E,
                           stride_ps, stride_pt, stride_lt, 1, stride_b, stride_wt, stride_wk, stride_it,
                           stride_ik, stride_g, renorm_eps, scale, SPLIT, HAS_GATE, GROUP_SIZE, N_GROUP,
                           TOPK_GROUP, TOP_K, G_PAD, GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE,
                           SELECT, TAIL_LOADS, KEYS, WARPS)
            if routers == 1:  # the only router: nobody else reads the counter
                tl.store(COUNTERS, 0)
            elif tl.atomic_add(COUNTERS + 1, 1, sem="acq_rel", scope="gpu") == routers - 1:
                tl.store(COUNTERS, 0)
                tl.store(COUNTERS + 1, 0)


def launch_config(experts: int, n_group: int, top_k: int) -> tuple[int, int, int, int]:
    """(G_PAD, GS_PAD, K_PAD, num_warps) for a row of ``experts`` in ``n_group`` groups."""
    if n_group > 1:
        g_pad = triton.next_power_of_2(n_group)
        gs_pad = triton.next_power_of_2(experts // n_group)
    else:
        g_pad, gs_pad = 1, triton.next_power_of_2(experts)
    num_warps = 8 if experts >= 512 else 4  # not tuned
    return g_pad, gs_pad, triton.next_power_of_2(top_k), num_warps


# Up to this many tokens the router GEMM and the routing are one launch (the last programs of the
# GEMM route, one token each); above it, the GEMM launch writes partial sums and the routing
# kernel (one program per token) sums them: two launches.  At most one token tile (BLOCK_T 16).
# History (H200, µs in CUDA graphs, DeepSeek / MiniMax / Qwen3.5, bench/NOTES.md): moe_route-7's
# one launch routed every token in its single last program, 7.96 / 7.24 / 9.20 at 1 token against
# two launches' 8.69 / 7.29 / 10.05, but 29.8 / 23.8 / 36.1 at 16, so it shipped at 1 token only.
# moe_route-9 on routes the tokens in parallel (the last T programs to finish): moe_route-11 one
# launch 7.17 / 6.06 / 8.83 at 1 token, 8.13 / 6.94 / 9.66 at 2, against two launches'
# 8.3-9.4 / 6.8-7.5 / 10.4-11.3 at 1-16 tokens (session 6).
FUSED_GEMM_MAX_TOKENS = 16
_TARGET_PROGRAMS = 128  # about one per SM: enough loads in flight to stream the router weight
_MAX_SPLIT = 8

# GEMM-phase A/B knobs of the <= 16-token launch (bench/moe_router_check.py --parts gemm; None:
# the shipped shape, ``SHIPPED_GEMM``).  moe_route-13 streamed the weight from ~128 programs with
# 2-4 KB loads per step, far below the ~32 KB per SM in flight that HBM / L2 bandwidth x latency
# asks for; these change how many bytes each program has in flight and how many programs there
# are (with _TARGET_PROGRAMS / _MAX_SPLIT).  Tokens > 16 (two launches) always take the shipped shape.
#   _BLOCK_K      hidden columns per step (power of two >= 16); 0: one step per program, its whole
#                 split in one tile, so all its loads issue at once (the span ~hidden * tiles /
#                 _TARGET_PROGRAMS rounded down to a power of two, at most _MAX_SPAN, or
#                 _MAX_GEMV_SPAN for the GEMV body: about 1x-2x
#                 _TARGET_PROGRAMS programs; _MAX_SPLIT ignored)
#   _BLOCK_E      router-weight rows (experts) per program (power of two; >= 16 for tl.dot, i.e.
#                 above one token; the GEMV body at one token ships SHIPPED_GEMM["gemv_block_e"])
#   _GEMM_WARPS   num_warps of the launch (the routing tail runs in these warps too)
#   _GEMM_STAGES  num_stages of the launch (software pipelining of the K loop: sm_90 ptxas output of
#                 the shipped shape has its tiles fetched by cp.async num_stages - 1 steps ahead)
#   _MAXNREG      the launch's register cap (ptxas -maxrregcount; 0: none). Session 14's offline sm_90
#                 SASS of the 1-token tail: ptxas reuses the partial sums' registers, so the last
#                 program's SPLIT partial loads return in dependent L2 round trips (DeepSeek ~9,
#                 MiniMax 4) instead of one; with 128 the loads issue together. Shipped in
#                 moe_route-15 from session 15's H200 A/B (rotated cold, one token, DeepSeek / MiniMax
#                 / Qwen3.5): 7.66 / 5.74 / 8.43 -> 6.21 / 4.87 / 8.21 us; 2 and 16 tokens within
#                 +-0.15 us. ptxas's load scheduling moves with unrelated changes: after a tail change,
#                 read the SASS (bench/sass_offline.py router) and re-time ``no_maxnreg``.
#   _UNROLL       the K loop unrolled (tl.static_range): the steps' loads may issue up front (no
#                 barrier between the GEMV body's steps; tl.dot's operand shuffle puts a bar.sync
#                 between steps, which the loads do not cross)
#   _GEMV         at one token, BLOCK_T = 1 and fp32 multiply-adds instead of a 16-row tl.dot
#   _W_HINTS      (cache_modifier, eviction_policy) of the router-weight loads, e.g. ("", "evict_last");
#                 not ".cg" with a policy (ptxas: ".evict_last cannot be combined with .cg")
# The shipped shape (moe_route-14; -15 added the register cap), from the session-12 A/B (H200, one
# token, µs with the router weight cold, i.e. read from HBM as in a real step, against the same copy
# cold; DeepSeek / MiniMax / Qwen3.5): moe_route-13's 64-column steps 10.62 / 6.95 / 13.91
# (2.73 / 2.67 / 3.53x the copy);
# one span per program with evict_last 7.37 / 5.17 / 8.96; the GEMV body at one token over spans
# 7.55 / 5.24 / 7.06 (1.94 / 2.01 / 1.79x). Warm (L2-resident) within +-0.5 µs of -13 throughout.
# At 2-16 tokens span + evict_last was the fastest cold (16 tokens: 8.69 / 6.68 / 9.26 against
# 11.28 / 7.63 / 14.80). "Cold" there subtracts a flush graph; timed by rotating over weight
# copies instead (cleaner), -14 at one token is 7.61 / 5.72 / 8.35 µs, 2.36 / 2.58 / 2.43x the
# copy timed the same way (-13: 9.50 / 6.16 / 13.56).
# moe_route-16: at one token (the GEMV body) 2 experts a program over spans of at most 2048 hidden
# columns (8 KB a program; DeepSeek / MiniMax / Qwen3.5 512 x 4 / 256 x 2 / 514 x 2 programs x
# splits, from 224 x 14 / 192 x 12 / 132 x 4), session 16's A/B (rotated cold, one token): 5.90 /
# 4.42 / 6.53 -> 5.35 / 3.93 / 5.74 us. More programs stream the weight faster (Qwen3.5's gain at
# the same split) and fewer splits leave the router fewer partial sums to poll, sum and reset.
SHIPPED_GEMM = dict(block_k=0, gemv=True, w_hints=("", "evict_last"), maxnreg=128, gemv_block_e=2)
_BLOCK_K: int | None = None
_BLOCK_E: int | None = None
_GEMM_WARPS: int | None = None
_GEMM_STAGES: int | None = None
_MAXNREG: int | None = None
_UNROLL: bool | None = None
_GEMV: bool | None = None
_W_HINTS: tuple[str, str] | None = None
# Diagnostics for the bench (bench/moe_router_check.py's diag_* variants; outputs left unwritten):
# "gemm" runs the one launch's GEMM phase alone (partials stored, no arrival, no routing),
# "arrive" adds the arrival count; the shipped launch minus these is the routing tail's time.
_TAIL_DIAG: str | None = None
_MIN_BLOCK_K = 16  # tl.dot's smallest K
_MAX_SPAN = 1024  # a [16, 1024] bf16 operand pair is 64 KB of shared memory for tl.dot's shuffle
_MAX_GEMV_SPAN = 2048  # the GEMV body has no shared-memory operands (moe_route-16); A/B knob


def gemm_launch_config(tokens: int, experts: int, hidden: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_T, BLOCK_E, BLOCK_K, K_STEPS, SPLIT, num_warps) of the router GEMM launch.

    Up to 16 tokens (``SHIPPED_GEMM``): each program reads one span of the hidden dim in one
    tile, so all its weight loads are in flight at once; at one token the GEMV body (BLOCK_T 1:
    fp32 multiply-adds, no 16-row padding for tl.dot; 2 experts a program, spans up to
    ``_MAX_GEMV_SPAN``), else tokens padded to tl.dot's 16 and 16 experts a program. Above
    16 tokens, 64-column steps with the hidden dim split until there are about _TARGET_PROGRAMS
    programs, each reading its weight tile once."""
    small = tokens <= 16  # the one-launch regime the A/B knobs shape
    gemv = small and tokens == 1 and (SHIPPED_GEMM["gemv"] if _GEMV is None else bool(_GEMV))
    block_t = 1 if gemv else (16 if tokens <= 16 else (32 if tokens <= 32 else 64))
    block_e = _BLOCK_E if small and _BLOCK_E is not None else (SHIPPED_GEMM["gemv_block_e"] if gemv else 16)
    block_k = (SHIPPED_GEMM["block_k"] if _BLOCK_K is None else _BLOCK_K) if small else 64
    num_warps = _GEMM_WARPS if small and _GEMM_WARPS is not None else 4
    tiles = triton.cdiv(tokens, block_t) * triton.cdiv(experts, block_e)
    if block_k == 0:  # one step per program: the split's whole span in one tile
        span = triton.cdiv(hidden, max(1, _TARGET_PROGRAMS // tiles))
        cap = _MAX_GEMV_SPAN if gemv else _MAX_SPAN
        block_k = min(cap, max(_MIN_BLOCK_K, triton.next_power_of_2(span + 1) // 2))  # rounded down
        return block_t, block_e, block_k, 1, triton.cdiv(hidden, block_k), num_warps
    k_blocks = triton.cdiv(hidden, block_k)
    split = max(1, min(_MAX_SPLIT, k_blocks, _TARGET_PROGRAMS // tiles))
    k_steps = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, k_steps)  # no empty splits
    return block_t, block_e, block_k, k_steps, split, num_warps


def gemm_variant_meta(block_t: int) -> tuple[dict, dict]:
    """(the GEMM body's constexprs, extra launch options) from the A/B knobs for a launch whose
    BLOCK_T is ``block_t`` (1: the GEMV body)."""
    small = block_t <= 16
    cache, evict = (SHIPPED_GEMM["w_hints"] if _W_HINTS is None else _W_HINTS) if small else ("", "")
    meta = dict(GEMV=block_t == 1, UNROLL=bool(small and _UNROLL), W_CACHE=cache, W_EVICT=evict)
    options = {"num_stages": _GEMM_STAGES} if small and _GEMM_STAGES is not None else {}
    maxnreg = SHIPPED_GEMM["maxnreg"] if _MAXNREG is None else _MAXNREG
    if small and maxnreg:
        options["maxnreg"] = maxnreg
    return meta, options


def _routing_meta(named: dict, experts: int, logits_dtype: torch.dtype) -> tuple[dict, int]:
    """Checked routing scalars -> (the kernels' routing constexprs, the routing kernel's
    num_warps)."""
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
    g_pad, gs_pad, k_pad, num_warps = launch_config(experts, n_group, top_k)
    meta = dict(
        GROUP_SIZE=experts // n_group, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        G_PAD=g_pad, GS_PAD=gs_pad, K_PAD=k_pad, SCORING=scoring, HAS_BIAS=bias is not None,
        RENORMALIZE=bool(named["renormalize"]),
    )
    meta["SELECT"], meta["TAIL_LOADS"], meta["KEYS"] = routing_tail(g_pad * gs_pad, bias is not None, n_group, logits_dtype)
    return meta, num_warps


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
    meta, num_warps = _routing_meta(named, experts, logits.dtype)
    _check_outputs(weights, ids, tokens, meta["TOP_K"])
    tensors = [logits, weights, ids] + ([bias] if bias is not None else [])
    if any(t.device != logits.device for t in tensors):
        raise ValueError(f"all tensors must be on {logits.device}")
    if tokens == 0:
        return
    bias_arg = bias if bias is not None else logits  # dummy, never read without HAS_BIAS

    def _launch():
        _moe_route_kernel[(tokens,)](
            logits, bias_arg, weights, ids, logits, logits,
            logits.stride(0), logits.stride(1), bias.stride(0) if bias is not None else 0,
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1), 0, 0, 0,
            float(named["renorm_eps"]), float(named["scale"]),
            num_warps=num_warps, WARPS=num_warps, SPLIT=0, HAS_GATE=False, **meta,
        )

    launch_on_device(logits, _launch)


# One pair of counters per device (arrivals, routers done). The GEMM-fused launch's last router
# resets them to zero, so they are allocated (zeroed) once, outside any CUDA-graph capture, and
# every later launch, in a graph or not and on whichever stream, finds them at zero. Launches on
# one device must not overlap in time (two streams routing concurrently would share them).
_COUNTERS: dict[tuple[int], torch.Tensor] = {}


def _handed_on(cache: dict, device: torch.device, shape: tuple, make, what: str) -> torch.Tensor:
    """A buffer one launch hands the next on ``device`` (``make()`` builds it in its initial state):
    made on the first call for ``shape``, which must be outside CUDA-graph capture, and kept (a
    captured graph points at it). Off CUDA (the interpreter), a fresh one each call."""
    if device.type != "cuda":
        return make()
    key = (device.index if device.index is not None else torch.cuda.current_device(), *shape)
    buffer = cache.get(key)
    if buffer is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"fusion_compiler.moe_router: its first {what} on this device is inside CUDA-graph capture; "
                "run it once before capturing (the buffer must be initialised outside the graph)"
            )
        buffer = cache[key] = make()
    return buffer


def _counters(device: torch.device) -> torch.Tensor:
    return _handed_on(_COUNTERS, device, (), lambda: torch.zeros(2, dtype=torch.int32, device=device),
                      "call (its completion counters)")


# One-token partial-sum buffers per (device, split, columns), for the launch whose router polls
# them (``POLL``): filled with _UNWRITTEN once, outside any CUDA-graph capture, and put back to it
# by every launch's router, so every later launch (in a graph or not) finds them that way. Launches
# on one device must not overlap in time (as with the counters).
_POLLED: dict[tuple[int, int, int], torch.Tensor] = {}
# A/B knob (bench/moe_router_check.py ``counters``): False gives one token the counters' protocol.
_POLL_ONE_TOKEN = True


def poll_rows(padded_experts: int, num_warps: int) -> bool:
    """Whether one token's router polls (else it takes the counters): the A/B knob allows it and
    the row has a lane for each of the launch's threads at least (``_sum_partials``: its exit
    count assumes no lane is held by two threads)."""
    return _POLL_ONE_TOKEN and padded_experts >= 32 * num_warps


def _poll_partials(device: torch.device, split: int, columns: int) -> torch.Tensor:
    def unwritten():
        return torch.full((split, 1, columns), -1, dtype=torch.int32, device=device).view(torch.float32)

    return _handed_on(_POLLED, device, (split, columns), unwritten, "one-token call for this shape (its partial sums)")


def moe_router_fwd(named: dict, hidden: torch.Tensor, router_weight: torch.Tensor,
                   logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   gate_weight: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> None:
    """Router GEMM + routing: one launch up to ``FUSED_GEMM_MAX_TOKENS`` tokens, else the GEMM
    launch (partial sums) and the routing kernel.

    ``hidden`` [T, H] and ``router_weight`` [E, H] (unit stride along H) are multiplied with
    fp32 accumulation (a bf16 x bf16 tensor-core dot when both are bf16, or both fp16; else both
    upcast, IEEE fp32); the logits are rounded to ``logits.dtype`` ([T, E], unit stride along E,
    written) before routing, as an ``F.linear`` in that dtype would round them.  So each input's
    dtype must be the logits dtype or a narrower float (an exact widening).  ``named`` holds the
    routing arguments as in :func:`moe_route_fwd`.  With ``gate_weight`` [1, H] (hidden's dtype,
    unit stride), ``gate`` [T, 1] receives ``sigmoid(F.linear(hidden, gate_weight))`` in its dtype,
    computed as one more GEMM column.
    """
    tokens, hid = hidden.shape
    experts = router_weight.shape[0]
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
    meta, route_warps = _routing_meta(named, experts, logits.dtype)
    _check_outputs(weights, ids, tokens, meta["TOP_K"])
    bias = named["bias"]
    tensors = [hidden, router_weight, logits, weights, ids] + ([bias] if bias is not None else [])
    if any(t.device != hidden.device for t in tensors):
        raise ValueError(f"all tensors must be on {hidden.device}")
    has_gate = gate_weight is not None
    if has_gate != (gate is not None):
        raise ValueError("gate_weight and gate must be given together")
    if has_gate:
        if (tuple(gate_weight.shape) != (1, hid) or gate_weight.dtype != hidden.dtype
                or gate_weight.dtype != router_weight.dtype or gate_weight.stride(-1) != 1):
            raise ValueError(f"gate_weight must be [1, {hid}], hidden's and router_weight's dtype, unit stride, got "
                             f"{tuple(gate_weight.shape)} {gate_weight.dtype} {gate_weight.stride()}")
        if tuple(gate.shape) != (tokens, 1) or gate.dtype not in _LOGIT_DTYPES or gate.device != hidden.device:
            raise ValueError(f"gate must be float [{tokens}, 1] on {hidden.device}, got {tuple(gate.shape)} {gate.dtype}")
    if tokens == 0:
        return

    columns = experts + has_gate
    block_t, block_e, block_k, k_steps, split, num_warps = gemm_launch_config(tokens, columns, hid)
    fused = tokens <= min(FUSED_GEMM_MAX_TOKENS, block_t)
    pollable = fused and poll_rows(meta["G_PAD"] * meta["GS_PAD"], num_warps)
    # Every fused call makes the one-token buffer (for the one-token launch's split, which the
    # GEMV shape sets apart from 2-16 tokens'), so a warm-up at any of those counts lets a later
    # capture at one token find it.
    one_token_split = split if tokens == 1 else gemm_launch_config(1, columns, hid)[4]
    polled = _poll_partials(hidden.device, one_token_split, columns) if pollable else None
    poll = pollable and tokens == 1 and _TAIL_DIAG is None
    partials = polled if poll else torch.empty((split, tokens, columns), dtype=torch.float32, device=hidden.device)
    gate_w_arg = gate_weight if has_gate else router_weight  # dummies, never read without HAS_GATE
    gate_arg = gate if has_gate else logits
    stride_g = gate.stride(0) if has_gate else 0
    counters = _counters(hidden.device) if fused and not poll else partials  # dummy when unused
    bias_arg = bias if bias is not None else logits
    stride_b = bias.stride(0) if bias is not None else 0
    fp32_dot = not (hidden.dtype == router_weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16))
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(columns, block_e), split)
    gemm_meta, gemm_options = gemm_variant_meta(block_t)
    if fused and _TAIL_DIAG is not None:
        if _TAIL_DIAG not in ("gemm", "arrive"):
            raise ValueError(f"_TAIL_DIAG must be None, 'gemm' or 'arrive', got {_TAIL_DIAG!r}")
        gemm_meta["ARRIVE_ONLY"] = _TAIL_DIAG == "arrive"
        route = _TAIL_DIAG == "arrive"
    else:
        route = fused

    def _launch():
        _router_gemm_kernel[grid](
            hidden, router_weight, gate_w_arg, partials, logits, bias_arg, weights, ids, gate_arg, counters,
            tokens, hid, experts,
            hidden.stride(0), router_weight.stride(0), partials.stride(0), partials.stride(1),
            logits.stride(0), stride_b,
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1), stride_g,
            float(named["renorm_eps"]), float(named["scale"]),
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=k_steps, SPLIT=split,
            FP32_DOT=fp32_dot, ROUTE=route,
            HAS_GATE=has_gate, num_warps=num_warps, WARPS=num_warps, POLL=poll, COLS_PAD=triton.next_power_of_2(columns),
            **meta, **gemm_meta, **gemm_options,
        )
        if not fused:
            _moe_route_kernel[(tokens,)](
                logits, bias_arg, weights, ids, partials, gate_arg,
                logits.stride(0), 1, stride_b,
                weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
                partials.stride(0), partials.stride(1), stride_g,
                float(named["renorm_eps"]), float(named["scale"]),
                num_warps=route_warps, WARPS=route_warps, SPLIT=split,
                HAS_GATE=has_gate, **meta,
            )

    launch_on_device(hidden, _launch)
