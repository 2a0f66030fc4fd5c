"""Gated DeltaNet decode step (conv update + SiLU, l2norm, gates, delta-rule state update, gated
RMSNorm): one Triton kernel and its launcher. Semantics: ``fusion_compiler.ops.gdn_decode`` (its
reference must match, rounding point for rounding point); with ``vllm_math``, vLLM's decode path
on vLLM's state layout (``ops/gdn_decode_vllm.py``; ``gdn_decode_fwd`` lists the differences).

Design. Traffic is the recurrent state: Hv x Dk x Dv fp32 per sequence (Qwen3.5: 64 x 128 x 128
= 4 MiB), read once and written once; everything else is ~0.2 MiB. Bytes moved per sequence at
Qwen3.5's shapes (bf16 activations, HF's conv state width 4):

    recurrent state   4 MiB read + 4 MiB written
    conv state        12288 x 4 x 2 B = 96 KiB read, 96 KiB written (the q/k lines are read by
                      the 4 programs of their key head, and twice in each: L1/L2 hits)
    mixed_qkv, z, out 24 KiB + 16 KiB read, 16 KiB written (+ b, a, weights: ~100 KiB, shared)

so ~8.2 MiB per sequence, ~2.8 us at 3 TB/s for one sequence if bandwidth-bound.

Grid (T, Hv, split): each value head's Dv state columns are spread over ``split`` programs,
each updating ``chunks`` blocks of ``block_v`` columns in turn ([Dk, block_v] fp32 in
registers). The columns are independent in the delta rule (kv_mem, the update and o are all
per column given q, k, beta, g), so each block is loaded once, decayed, read for kv_mem,
updated, stored once, and its o columns are final. The first block's loads are issued before
the q/k conv and gates (the program's other work overlaps them); each later block's right
after the previous block's stores. ``tiling`` picks the split from the H200 sweep
(bench/diagnostics/gdn_tiling_sweep.py; bench/NOTES.md): one program per head looping over 32- or 64-column
blocks at 5+ sequences (68% of the copy bandwidth on the state bytes at 256, fla's three
kernels 62%), and a head split over 4 programs at 1-2 sequences, where 64 programs would leave
half of the 132 SMs idle. One [Dk, Dv] tile per program runs at 38%: 64 state registers a
thread at 8 warps leave too few programs resident to keep the loads in flight.

The gated RMSNorm needs the head's whole o row. One block per row: in registers. Otherwise each
block's o goes to OUT (exact: OUT has o's dtype, the reference's rounding point) and is read back
(``.cg``, from L2) and normalised: by the head's only program after a bar.sync, or with split >
1 by the last program of the whole key head to arrive on its counter (below), which finishes
the rows of all ``ratio`` heads of the key head at once. So a split row costs one atomic, not
one for the norm and one for the conv windows (each atomic is a ~1 us stall at one sequence;
bench/NOTES.md, gdn_decode).

Each program recomputes the conv (K taps, SiLU) of the channels it needs: Dk q channels and
Dk k channels of its key head h // ratio, and the v channels of its blocks, from the conv state
window plus the new column, in the reference's dtypes (window rounded to the conv weight's dtype,
fp32 sum rounded once, SiLU rounded to the weight's dtype, then to the activation dtype). The
``ratio * split`` programs of a key head each recompute its q/k conv (cheap: 2 x Dk x K values).

Conv state, written exactly once per channel, in place: the v channels by their only reader
(after a barrier: the shifted tile is stored over columns other threads of the program load);
the q/k channels of key head kh are read by ``ratio * split`` programs, so the one that arrives
last on a per-(row, key head) counter writes them, at the end of the program. Every reader
loads, then ``debug_barrier`` (bar.sync) and a gpu-scope acq_rel ``atomic_add``; the program that
draws the last ticket knows every other reader's loads are done and stores the shifted window,
then resets the counter to zero, so counters stay zero between launches (moe_route's counters do
the same; the per-device buffer must first be sized outside CUDA-graph capture, see
``_counters``). With one reader there is no counter. Letting any reader write would race with
the others' loads; vLLM's answer is a separate conv-update launch before the recurrent kernel,
one launch more.
Padding rows (slot -1) read and write no state and no counter, and store a zero output row.

Math in fp32: sigmoid, silu and softplus as torch writes them (``x / (1 + exp(-x))``,
``log1p(exp(x))`` below 20, with the log1p done in the accurate ``log(u) * e / (u - 1)`` form), the
divisions correctly rounded (``div_rn``: plain ``/`` is approximate on the GPU). The reductions
sum in tree order, not torch's, and ``exp`` / ``rsqrt`` may differ in the last ulp on the GPU, so
states agree to a few fp32 ulp and outputs to one bf16 ulp.

Block sizes: Dk, K, W padded to powers of two, block_v a power of two. This module imports only
torch and triton; set ``TRITON_INTERPRET=1`` before importing it to run on CPU tensors.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._device import downcast, launch_on_device, mean_from_sum, round_trip, upcast

KERNEL_VERSION = "gdn_decode-10"

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _silu(x):
    return tl.math.div_rn(x, 1.0 + tl.exp(-x))


@triton.jit
def _softplus(x, VLLM: tl.constexpr):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x)); VLLM: the packed
    decode kernel's ``log(1 + exp(x))``."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    if VLLM:
        log1p = tl.log(u)
    else:
        log1p = tl.where(u == 1.0, e, tl.math.div_rn(tl.log(u) * e, u - 1.0))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _conv_channels(X_ROW, STATE, W_PTR, chan0, count, live, stride_cs_c, stride_cs_w, stride_w_c, stride_w_k,
                   C_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   W: tl.constexpr, W_PAD: tl.constexpr, CONV_DTYPE: tl.constexpr, ACT_DTYPE: tl.constexpr,
                   TAPS: tl.constexpr, VLLM: tl.constexpr):
    """Conv + SiLU of channels [chan0, chan0 + count) of one sequence: returns (the activations
    in fp32, rounded to ACT_DTYPE, [C_PAD]; the shifted conv-state window in fp32 [C_PAD, W_PAD],
    or with TAPS its W columns as a tuple of [C_PAD] vectors). ``STATE`` points at the sequence's
    conv-state slot. Loads only; the caller stores (``_store_window``, the same TAPS). VLLM:
    causal_conv1d_update's roundings (``_conv_act``)."""
    c = tl.arange(0, C_PAD)
    cmask = (c < count) & live
    if TAPS:  # (an early return would not do: the compiler unifies every return's type)
        act, window = _conv_taps(X_ROW, STATE, W_PTR, chan0 + c, cmask, stride_cs_c, stride_cs_w, stride_w_c,
                                 stride_w_k, K, W, CONV_DTYPE, ACT_DTYPE, VLLM)
    else:
        chan = (chan0 + c)[:, None]
        x = round_trip(upcast(tl.load(X_ROW + chan0 + c, mask=cmask, other=0.0)), CONV_DTYPE)
        if VLLM:  # causal_conv1d_update: acc += x_i * w_i tap by tap, each product in the operands' dtype
            conv = tl.zeros([C_PAD], dtype=tl.float32)
            for tap in tl.static_range(K):  # tap i < K - 1 reads state column W - K + 1 + i
                if tap < K - 1:
                    column = tl.load(STATE + (chan0 + c) * stride_cs_c + (W - K + 1 + tap) * stride_cs_w, mask=cmask,
                                     other=0.0)  # fmt: skip
                    column = round_trip(upcast(column), CONV_DTYPE)
                else:
                    column = x
                weight = upcast(tl.load(W_PTR + (chan0 + c) * stride_w_c + tap * stride_w_k, mask=cmask, other=0.0))
                conv += round_trip(column * weight, CONV_DTYPE)
        else:
            i = tl.arange(0, K_PAD)[None, :]
            # Tap i < K - 1 reads state column W - K + 1 + i; tap K - 1 is the new column.
            taps = tl.load(STATE + chan * stride_cs_c + (W - K + 1 + i) * stride_cs_w,
                           mask=cmask[:, None] & (i < K - 1), other=0.0)
            taps = tl.where(i == K - 1, x[:, None], round_trip(upcast(taps), CONV_DTYPE))
            w = upcast(tl.load(W_PTR + chan * stride_w_c + i * stride_w_k, mask=cmask[:, None] & (i < K), other=0.0))
            conv = tl.sum(taps * w, axis=1)
        act = _conv_act(conv, CONV_DTYPE, ACT_DTYPE, VLLM)
        # New window: column j takes old column j + 1, the last one the new column.
        j = tl.arange(0, W_PAD)[None, :]
        shifted = tl.load(STATE + chan * stride_cs_c + (j + 1) * stride_cs_w,
                          mask=cmask[:, None] & (j < W - 1), other=0.0)
        window = tl.where(j == W - 1, x[:, None], round_trip(upcast(shifted), CONV_DTYPE))
    return act, window


