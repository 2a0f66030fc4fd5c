"""DeepSeek V3.2 MLA kv prologue: q-norm (+FP8 quant), kv-norm + k_pe RoPE + latent cache write,
indexer k LayerNorm + NeoX RoPE + index cache write, as one Triton launch.

The contract is ``fusion_compiler.ops.mla_kv_prologue`` (its reference is the numerical truth;
this file must match it).  Grid ``(tokens, roles)``: axis 1 runs only the roles present, in the
order q, kv, index_k (constexpr flags ``HAS_Q`` / ``HAS_KV`` / ``HAS_INDEX_K`` and the program
ids ``KV_PID`` / ``INDEX_K_PID`` they map to), so an absent role costs no program.  Each
program handles one token of one role with the whole row in registers:

* q: RMSNorm over a ``[groups, group]`` tile (the quant groups, or one group of the whole row
  without quant), rounded to q_c's dtype; then FP8 group quant of that, or stored as is.
* kv: RMSNorm of kv_c over a ``[groups, group]`` tile: ``[kv_rank / 128, 128]`` (the
  fp8_ds_mla quant groups) when kv_rank is a multiple of 128, else masked groups of up to 128
  (the bf16 path takes any kv_rank: 64 is one 64-wide group, 192 two of 128), rounded to kv_c's
  dtype; interleaved RoPE of k_pe; kv_out / k_pe_out and the latent cache row at ``slots``
  (bf16 ``[kv | k_pe]`` or uint8 ``[fp8 kv | fp32 scales | bf16 k_pe]``).
* index_k: LayerNorm (+ bias) rounded to index_k's dtype, NeoX RoPE of the first rot dims,
  index_k_out and the index cache row ``[D fp8 | fp32 scale]``.

Slot -1 masks the cache stores.  No host syncs: the launcher reads shapes and strides only.
This module imports only torch and triton; set ``TRITON_INTERPRET=1`` before importing it to run
the kernel on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import (
    launch_on_device,
    downcast,
    fp8_group_quant,
    interleaved_out_index,
    mean_from_sum,
    rope_interleaved_lanes,
    rope_neox_lanes,
    rotate,
    round_trip,
    store_fp8_as_bytes,
    store_fp32_at_byte,
    upcast,
)

# Bump whenever the kernel or its launch choices change (hashed into the Inductor cache key).
KERNEL_VERSION = "mla_kv_prologue-4"

LATENT_GROUP = 128  # fp8_ds_mla quant group (ops.mla_kv_prologue.LATENT_GROUP)
_LATENT_GROUP = tl.constexpr(LATENT_GROUP)

# Latent cache modes (constexpr LATENT_MODE).
_NO_LATENT, _LATENT_SAME_DTYPE, _LATENT_FP8_DS_MLA = 0, 1, 2


@triton.jit
def _rope_row(COS, SIN, POS, t, stride_cos, stride_sin, HAS_POS: tl.constexpr):
    """Row pointers of this token's cos / sin (the tables read at positions[t])."""
    if HAS_POS:
        row = tl.load(POS + t).to(tl.int64)
    else:
        row = t
    return COS + row * stride_cos, SIN + row * stride_sin


