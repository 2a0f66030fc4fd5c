"""Everything of DeepSeek V3.2 attention between the down-projections and the q_b GEMM, as one op.

    fusion_compiler::mla_kv_prologue(
        Tensor? q_c, Tensor? q_weight, float q_eps, int q_quant_group, bool q_ue8m0,
        Tensor? kv_c, Tensor? k_pe, Tensor? kv_weight, float kv_eps, bool deinterleave_rope,
        Tensor? index_k, Tensor? index_k_weight, Tensor? index_k_bias, float index_k_eps,
        Tensor? cos, Tensor? sin, Tensor? positions, Tensor? slots,
        Tensor(a!)? latent_cache, Tensor(b!)? index_cache, bool cache_ue8m0,
        bool return_kv, bool return_index_k, bool round_before_quant, bool q_scale_column_major)
      -> (Tensor q_out, Tensor q_scale, Tensor kv_out, Tensor k_pe_out, Tensor index_k_out)

Three independent roles, each present when its input is given (one CUDA program per token
and role; the horizontal merge in ``patterns/mla_prologue_horizontal.py`` folds sibling sites into one call):

* q role (``q_c`` [T, q_rank]): RMSNorm; with ``q_quant_group`` > 0, FP8 group quant of the
  result, rounded to q_c's dtype first unless ``round_before_quant`` is false (``fp8_quant.py`` contract) for the FP8 q_b GEMM: ``q_out`` fp8, ``q_scale`` fp32
  [T, q_rank / group] (column-major, strides (1, T), as DeepGEMM reads them, with
  ``q_scale_column_major``); else ``q_out`` in q_c's dtype.
* kv role (``kv_c`` [T, kv_rank], ``k_pe`` [T, rot]): RMSNorm of kv_c, interleaved (GPT-J) RoPE
  of k_pe; written at ``slots`` to the paged ``latent_cache`` and/or returned (``return_kv``).
  A cache is any contiguous tensor whose last dim is the row ([blocks, block_size, row] for a
  paged cache, or its [slots, row] view); slot s is row s of ``cache.view(-1, row)``.
  latent_cache is either
  - kv_c's dtype ``[blocks, block_size, kv_rank + rot]``: ``[normed kv_c | roped k_pe]``, any
    kv_rank (the bf16 path: DeepSeek V3's HF code at kv_lora_rank 64 takes it); or
  - uint8 ``[blocks, block_size, kv_rank + 4 * kv_rank / 128 + 2 * rot]`` (vLLM's
    ``fp8_ds_mla``, 656 B/token at real size): kv_rank FP8 bytes, kv_rank / 128 fp32 scales
    (group 128, ue8m0 with ``cache_ue8m0``), then rot bf16 values of roped k_pe.  Only this
    layout needs kv_rank a multiple of 128 (its quant groups); another width is declined.
* index_k role (``index_k`` [T, D]): LayerNorm with bias, NeoX RoPE of the first rot dims;
  written at ``slots`` to ``index_cache`` uint8 ``[blocks, block_size, D + 4]`` as D FP8 bytes
  plus one fp32 scale (one group of D), token-major, and/or returned (``return_index_k``).

RoPE angles: ``cos``/``sin`` are [T, rot/2], or tables [positions, rot/2] read at
``positions``.  ``deinterleave_rope`` gives HF's k_pe output layout (see ``rope.py``); the
cache always stores pairs in place.  A slot of -1 writes nothing.  Absent outputs are empty
tensors of shape [0].  Norm math is fp32 with the weight applied in fp32, rounded once.
"""

from __future__ import annotations

import torch

from . import rope
from ._checks import (
    require_dtype,
    require_last_dim_contiguous,
    require_same_device,
    require_shape,
    require_size_eq,
    require_slots_in_range,
)
from .fp8_quant import FP8_DTYPE, fp8_group_quant_reference, scales_column_major
from .padding_slots import padded_scatter_rows

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LATENT_GROUP = 128

