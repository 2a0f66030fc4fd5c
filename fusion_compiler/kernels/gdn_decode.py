"""Gated DeltaNet decode step (conv update + SiLU, l2norm, gates, delta-rule state update, gated
RMSNorm): one Triton kernel and its launcher. Semantics: ``fusion_compiler.ops.gdn_decode`` (its
reference must match, rounding point for rounding point).

Design. Traffic is the recurrent state: Hv x Dk x Dv fp32 per sequence (Qwen3.5: 64 x 128 x 128
= 4 MiB), read once and written once; everything else is ~0.2 MiB. Bytes moved per sequence at
Qwen3.5's shapes (bf16 activations, HF's conv state width 4):

    recurrent state   4 MiB read + 4 MiB written
    conv state        12288 x 4 x 2 B = 96 KiB read, 96 KiB written (the q/k lines are read by
                      the 4 programs of their key head, and twice in each: L1/L2 hits)
    mixed_qkv, z, out 24 KiB + 16 KiB read, 16 KiB written (+ b, a, weights: ~100 KiB, shared)

so ~8.2 MiB per sequence, ~2.8 us at 3 TB/s for one sequence if bandwidth-bound.

Grid (T, Hv): one program per (sequence, value head). It holds the head's whole [Dk, Dv] state
tile in registers (128 x 128 fp32 = 64 KiB: 64 registers a thread at 8 warps), so the state is
loaded once, decayed, read for kv_mem, updated and stored once, and the output row o[Dv] is
complete in the program, which the gated RMSNorm needs (a norm over all Dv of the head). The
state load is issued first so the small work below overlaps it. Splitting Dv over programs
(vLLM's BV blocks) would give more programs at T = 1 but needs a second pass for the norm: a
second launch, or a cross-program reduction. At T = 1 the grid is 64 programs on the H200's
132 SMs; each streams 128 KiB with all its loads in flight at once, which should be near the
per-SM bandwidth needed (64 x 128 KiB / 2.8 us ~ 46 GB/s per SM); not yet measured.

Each program recomputes the conv (K taps, SiLU) of the channels it needs: Dk q channels and
Dk k channels of its key head h // ratio, Dv v channels of its own head, from the conv state
window plus the new column, in the reference's dtypes (window rounded to the conv weight's dtype,
fp32 sum rounded once, SiLU rounded to the weight's dtype, then to the activation dtype). The
`ratio` programs of a key head each recompute its q/k conv (cheap: 2 x Dk x K values).

Conv state, written exactly once per channel, in place: the v channels by their only reader
(after a barrier: the shifted tile is stored over columns other threads of the program load);
the q/k channels of key head kh are read by `ratio` programs, so the one that arrives last on a
per-(row, key head) counter writes them. Every reader loads, then ``debug_barrier`` (bar.sync)
and a gpu-scope acq_rel ``atomic_add``; the program that draws ticket ratio - 1 knows every
other reader's loads are done and stores the shifted window, then resets the counter to zero,
so counters stay zero between launches (moe_route's completion counter does the same; the
per-device buffer must first be sized outside CUDA-graph capture, see ``_counters``). With
ratio 1 there is no counter. Letting any reader write would race with the others' loads;
vLLM's answer is a separate conv-update launch before the recurrent kernel, one launch more. Padding rows (slot -1) read and write no state and no counter, and
store a zero output row.

Math in fp32: sigmoid, silu and softplus as torch writes them (``x / (1 + exp(-x))``,
``log1p(exp(x))`` below 20, with the log1p done in the accurate ``log(u) * e / (u - 1)`` form), the
divisions correctly rounded (``div_rn``: plain ``/`` is approximate on the GPU). The reductions
sum in tree order, not torch's, and ``exp`` / ``rsqrt`` may differ in the last ulp on the GPU, so
states agree to a few fp32 ulp and outputs to one bf16 ulp.

Block sizes: Dk, Dv, K, W padded to powers of two; 8 warps for a 128 x 128 state (register
count: 64 state values a thread), 4 below; not tuned. This module imports only torch and
triton; set ``TRITON_INTERPRET=1`` before importing it to run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import downcast, launch_on_device, mean_from_sum, round_trip, upcast

KERNEL_VERSION = "gdn_decode-1"

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _silu(x):
    return tl.math.div_rn(x, 1.0 + tl.exp(-x))


@triton.jit
def _softplus(x):
    """torch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x))."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.math.div_rn(tl.log(u) * e, u - 1.0))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _conv_channels(X_ROW, STATE, W_PTR, chan0, live, stride_cs_c, stride_cs_w, stride_w_c, stride_w_k,
                   C: tl.constexpr, C_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   W: tl.constexpr, W_PAD: tl.constexpr, CONV_DTYPE: tl.constexpr, ACT_DTYPE: tl.constexpr):
    """Conv + SiLU of channels [chan0, chan0 + C) of one sequence: returns (the activations in
    fp32, rounded to ACT_DTYPE, [C_PAD]; the shifted conv-state window in fp32 [C_PAD, W_PAD]).
    ``STATE`` points at the sequence's conv-state slot. Loads only; the caller stores."""
    c = tl.arange(0, C_PAD)
    cmask = (c < C) & live
    chan = (chan0 + c)[:, None]
    x = round_trip(upcast(tl.load(X_ROW + chan0 + c, mask=cmask, other=0.0)), CONV_DTYPE)
    i = tl.arange(0, K_PAD)[None, :]
    # Tap i < K - 1 reads state column W - K + 1 + i; tap K - 1 is the new column.
    taps = tl.load(STATE + chan * stride_cs_c + (W - K + 1 + i) * stride_cs_w,
                   mask=cmask[:, None] & (i < K - 1), other=0.0)
    taps = tl.where(i == K - 1, x[:, None], round_trip(upcast(taps), CONV_DTYPE))
    w = upcast(tl.load(W_PTR + chan * stride_w_c + i * stride_w_k, mask=cmask[:, None] & (i < K), other=0.0))
    conv = round_trip(tl.sum(taps * w, axis=1), CONV_DTYPE)
    act = round_trip(round_trip(_silu(conv), CONV_DTYPE), ACT_DTYPE)
    # New window: column j takes old column j + 1, the last one the new column.
    j = tl.arange(0, W_PAD)[None, :]
    shifted = tl.load(STATE + chan * stride_cs_c + (j + 1) * stride_cs_w,
                      mask=cmask[:, None] & (j < W - 1), other=0.0)
    window = tl.where(j == W - 1, x[:, None], round_trip(upcast(shifted), CONV_DTYPE))
    return act, window