@triton.jit
def _conv_act(conv, CONV_DTYPE: tl.constexpr, ACT_DTYPE: tl.constexpr, VLLM: tl.constexpr):
    """SiLU of the fp32 conv sum: HF rounds the sum and the SiLU to the weight's dtype, then to
    the activation dtype; vLLM's causal_conv1d_update rounds once, at its store, and divides with
    a plain ``/`` (approximate on the GPU, as there)."""
    if VLLM:
        act = round_trip(conv / (1.0 + tl.exp(-conv)), ACT_DTYPE)
    else:
        act = round_trip(round_trip(_silu(round_trip(conv, CONV_DTYPE)), CONV_DTYPE), ACT_DTYPE)
    return act


@triton.jit
def _conv_taps(X_ROW, STATE, W_PTR, chan, cmask, stride_cs_c, stride_cs_w, stride_w_c, stride_w_k,
               K: tl.constexpr, W: tl.constexpr, CONV_DTYPE: tl.constexpr, ACT_DTYPE: tl.constexpr,
               VLLM: tl.constexpr):
    """_conv_channels for K == W == 4 as per-tap [C] vectors, not a [C, K_PAD] tile. In sm_90
    SASS the tile is reshuffled through shared memory between the x load and the taps' load, and
    ptxas moves no load above that bar.sync, so every conv costs two dependent round trips more;
    vectors keep the loads together, and at one sequence the chain of dependent loads sets the
    time (bench/NOTES.md, gdn_decode). The default where K == W == 4 (``Tiling.conv_taps`` gives
    the H200 A/B)."""
    tl.static_assert(K == 4 and W == 4)
    x = round_trip(upcast(tl.load(X_ROW + chan, mask=cmask, other=0.0)), CONV_DTYPE)
    s = STATE + chan * stride_cs_c  # with W == K, tap i < K - 1 is state column i + 1
    t1 = round_trip(upcast(tl.load(s + stride_cs_w, mask=cmask, other=0.0)), CONV_DTYPE)
    t2 = round_trip(upcast(tl.load(s + 2 * stride_cs_w, mask=cmask, other=0.0)), CONV_DTYPE)
    t3 = round_trip(upcast(tl.load(s + 3 * stride_cs_w, mask=cmask, other=0.0)), CONV_DTYPE)
    w = W_PTR + chan * stride_w_c
    w0 = upcast(tl.load(w, mask=cmask, other=0.0))
    w1 = upcast(tl.load(w + stride_w_k, mask=cmask, other=0.0))
    w2 = upcast(tl.load(w + 2 * stride_w_k, mask=cmask, other=0.0))
    w3 = upcast(tl.load(w + 3 * stride_w_k, mask=cmask, other=0.0))
    act = _conv_act((t1 * w0 + t3 * w2) + (t2 * w1 + x * w3), CONV_DTYPE, ACT_DTYPE, VLLM)  # tl.sum's pairing
    return act, (t1, t2, t3, x)  # the new window: old columns 1..3, then the new column