_SCHEMA = (
    "(Tensor? q_c, Tensor? q_weight, float q_eps, int q_quant_group, bool q_ue8m0, "
    "Tensor? kv_c, Tensor? k_pe, Tensor? kv_weight, float kv_eps, bool deinterleave_rope, "
    "Tensor? index_k, Tensor? index_k_weight, Tensor? index_k_bias, float index_k_eps, "
    "Tensor? cos, Tensor? sin, Tensor? positions, Tensor? slots, "
    "Tensor(a!)? latent_cache, Tensor(b!)? index_cache, bool cache_ue8m0, "
    "bool return_kv, bool return_index_k, bool round_before_quant, bool q_scale_column_major) "
    "-> (Tensor q_out, Tensor q_scale, Tensor kv_out, Tensor k_pe_out, Tensor index_k_out)"
)


def latent_cache_width(kv_rank: int, rot: int, dtype: torch.dtype) -> int:
    if dtype == torch.uint8:
        return kv_rank + 4 * (kv_rank // LATENT_GROUP) + 2 * rot
    return kv_rank + rot


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def _validate(args: dict, check_slot_values: bool = False) -> None:
    """check_slot_values: the reference path only (reading values would sync a GPU, and fake
    tensors have none)."""
    q_c, kv_c, k_pe, index_k = args["q_c"], args["kv_c"], args["k_pe"], args["index_k"]
    present = [t for t in (q_c, kv_c, index_k) if t is not None]
    if not present:
        raise ValueError("mla_kv_prologue: no role given (q_c, kv_c and index_k are all None)")
    like = present[0]
    tokens = like.shape[0]
    require_same_device({k: v for k, v in args.items() if isinstance(v, torch.Tensor)}, like)
    if q_c is not None:
        _check_norm_input(q_c, args["q_weight"], "q_c", tokens)
        group = args["q_quant_group"]
        if group < 0 or (group and q_c.shape[-1] % group):
            raise ValueError(f"q_quant_group {group} must be 0 or divide q_c's width {q_c.shape[-1]}")
    elif args["q_quant_group"]:
        raise ValueError("q_quant_group given without q_c")
    uses_rope = kv_c is not None or index_k is not None
    if (kv_c is None) != (k_pe is None):
        raise ValueError("kv_c and k_pe come together (the kv role)")
    if uses_rope:
        _check_rope(args["cos"], args["sin"], args["positions"], tokens)
        rot = 2 * args["cos"].shape[-1]
    if kv_c is not None:
        _check_norm_input(kv_c, args["kv_weight"], "kv_c", tokens)
        require_shape(k_pe, (tokens, rot), "k_pe")
        require_last_dim_contiguous(k_pe, "k_pe")
        require_dtype(k_pe, (kv_c.dtype,), "k_pe")
    if index_k is not None:
        _check_norm_input(index_k, args["index_k_weight"], "index_k", tokens)
        if args["index_k_bias"] is not None:
            require_shape(args["index_k_bias"], (index_k.shape[-1],), "index_k_bias")
        if isinstance(index_k.shape[-1], int) and isinstance(rot, int) and rot > index_k.shape[-1]:
            raise ValueError(f"rotary dims {rot} exceed index_k's width {index_k.shape[-1]}")
    _check_caches(args, tokens, check_slot_values)


def _check_norm_input(x, weight, name: str, tokens) -> None:
    require_dtype(x, ACT_DTYPES, name)
    if x.dim() != 2:
        raise ValueError(f"{name} must be [tokens, width], got shape {tuple(x.shape)}")
    require_size_eq(x.shape[0], tokens, f"{name} tokens")
    require_last_dim_contiguous(x, name)
    if weight is None:
        raise ValueError(f"{name} needs its norm weight")
    require_dtype(weight, ACT_DTYPES, f"{name} weight")
    require_shape(weight, (x.shape[-1],), f"{name} weight")


def _check_rope(cos, sin, positions, tokens) -> None:
    if cos is None or sin is None:
        raise ValueError("the kv and index_k roles need cos and sin")
    for t, name in ((cos, "cos"), (sin, "sin")):
        require_dtype(t, ACT_DTYPES, name)
        if t.dim() != 2:
            raise ValueError(f"{name} must be [rows, rot/2], got shape {tuple(t.shape)}")
        require_last_dim_contiguous(t, name)
    require_shape(sin, (cos.shape[0], cos.shape[1]), "sin")
    if positions is None:
        require_size_eq(cos.shape[0], tokens, "cos rows (one per token without positions)")
    else:
        require_dtype(positions, (torch.int32, torch.int64), "positions")
        require_shape(positions, (tokens,), "positions")


def _check_caches(args: dict, tokens, check_slot_values: bool) -> None:
    latent, index, slots = args["latent_cache"], args["index_cache"], args["slots"]
    if latent is None and index is None:
        if slots is not None:
            raise ValueError("slots given without a cache")
        return
    if slots is None:
        raise ValueError("a cache write needs slots")
    require_dtype(slots, (torch.int32, torch.int64), "slots")
    require_shape(slots, (tokens,), "slots")
    if latent is not None:
        kv_c, k_pe = args["kv_c"], args["k_pe"]
        if kv_c is None:
            raise ValueError("latent_cache given without the kv role")
        if not latent.is_contiguous():
            raise ValueError(f"latent_cache must be contiguous, got strides {latent.stride()}")
        require_dtype(latent, (kv_c.dtype, torch.uint8), "latent_cache")
        if latent.dtype == torch.uint8 and kv_c.dtype != torch.bfloat16:
            raise ValueError("the fp8_ds_mla latent cache stores k_pe as bf16: kv_c must be bf16")
        if latent.dtype == torch.uint8 and kv_c.shape[-1] % LATENT_GROUP:
            raise ValueError(
                f"the latent kv_c is {kv_c.shape[-1]} wide (kv_lora_rank), not a multiple of {LATENT_GROUP}: "
                f"the FP8 fp8_ds_mla cache layout quantises it in {LATENT_GROUP}-wide groups"
            )
        width = latent_cache_width(kv_c.shape[-1], k_pe.shape[-1], latent.dtype)
        _check_cache_rows(latent, width, slots, "latent_cache", check_slot_values)
    if index is not None:
        index_k = args["index_k"]
        if index_k is None:
            raise ValueError("index_cache given without the index_k role")
        if not index.is_contiguous():
            raise ValueError(f"index_cache must be contiguous, got strides {index.stride()}")
        require_dtype(index, (torch.uint8,), "index_cache")
        _check_cache_rows(index, index_k.shape[-1] + 4, slots, "index_cache", check_slot_values)


def _check_cache_rows(cache: torch.Tensor, width, slots: torch.Tensor, name: str, check_slot_values: bool) -> None:
    if cache.dim() < 2:
        raise ValueError(f"{name} must be [..., slots, row], got shape {tuple(cache.shape)}")
    require_size_eq(cache.shape[-1], width, f"{name} row width")
    rows = 1
    for size in cache.shape[:-1]:
        rows = rows * size
    if check_slot_values and isinstance(rows, int):
        require_slots_in_range(slots, rows)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps) * weight.float()


