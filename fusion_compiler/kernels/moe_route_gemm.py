"""MoE routing, the router GEMM phase: ``hidden @ router_weight^T`` as fp32 partial sums over
splits of the hidden dim, and the one launch whose last programs then route the tokens
(``moe_route_select._route_row``). Triton only; the launch policy and launchers are in
``moe_route.py``.

The hidden dim is split so that ~``target_programs`` programs stream the router weight, each its
span in one tile (all its loads in flight at once): tl.dot, or at one token fp32 multiply-adds
(the GEMV body: no 16-row token padding). Qwen3.5's shared-expert gate
``sigmoid(hidden . gate_weight)`` rides along as GEMM column E.
"""

import triton
import triton.language as tl

from ._device import INTERPRETER, INTERPRETER_BIT_CASTS
from ._device import upcast as _upcast
from .moe_route_select import _route_row

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
    ROUTE: tl.constexpr,  # the GEMM's programs also route the T tokens (below)
    HAS_GATE: tl.constexpr,  # GATE_W [1, H] is GEMM column E (Qwen's shared-expert gate)
    GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    G_PAD: tl.constexpr, GS_PAD: tl.constexpr, K_PAD: tl.constexpr,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
    SELECT: tl.constexpr, TAIL_LOADS: tl.constexpr, KEYS: tl.constexpr, WARPS: tl.constexpr,
    GEMV: tl.constexpr = False,  # BLOCK_T == 1: fp32 multiply-adds, no tl.dot (_gemm_step)
    UNROLL: tl.constexpr = False,  # the K_STEPS loop unrolled (static_range) instead of a loop
    W_CACHE: tl.constexpr = "",  # the router weight loads' cache modifier ("", ".cg", ".ca")
    W_EVICT: tl.constexpr = "",  # ... and eviction policy ("", "evict_last", "evict_first")
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
    have finished their GEMM wait, and they are at most R - 1 < MAX_ROUTERS (the launcher's cap,
    below an H200's 132 SMs), so the programs they wait for always find a free slot on the GPU:
    no grid-wide co-residency is assumed.  The last one
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
        if INTERPRETER:
            if arrival == programs - 1:
                row = tl.zeros([], tl.int32)
                while row < T:  # (a while: the interpreter's range takes no runtime bounds)
                    _route_row(row, PARTIALS, LOGITS, BIAS, WEIGHTS, IDS, GATE, T, E,
                               stride_ps, stride_pt, stride_lt, 1, stride_b, stride_wt, stride_wk, stride_it,
                               stride_ik, stride_g, renorm_eps, scale, SPLIT, HAS_GATE, GROUP_SIZE, N_GROUP,
                               TOPK_GROUP, TOP_K, G_PAD, GS_PAD, K_PAD, SCORING, HAS_BIAS, RENORMALIZE,
                               SELECT, TAIL_LOADS, KEYS, WARPS)
                    row += 1
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