@triton.jit
def _store_window(STATE, window, chan0, count, mask, stride_cs_c, stride_cs_w,
                  C_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, TAPS: tl.constexpr):
    if TAPS:
        c = tl.arange(0, C_PAD)
        keep = mask & (c < count)
        s = STATE + (chan0 + c) * stride_cs_c
        for j in tl.static_range(W):
            tl.store(s + j * stride_cs_w, downcast(window[j], STATE.dtype.element_ty), mask=keep)
    else:
        c = tl.arange(0, C_PAD)[:, None]
        j = tl.arange(0, W_PAD)[None, :]
        tl.store(STATE + (chan0 + c) * stride_cs_c + j * stride_cs_w, downcast(window, STATE.dtype.element_ty),
                 mask=mask & (c < count) & (j < W))


@triton.jit
def _k_axis(k, VK: tl.constexpr):
    """A [DK] vector along the state tile's k axis: its rows in [DK, BV] tiles, its columns in
    vLLM's [BV, DK] (VK)."""
    if VK:
        out = k[None, :]
    else:
        out = k[:, None]
    return out


@triton.jit
def _v_axis(v, VK: tl.constexpr):
    """A [BV] vector along the state tile's value axis (``_k_axis``'s other one)."""
    if VK:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _store_state(s_row, state, kk, vv, stride_rs_v, DK: tl.constexpr, DV: tl.constexpr, live):
    """Store a state block at value columns ``vv`` (along the tile's value axis: ``_v_axis``)."""
    tl.store(s_row + vv * stride_rs_v, state, mask=(kk < DK) & (vv < DV) & live)