@triton.jit
def _store_window(STATE, window, chan0, mask, stride_cs_c, stride_cs_w,
                  C: tl.constexpr, C_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr):
    c = tl.arange(0, C_PAD)[:, None]
    j = tl.arange(0, W_PAD)[None, :]
    tl.store(STATE + (chan0 + c) * stride_cs_c + j * stride_cs_w, downcast(window, STATE.dtype.element_ty),
             mask=mask & (c < C) & (j < W))


@triton.jit
def _l2norm(x, eps):
    return x * tl.math.rsqrt(tl.sum(x * x, axis=0) + eps)


@triton.jit
def _gdn_decode_kernel(
    MIXED, Z, B, A, CONV_W, A_LOG, DT_BIAS, NORM_W, CONV_STATE, REC_STATE, SLOTS, OUT, COUNTERS,
    stride_x, stride_z, stride_b, stride_a, stride_o, stride_w_c, stride_w_k,
    stride_cs_s, stride_cs_c, stride_cs_w, stride_rs_s, stride_rs_h, stride_rs_k,
    key_heads, eps, qk_eps, sqrt_dk,
    RATIO: tl.constexpr, DK: tl.constexpr, DK_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr,
    ACT: tl.constexpr, CONV_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // RATIO
    slot = tl.load(SLOTS + t).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)

    # The state tile first: the rest of the program overlaps its load.
    kk = tl.arange(0, DK_PAD)[:, None]
    vv = tl.arange(0, DV_PAD)[None, :]
    s_mask = (kk < DK) & (vv < DV) & live
    s_ptrs = REC_STATE + slot * stride_rs_s + h * stride_rs_h + kk * stride_rs_k + vv
    state = tl.load(s_ptrs, mask=s_mask, other=0.0)

    # Conv of this program's q, k and v channels ([q | k | v] along conv_dim).
    key_width = key_heads * DK
    x_row = MIXED + t * stride_x
    cs = CONV_STATE + slot * stride_cs_s
    q, q_win = _conv_channels(x_row, cs, CONV_W, kh * DK, live, stride_cs_c, stride_cs_w, stride_w_c, stride_w_k,
                              DK, DK_PAD, K, K_PAD, W, W_PAD, CONV_DTYPE, ACT)
    k, k_win = _conv_channels(x_row, cs, CONV_W, key_width + kh * DK, live, stride_cs_c, stride_cs_w, stride_w_c,
                              stride_w_k, DK, DK_PAD, K, K_PAD, W, W_PAD, CONV_DTYPE, ACT)
    v, v_win = _conv_channels(x_row, cs, CONV_W, 2 * key_width + h * DV, live, stride_cs_c, stride_cs_w,
                              stride_w_c, stride_w_k, DV, DV_PAD, K, K_PAD, W, W_PAD, CONV_DTYPE, ACT)

    # Every conv-state load of this program is done before any store to it (here or, through
    # the counter's release, in the program that writes this key head's q/k channels).
    tl.debug_barrier()
    _store_window(cs, v_win, 2 * key_width + h * DV, live, stride_cs_c, stride_cs_w, DV, DV_PAD, W, W_PAD)
    if RATIO == 1:
        writer = live
    else:
        ticket = tl.atomic_add(COUNTERS + t * key_heads + kh, 1, mask=live, sem="acq_rel", scope="gpu")
        writer = live & (ticket == RATIO - 1)
        tl.debug_barrier()
    _store_window(cs, q_win, kh * DK, writer, stride_cs_c, stride_cs_w, DK, DK_PAD, W, W_PAD)
    _store_window(cs, k_win, key_width + kh * DK, writer, stride_cs_c, stride_cs_w, DK, DK_PAD, W, W_PAD)
    if RATIO > 1:
        tl.store(COUNTERS + t * key_heads + kh, 0, mask=writer)

    # Gates: beta rounded to b's dtype (HF's b.sigmoid()), g in fp32.
    b = upcast(tl.load(B + t * stride_b + h, mask=live, other=0.0))
    beta = round_trip(tl.math.div_rn(b * 0.0 + 1.0, 1.0 + tl.exp(-b)), B.dtype.element_ty)
    a = upcast(tl.load(A + t * stride_a + h, mask=live, other=0.0))
    a_log = upcast(tl.load(A_LOG + h))
    g = -tl.exp(a_log) * _softplus(a + upcast(tl.load(DT_BIAS + h)))

    q = tl.math.div_rn(_l2norm(q, qk_eps), tl.full(q.shape, 0.0, tl.float32) + sqrt_dk)
    k = _l2norm(k, qk_eps)

    # Delta rule on S[key, value], in HF's order.
    state = state * tl.exp(g)
    kv_mem = tl.sum(state * k[:, None], axis=0)
    delta = (v - kv_mem) * beta
    state = state + k[:, None] * delta[None, :]
    o = round_trip(tl.sum(state * q[:, None], axis=0), ACT)
    tl.store(s_ptrs, state, mask=s_mask)

    # Gated RMSNorm over the head's Dv values.
    d = tl.arange(0, DV_PAD)
    dmask = d < DV
    rstd = tl.math.rsqrt(mean_from_sum(tl.sum(o * o, axis=0), DV) + eps)
    normed = round_trip(o * rstd, ACT)
    w = upcast(tl.load(NORM_W + d, mask=dmask, other=0.0))
    y = round_trip(w * normed, NORM_DTYPE)
    z = upcast(tl.load(Z + t * stride_z + h * DV + d, mask=dmask & live, other=0.0))
    y = tl.where(live, y * _silu(z), 0.0)
    tl.store(OUT + t * stride_o + h * DV + d, downcast(y, OUT.dtype.element_ty), mask=dmask)