def _layer_norm(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    centred = h - mean
    out = centred * torch.rsqrt((centred * centred).mean(-1, keepdim=True) + eps) * weight.float()
    return out + bias.float() if bias is not None else out


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    keep = slots >= 0
    cache.view(-1, cache.shape[-1])[slots[keep].long()] = rows[keep]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def latent_cache_rows(kv: torch.Tensor, k_pe: torch.Tensor, cache_dtype: torch.dtype, ue8m0: bool, exact: bool = True) -> torch.Tensor:
    """The cache row of each token (see the module docstring for the two layouts)."""
    if cache_dtype != torch.uint8:
        return torch.cat([kv, k_pe], dim=-1).to(cache_dtype)
    y, scale = fp8_group_quant_reference(kv, LATENT_GROUP, ue8m0, exact)
    return torch.cat([_bytes(y), _bytes(scale), _bytes(k_pe.to(torch.bfloat16))], dim=-1)


def index_cache_rows(k: torch.Tensor, ue8m0: bool, exact: bool = True) -> torch.Tensor:
    y, scale = fp8_group_quant_reference(k, k.shape[-1], ue8m0, exact)
    return torch.cat([_bytes(y), _bytes(scale)], dim=-1)


def mla_kv_prologue_reference(
    q_c=None, q_weight=None, q_eps=1e-6, q_quant_group=0, q_ue8m0=False,
    kv_c=None, k_pe=None, kv_weight=None, kv_eps=1e-6, deinterleave_rope=False,
    index_k=None, index_k_weight=None, index_k_bias=None, index_k_eps=1e-6,
    cos=None, sin=None, positions=None, slots=None,
    latent_cache=None, index_cache=None, cache_ue8m0=False,
    return_kv=True, return_index_k=True, round_before_quant=True, q_scale_column_major=False,
):  # fmt: skip
    """Plain torch, any device; mutates the caches like the op."""
    args = dict(locals())
    _validate(args, check_slot_values=True)
    return _prologue(args, _write_rows, exact=True)


def mla_kv_prologue_canonical(**kwargs):
    """The same math as a functional graph Inductor fuses (lowering "inductor"): returns the
    op's five outputs, then the new latent and index caches (None where absent), like
    ``auto_functionalized`` does. Padding slots (-1) write the first live row's slot with its own row (ops/padding_slots.py)."""
    args = {**DEFAULTS, **kwargs}
    _validate(args)
    written = {}

    def write(cache, slots, rows):
        flat = cache.reshape(-1, cache.shape[-1])
        targets, rows = padded_scatter_rows(slots, rows, lambda t: flat[t])
        written[id(cache)] = torch.ops.aten.index_put.default(flat, [targets], rows).reshape(cache.shape)

    outs = _prologue(args, write, exact=False)
    return (*outs, written.get(id(args["latent_cache"])), written.get(id(args["index_cache"])))


def _prologue(args: dict, write, exact: bool):
    a = args
    q_c, kv_c, k_pe, index_k = a["q_c"], a["kv_c"], a["k_pe"], a["index_k"]
    latent_cache, index_cache, slots = a["latent_cache"], a["index_cache"], a["slots"]
    like = next(t for t in (q_c, kv_c, index_k) if t is not None)
    # Distinct empties: a custom op's outputs may not alias each other.
    q_out, q_scale, kv_out, k_pe_out, index_k_out = (like.new_empty(0) for _ in range(5))
    if q_c is not None:
        normed = _rms(q_c, a["q_weight"], a["q_eps"])
        if a["q_quant_group"]:
            # Model code rounds the norm's output to q_c's dtype, then quantizes it; torch 2.11's
            # Inductor drops that round trip (round_before_quant=False follows its graph).
            q_out, q_scale = fp8_group_quant_reference(
                normed.to(q_c.dtype) if a["round_before_quant"] else normed, a["q_quant_group"], a["q_ue8m0"], exact
            )
            if a["q_scale_column_major"]:
                q_scale = scales_column_major(q_scale)
        else:
            q_out = normed.to(q_c.dtype)
    if kv_c is not None or index_k is not None:
        cos_t, sin_t = rope.cos_sin_for_tokens(a["cos"], a["sin"], a["positions"])
    if kv_c is not None:
        kv32 = _rms(kv_c, a["kv_weight"], a["kv_eps"])
        kv = kv32.to(kv_c.dtype)
        pe = rope.rope_interleaved_reference(k_pe, cos_t, sin_t)
        if latent_cache is not None:
            quantized = kv if a["round_before_quant"] or latent_cache.dtype != torch.uint8 else kv32
            write(latent_cache, slots, latent_cache_rows(quantized, pe, latent_cache.dtype, a["cache_ue8m0"], exact))
        if a["return_kv"]:
            kv_out = kv
            k_pe_out = rope.rope_interleaved_reference(k_pe, cos_t, sin_t, a["deinterleave_rope"])
    if index_k is not None:
        rot = 2 * cos_t.shape[-1]
        k = _layer_norm(index_k, a["index_k_weight"], a["index_k_bias"], a["index_k_eps"]).to(index_k.dtype)
        k = torch.cat([rope.rope_neox_reference(k[:, :rot], cos_t, sin_t), k[:, rot:]], dim=-1)
        if index_cache is not None:
            write(index_cache, slots, index_cache_rows(k, a["cache_ue8m0"], exact))
        if a["return_index_k"]:
            index_k_out = k
    return q_out, q_scale, kv_out, k_pe_out, index_k_out


# --------------------------------------------------------------------------------------------
# Custom op
# --------------------------------------------------------------------------------------------

_ARG_NAMES = (
    "q_c", "q_weight", "q_eps", "q_quant_group", "q_ue8m0",
    "kv_c", "k_pe", "kv_weight", "kv_eps", "deinterleave_rope",
    "index_k", "index_k_weight", "index_k_bias", "index_k_eps",
    "cos", "sin", "positions", "slots", "latent_cache", "index_cache", "cache_ue8m0",
    "return_kv", "return_index_k", "round_before_quant", "q_scale_column_major",
)  # fmt: skip


# Every argument's default (the reference's): what a call that names only its roles passes.
DEFAULTS = dict(zip(_ARG_NAMES, mla_kv_prologue_reference.__defaults__))


def output_shapes(args: dict):
    """(shape, dtype) of each output; shape (0,) for an absent one."""
    q_c, kv_c, k_pe, index_k = args["q_c"], args["kv_c"], args["k_pe"], args["index_k"]
    like = next(t for t in (q_c, kv_c, index_k) if t is not None)
    none = ((0,), like.dtype)
    q_out = q_scale = kv_out = k_pe_out = index_k_out = none
    if q_c is not None:
        group = args["q_quant_group"]
        if group:
            q_out = (tuple(q_c.shape), FP8_DTYPE)
            q_scale = ((q_c.shape[0], q_c.shape[1] // group), torch.float32)
        else:
            q_out = (tuple(q_c.shape), q_c.dtype)
    if kv_c is not None and args["return_kv"]:
        kv_out, k_pe_out = (tuple(kv_c.shape), kv_c.dtype), (tuple(k_pe.shape), k_pe.dtype)
    if index_k is not None and args["return_index_k"]:
        index_k_out = (tuple(index_k.shape), index_k.dtype)
    return q_out, q_scale, kv_out, k_pe_out, index_k_out


def _allocate(named: dict, empty) -> tuple:
    """Outputs as the op returns them: q_scale column-major when asked."""
    outs = []
    for i, (shape, dtype) in enumerate(output_shapes(named)):
        if i == 1 and named["q_scale_column_major"] and len(shape) == 2:
            outs.append(empty((shape[1], shape[0]), dtype).t())
        else:
            outs.append(empty(shape, dtype))
    return tuple(outs)


@torch.library.custom_op(
    "fusion_compiler::mla_kv_prologue", mutates_args=("latent_cache", "index_cache"), schema=_SCHEMA
)
def _op(*args):
    return mla_kv_prologue_reference(*args)


@_op.register_fake
def _fake(*args):
    named = dict(zip(_ARG_NAMES, args))
    _validate(named)
    like = next(t for t in (named["q_c"], named["kv_c"], named["index_k"]) if t is not None)
    return _allocate(named, lambda shape, dtype: like.new_empty(shape, dtype=dtype))


@_op.register_kernel("cuda")
def _cuda(*args):
    from fusion_compiler.kernels.mla_kv_prologue import mla_kv_prologue_fwd

    named = dict(zip(_ARG_NAMES, args))
    _validate(named)
    like = next(t for t in (named["q_c"], named["kv_c"], named["index_k"]) if t is not None)
    outs = _allocate(named, lambda shape, dtype: torch.empty(shape, dtype=dtype, device=like.device))
    mla_kv_prologue_fwd(named, *outs)
    return outs


def mla_kv_prologue(**kwargs):
    """Keyword front end of ``torch.ops.fusion_compiler.mla_kv_prologue`` with the reference's defaults."""
    unknown = set(kwargs) - set(_ARG_NAMES)
    if unknown:
        raise TypeError(f"unknown arguments {sorted(unknown)}")
    args = {**DEFAULTS, **kwargs}
    return torch.ops.fusion_compiler.mla_kv_prologue(*(args[n] for n in _ARG_NAMES))