@triton.jit
def _value_block(s_row, kk, x_row, cs, CONV_W, v_chan_base, v0, valid, stride_cs_c, stride_cs_w, stride_w_c,
                 stride_w_k, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, K: tl.constexpr,
                 K_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, CONV_DTYPE: tl.constexpr,
                 ACT: tl.constexpr, TAPS: tl.constexpr, VLLM: tl.constexpr, stride_rs_v):
    """One block's loads: the state columns [v0, v0 + BV) of the head ([DK_PAD, BV], or with VLLM
    [BV, DK_PAD]), and the conv + SiLU of the same v channels (activations, shifted window). All
    masked off unless valid."""
    vv = _v_axis(v0 + tl.arange(0, BV), VLLM)
    state = tl.load(s_row + vv * stride_rs_v, mask=(kk < DK) & (vv < DV) & valid, other=0.0)
    v, v_win = _conv_channels(x_row, cs, CONV_W, v_chan_base + v0, tl.minimum(DV - v0, BV), valid, stride_cs_c,
                              stride_cs_w, stride_w_c, stride_w_k, BV, K, K_PAD, W, W_PAD, CONV_DTYPE, ACT, TAPS,
                              VLLM)
    return state, v, v_win


@triton.jit
def _last_arrival(COUNTER, live, ARRIVALS: tl.constexpr):
    """Whether this program is the last of ARRIVALS to arrive on COUNTER (live programs only).
    The caller has done its own loads / stores and a bar.sync; the gpu-scope acq_rel atomic
    orders them before the ticket, and the last arriver's later accesses after every other
    arrival's. The caller resets the counter to zero (masked by the result) when ARRIVALS > 1."""
    if ARRIVALS == 1:
        last = live
    else:
        ticket = tl.atomic_add(COUNTER, 1, mask=live, sem="acq_rel", scope="gpu")
        last = live & (ticket == ARRIVALS - 1)
        tl.debug_barrier()
    return last


@triton.jit
def _sum_over_k(x, VK: tl.constexpr):
    """A state tile's sums over k: along axis 0 of [DK, BV], axis 1 of vLLM's [BV, DK] (VK)."""
    if VK:
        out = tl.sum(x, axis=1)
    else:
        out = tl.sum(x, axis=0)
    return out


@triton.jit
def _update_block(state, v, k, q, decay, beta, ACT: tl.constexpr, VK: tl.constexpr):
    """The delta rule on one block of state columns, in HF's order: (new state, o rounded to ACT).
    VK: vLLM's [BV, DK] tile, as its packed decode kernel holds it, so the sums over k reduce the
    same axis of the same shape (bit-equal under the interpreter; on the GPU the order also
    depends on the layout Triton picks)."""
    k = _k_axis(k, VK)
    state = state * decay
    delta = (v - _sum_over_k(state * k, VK)) * beta
    state = state + k * _v_axis(delta, VK)
    return state, round_trip(_sum_over_k(state * _k_axis(q, VK), VK), ACT)


@triton.jit
def _l2norm(x, eps, VLLM: tl.constexpr):
    if VLLM:  # the packed decode kernel's form
        return x / tl.sqrt(tl.sum(x * x, axis=0) + eps)
    return x * tl.math.rsqrt(tl.sum(x * x, axis=0) + eps)


@triton.jit
def _gated_norm(o, z, norm_w, eps, DV: tl.constexpr, ACT: tl.constexpr, NORM_DTYPE: tl.constexpr,
                VLLM: tl.constexpr):
    """rms-normalised rows of o [rows, DV_PAD] times norm_w, times silu(z), in HF's roundings
    (VLLM: all in fp32, as RMSNormGated.forward_native)."""
    rstd = tl.math.rsqrt(mean_from_sum(tl.sum(o * o, axis=1), DV) + eps)[:, None]
    if VLLM:
        return o * rstd * norm_w * _silu(z)
    normed = round_trip(o * rstd, ACT)
    return round_trip(norm_w * normed, NORM_DTYPE) * _silu(z)