@triton.jit
def _q_role(t, QC, QW, Q_OUT, Q_SCALE, stride_qc, stride_qout, stride_qscale, stride_qscale_g, eps,
            N: tl.constexpr, GROUP: tl.constexpr, GROUPS_BLOCK: tl.constexpr,
            GROUP_BLOCK: tl.constexpr, FP8: tl.constexpr, UE8M0: tl.constexpr,
            ROUND_BEFORE_QUANT: tl.constexpr):
    g1 = tl.arange(0, GROUPS_BLOCK)
    g = g1[:, None]
    j = tl.arange(0, GROUP_BLOCK)[None, :]
    col = g * GROUP + j
    mask = (g < N // GROUP) & (j < GROUP)
    w = upcast(tl.load(QW + col, mask=mask, other=0.0))
    h = upcast(tl.load(QC + t * stride_qc + col, mask=mask, other=0.0))
    rstd = tl.math.rsqrt(mean_from_sum(tl.sum(tl.sum(h * h, axis=1), axis=0), N) + eps)
    # Rounded to q_c's dtype, then (optionally) quantized from that rounded value.
    y32 = h * rstd * w
    y = downcast(y32, QC.dtype.element_ty)
    if FP8:
        codes, scale = fp8_group_quant(upcast(y) if ROUND_BEFORE_QUANT else y32, mask, UE8M0)
        tl.store(Q_OUT + t * stride_qout + col, codes, mask=mask)
        tl.store(Q_SCALE + t * stride_qscale + g1 * stride_qscale_g, scale, mask=g1 < N // GROUP)
    else:
        tl.store(Q_OUT + t * stride_qout + col, y, mask=mask)


@triton.jit
def _kv_role(t, KVC, KPE, KVW, KV_OUT, KPE_OUT, stride_kvc, stride_kpe, stride_kvout,
             stride_kpeout, eps, cos_row, sin_row, SLOTS, LATENT, latent_row_stride,
             KV_N: tl.constexpr, GROUPS_BLOCK: tl.constexpr, GROUP_BLOCK: tl.constexpr, ROT: tl.constexpr,
             ROT_BLOCK: tl.constexpr, DEINTERLEAVE: tl.constexpr, STORE_KV: tl.constexpr,
             LATENT_MODE: tl.constexpr, CACHE_UE8M0: tl.constexpr, ROUND_BEFORE_QUANT: tl.constexpr):
    g1 = tl.arange(0, GROUPS_BLOCK)
    g = g1[:, None]
    # One quant group per tile row in the FP8 mode (GROUP_BLOCK is 128 there); the last row is
    # masked past KV_N where kv_rank is no multiple of GROUP_BLOCK (the bf16 path).
    col = g * GROUP_BLOCK + tl.arange(0, GROUP_BLOCK)[None, :]
    mask = col < KV_N
    # Loads first (k_pe and cos/sin are independent of the norm's reduction).
    w = upcast(tl.load(KVW + col, mask=mask, other=0.0))
    h = upcast(tl.load(KVC + t * stride_kvc + col, mask=mask, other=0.0))
    d = tl.arange(0, ROT_BLOCK)
    dmask = d < ROT
    partner, pair, first = rope_interleaved_lanes(d)
    x = upcast(tl.load(KPE + t * stride_kpe + d, mask=dmask, other=0.0))
    xp = upcast(tl.load(KPE + t * stride_kpe + partner, mask=dmask, other=0.0))
    c = upcast(tl.load(cos_row + pair, mask=dmask, other=0.0))
    s = upcast(tl.load(sin_row + pair, mask=dmask, other=0.0))

    rstd = tl.math.rsqrt(mean_from_sum(tl.sum(tl.sum(h * h, axis=1), axis=0), KV_N) + eps)
    kv32 = h * rstd * w
    kv = downcast(kv32, KVC.dtype.element_ty)
    pe = downcast(rotate(x, xp, c, s, first), KPE.dtype.element_ty)

    if STORE_KV:
        tl.store(KV_OUT + t * stride_kvout + col, kv, mask=mask)
        out_d = interleaved_out_index(d, pair, ROT // 2, DEINTERLEAVE)
        tl.store(KPE_OUT + t * stride_kpeout + out_d, pe, mask=dmask)
    if LATENT_MODE != 0:
        slot = tl.load(SLOTS + t).to(tl.int64)
        ok = slot >= 0
        row = LATENT + slot * latent_row_stride
        if LATENT_MODE == 1:
            # [kv | k_pe] in the activation dtype (pairs in place).
            tl.store(row + col, kv, mask=mask & ok)
            tl.store(row + KV_N + d, pe, mask=dmask & ok)
        else:
            # fp8_ds_mla bytes: [kv_rank fp8 | kv_rank / 128 fp32 scales | rot bf16].
            codes, scale = fp8_group_quant(upcast(kv) if ROUND_BEFORE_QUANT else kv32, mask, CACHE_UE8M0)
            store_fp8_as_bytes(row, col, codes, mask & ok)
            store_fp32_at_byte(row, KV_N + 4 * g1, scale, (g1 < KV_N // _LATENT_GROUP) & ok)
            pe_ptr = (row + (KV_N + 4 * (KV_N // _LATENT_GROUP))).to(tl.pointer_type(tl.bfloat16))
            tl.store(pe_ptr + d, pe, mask=dmask & ok)


@triton.jit
def _index_k_role(t, IK, IKW, IKB, IK_OUT, stride_ik, stride_ikout, eps, cos_row, sin_row,
                  SLOTS, INDEX_CACHE, index_row_stride,
                  D: tl.constexpr, D_BLOCK: tl.constexpr, ROT: tl.constexpr,
                  HAS_BIAS: tl.constexpr, STORE_IK: tl.constexpr, HAS_CACHE: tl.constexpr,
                  CACHE_UE8M0: tl.constexpr):
    d = tl.arange(0, D_BLOCK)
    dmask = d < D
    rotary = d < ROT
    partner, pair, first = rope_neox_lanes(d, ROT // 2)
    row_in = IK + t * stride_ik
    x = upcast(tl.load(row_in + d, mask=dmask, other=0.0))
    xp = upcast(tl.load(row_in + partner, mask=dmask, other=0.0))
    w = upcast(tl.load(IKW + d, mask=dmask, other=0.0))
    wp = upcast(tl.load(IKW + partner, mask=dmask, other=0.0))
    c = upcast(tl.load(cos_row + pair, mask=rotary, other=0.0))
    s = upcast(tl.load(sin_row + pair, mask=rotary, other=0.0))

    mean = mean_from_sum(tl.sum(x, axis=0), D)
    centred = tl.where(dmask, x - mean, 0.0)
    rstd = tl.math.rsqrt(mean_from_sum(tl.sum(centred * centred, axis=0), D) + eps)
    # The partner lane's normed value, recomputed elementwise (bit-identical to its own lane).
    k = centred * rstd * w
    kp = (xp - mean) * rstd * wp
    if HAS_BIAS:
        k = k + upcast(tl.load(IKB + d, mask=dmask, other=0.0))
        kp = kp + upcast(tl.load(IKB + partner, mask=dmask, other=0.0))
    k = round_trip(k, IK.dtype.element_ty)
    kp = round_trip(kp, IK.dtype.element_ty)
    out = downcast(tl.where(rotary, rotate(k, kp, c, s, first), k), IK.dtype.element_ty)

    if STORE_IK:
        tl.store(IK_OUT + t * stride_ikout + d, out, mask=dmask)
    if HAS_CACHE:
        slot = tl.load(SLOTS + t).to(tl.int64)
        ok = slot >= 0
        row = INDEX_CACHE + slot * index_row_stride
        mask2 = dmask[None, :]
        codes, scale = fp8_group_quant(upcast(out)[None, :], mask2, CACHE_UE8M0)
        store_fp8_as_bytes(row, d[None, :], codes, mask2 & ok)
        store_fp32_at_byte(row, D + tl.arange(0, 1), scale, ok)


@triton.jit
def _mla_kv_prologue_kernel(
    # q role
    QC, QW, Q_OUT, Q_SCALE, stride_qc, stride_qout, stride_qscale, stride_qscale_g, q_eps,
    # kv role
    KVC, KPE, KVW, KV_OUT, KPE_OUT, stride_kvc, stride_kpe, stride_kvout, stride_kpeout, kv_eps,
    LATENT, latent_row_stride,
    # index_k role
    IK, IKW, IKB, IK_OUT, stride_ik, stride_ikout, ik_eps, INDEX_CACHE, index_row_stride,
    # shared
    COS, SIN, POS, stride_cos, stride_sin, SLOTS,
    # role dispatch
    HAS_Q: tl.constexpr, HAS_KV: tl.constexpr, HAS_INDEX_K: tl.constexpr,
    KV_PID: tl.constexpr, INDEX_K_PID: tl.constexpr, HAS_POS: tl.constexpr,
    # q role
    Q_N: tl.constexpr, Q_GROUP: tl.constexpr, Q_GROUPS_BLOCK: tl.constexpr,
    Q_GROUP_BLOCK: tl.constexpr, Q_FP8: tl.constexpr, Q_UE8M0: tl.constexpr,
    # kv role
    KV_N: tl.constexpr, KV_GROUPS_BLOCK: tl.constexpr, KV_GROUP_BLOCK: tl.constexpr, ROT: tl.constexpr,
    ROT_BLOCK: tl.constexpr, DEINTERLEAVE: tl.constexpr, STORE_KV: tl.constexpr,
    LATENT_MODE: tl.constexpr,
    # index_k role
    IK_N: tl.constexpr, IK_BLOCK: tl.constexpr, IK_HAS_BIAS: tl.constexpr,
    STORE_IK: tl.constexpr, HAS_INDEX_CACHE: tl.constexpr,
    CACHE_UE8M0: tl.constexpr,
    ROUND_BEFORE_QUANT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    role = tl.program_id(1)
    if HAS_Q:
        if role == 0:
            _q_role(t, QC, QW, Q_OUT, Q_SCALE, stride_qc, stride_qout, stride_qscale, stride_qscale_g, q_eps,
                    Q_N, Q_GROUP, Q_GROUPS_BLOCK, Q_GROUP_BLOCK, Q_FP8, Q_UE8M0, ROUND_BEFORE_QUANT)
    if HAS_KV:
        if role == KV_PID:
            cos_row, sin_row = _rope_row(COS, SIN, POS, t, stride_cos, stride_sin, HAS_POS)
            _kv_role(t, KVC, KPE, KVW, KV_OUT, KPE_OUT, stride_kvc, stride_kpe, stride_kvout,
                     stride_kpeout, kv_eps, cos_row, sin_row, SLOTS, LATENT, latent_row_stride,
                     KV_N, KV_GROUPS_BLOCK, KV_GROUP_BLOCK, ROT, ROT_BLOCK, DEINTERLEAVE, STORE_KV,
                     LATENT_MODE, CACHE_UE8M0, ROUND_BEFORE_QUANT)
    if HAS_INDEX_K:
        if role == INDEX_K_PID:
            cos_row, sin_row = _rope_row(COS, SIN, POS, t, stride_cos, stride_sin, HAS_POS)
            _index_k_role(t, IK, IKW, IKB, IK_OUT, stride_ik, stride_ikout, ik_eps, cos_row,
                          sin_row, SLOTS, INDEX_CACHE, index_row_stride,
                          IK_N, IK_BLOCK, ROT, IK_HAS_BIAS, STORE_IK, HAS_INDEX_CACHE,
                          CACHE_UE8M0)


def launch_config(q_width: int, q_group: int, kv_width: int, rot: int, index_width: int):
    """Block sizes and num_warps for the given row widths (0: role absent).

    Returns dict(Q_GROUP, Q_GROUPS_BLOCK, Q_GROUP_BLOCK, KV_GROUPS_BLOCK, KV_GROUP_BLOCK,
    ROT_BLOCK, IK_BLOCK, num_warps).  One program holds one row of its role in registers; the q
    row is a ``[groups, group]`` tile (one group of the whole row without quant).  The kv row
    is a ``[groups, group]`` tile of groups of 128 (the fp8_ds_mla quant group; DeepSeek's 512
    is 4 x 128), or for a kv_rank under 128 one group of its power of two (64: 64 lanes, not
    128 half masked); a kv_rank that is no multiple of 128 gets its last group masked (192:
    2 x 128, 64 lanes idle).  Any kv_rank the bf16 path takes launches; the FP8 layout's
    kv_rank is a multiple of 128 (the op declines others).  All roles share the
    launch's num_warps: 4 (16 fp32 values per thread for the 1536-wide q row on 128 threads;
    the rms_norm launch table found 4-8 warps best for 512-2048 rows), 8 above 2048 lanes.
    Not tuned on a GPU yet.
    """
    group = q_group if q_group else max(q_width, 1)
    kv_group = min(LATENT_GROUP, triton.next_power_of_2(max(kv_width, 1)))
    cfg = dict(
        Q_GROUP=group,
        Q_GROUPS_BLOCK=triton.next_power_of_2(max(q_width // group, 1)),
        Q_GROUP_BLOCK=triton.next_power_of_2(group),
        KV_GROUP_BLOCK=kv_group,
        KV_GROUPS_BLOCK=triton.next_power_of_2(max(triton.cdiv(kv_width, kv_group), 1)),
        ROT_BLOCK=triton.next_power_of_2(max(rot, 2)),
        IK_BLOCK=triton.next_power_of_2(max(index_width, 2)),
    )
    lanes = max(cfg["Q_GROUPS_BLOCK"] * cfg["Q_GROUP_BLOCK"] if q_width else 0,
                cfg["KV_GROUPS_BLOCK"] * kv_group, cfg["IK_BLOCK"])
    cfg["num_warps"] = 4 if lanes <= 2048 else 8
    return cfg


def _check_out(t: torch.Tensor, shape: tuple, dtype: torch.dtype, name: str, any_layout: bool = False) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype}, got {tuple(t.shape)} {t.dtype}")
    if not any_layout and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride on its last dim, got {t.stride()}")


def mla_kv_prologue_fwd(named: dict, q_out: torch.Tensor, q_scale: torch.Tensor,
                        kv_out: torch.Tensor, k_pe_out: torch.Tensor,
                        index_k_out: torch.Tensor) -> None:
    """Launch the kv prologue on validated arguments (``named``: the op's argument names).

    Outputs come from ``ops.mla_kv_prologue.output_shapes``; an absent output is an empty
    tensor and is not written.  Caches are written in place at ``slots`` (-1: skipped).
    No host syncs: safe under CUDA-graph capture once compiled.
    """
    q_c, kv_c, k_pe, index_k = named["q_c"], named["kv_c"], named["k_pe"], named["index_k"]
    latent, index_cache = named["latent_cache"], named["index_cache"]
    like = next(t for t in (q_c, kv_c, index_k) if t is not None)
    tokens = like.shape[0]

    has_q = q_c is not None
    store_kv = kv_c is not None and kv_out.numel() > 0
    has_kv = kv_c is not None and (store_kv or latent is not None)
    store_ik = index_k is not None and index_k_out.numel() > 0
    has_ik = index_k is not None and (store_ik or index_cache is not None)
    roles = int(has_q) + int(has_kv) + int(has_ik)
    if tokens == 0 or roles == 0:
        return

    q_width = q_c.shape[1] if has_q else 0
    q_group = int(named["q_quant_group"]) if has_q else 0
    kv_width = kv_c.shape[1] if has_kv else 0
    cos, sin, positions, slots = named["cos"], named["sin"], named["positions"], named["slots"]
    rot = 2 * cos.shape[1] if (has_kv or has_ik) else 0
    ik_width = index_k.shape[1] if has_ik else 0
    cfg = launch_config(q_width, q_group, kv_width, rot, ik_width)

    if has_q:
        if q_group:
            _check_out(q_out, q_c.shape, torch.float8_e4m3fn, "q_out")
            _check_out(q_scale, (tokens, q_width // q_group), torch.float32, "q_scale",
                       any_layout=bool(named.get("q_scale_column_major")))
        else:
            _check_out(q_out, q_c.shape, q_c.dtype, "q_out")
    if store_kv:
        _check_out(kv_out, kv_c.shape, kv_c.dtype, "kv_out")
        _check_out(k_pe_out, k_pe.shape, k_pe.dtype, "k_pe_out")
    if store_ik:
        _check_out(index_k_out, index_k.shape, index_k.dtype, "index_k_out")
    latent_mode = _NO_LATENT
    if has_kv and latent is not None:
        latent_mode = _LATENT_FP8_DS_MLA if latent.dtype == torch.uint8 else _LATENT_SAME_DTYPE
    if latent_mode == _LATENT_FP8_DS_MLA and kv_width % LATENT_GROUP:
        raise ValueError(f"the fp8_ds_mla latent cache quantises kv_c in {LATENT_GROUP}-wide groups; "
                         f"kv_c is {kv_width} wide")
    has_index_cache = has_ik and index_cache is not None
    # The fp32 scales are stored into the uint8 rows with 4-byte stores.
    for cache, name in ((latent, "latent_cache"), (index_cache, "index_cache")):
        if cache is not None and cache.dtype == torch.uint8:
            if cache.data_ptr() % 4 or cache.shape[-1] % 4:
                raise ValueError(f"{name} rows must be 4-byte aligned (fp32 scales), got row "
                                 f"width {cache.shape[-1]} at address {cache.data_ptr()}")

    def ptr(t):  # absent tensors: any valid pointer, never dereferenced
        return like if t is None or t.numel() == 0 else t

    def row_stride(t):
        return t.stride(0) if t is not None and t.dim() >= 1 and t.numel() > 0 else 0

    grid = (tokens, roles)

    def _launch():
        _mla_kv_prologue_kernel[grid](
            ptr(q_c), ptr(named["q_weight"]), ptr(q_out), ptr(q_scale),
            row_stride(q_c), row_stride(q_out), row_stride(q_scale),
            q_scale.stride(1) if q_scale.dim() == 2 else 1, float(named["q_eps"]),
            ptr(kv_c), ptr(k_pe), ptr(named["kv_weight"]), ptr(kv_out), ptr(k_pe_out),
            row_stride(kv_c), row_stride(k_pe), row_stride(kv_out), row_stride(k_pe_out),
            float(named["kv_eps"]),
            ptr(latent), latent.shape[-1] if latent is not None else 0,
            ptr(index_k), ptr(named["index_k_weight"]), ptr(named["index_k_bias"]),
            ptr(index_k_out), row_stride(index_k), row_stride(index_k_out),
            float(named["index_k_eps"]),
            ptr(index_cache), index_cache.shape[-1] if index_cache is not None else 0,
            ptr(cos), ptr(sin), ptr(positions), row_stride(cos), row_stride(sin), ptr(slots),
            HAS_Q=has_q, HAS_KV=has_kv, HAS_INDEX_K=has_ik,
            KV_PID=int(has_q), INDEX_K_PID=int(has_q) + int(has_kv),
            HAS_POS=positions is not None,
            Q_N=q_width, Q_GROUP=cfg["Q_GROUP"], Q_GROUPS_BLOCK=cfg["Q_GROUPS_BLOCK"],
            Q_GROUP_BLOCK=cfg["Q_GROUP_BLOCK"], Q_FP8=q_group > 0,
            Q_UE8M0=bool(named["q_ue8m0"]),
            KV_N=kv_width, KV_GROUPS_BLOCK=cfg["KV_GROUPS_BLOCK"],
            KV_GROUP_BLOCK=cfg["KV_GROUP_BLOCK"], ROT=rot,
            ROT_BLOCK=cfg["ROT_BLOCK"], DEINTERLEAVE=bool(named["deinterleave_rope"]),
            STORE_KV=store_kv, LATENT_MODE=latent_mode,
            IK_N=ik_width, IK_BLOCK=cfg["IK_BLOCK"],
            IK_HAS_BIAS=named["index_k_bias"] is not None, STORE_IK=store_ik,
            HAS_INDEX_CACHE=has_index_cache, CACHE_UE8M0=bool(named["cache_ue8m0"]),
            ROUND_BEFORE_QUANT=bool(named["round_before_quant"]),
            num_warps=cfg["num_warps"],
            # No FMA contraction: the reference's fp32 products and sums are rounded one by
            # one (the kernel is memory-bound; contraction would only shift roundings).
            enable_fp_fusion=False,
        )

    launch_on_device(like, _launch)
