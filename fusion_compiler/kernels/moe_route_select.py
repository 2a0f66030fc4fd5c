"""MoE routing, the routing phase: one token's logits (or the router GEMM's partial sums) -> its
top-k weights and expert ids. Triton only; the launch policy and launchers are in
``moe_route.py``, which states the semantics these functions implement.

The routing body (``_route_rows``) works on a [R, G_PAD, GS_PAD] tile: R tokens x group x
expert-in-group, each padded to a power of two (one row of next_power_of_2(E) without groups), so
per-group reductions run over axis 2. Every choice score becomes one int64 key, ``(order-preserving
int32 of the fp32 score) << 32 | (NP - 1 - expert)``: one max-reduction then yields the best score
*and* the lowest expert index among equal scores, and keys are unique, so a pick is removed by key
equality. A group's top-2 sum is two such reductions over axis 2 (two equal maxima both count).
Groups are kept by rank: group g is kept iff fewer than ``topk_group`` valid groups beat it (higher
score, or equal score and lower index), one [G_PAD, G_PAD] comparison.

The tail after the keys is latency at one token: TOP_K dependent block-wide reductions (a bar.sync
each), then an L2 round trip for the picked logits, then (Qwen) another for the gate's partials.
Three constexprs choose its form (``moe_route.routing_tail`` picks them by shape):

- SELECT 0: TOP_K rounds of one max-reduction; 1: tl.topk's bitonic network; 2: rounds within
  each warp, then the warps' candidates merged by rank (``_top_keys``).
- TAIL_LOADS 0: the picked experts' unbiased scores recomputed from their reloaded logits with
  the same formula (so bit-identical to the in-register scores), the gate's partials summed after
  the routing; 1: the picked scores from the registers (the keys themselves without a bias, else
  one masked sum) and the gate's partials loaded with the experts'; 2: as 1, from the 16-bit logit
  carried in the int64 key's low 16 bits below the index, so nothing is reloaded.
- KEYS 0: int64 keys of the fp32 scores; 1: where the score is a monotone function of a 16-bit
  logit alone (no bias, no groups: Qwen3.5's softmax), int32 keys ``ordered logit << 16 | (NP - 1
  - expert)`` (``_logit_key``), and only the picked experts' scores are computed. Their ties
  differ in one documented way: distinct logits whose fp32 scores are equal go to the larger logit.
"""

import triton
import triton.language as tl

from ._device import INTERPRETER
from ._device import downcast as _downcast
from ._device import round_trip as _round_trip
from ._device import upcast as _upcast

_NO_KEY = tl.constexpr(-(2**63))  # below every score's key: padding, picked experts
_NO_KEY32 = tl.constexpr(-(2**31))  # ... and below every int32 logit key (>= -32767 * 2**16)
# A partial sum not yet written (the one-token launch's polling router): the bits of a negative
# NaN with every payload bit set, which no GPU arithmetic produces (its NaNs are 0x7FFFFFFF).
_UNWRITTEN = tl.constexpr(-1)


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
        # tl.gather from the registers (H200: 0.3-0.9 µs at 1 token; bench/NOTES.md, section 7).
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