def _num_warps(key_dim: int, value_dim: int) -> int:
    # Registers, not timing: a 128 x 128 fp32 tile is 64 values a thread at 8 warps.
    return 8 if key_dim * value_dim >= 128 * 128 else 4


# Key-head counters per device. The last arriving program resets its counter to zero, so a
# buffer is zeroed once, outside any CUDA-graph capture, and every later launch finds it at zero.
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
                f"fusion_compiler.gdn_decode: {size} key-head counters are first needed inside CUDA-graph capture; "
                "run the largest batch once before capturing (the counters must be zeroed outside the graph)"
            )
        if counters is not None:
            _RETIRED.append(counters)
        counters = _COUNTERS[index] = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
    return counters


def gdn_decode_fwd(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps, conv_state,
                   recurrent_state, state_slots, out, counters=None) -> None:  # fmt: skip
    """Launch the kernel: writes ``out`` [T, Hv * Dv] and both states in place. Arguments as the
    op's (validated there); mixed_qkv, z, b, a need unit stride along their width, the weights
    unit stride, recurrent_state unit stride along Dv. ``counters`` (int32, >= T * key_heads,
    all zero; left zero) defaults to a per-device buffer. No host syncs."""
    tokens = mixed_qkv.shape[0]
    if tokens == 0:
        return
    num_slots, value_heads, key_dim, value_dim = recurrent_state.shape
    conv_dim, width = conv_state.shape[1], conv_state.shape[2]
    kernel = conv_weight.shape[-1]
    key_heads = (conv_dim - value_heads * value_dim) // (2 * key_dim)
    for name, t in (("mixed_qkv", mixed_qkv), ("z", z), ("b", b), ("a", a), ("recurrent_state", recurrent_state),
                    ("out", out)):  # fmt: skip
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride on its last dim, got {t.stride()}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("norm_weight", norm_weight)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if counters is None and value_heads > key_heads:
        counters = _counters(mixed_qkv.device, tokens * key_heads)
    norm_dtype = _TL_DTYPES[torch.promote_types(norm_weight.dtype, mixed_qkv.dtype)]

    def _launch():
        _gdn_decode_kernel[(tokens, value_heads)](
            mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, state_slots,
            out, counters if counters is not None else state_slots,
            mixed_qkv.stride(0), z.stride(0), b.stride(0), a.stride(0), out.stride(0),
            conv_weight.stride(0), conv_weight.stride(-1),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
            key_heads, float(eps), float(qk_l2norm_eps), float(key_dim**0.5),
            RATIO=value_heads // key_heads, DK=key_dim, DK_PAD=triton.next_power_of_2(key_dim),
            DV=value_dim, DV_PAD=triton.next_power_of_2(value_dim),
            K=kernel, K_PAD=triton.next_power_of_2(kernel), W=width, W_PAD=triton.next_power_of_2(width),
            ACT=_TL_DTYPES[mixed_qkv.dtype], CONV_DTYPE=_TL_DTYPES[conv_weight.dtype], NORM_DTYPE=norm_dtype,
            num_warps=_num_warps(key_dim, value_dim),
        )

    launch_on_device(mixed_qkv, _launch)