@triton.jit
def _gdn_decode_kernel(
    MIXED, Z, B, A, CONV_W, A_LOG, DT_BIAS, NORM_W, CONV_STATE, REC_STATE, SLOTS, OUT, COUNTERS,
    stride_x, stride_z, stride_b, stride_a, stride_o, stride_w_c, stride_w_k,
    stride_cs_s, stride_cs_c, stride_cs_w, stride_rs_s, stride_rs_h, stride_rs_k, stride_rs_v,
    key_heads, eps, qk_eps, sqrt_dk, rows, min_slot,
    RATIO: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    BV: tl.constexpr, CHUNKS: tl.constexpr, SPLIT: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr,
    ACT: tl.constexpr, CONV_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr,
    CONV_TAPS: tl.constexpr = False,  # the conv as per-tap vectors (_conv_taps; K == W == 4)
    VLLM: tl.constexpr = False,  # vLLM's arithmetic (gdn_decode_fwd's vllm_math)
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    part = tl.program_id(2)  # which of the head's SPLIT programs: value columns [part * CHUNKS * BV, ...)
    kh = h // RATIO
    slot = tl.load(SLOTS + t, mask=t < rows, other=-1).to(tl.int64)
    live = (slot >= min_slot) & (t < rows)
    slot = tl.maximum(slot, 0)
    kk = _k_axis(tl.arange(0, DK_PAD), VLLM)  # the state tile: [DK, BV], or vLLM's [BV, DK]
    s_row = REC_STATE + slot * stride_rs_s + h * stride_rs_h + kk * stride_rs_k
    key_width = key_heads * DK
    x_row = MIXED + t * stride_x
    cs = CONV_STATE + slot * stride_cs_s
    # The heads whose gated norm this program may finish: its own, or with a split row every
    # head of its key head (the key head's last program to arrive finishes all of them).
    NH: tl.constexpr = RATIO if SPLIT > 1 else 1
    norm_heads = (kh * RATIO + tl.arange(0, NH)[:, None]) if SPLIT > 1 else (h + tl.arange(0, NH)[:, None])
    d = tl.arange(0, DV_PAD)[None, :]
    dmask = d < DV

    # The first value block's loads (state and v conv), the gates' inputs and the norm weight are
    # issued first: the q/k work below overlaps them.
    v_chan_base = 2 * key_width + h * DV  # this head's v channels along conv_dim
    v0 = part * CHUNKS * BV
    state, v, v_win = _value_block(s_row, kk, x_row, cs, CONV_W, v_chan_base, v0, live, stride_cs_c, stride_cs_w,
                                   stride_w_c, stride_w_k, DK, DV, BV, K, K_PAD, W, W_PAD, CONV_DTYPE, ACT, CONV_TAPS, VLLM, stride_rs_v)
    z = upcast(tl.load(Z + t * stride_z + norm_heads * DV + d, mask=dmask & live, other=0.0))
    norm_w = upcast(tl.load(NORM_W + d, mask=dmask, other=0.0))
    b = upcast(tl.load(B + t * stride_b + h, mask=live, other=0.0))
    a = upcast(tl.load(A + t * stride_a + h, mask=live, other=0.0))
    a_log = upcast(tl.load(A_LOG + h))
    dt_bias = upcast(tl.load(DT_BIAS + h))

    # q and k of this program's key head: conv ([q | k | v] along conv_dim), l2norm, q's scale.
    # Their shifted windows are stored at the end, by the key head's last program.
    q, q_win = _conv_channels(x_row, cs, CONV_W, kh * DK, DK, live, stride_cs_c, stride_cs_w, stride_w_c,
                              stride_w_k, DK_PAD, K, K_PAD, W, W_PAD, CONV_DTYPE, ACT, CONV_TAPS, VLLM)
    k, k_win = _conv_channels(x_row, cs, CONV_W, key_width + kh * DK, DK, live, stride_cs_c, stride_cs_w,
                              stride_w_c, stride_w_k, DK_PAD, K, K_PAD, W, W_PAD, CONV_DTYPE, ACT, CONV_TAPS, VLLM)
    if VLLM:  # q times dk ** -0.5, which sqrt_dk then holds
        q = _l2norm(q, qk_eps, VLLM) * sqrt_dk
    else:
        q = tl.math.div_rn(_l2norm(q, qk_eps, VLLM), tl.full(q.shape, 0.0, tl.float32) + sqrt_dk)
    k = _l2norm(k, qk_eps, VLLM)

    # Gates: beta rounded to b's dtype (HF's b.sigmoid(); vLLM keeps fp32), g in fp32.
    if VLLM:
        beta = tl.sigmoid(b)
    else:
        beta = round_trip(tl.math.div_rn(b * 0.0 + 1.0, 1.0 + tl.exp(-b)), B.dtype.element_ty)
    decay = tl.exp(-tl.exp(a_log) * _softplus(a + dt_bias, VLLM))

    # Value columns in CHUNKS blocks of BV; each block's loads are issued before the gates'
    # math (the first) or right after the previous block's stores. Columns are independent in
    # the delta rule: each block's v conv, state update and o are complete alone.
    o_row = OUT + t * stride_o + h * DV
    one_block_of_split_row: tl.constexpr = CHUNKS == 1 and SPLIT > 1
    if one_block_of_split_row:
        # o goes out first and the state only after the counter below: the counter's release
        # then waits for o's stores, not for the state block's.
        vv = v0 + tl.arange(0, BV)
        state, o = _update_block(state, v, k, q, decay, beta, ACT, VLLM)
        tl.store(o_row + vv, downcast(tl.where(live, o, 0.0), OUT.dtype.element_ty), mask=vv < DV)
        tl.debug_barrier()  # this block's conv-window loads (any thread) before its store
        _store_window(cs, v_win, v_chan_base + v0, tl.minimum(DV - v0, BV), live, stride_cs_c, stride_cs_w, BV,
                      W, W_PAD, CONV_TAPS)
    else:
        o = tl.zeros([BV], dtype=tl.float32)
        for c in range(0, CHUNKS):
            vv = v0 + tl.arange(0, BV)
            state, o = _update_block(state, v, k, q, decay, beta, ACT, VLLM)
            _store_state(s_row, state, kk, _v_axis(vv, VLLM), stride_rs_v, DK, DV, live)
            tl.debug_barrier()  # this block's conv-window loads (any thread) before its store
            _store_window(cs, v_win, v_chan_base + v0, tl.minimum(DV - v0, BV), live, stride_cs_c, stride_cs_w,
                          BV, W, W_PAD, CONV_TAPS)
            if CHUNKS * SPLIT > 1:  # o of a split row goes through OUT (exact: OUT has o's dtype)
                tl.store(o_row + vv, downcast(tl.where(live, o, 0.0), OUT.dtype.element_ty), mask=vv < DV)
            v0 = v0 + BV
            state, v, v_win = _value_block(s_row, kk, x_row, cs, CONV_W, v_chan_base, v0, live & (c + 1 < CHUNKS),
                                           stride_cs_c, stride_cs_w, stride_w_c, stride_w_k, DK, DV, BV, K, K_PAD,
                                           W, W_PAD, CONV_DTYPE, ACT, CONV_TAPS, VLLM, stride_rs_v)

    # Gated RMSNorm over each head's DV values, and the key head's q/k conv windows. The RATIO *
    # SPLIT programs of a key head all read its q/k windows, so one of them, the last to arrive on
    # the per-(row, key head) counter, stores the shifted windows after every reader's loads.
    # One block a row: the norm in registers. A row in blocks of one program: read back from OUT
    # after a bar.sync. A split row: the same last program reads back and finishes every row of
    # the key head, so one counter serves both (o's stores, then bar.sync and the gpu-scope
    # acq_rel atomic, are ordered before the ticket; the finisher's loads after it).
    readers: tl.constexpr = RATIO * SPLIT
    out_rows = OUT + t * stride_o + norm_heads * DV + d
    if CHUNKS * SPLIT == 1:  # BV == DV_PAD
        y = _gated_norm(o[None, :], z, norm_w, eps, DV, ACT, NORM_DTYPE, VLLM)
        tl.store(out_rows, downcast(tl.where(live, y, 0.0), OUT.dtype.element_ty), mask=dmask)
        tl.debug_barrier()
        writer = _last_arrival(COUNTERS + t * key_heads + kh, live, readers)
    elif SPLIT == 1:
        tl.debug_barrier()
        o = upcast(tl.load(out_rows, mask=dmask & live, other=0.0, cache_modifier=".cg"))
        y = _gated_norm(o, z, norm_w, eps, DV, ACT, NORM_DTYPE, VLLM)
        tl.store(out_rows, downcast(y, OUT.dtype.element_ty), mask=dmask & live)  # padding rows: zeros stored
        writer = _last_arrival(COUNTERS + t * key_heads + kh, live, readers)
    else:
        tl.debug_barrier()
        writer = _last_arrival(COUNTERS + t * key_heads + kh, live, readers)
        if one_block_of_split_row:
            _store_state(s_row, state, kk, _v_axis(vv, VLLM), stride_rs_v, DK, DV, live)
        o = upcast(tl.load(out_rows, mask=dmask & writer, other=0.0, cache_modifier=".cg"))
        y = _gated_norm(o, z, norm_w, eps, DV, ACT, NORM_DTYPE, VLLM)
        tl.store(out_rows, downcast(y, OUT.dtype.element_ty), mask=dmask & writer)  # padding rows: zeros stored
    _store_window(cs, q_win, kh * DK, DK, writer, stride_cs_c, stride_cs_w, DK_PAD, W, W_PAD, CONV_TAPS)
    _store_window(cs, k_win, key_width + kh * DK, DK, writer, stride_cs_c, stride_cs_w, DK_PAD, W, W_PAD, CONV_TAPS)
    if readers > 1:
        tl.store(COUNTERS + t * key_heads + kh, 0, mask=writer)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a value head's DV columns are spread: ``split`` programs per head, each updating
    ``chunks`` blocks of ``block_v`` columns in turn. ``conv_taps``: the conv as per-tap vectors
    where the kernel and the state width are 4 (``_conv_taps``; the [C, K] tile form elsewhere,
    and everywhere with False: the A/B form). Taps by default: faster at every batch in the H200
    A/B (bench/gdn_decode.py, Qwen3.5's dims, CUDA-graph us, tile -> taps): 7.78 -> 6.87 at 1
    sequence, 27.8 -> 25.5 at 8, 181.4 -> 173.6 at 64, 707 -> 676 at 256 (bench/NOTES.md,
    gdn_decode)."""

    block_v: int
    chunks: int = 1
    split: int = 1
    num_warps: int = 4
    conv_taps: bool = True


def tiling(tokens: int, value_dim: int, value_heads: int, vllm: bool = False) -> Tiling:
    """The H200 sweeps' choice (bench/diagnostics/gdn_tiling_sweep.py, gdn_decode-3 and -7, bench/NOTES.md):
    one program per head looping over 64-column blocks at 4 warps from 16 sequences up (70% of
    the copy bandwidth at 256), 32-column blocks below; a head split over 4 programs while
    there are fewer heads than ~SMs (1 sequence: 64 programs would leave half the 132 SMs
    idle), over 2 up to 2x that."""
    block_v = min(triton.next_power_of_2(value_dim), 64 if tokens >= 16 else 32)
    blocks = triton.cdiv(value_dim, block_v)
    programs = tokens * value_heads
    split = 4 if programs <= 128 else 2 if programs <= 256 else 1
    while blocks % split:
        split //= 2
    # At 8 sequences 32-column blocks looped by one or two programs a head are fastest at 2
    # warps (H200: 28.8 / 30.8 us against 32.8 / 33.7 at 4; bench/NOTES.md, gdn_decode). vLLM's
    # [V, K] tile (``vllm``) takes 243-255 registers at 2 warps, 96 at 4 (offline sm_90 SASS,
    # 64 sequences): 4 there, not timed.
    warps = 2 if block_v == 32 and split <= 2 and not vllm else 4
    return Tiling(block_v, chunks=blocks // split, split=split, num_warps=warps)


# Arrival counters per device, one per (row, key head). The last
# arriving program resets its counter to zero, so a buffer is zeroed once, outside any
# CUDA-graph capture, and every later launch finds it at zero.
# A bigger batch allocates a bigger buffer (outside capture only); the old ones are kept, since a
# captured graph may still point at them. Launches on one device must not overlap in time.
_COUNTERS: dict[int, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _counters(device: torch.device, size: int) -> torch.Tensor:
    if device.type != "cuda":
        return torch.zeros(size, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    counters = _COUNTERS.get(index)
    if counters is None or counters.numel() < size:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"fusion_compiler.gdn_decode: {size} arrival counters are first needed inside CUDA-graph capture; "
                "run the largest batch once before capturing (the counters must be zeroed outside the graph)"
            )
        if counters is not None:
            _RETIRED.append(counters)
        counters = _COUNTERS[index] = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
    return counters


def gdn_decode_fwd(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps, conv_state,
                   recurrent_state, state_slots, out, counters=None, tiling_override=None, rows=None, min_slot=0,
                   vllm_math=False) -> None:  # fmt: skip
    """Launch the kernel: writes ``out`` [T, Hv * Dv] and both states in place. Arguments as the
    op's (validated there); mixed_qkv, z, b, a need unit stride along their width, the weights
    unit stride; both states take any strides (vLLM's SSM state is [slot, Hv, Dv, Dk], Dk
    innermost: pass it as ``.transpose(-1, -2)``). ``counters`` (int32, >= T * key_heads, all
    zero; left zero) defaults to a per-device buffer. ``tiling_override`` (a ``Tiling``)
    replaces ``tiling``'s choice. No host syncs.

    vLLM's contract (ops/gdn_decode_vllm.py): only the first ``rows`` rows (default T) are live
    and read ``state_slots``; a slot below ``min_slot`` (default 0; vLLM's NULL_BLOCK_ID 0 needs
    1) is padding. ``vllm_math``: vLLM's arithmetic (causal_conv1d_update, the packed decode
    kernel, RMSNormGated.forward_native): the conv summed tap by tap, each product rounded to
    the weight's dtype (needs the activations, conv state and weight in one dtype), and rounded
    once after SiLU; beta as ``tl.sigmoid`` in fp32; l2norm as ``x / sqrt(sum + eps)`` and q times
    ``Dk ** -0.5``; softplus as ``log(1 + exp(x))``; the state tile [V, K] as vLLM's, so the
    sums over k take its order; the gated norm in fp32. The conv's per-tap vectors are not
    used (vLLM's state is K - 1 wide)."""
    tokens = mixed_qkv.shape[0]
    if tokens == 0:
        return
    num_slots, value_heads, key_dim, value_dim = recurrent_state.shape
    conv_dim, width = conv_state.shape[1], conv_state.shape[2]
    kernel = conv_weight.shape[-1]
    key_heads = (conv_dim - value_heads * value_dim) // (2 * key_dim)
    for name, t in (("mixed_qkv", mixed_qkv), ("z", z), ("b", b), ("a", a), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on its last dim, got {t.stride()}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("norm_weight", norm_weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out.dtype != mixed_qkv.dtype:
        raise ValueError(f"out must have mixed_qkv's dtype {mixed_qkv.dtype} (split heads keep o in it), got {out.dtype}")
    tile = tiling_override or tiling(tokens, value_dim, value_heads, vllm=vllm_math)
    if tile.block_v & (tile.block_v - 1) or tile.block_v * tile.chunks * tile.split < value_dim:
        raise ValueError(f"{tile} does not cover {value_dim} value columns with a power-of-two block")
    # One block a row needs BV == DV_PAD (the norm's row is the block).
    tile = dataclasses.replace(tile, block_v=min(tile.block_v, triton.next_power_of_2(value_dim)))
    if counters is None and (value_heads > key_heads or tile.split > 1):
        counters = _counters(mixed_qkv.device, tokens * key_heads)
    if counters is None:
        counters = state_slots  # never touched: every key head has one reader
    norm_dtype = _TL_DTYPES[torch.promote_types(norm_weight.dtype, mixed_qkv.dtype)]

    def _launch():
        _gdn_decode_kernel[(tokens, value_heads, tile.split)](
            mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, state_slots,
            out, counters,
            mixed_qkv.stride(0), z.stride(0), b.stride(0), a.stride(0), out.stride(0),
            conv_weight.stride(0), conv_weight.stride(-1),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2), recurrent_state.stride(3),
            key_heads, float(eps), float(qk_l2norm_eps), float(key_dim**-0.5 if vllm_math else key_dim**0.5),
            tokens if rows is None else rows, min_slot,
            RATIO=value_heads // key_heads, DK=key_dim, DK_PAD=triton.next_power_of_2(key_dim),
            DV=value_dim, DV_PAD=triton.next_power_of_2(value_dim), BV=tile.block_v, CHUNKS=tile.chunks,
            SPLIT=tile.split,
            K=kernel, K_PAD=triton.next_power_of_2(kernel), W=width, W_PAD=triton.next_power_of_2(width),
            ACT=_TL_DTYPES[mixed_qkv.dtype], CONV_DTYPE=_TL_DTYPES[conv_weight.dtype], NORM_DTYPE=norm_dtype,
            CONV_TAPS=bool(tile.conv_taps and kernel == width == 4 and not vllm_math), VLLM=vllm_math, num_warps=tile.num_warps,
        )

    launch_on_device(mixed_qkv, _launch)
