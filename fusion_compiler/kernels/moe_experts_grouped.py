"""The ``moe_experts`` stage's grouped kernels (``fusion_compiler::moe_experts`` on CUDA above
``ops/moe_experts.SMALL_BATCH_MAX_TOKENS`` tokens; at or below, kernels/moe_experts.py): the
(token, k) pairs grouped by expert on the device, and each touched expert's weights read once for
all its pairs with ``tl.dot`` tiles. The op's semantics and rounding points:
``ops/moe_experts.moe_experts_reference``.

P = T * k pairs, gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I],
S = min(E, P) expert slots (at most that many experts can be touched). Two modes.

Scan mode (up to ``GroupedConfig.scan_max_pairs`` pairs; off as shipped, slower on the H200): two launches.

    gate_up, grid (S, cdiv(I, BN)):    each program histograms all P ids (padding, an id outside
                                       [0, E), in bin E) and takes the slot-th touched expert in
                                       id order; BLOCK_M of its pairs at a time are picked out of
                                       the ids in pair order (a hit's rank by cumsum, the ids read
                                       ``scan_chunk`` at a time); x rows gathered by token =
                                       pair // k; act[pair] = silu(gate) * up written in the
                                       ORIGINAL pair order (no permuted copy); program (0, 0) also
                                       zeroes the down kernel's arrival counters [T, cdiv(H, BN)]
                                       and the output rows of tokens with only padding pairs;
    down,    grid (S, cdiv(H, BN)):    the same pairs over act: y[pair] = W_down[e] @ act[pair],
                                       rounded to hidden's dtype (the reference's rounding point)
                                       and stored; then each pair arrives at its (token, column
                                       block) counter (a barrier, then an acq_rel atomic), and the
                                       program whose arrival completes a token's real pairs sums
                                       its k y rows in k order: out[t] = sum_k float(w[t, k]) *
                                       float(y[(t, k)]), rounded once (deterministic, no float
                                       atomics; the same bits as the combine kernel's).

Plan mode (past it; every batch as shipped): four.

    align,   grid (1,):                one program loads all P ids, maps padding past the last
                                       expert, sorts the keys ``expert * P_POW2 + pair`` with
                                       ``tl.sort`` and writes the plan: the pairs in expert order,
                                       per-expert offsets [E + 1] (histogram, exclusive cumsum),
                                       the touched experts compacted into slots, and their count;
    gate_up, down:                     as above, each slot's run read from the plan; y written;
    combine, grid (T, cdiv(H, BLOCK)): out[t] = sum_k float(w[t, k]) * float(y[(t, k)]) in k
                                       order, padding pairs skipped, rounded once.

Padding pairs are never gathered by the GEMM kernels (they match no expert's scan, and sort past
the last expert's offset in a plan),
so no weight is read for them and a token with only padding pairs gets zeros. The order of the
pairs inside one expert's run does not change any bit: a ``tl.dot`` row depends only on its own
row. No host sync, no data-dependent shapes (the grids depend on T, k, E, H, I only): a CUDA graph
captures it. Expert offsets into the weights are int64 (E * 2I * H passes 2**31 for DeepSeek:
256 x 4096 x 7168). The single align program holds all P keys at once, fine up to
``GroupedConfig.align_max_pairs`` (16384: 2048 tokens x top 8); past it (a long prefill) the
plan comes from a few torch ops instead, still on the device with no host sync, every expert
given a slot.

Under Triton's interpreter (``TRITON_INTERPRET=1``, set before importing this module) it runs on
CPU tensors, with the bit-exact casts and the fp32 ``mma`` of ``kernels/_device.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import downcast as _downcast
from ._device import launch_on_device, mma
from ._device import upcast as _upcast
from .moe_experts import _TL_DTYPES, prepare, silu_mul_rounded

KERNEL_VERSION = "moe_experts_grouped-4"

# Pairs per expert a GEMM program takes at once: tl.dot needs >= 16 rows; the average run
# (P / E) sets it up to 64, past which a longer run loops (e.g. MiniMax at 64 tokens: 512 pairs
# over 256 experts, ~2 a touched expert: 16; at 2048 tokens 64 a run: 64).
_MIN_BLOCK_M = 16
_MAX_BLOCK_M = 64


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """Launch shape of the four kernels. ``block_m``: pairs a GEMM program takes at once (>= 16,
    a power of two); ``*_block_n``: output columns per program (I for gate_up, H for down);
    ``*_block_k``: reduced-dim step (H for gate_up, I for down); ``*_stages``: ``num_stages`` of
    the reduced-dim loop (Triton's software pipeliner); ``combine_block``: H columns per combine
    program. bench/diagnostics/experts_check.py --grouped-sweep-tokens sweeps the GEMMs' shapes
    (``default_config`` says what it chose)."""

    block_m: int = 16
    gate_up_block_n: int = 64
    gate_up_block_k: int = 64
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_block_n: int = 64
    down_block_k: int = 64
    down_warps: int = 4
    down_stages: int = 3
    combine_block: int = 1024
    combine_warps: int = 4
    # The align kernel holds all keys of the next power of two >= P in one program; 65536 of them
    # (8192 tokens x top 8) needed 256 KB of shared memory on an H200 (limit 227 KB). Past this
    # many, the plan comes from torch on the device instead (``_torch_plan``: no host sync either).
    align_max_pairs: int = 16384
    # Up to this many pairs, scan mode (2 launches): every GEMM program finds its slot's expert
    # and pairs in the ids itself (a histogram of all P ids, then a cumsum rank per tile,
    # ``scan_chunk`` ids at a time), and the down kernel combines (arrival counters), so there is
    # no align and no combine launch. Past it, plan mode: align, gate/up, down, combine. Shipped
    # 0 (always plan mode): on the H200 scan mode is 1.49x slower, Qwen3.5 at 64 tokens 3211 us
    # (67% of copy bw) against plan mode's 2153 us (101%), alone and inside HF's layer alike
    # (results/moe_experts_scan_vs_plan_h200_qwen64_d926c86.json,
    # results/profile_step_h200_hf_qwen_b64_experts_d926c86.json; bench/NOTES.md section 19).
    scan_max_pairs: int = 0
    scan_chunk: int = 256


def default_config(tokens: int, top_k: int, experts: int, hidden: int, intermediate: int) -> GroupedConfig:
    """``block_m`` by the average run P / E (16..64). At block_m <= 32 (decode: up to ~1000
    tokens of top-8 over 256 experts) the shapes swept at 64 tokens (H100, c9df2ae, all three
    models' best or within 0.3% of it): gate/up 64 x 128 (N x K), 4 warps; down 128 x 128,
    8 warps; 3 stages each, (32 x 128 + 128 x 128) x 2 B x 3 = 123 KB of shared memory at most.
    Above (prefill), the 64 x 64 tiles, 4 warps (55 KB at block_m 16). Tiles are narrowed to
    the dims' powers of two at tiny shapes. MiniMax at 17 tokens: 136 slots x 24 I blocks =
    3264 gate_up programs, >= 2 per SM of an H200."""
    pairs = tokens * top_k
    block_m = min(_MAX_BLOCK_M, max(_MIN_BLOCK_M, triton.next_power_of_2(triton.cdiv(pairs, max(experts, 1)))))

    def tile(dim: int, widest: int = 64) -> int:
        return max(16, min(widest, triton.next_power_of_2(dim)))

    wide = 128 if block_m <= 32 else 64
    return GroupedConfig(
        block_m=block_m,
        gate_up_block_n=tile(intermediate),
        gate_up_block_k=tile(hidden, wide),
        down_block_n=tile(hidden, wide),
        down_block_k=tile(intermediate, wide),
        down_warps=8 if block_m <= 32 else 4,
        combine_block=max(16, min(1024, triton.next_power_of_2(hidden))),
    )


# ------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------


@triton.jit
def _align_kernel(ids_ptr, plan_ptr, experts, PAIRS: tl.constexpr, P_POW2: tl.constexpr, E_BINS: tl.constexpr):
    """The plan (int32): [0, P) the pairs sorted by expert (padding last), [P, P + E + 1) the
    experts' offsets into it, [P + E + 1, P + 2E + 1) the touched experts in id order, then
    their count. E_BINS > E: padding's bin E is counted apart."""
    pair = tl.arange(0, P_POW2)
    in_range = pair < PAIRS
    ids = tl.load(ids_ptr + pair, mask=in_range, other=-1).to(tl.int64)
    valid = in_range & (ids >= 0) & (ids < experts)
    expert = tl.where(valid, ids, experts).to(tl.int32)
    keys = tl.sort(expert * P_POW2 + pair)
    tl.store(plan_ptr + pair, keys % P_POW2, mask=in_range)  # every real pair sorts before P

    counts = tl.histogram(expert, E_BINS)
    bins = tl.arange(0, E_BINS)
    tl.store(plan_ptr + PAIRS + bins, tl.cumsum(counts, 0) - counts, mask=bins <= experts)
    touched = ((counts > 0) & (bins < experts)).to(tl.int32)
    slot = tl.cumsum(touched, 0) - touched
    tl.store(plan_ptr + PAIRS + experts + 1 + slot, bins, mask=touched > 0)
    tl.store(plan_ptr + PAIRS + 2 * experts + 1, tl.sum(touched, 0))


@triton.jit
def _expert_run(plan_ptr, experts, PAIRS: tl.constexpr):
    """Plan mode: this program's slot, its expert (int64) and run [start, end) in the sorted
    pairs; an empty run past the touched count."""
    slot = tl.program_id(0)
    live = slot < tl.load(plan_ptr + PAIRS + 2 * experts + 1)
    # Unmasked loads (slot < E: in bounds; a dead slot's entry is stale, replaced by expert 0's
    # run, emptied): the interpreter's masked scalar loads are not scalars.
    expert = tl.where(live, tl.load(plan_ptr + PAIRS + experts + 1 + slot), 0)
    start = tl.where(live, tl.load(plan_ptr + PAIRS + expert), 0)
    end = tl.where(live, tl.load(plan_ptr + PAIRS + expert + 1), 0)
    return expert.to(tl.int64), start, end


@triton.jit
def _scanned_run(ids_ptr, experts, PAIRS: tl.constexpr, P_POW2: tl.constexpr, E_BINS: tl.constexpr):
    """Scan mode: this program's slot is the slot-th touched expert in id order (a histogram of
    all P ids, padding in bin E); its expert (int64) and run [0, count) of its pairs in pair
    order; an empty run past the touched count."""
    slot = tl.program_id(0)
    pair = tl.arange(0, P_POW2)
    ids = tl.load(ids_ptr + pair, mask=pair < PAIRS, other=-1).to(tl.int64)
    counts = tl.histogram(tl.where((ids >= 0) & (ids < experts), ids, experts).to(tl.int32), E_BINS)
    bins = tl.arange(0, E_BINS)
    touched = ((counts > 0) & (bins < experts)).to(tl.int32)
    mine = (touched > 0) & (tl.cumsum(touched, 0) - touched == slot)
    expert = tl.sum(tl.where(mine, bins, 0), 0).to(tl.int64)
    return expert, 0, tl.sum(tl.where(mine, counts, 0), 0)


@triton.jit
def _tile_pairs(plan_ptr, ids_ptr, expert, m0, end, SCAN: tl.constexpr, PAIRS: tl.constexpr,
                BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """Pairs m0 .. m0 + BLOCK_M - 1 of the run (int64, 0 past ``end``) and their mask. Plan
    mode reads them from the sorted plan; scan mode picks the expert's m0-th.. hits in pair order
    out of the ids, CHUNK at a time (a hit's rank among the expert's hits by cumsum)."""
    rows = m0 + tl.arange(0, BLOCK_M)
    m_ok = rows < end
    if SCAN:
        pair = tl.zeros((BLOCK_M,), dtype=tl.int64)
        seen = tl.sum(tl.zeros((CHUNK,), dtype=tl.int32), 0)
        for c0 in tl.range(0, PAIRS, CHUNK):
            j = c0 + tl.arange(0, CHUNK)
            hit = (tl.load(ids_ptr + j, mask=j < PAIRS, other=-1).to(tl.int64) == expert).to(tl.int32)
            rank = seen + tl.cumsum(hit, 0) - hit
            pick = (hit[None, :] > 0) & (rank[None, :] == rows[:, None])
            pair += tl.sum(tl.where(pick, j[None, :].to(tl.int64), 0), 1)
            seen += tl.sum(hit, 0)
    else:
        pair = tl.load(plan_ptr + rows, mask=m_ok, other=0).to(tl.int64)
    return pair, m_ok


@triton.jit
def _zero_counters_and_empty_rows(
    ids_ptr, counters_ptr, out_ptr, experts, stride_ot,
    TOKENS: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr, HIDDEN: tl.constexpr, COUNTERS: tl.constexpr,
    OUT_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Scan mode, gate/up's program (0, 0): the down kernel's arrival counters set to 0, and the
    output rows of tokens with no real pair (only padding ids) set to 0 (no down program writes
    them)."""
    for c0 in tl.range(0, COUNTERS, 1024):
        c = c0 + tl.arange(0, 1024)
        tl.store(counters_ptr + c, tl.zeros((1024,), dtype=tl.int32), mask=c < COUNTERS)
    kk = tl.arange(0, K_POW2)
    for t0 in tl.range(0, TOKENS, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < TOKENS
        ids = tl.load(ids_ptr + t[:, None] * TOP_K + kk[None, :], mask=t_ok[:, None] & (kk < TOP_K)[None, :], other=-1)
        empty = t_ok & (tl.sum(((ids >= 0) & (ids < experts)).to(tl.int32), 1) == 0)
        if tl.sum(empty.to(tl.int32), 0) > 0:
            zeros = _downcast(tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32), OUT_DTYPE)
            for h0 in tl.range(0, HIDDEN, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + h[None, :], zeros,
                         mask=empty[:, None] & (h < HIDDEN)[None, :])  # fmt: skip


@triton.jit
def _slot_run(plan_ptr, ids_ptr, counters_ptr, out_ptr, experts, stride_ot, HIDDEN: tl.constexpr, PAIRS: tl.constexpr,
              TOP_K: tl.constexpr, DTYPE: tl.constexpr, SCAN: tl.constexpr, P_POW2: tl.constexpr, E_BINS: tl.constexpr,
              K_POW2: tl.constexpr, COUNTERS: tl.constexpr):  # fmt: skip
    """A GEMM program's expert and run, in either mode. COUNTERS > 0 (scan mode's gate/up
    launch): its program (0, 0) first zeroes the counters and the all-padding tokens' rows."""
    if SCAN:
        if COUNTERS > 0:
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                _zero_counters_and_empty_rows(ids_ptr, counters_ptr, out_ptr, experts, stride_ot, PAIRS // TOP_K,
                                              TOP_K, K_POW2, HIDDEN, COUNTERS, DTYPE, 16, 256)  # fmt: skip
        expert, start, end = _scanned_run(ids_ptr, experts, PAIRS, P_POW2, E_BINS)
    else:
        expert, start, end = _expert_run(plan_ptr, experts, PAIRS)
    return expert, start, end


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w_ptr, act_ptr, plan_ptr, ids_ptr, counters_ptr, out_ptr,
    experts, stride_xt, stride_we, stride_wr, stride_ap, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, PAIRS: tl.constexpr, TOP_K: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SCAN: tl.constexpr, P_POW2: tl.constexpr, E_BINS: tl.constexpr, CHUNK: tl.constexpr, K_POW2: tl.constexpr,
    COUNTERS: tl.constexpr,
):  # fmt: skip
    expert, start, end = _slot_run(plan_ptr, ids_ptr, counters_ptr, out_ptr, experts, stride_ot, HIDDEN, PAIRS, TOP_K,
                                   DTYPE, SCAN, P_POW2, E_BINS, K_POW2, COUNTERS)  # fmt: skip
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < INTER
    gate_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wr + k[:, None]  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + INTER * stride_wr
    m0 = start
    while m0 < end:  # (a while: the interpreter's range takes no loaded bounds)
        pair, m_ok = _tile_pairs(plan_ptr, ids_ptr, expert, m0, end, SCAN, PAIRS, BLOCK_M, CHUNK)
        x_ptrs = x_ptr + (pair // TOP_K)[:, None] * stride_xt + k[None, :]
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=STAGES):
            k_ok = k0 + k < HIDDEN
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            gate += mma(x, tl.load(gate_ptrs + k0, mask=w_ok, other=0.0))
            up += mma(x, tl.load(up_ptrs + k0, mask=w_ok, other=0.0))
        act = silu_mul_rounded(gate, up, DTYPE)
        tl.store(act_ptr + pair[:, None] * stride_ap + n[None, :], act, mask=m_ok[:, None] & n_ok[None, :])
        m0 += BLOCK_M


@triton.jit
def _combine_arrived(
    y_ptr, ids_ptr, weights_ptr, out_ptr, counters_ptr, pair, m_ok, n, n_ok,
    experts, stride_yp, stride_ot,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Scan mode, the down kernel's epilogue: each of the tile's pairs arrives at its (token,
    column block) counter once its y columns are stored; the program whose arrival completes a
    token's real pairs sums that token's k y rows for these columns in k order (as the combine
    kernel: deterministic, no float atomics) and writes the output. acq_rel arrivals after a
    barrier: every y store of the arriving programs is visible to the last one's loads (L2, .cg)."""
    token = pair // TOP_K
    tl.debug_barrier()  # the whole tile's y stores before its arrivals
    arrived = tl.atomic_add(counters_ptr + token * tl.num_programs(1) + tl.program_id(1), 1, mask=m_ok,
                            sem="acq_rel", scope="gpu")  # fmt: skip
    kk = tl.arange(0, K_POW2)
    row_ids = tl.load(ids_ptr + token[:, None] * TOP_K + kk[None, :], mask=m_ok[:, None] & (kk < TOP_K)[None, :],
                      other=-1)  # fmt: skip
    real = tl.sum(((row_ids >= 0) & (row_ids < experts)).to(tl.int32), 1)
    last = m_ok & (arrived == real - 1)
    tl.debug_barrier()  # the acquiring lanes before any thread's loads of the others' y
    total = tl.zeros((pair.shape[0], n.shape[0]), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # k order: deterministic
        other = token * TOP_K + j
        expert = tl.load(ids_ptr + other, mask=last, other=-1).to(tl.int64)
        ok = last & (expert >= 0) & (expert < experts)
        weight = _upcast(tl.load(weights_ptr + other, mask=ok, other=0.0))
        y = tl.load(y_ptr + other[:, None] * stride_yp + n[None, :], mask=ok[:, None] & n_ok[None, :], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        total += _upcast(y) * weight[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + n[None, :], _downcast(total, OUT_DTYPE),
             mask=last[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _grouped_down_kernel(
    act_ptr, w_ptr, y_ptr, plan_ptr, ids_ptr, weights_ptr, out_ptr, counters_ptr,
    experts, stride_ap, stride_we, stride_wr, stride_yp, stride_ot,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, PAIRS: tl.constexpr, TOP_K: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SCAN: tl.constexpr, P_POW2: tl.constexpr, E_BINS: tl.constexpr, CHUNK: tl.constexpr, K_POW2: tl.constexpr,
):  # fmt: skip
    expert, start, end = _slot_run(plan_ptr, ids_ptr, counters_ptr, out_ptr, experts, stride_ot, HIDDEN, PAIRS, TOP_K,
                                   DTYPE, SCAN, P_POW2, E_BINS, K_POW2, 0)  # fmt: skip
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < HIDDEN
    w_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wr + k[:, None]  # [BLOCK_K, BLOCK_N]
    m0 = start
    while m0 < end:  # (a while: the interpreter's range takes no loaded bounds)
        pair, m_ok = _tile_pairs(plan_ptr, ids_ptr, expert, m0, end, SCAN, PAIRS, BLOCK_M, CHUNK)
        a_ptrs = act_ptr + pair[:, None] * stride_ap + k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(0, INTER, BLOCK_K, num_stages=STAGES):
            k_ok = k0 + k < INTER
            a = tl.load(a_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += mma(a, tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0))
        # The expert's GEMM output in the activation dtype (exact in y's dtype).
        tl.store(y_ptr + pair[:, None] * stride_yp + n[None, :], _downcast(acc, DTYPE),
                 mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip
        if SCAN:
            _combine_arrived(y_ptr, ids_ptr, weights_ptr, out_ptr, counters_ptr, pair, m_ok, n, n_ok,
                             experts, stride_yp, stride_ot, TOP_K, K_POW2, DTYPE)  # fmt: skip
        m0 += BLOCK_M


@triton.jit
def _combine_kernel(
    y_ptr, ids_ptr, weights_ptr, out_ptr,
    experts, stride_yp, stride_ot,
    HIDDEN: tl.constexpr, TOP_K: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols_ok = cols < HIDDEN
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # k order: deterministic
        pair = token * TOP_K + k
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        if (expert >= 0) & (expert < experts):  # else padding: its y row was never written
            weight = _upcast(tl.load(weights_ptr + pair))
            y = tl.load(y_ptr + pair.to(tl.int64) * stride_yp + cols, mask=cols_ok, other=0.0)
            total += _upcast(y) * weight
    tl.store(out_ptr + token * stride_ot + cols, _downcast(total, OUT_DTYPE), mask=cols_ok)


# ------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------


def plan_size(pairs: int, experts: int) -> int:
    """int32 elements of the align kernel's plan (see ``_align_kernel``)."""
    return pairs + 2 * experts + 2


def _torch_plan(top_k_ids: torch.Tensor, experts: int, plan: torch.Tensor) -> None:
    """The align kernel's plan from torch ops (a stable sort, a count by ``index_add_``, a
    cumsum: no host sync), for pair counts past one program: every expert gets a slot (a
    compaction would need a data-dependent shape), an untouched one an empty run."""
    pairs = top_k_ids.numel()
    flat = top_k_ids.reshape(-1).long()
    keys = torch.where((flat >= 0) & (flat < experts), flat, experts)
    plan[:pairs] = torch.argsort(keys, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int32, device=flat.device)
    counts.index_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))
    plan[pairs] = 0
    plan[pairs + 1 : pairs + experts + 1] = torch.cumsum(counts[:experts], 0)
    plan[pairs + experts + 1 : pairs + 2 * experts + 1] = torch.arange(experts, device=flat.device)
    plan[pairs + 2 * experts + 1] = experts


def make_plan(top_k_ids: torch.Tensor, experts: int, align_max_pairs: int) -> torch.Tensor:
    """The plan of ``top_k_ids`` (contiguous): the align kernel up to ``align_max_pairs`` pairs
    (a power of two; int32 sort keys), past that ``_torch_plan``."""
    pairs = top_k_ids.numel()
    plan = torch.empty(plan_size(pairs, experts), dtype=torch.int32, device=top_k_ids.device)
    p_pow2 = triton.next_power_of_2(max(pairs, 1))
    if p_pow2 <= align_max_pairs and (experts + 1) * p_pow2 < 2**31:  # (int32 sort keys)
        launch_on_device(top_k_ids, lambda: _align_kernel[(1,)](
            top_k_ids, plan, experts,
            PAIRS=pairs, P_POW2=p_pow2, E_BINS=triton.next_power_of_2(experts + 1),
            num_warps=4 if p_pow2 <= 2048 else 8 if p_pow2 <= 8192 else 16,
        ))  # fmt: skip
    else:
        _torch_plan(top_k_ids, experts, plan)
    return plan


def grouping(top_k_ids: torch.Tensor, experts: int, down_blocks: int, config) -> tuple[bool, torch.Tensor, torch.Tensor, dict]:
    """How the GEMM kernels find their pairs: (scan mode?, the plan, the down kernel's arrival
    counters [T * down_blocks], the kernels' grouping constexprs). Scan mode up to
    ``config.scan_max_pairs`` pairs (no plan: its pointer is the ids, unused), else a plan (no
    counters: their pointer is the ids, unused). ``config``: any config with ``scan_max_pairs``,
    ``scan_chunk`` and ``align_max_pairs`` (the bf16 and FP8 grouped kernels')."""
    tokens, top_k = top_k_ids.shape
    pairs = tokens * top_k
    if config.scan_chunk < 16 or config.scan_chunk & (config.scan_chunk - 1):
        raise ValueError(f"scan_chunk {config.scan_chunk}: a power of two >= 16")
    scan = pairs <= config.scan_max_pairs
    if scan:
        plan, counters = top_k_ids, torch.empty(tokens * down_blocks, dtype=torch.int32, device=top_k_ids.device)
    else:
        plan, counters = make_plan(top_k_ids, experts, config.align_max_pairs), top_k_ids
    meta = dict(
        SCAN=scan, P_POW2=triton.next_power_of_2(pairs) if scan else 16, E_BINS=triton.next_power_of_2(experts + 1),
        CHUNK=min(config.scan_chunk, triton.next_power_of_2(pairs)), K_POW2=triton.next_power_of_2(top_k),
    )  # fmt: skip
    return scan, plan, counters, meta


def launch_combine(y, top_k_ids, top_k_weights, out, experts: int, block: int, warps: int) -> None:
    """``out`` [T, H] = sum_k w[t, k] * y[(t, k)] over each token's real pairs, in k order."""
    tokens, top_k = top_k_ids.shape
    hidden_size = out.shape[1]
    launch_on_device(out, lambda: _combine_kernel[(tokens, triton.cdiv(hidden_size, block))](
        y, top_k_ids, top_k_weights, out,
        experts, y.stride(0), out.stride(0),
        HIDDEN=hidden_size, TOP_K=top_k, OUT_DTYPE=_TL_DTYPES[out.dtype], BLOCK=block,
        num_warps=warps,
    ))  # fmt: skip


def grouped_experts(
    hidden: torch.Tensor,
    top_k_ids: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    config: GroupedConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fusion_compiler::moe_experts`` (same arguments, the reference's result up to summation
    order): hidden [T, H], ids / weights [T, k], gate_up_proj [E, 2I, H], down_proj [E, H, I] ->
    [T, H] in hidden's dtype; two launches up to ``config.scan_max_pairs`` pairs, four past it.
    ``config``: launch shape, ``default_config`` by size if None. ``out``: where to write (a
    [T, H] tensor in hidden's dtype, rows of unit stride; every element is written), a new
    tensor if None."""
    hidden, top_k_ids, top_k_weights, out = prepare(
        "grouped_experts", hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj, out
    )
    tokens, top_k = top_k_ids.shape
    experts, hidden_size, intermediate = down_proj.shape
    pairs = tokens * top_k
    if config is None:
        config = default_config(tokens, top_k, experts, hidden_size, intermediate)
    c = config
    if c.block_m < 16 or c.block_m & (c.block_m - 1):
        raise ValueError(f"block_m {c.block_m}: tl.dot takes a power of two >= 16")
    if tokens == 0 or hidden_size == 0:
        return out
    if not (pairs and intermediate):  # no GEMM to run: every real pair's y is 0, so is the sum
        return out.zero_()
    dtype, device = hidden.dtype, hidden.device
    down_blocks = triton.cdiv(hidden_size, c.down_block_n)
    y = torch.empty(pairs, hidden_size, dtype=dtype, device=device)
    act = torch.empty(pairs, intermediate, dtype=dtype, device=device)
    scan, plan, counters, scan_meta = grouping(top_k_ids, experts, down_blocks, c)
    slots = min(experts, pairs)
    launch_on_device(hidden, lambda: _grouped_gate_up_kernel[(slots, triton.cdiv(intermediate, c.gate_up_block_n))](
        hidden, gate_up_proj, act, plan, top_k_ids, counters, out,
        experts, hidden.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0), out.stride(0),
        HIDDEN=hidden_size, INTER=intermediate, PAIRS=pairs, TOP_K=top_k, DTYPE=_TL_DTYPES[dtype],
        BLOCK_M=c.block_m, BLOCK_N=c.gate_up_block_n, BLOCK_K=c.gate_up_block_k, STAGES=c.gate_up_stages,
        COUNTERS=tokens * down_blocks if scan else 0, **scan_meta,
        num_warps=c.gate_up_warps,
    ))  # fmt: skip
    launch_on_device(hidden, lambda: _grouped_down_kernel[(slots, down_blocks)](
        act, down_proj, y, plan, top_k_ids, top_k_weights, out, counters,
        experts, act.stride(0), down_proj.stride(0), down_proj.stride(1), y.stride(0), out.stride(0),
        HIDDEN=hidden_size, INTER=intermediate, PAIRS=pairs, TOP_K=top_k, DTYPE=_TL_DTYPES[dtype],
        BLOCK_M=c.block_m, BLOCK_N=c.down_block_n, BLOCK_K=c.down_block_k, STAGES=c.down_stages, **scan_meta,
        num_warps=c.down_warps,
    ))  # fmt: skip
    if not scan:
        launch_combine(y, top_k_ids, top_k_weights, out, experts, c.combine_block, c.combine_warps)
    return out
