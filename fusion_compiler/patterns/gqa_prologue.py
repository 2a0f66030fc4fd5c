"""GQA attention prologue: q/k RMSNorm (or none) + partial NeoX (or GPT-J) RoPE + the K/V cache
write, one site per attention layer (MiniMax-M2.5, Qwen3.5's full-attention layers, Qwen3-MoE,
GLM-4-MoE, Mixtral, Qwen2-MoE, GLM-4, Helium, ERNIE-4.5, Cohere / Cohere2, OLMo-2 / OLMo-3,
Gemma-3, Apertus, EXAONE-4) -> ``gqa_prologue``.

Four norms, each as its model writes it, and none:

* ``minimax``: HF's ``MiniMaxM2RMSNorm`` over the **whole** q and k projections (6144 and 1024
  wide), then the head split;
* ``olmo``: HF's ``Olmo2RMSNorm`` over the whole projections, ``(w * x·rstd).to(dtype)`` (one
  rounding, where MiniMax's rounds x·rstd first), before RoPE on OLMo's fp32 cos / sin (its
  rotary embedding does not cast them: fp32 products, ``.to(q_type)``; ``_fp32``);
* ``qwen``: the Gemma ``x * (1 + w)`` norm per head, on q taken out of each head's
  [q | gate] row (the gate stays outside: ``* sigmoid(gate)`` after attention);
* ``per_head``: HF's plain ``weight * (x * rstd).to(dtype)`` per head, weight [D]
  (``Qwen3MoeRMSNorm``, ``Glm4MoeRMSNorm`` with ``use_qk_norm``), in HF's layout only: full
  RoPE (Qwen3-MoE) or partial (GLM-4-MoE, half the head). ``_transposed_norm`` (``qwen`` and
  ``per_head``): the per-head norm run on the heads after their transpose, [B, heads, S, D]
  (Gemma-3's Gemma norm; Apertus' and EXAONE-4's plain one);
* ``none``: no q/k norm, the projections' head views RoPE'd as they are (HF's Mixtral,
  Qwen2-MoE, Llama: full RoPE; GLM-4-MoE with its default ``use_qk_norm=False``: half the head),
  in HF's layout only. Its pattern begins at RoPE, so it would also fit a normed attention with
  the norm left outside: these variants come after every normed one, and the guard declines a q
  or k with an RMS norm in front (the normed variants' reasons stand). ``none.hf*_gptj``: GPT-J's
  interleaved pairs as HF's GLM / GLM-4 write them (``rotate_half`` stacking (-x[..., 1::2],
  x[..., 0::2]) pair by pair, cos / sin's first half ``repeat_interleave``d) over half the head
  (GLM-4) or all of it (Helium); the op's ``interleaved_rope``. ``none.hf_full_rope_gptj_fp32``:
  ERNIE-4.5's spelling of those pairs over the whole head, turned in fp32 (``x.float() * cos +
  rotate_half(x).float() * sin`` on its rotary embedding's fp32 cos / sin, then
  ``.to(original_dtype)``): ``interleaved_rope`` without ``round_rope_products``, one rounding, so
  eager's bits (no HF model writes it on part of the head). ``none.hf_full_rope_gptj_fp32_upcast``:
  Cohere's (and Cohere2's) spelling of the same math: q, k upcast first, ``rotate_half`` of the
  upcast, times cos / sin in the activation dtype that its rotary embedding repeated pairwise
  before the cos (``repeat_interleave(freqs, 2)``), ``.to(dtype)``; the op reads every other lane
  of them (bf16 upcast is exact, and so is taking the pairs before or after it), eager's bits.
  ``none.hf*_full_rope_chunk``:
  gpt-oss's ``_apply_rotary_emb``, NeoX halves written out on ``torch.chunk``'s halves, ``cat((x1
  * cos - x2 * sin, x2 * cos + x1 * sin))`` with cos / sin half as wide as the head: rounding
  point for rounding point HF's ``rotate_half`` spelling (each bf16 product rounded, then the add;
  ``a - b`` is ``a + (-b)``, the negation exact), so the same op and kernel, its bits.

Two layouts, each as its code writes it:

* ``hf``: HF transformers: heads transposed to [B, H, S, D], RoPE ``x * cos + rotate_half(x) *
  sin`` on the first ``cos.shape[-1]`` dims in the activation dtype (``hf_full_rope``: on all of
  them, as HF's default ``MiniMaxM2Config`` without ``partial_rotary_factor`` has it; the
  post-grad graph then has no slice and no cat around the rotation), the static cache written
  by ``index_copy_`` along the sequence dim (an ``index_put`` with ``[None, None, position]``
  post-grad). cos / sin are [B, S, D] (per-row position_ids) or [1, S, D] (HF's default,
  broadcast over the batch); the op reads either. ``hf_flat``: the same code under HF's
  continuous batching (``generate_batch``): one packed sequence [1, T], the cache flat [slots,
  kv_heads, D] and written by ``index_copy_(0, slots, k.transpose(1, 2).squeeze(0))`` (an
  ``index_put`` at ``[slots]``), then read back by ``index_select`` (the replacement's new cache
  feeds that read and the graph's final ``copy_``). Flat forms exist of HF's NeoX RoPE after a
  per-head norm (plain or Gemma) or none, gpt-oss's written-out halves, and ERNIE-4.5's and
  Cohere's fp32 GPT-J pairs (``none.hf_flat_full_rope_gptj_fp32[_upcast]``), each built from its
  static-cache search with ``cache="flat"``. Padding tokens all write one trash slot, which HF
  never reads; the op writes it with one of their rows, as ``index_copy_`` does;
* ``paged``: a serving engine (model_adapters/reference/<model>.py, vLLM's forward_native):
  [T, H, D], NeoX RoPE in fp32 with one rounding, cos / sin halves of a ``cos_sin_cache``
  gathered at the positions, K and V written into a paged cache at flat slots, bf16 or FP8 with
  a per-tensor scale.

Tensor parallelism (``minimax.paged_tp_*``): each rank holds a share of the heads, and the
full-width norm's mean of squares is global: the local means are all-reduced (vLLM's
``MiniMaxText01RMSNormTP``; model_adapters/reference/minimax_m2.py's ``rms_norm_tp``). The
all-reduce stays in the graph; these variants match the side after it, taking the global
variance as an input, and the guard follows that input back: ``wait_tensor(all_reduce(local,
"sum", group)) / world`` (a column of it when q and k share one [T, 2] all-reduce), the local
part being the mean of squares of the same q (or k). patterns/gqa_prologue_tp_variance.py then folds the
division into the op and fuses the two local means before the all-reduce into one op.

The op rounds where each spelling rounds (its ``round_normalized`` / ``round_rope_products``):
MiniMax's norm rounds ``x * rstd`` before the weight multiply, HF's RoPE every bf16 product (with
no norm, of the projection's bf16 rows), so
a fused model keeps eager's bits and its greedy tokens. Patterns are traced in bf16 and fp32 (an
fp32 graph has no casts, so the bf16 trace does not fit it); other float widths meet the bf16
trace, and the op's dtypes decide (float64: a reported miss).

The site's anchor is the K-cache write whose rows are ``cat([rope(..), pass-through])``, or
HF's rotation itself (full RoPE) written to HF's static or flat cache, or after a q/k norm. A plain
attention with no RoPE, or no cache write, has no site.
Inductor's tracer turns ints and floats into wildcards, so the guard reads what they hid from
the matched nodes: the RoPE's slice points (NeoX halves or GPT-J pairs, as the variant says), the
dims of a pairwise repeat (``repeat_interleave`` and ``cat([x, x])`` trace alike but for one int;
Cohere's lies before the cos, outside the match, and is read back from cos / sin), the norm's
width and Gemma's offset, the cast an FP8 write rounds to, whether a no-norm match has a norm in
front (a LayerNorm, Cohere's ``use_qk_norm``, named as one). Not fused, said in words: GPT-J pairs
after a q/k norm, in another spelling (bf16 products otherwise than GLM-4's, an fp32 turn otherwise
than ERNIE-4.5's and Cohere's) or turned by cos / sin not repeated pairwise, no norm written to a
paged cache (serving code), a q/k norm after the RoPE (HunYuan: in HF's caches a site, its rows a
norm's), k scaled before its RoPE (Falcon-H1's key_multiplier), NeoX halves written out otherwise
than gpt-oss's ``_apply_rotary_emb`` (in HF's caches a site), MLA's decoupled RoPE key
(MiniCPM3), and a norm and RoPE that no one variant takes together.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from typing import Any

import torch

from .. import _compat
from ..ops import gqa_prologue as gqa_ops
from . import add_rms_norm, mla_prologue
from ..fx.graph_walk import downstream, is_pair_slice, upstream, val_shape, walk
from .registry import Family, Reason, Variant
from .spellings import FP8, write_rows

aten = torch.ops.aten
prims = torch.ops.prims

_EPS = 1.2345e-6
_K_SCALE, _V_SCALE = 0.3456, 0.4567
_NO_END = 2**63 - 1  # a slice to the end

# ------------------------------------------------------------------------------------------
# Model-code spellings
# ------------------------------------------------------------------------------------------


def normed_heads(x, weight, eps, norm: str, layout: str, head_dim):
    """q or k after its norm, as [..., heads, D]. The head split is spelled as each layout's
    code writes it (a dynamic token count keeps its -1 where the code put it)."""
    if norm == "qwen":  # per head: x is [..., heads, D] already
        return add_rms_norm.gemma(x, weight, eps)
    if norm == "per_head":  # Qwen3-MoE, GLM-4-MoE: HF's plain norm on [..., heads, D]
        return add_rms_norm.hf(x, weight, eps)
    if norm == "olmo":  # OLMo-2 / OLMo-3: the whole projection, w * x·rstd in fp32, one rounding
        return split_heads(add_rms_norm.deepseek(x, weight, eps), layout, head_dim)
    normed = add_rms_norm.hf(x, weight, eps)  # MiniMax: the whole projection, then the split
    return split_heads(normed, layout, head_dim)


def normed_tp(x, weight, variance, eps):
    """A tensor-parallel full-width norm after its all-reduce (``rms_norm_tp``): the global mean
    of squares comes in; HF-style rounding (cast, then times the weight shard)."""
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def split_heads(x, layout: str, head_dim):
    if layout == "hf":  # HF: x.view(*input_shape, -1, head_dim)
        return x.view(*x.shape[:-1], -1, head_dim)
    return x.view(-1, x.shape[-1] // head_dim, head_dim)  # serving code: view(-1, heads, D)


def rope_partial_hf(x, cos, sin):
    """HF ``apply_rotary_pos_emb`` (MiniMax-M2, Qwen3.5): rotate-half on the first
    ``cos.shape[-1]`` dims (cos / sin unsqueezed over heads), the rest passed through."""
    rot = cos.shape[-1]
    return torch.cat([mla_prologue.rope_halves_hf(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)


def rope_full_hf(x, cos, sin):
    """HF ``apply_rotary_pos_emb`` with cos / sin as wide as the head: its ``x[..., :D]`` and
    the empty pass-through are gone from the post-grad graph."""
    return mla_prologue.rope_halves_hf(x, cos, sin)


def rope_chunk_hf(x, cos, sin):
    """gpt-oss's ``_apply_rotary_emb``: NeoX halves written out on ``torch.chunk``'s halves, cos /
    sin half as wide as the head (not duplicated). Rounding point for rounding point HF's
    ``x * cos + rotate_half(x) * sin``: each bf16 product rounded, then the add (``a - b`` is
    ``a + (-b)``, and the negation is exact)."""
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def rotate_pairs_hf(x):
    """HF GLM / GLM-4's ``rotate_half``: GPT-J pairs (x[2i], x[2i + 1]) -> (-x[2i + 1], x[2i])."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def pair_angles_hf(cos):
    """HF GLM / GLM-4: cos (sin) ``cat(freqs, freqs)``, its first half repeated pairwise."""
    return cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)


def rope_pairs_partial_hf(x, cos, sin):
    """HF GLM / GLM-4 ``apply_rotary_pos_emb`` after its cos / sin ``pair_angles_hf``: GPT-J
    pairs on the first ``cos.shape[-1]`` dims, the rest passed through."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_pairs_hf(x_rot) * sin, x_pass], dim=-1)


def rope_pairs_full_hf(x, cos, sin):
    """GPT-J pairs over the whole head (GLM with partial_rotary_factor 1, Helium): no slice, no
    pass-through."""
    return x * cos + rotate_pairs_hf(x) * sin


def rope_pairs_full_fp32_hf(x, cos, sin):
    """HF ERNIE-4.5's ``apply_rotary_pos_emb``: GPT-J pairs over the whole head, turned in fp32
    (``x.float() * cos + rotate_half(x).float() * sin``, the pairs stacked in x's dtype, cos / sin
    fp32 as its rotary embedding keeps them); the caller rounds once (``.to(original_dtype)``)."""
    return x.float() * cos + rotate_pairs_hf(x).float() * sin


def rope_pairs_full_upcast_hf(x, cos, sin):
    """HF Cohere's ``apply_rotary_pos_emb``: x upcast first (``q.float()``), GPT-J pairs of the
    upcast over the whole head (``rotate_half`` of the fp32 x), times cos / sin as its rotary
    embedding hands them over: in x's dtype, the angles repeated pairwise before the cos
    (``repeat_interleave(freqs, 2)``); the caller rounds once (``.to(dtype)``)."""
    x = x.float()
    return x * cos + rotate_pairs_hf(x) * sin


def rope_partial_fp32(x, cos, sin):
    """vLLM's NeoX ``forward_native`` on the first ``2 * cos.shape[-1]`` dims of x [T, H, D]:
    fp32, one rounding (model_adapters/reference/paged_kv.py's ``rope_neox_partial``)."""
    half = cos.shape[-1]
    first, second = x[..., :half].float(), x[..., half : 2 * half].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([first * c - second * s, second * c + first * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half :]], dim=-1)


def fp8_rows(rows, scale):
    """vLLM's per-tensor ``fp8`` KV cache: value / scale, saturated, rounded to e4m3."""
    return (rows.float() / scale).clamp(-448.0, 448.0).to(FP8)


def _paged_rows(q, k, v, cos, sin, k_cache, v_cache, slots, cache: str, k_scale, v_scale):
    """A serving engine's tail: fp32 NeoX RoPE on normed q, k [T, H, D], K and V written at the
    slots (FP8: scaled)."""
    q, k = rope_partial_fp32(q, cos, sin), rope_partial_fp32(k, cos, sin)
    # v's head split belongs to the site: without it the V write's pattern would also fit
    # the K write (any rows), and the matcher would bind both to it.
    v = split_heads(v, "paged", k_cache.shape[-1])
    if cache == "fp8":
        k, v = fp8_rows(k, k_scale), fp8_rows(v, v_scale)
    return q, write_rows(k_cache, slots, k), write_rows(v_cache, slots, v)


def _hf_rows(q, k, v, cos, sin, k_cache, v_cache, where, rotary: str, rope: str = "neox", cache: str = "bf16",
             transposed_norm: bool = False, rope_fp32: bool = False, upcast: bool = False):  # fmt: skip
    """HF's tail on q, k, v [B, S, heads, D]: heads transposed, RoPE in the activation dtype
    (NeoX halves, or GPT-J pairs as GLM-4 writes them), the static cache written at the
    positions ``where`` (``index_copy_`` along the sequence dim), or with ``cache="flat"``
    continuous batching's flat cache [slots, kv_heads, D] at the slots ``where``
    (``cache.index_copy_(0, slots, k.transpose(1, 2).squeeze(0))``, batch 1: its tokens packed;
    v is then the projection [1, S, kv_heads * D]). ``transposed_norm``: q, k come transposed
    already (their per-head norm ran on [B, heads, S, D], as Gemma-3 writes it). ``rope_fp32``:
    cos / sin come in fp32 (OLMo-2's rotary embedding does not cast them), so the products are
    fp32 and the rotated rows are rounded once (``.to(q_type)``); with GPT-J pairs, ERNIE-4.5's
    explicit ``.float()`` casts (full RoPE only: no HF model writes it on part of the head), or
    with ``upcast`` Cohere's: q, k upcast before their pairs, cos / sin repeated pairwise already."""
    if rope == "gptj" and upcast:
        rope_hf = rope_pairs_full_upcast_hf
    elif rope == "gptj" and rope_fp32:
        rope_hf = rope_pairs_full_fp32_hf
    elif rope == "gptj":
        rope_hf = rope_pairs_full_hf if rotary == "full" else rope_pairs_partial_hf
    elif rope == "chunk":  # gpt-oss: full RoPE only
        rope_hf = rope_chunk_hf
    else:
        rope_hf = rope_full_hf if rotary == "full" else rope_partial_hf
    flat = cache == "flat"
    # Flat: v's head split belongs to the site (without it V's write, rows squeezed, would also
    # fit K's, and the matcher would bind both to it). HF transposes v's heads twice, before
    # attention and before the write; the post-grad graph has neither.
    v_rows = split_heads(v, "hf", k_cache.shape[-1]).squeeze(0) if flat else v.transpose(1, 2)
    if not transposed_norm:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if rope == "gptj" and not upcast:  # Cohere's rotary embedding repeats them before the cos
        cos, sin = pair_angles_hf(cos), pair_angles_hf(sin)
    dtype = q.dtype
    q, k = rope_hf(q, cos, sin), rope_hf(k, cos, sin)
    if rope_fp32:
        q, k = q.to(dtype), k.to(dtype)
    if flat:
        k_cache = aten.index_put.default(k_cache, [where], k.transpose(1, 2).squeeze(0))
        return q, k_cache, aten.index_put.default(v_cache, [where], v_rows)
    k_cache = aten.index_put.default(k_cache, [None, None, where], k)
    v_cache = aten.index_put.default(v_cache, [None, None, where], v_rows)
    return q, k_cache, v_cache


def _search(norm: str, layout: str, cache: str, rotary: str = "partial", transposed_norm: bool = False,
            rope_fp32: bool = False):  # fmt: skip
    def prologue(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps, k_scale=1.0, v_scale=1.0):
        head_dim = k_cache.shape[-1]
        if transposed_norm:  # Gemma-3, Apertus, EXAONE-4: the per-head norm after the heads' transpose
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = normed_heads(q, q_weight, eps, norm, layout, head_dim)
        k = normed_heads(k, k_weight, eps, norm, layout, head_dim)
        if layout == "hf":  # where: the cache positions (static cache) or slots (flat)
            return _hf_rows(q, k, v, cos, sin, k_cache, v_cache, where, rotary, cache=cache, transposed_norm=transposed_norm,
                            rope_fp32=rope_fp32)  # fmt: skip
        return _paged_rows(q, k, v, cos, sin, k_cache, v_cache, where, cache, k_scale, v_scale)  # where: the slots

    if cache != "fp8":  # no scale arguments to trace

        def prologue_bf16(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps):
            return prologue(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps)

        return prologue_bf16
    return prologue


def _search_no_norm(rotary: str, rope: str, cache: str, rope_fp32: bool = False, upcast: bool = False):
    """HF's attention without q/k norms (Mixtral, Qwen2-MoE, Llama; GLM-4-MoE without
    ``use_qk_norm``; GLM-4's GPT-J pairs; ERNIE-4.5's, ``rope_fp32``; Cohere's, ``upcast``): q, k,
    v [B, S, heads, D] are the projections' head views, RoPE'd as they are."""

    def prologue_no_norm(q, k, v, cos, sin, k_cache, v_cache, where):
        return _hf_rows(q, k, v, cos, sin, k_cache, v_cache, where, rotary, rope, cache, rope_fp32=rope_fp32,
                        upcast=upcast)  # fmt: skip

    return prologue_no_norm


def _search_tp(cache: str):
    """MiniMax under tensor parallelism, after the all-reduce: q_var, k_var are the global means
    of squares (the all-reduce's output, divided by the world size)."""

    def prologue_tp(q, k, v, q_weight, k_weight, q_var, k_var, cos, sin, k_cache, v_cache, where, eps,
                    k_scale=1.0, v_scale=1.0):  # fmt: skip
        head_dim = k_cache.shape[-1]
        q = split_heads(normed_tp(q, q_weight, q_var, eps), "paged", head_dim)
        k = split_heads(normed_tp(k, k_weight, k_var, eps), "paged", head_dim)
        return _paged_rows(q, k, v, cos, sin, k_cache, v_cache, where, cache, k_scale, v_scale)

    if cache != "fp8":

        def prologue_tp_bf16(q, k, v, q_weight, k_weight, q_var, k_var, cos, sin, k_cache, v_cache, where, eps):
            return prologue_tp(q, k, v, q_weight, k_weight, q_var, k_var, cos, sin, k_cache, v_cache, where, eps)

        return prologue_tp_bf16
    return prologue_tp


def _variant(norm: str, layout: str, cache: str = "bf16", tp: bool = False, rotary: str = "partial",
             rope: str = "neox", transposed_norm: bool = False, rope_fp32: bool = False,
             upcast: bool = False) -> Variant:  # fmt: skip
    name = f"{norm}.{layout}" + ("_transposed_norm" if transposed_norm else "") + ("_tp" if tp else "")
    name += f"_{cache}" if layout == "paged" or cache == "flat" else ""
    name += ("_full_rope" if rotary == "full" else "") + (f"_{rope}" if rope != "neox" else "")  # gptj, chunk
    name += ("_fp32" if rope_fp32 else "") + ("_upcast" if upcast else "")
    if norm == "none":
        search = _search_no_norm(rotary, rope, cache, rope_fp32, upcast)
    else:
        search = _search_tp(cache) if tp else _search(norm, layout, cache, rotary, transposed_norm, rope_fp32)
    params = {"norm": norm, "layout": layout, "cache": cache, "tp": tp, "rotary": rotary, "rope": rope,
              "transposed_norm": transposed_norm, "rope_fp32": rope_fp32, "upcast": upcast}  # fmt: skip
    return Variant(name, search, params)


# The tensor-parallel variants come after the single-rank ones: a single-rank graph never reaches
# them (its upcast also feeds the local mean, a user outside their pattern), and a TP graph never
# fits the others. Full RoPE: HF's spelling only (serving code ropes part of each head for both
# models). The per-head plain norm: HF's code only (Qwen3-MoE full, GLM-4-MoE partial RoPE); no
# serving reference of ours writes it. No norm comes last, HF's code only: its pattern begins at
# RoPE, so it also fits a normed attention whose norm another variant declined; every normed
# variant is tried first, and its guard declines a q or k with a norm in front (``_no_norm_reason``).
# GPT-J pairs: HF's GLM-4 (partial) and Helium (full), and the fp32 turns of ERNIE-4.5 and
# Cohere (full), all without q/k norms. HF's continuous batching (``hf_flat``): the same HF code,
# its flat cache written at slots: NeoX RoPE with per-head norms (plain or Gemma) or none, and
# without norms gpt-oss's written-out halves and ERNIE-4.5's and Cohere's fp32 GPT-J pairs.
_FLAT_NORMED = tuple(_variant(norm, "hf", "flat", rotary=rotary) for norm in ("per_head", "qwen")
                     for rotary in ("partial", "full"))  # fmt: skip
VARIANTS = (
    tuple(
        _variant(norm, layout, cache)
        for norm in ("minimax", "qwen")
        for layout, cache in (("paged", "fp8"), ("paged", "bf16"), ("hf", "bf16"))
    )
    + tuple(_variant(norm, "hf", rotary="full") for norm in ("minimax", "qwen"))
    + (_variant("per_head", "hf"), _variant("per_head", "hf", rotary="full"))
    + tuple(_variant(norm, "hf", rotary=rotary, transposed_norm=True) for norm in ("per_head", "qwen")
            for rotary in ("partial", "full"))
    + (_variant("olmo", "hf", rope_fp32=True), _variant("olmo", "hf", rotary="full", rope_fp32=True))
    + tuple(_variant("minimax", "paged", cache, tp=True) for cache in ("fp8", "bf16"))
    + _FLAT_NORMED
    + (_variant("none", "hf"), _variant("none", "hf", rotary="full"))
    + (_variant("none", "hf", "flat"), _variant("none", "hf", "flat", rotary="full"))
    + tuple(_variant("none", "hf", cache, rotary=rotary, rope="gptj") for rotary in ("partial", "full")
            for cache in ("bf16", "flat"))
    + tuple(_variant("none", "hf", cache, rotary="full", rope="gptj", rope_fp32=True, upcast=upcast)
            for upcast in (False, True) for cache in ("bf16", "flat"))
    + tuple(_variant("none", "hf", cache, rotary="full", rope="chunk") for cache in ("bf16", "flat"))
)

# The norms over the whole q and k projections: MiniMax's rounds x·rstd before its weight multiply,
# OLMo's multiplies in fp32 and rounds once (in fp32 models the two are one graph: MiniMax's fits).
_FULL_WIDTH = ("minimax", "olmo")

# ------------------------------------------------------------------------------------------
# Example inputs (tiny, real structure: partial RoPE, GQA)
# ------------------------------------------------------------------------------------------

# fp32: an fp32 graph has none of the casts the bf16 trace holds. fp16 fits the bf16 trace.
DTYPE_COMBOS = ((torch.bfloat16,), (torch.float32,))
_T, _HQ, _HKV, _D, _ROT, _BLOCKS, _BS = 2, 4, 2, 16, 8, 3, 4


def example_inputs(variant: Variant, combo) -> list:
    (act,) = combo
    p = variant.params

    def r(*shape, dtype=act):
        return torch.randn(*shape, dtype=dtype)

    lead = (1, _T) if p["layout"] == "hf" else (_T,)
    rot = _D if p["rotary"] == "full" else _ROT
    angles = rot // 2 if p["rope"] == "chunk" else rot  # gpt-oss: half-width cos / sin
    # HF's static cache [1, kv_heads, len, D], or continuous batching's flat one [slots, kv_heads, D]
    hf_cache = (_BLOCKS * _BS, _HKV, _D) if p["cache"] == "flat" else (1, _HKV, _BLOCKS * _BS, _D)
    # v: HF's head view [B, S, kv_heads, D] (static cache), else the projection [..., kv_heads * D]
    v_shape = (*lead, _HKV, _D) if p["layout"] == "hf" and p["cache"] != "flat" else (*lead, _HKV * _D)
    if p["norm"] == "none":  # HF's layout only; ERNIE-4.5's cos / sin fp32 (Cohere's in act)
        q, k, v = r(*lead, _HQ, _D), r(*lead, _HKV, _D), r(*v_shape)
        cos_dtype = torch.float32 if p["rope_fp32"] and not p["upcast"] else act
        cos, sin = r(1, _T, angles, dtype=cos_dtype), r(1, _T, angles, dtype=cos_dtype)
        return [q, k, v, cos, sin, r(*hf_cache), r(*hf_cache), torch.arange(_T)]
    if p["norm"] in _FULL_WIDTH:
        q, k, qw, kw = r(*lead, _HQ * _D), r(*lead, _HKV * _D), r(_HQ * _D), r(_HKV * _D)
    else:
        q, k, qw, kw = r(*lead, _HQ, _D), r(*lead, _HKV, _D), r(_D), r(_D)
    v = r(*v_shape)
    if p["layout"] == "hf":
        angles = torch.float32 if p["rope_fp32"] else act
        cos, sin = r(1, _T, rot, dtype=angles), r(1, _T, rot, dtype=angles)
        return [q, k, v, qw, kw, cos, sin, r(*hf_cache), r(*hf_cache), torch.arange(_T), _EPS]
    cos, sin = torch.randn(_T, rot // 2), torch.randn(_T, rot // 2)
    cache_dtype = FP8 if p["cache"] == "fp8" else act
    k_cache = torch.zeros(_BLOCKS, _BS, _HKV, _D, dtype=cache_dtype)
    variances = [torch.rand(_T, 1) + 0.5, torch.rand(_T, 1) + 0.5] if p["tp"] else []
    inputs = [q, k, v, qw, kw, *variances, cos, sin, k_cache, k_cache.clone(), torch.arange(_T), _EPS]
    return inputs + ([_K_SCALE, _V_SCALE] if p["cache"] == "fp8" else [])


SCALARS = {"eps": _EPS, "k_scale": _K_SCALE, "v_scale": _V_SCALE}

# ------------------------------------------------------------------------------------------
# Facts read from the matched nodes, and the guard
# ------------------------------------------------------------------------------------------


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    facts: dict[str, Any] = {"slices": set(), "norm_widths": set(), "weight_offsets": set(), "casts": set(),
                             "repeats": set(), "unsqueezes": set(), "splits": set(), "cat_dims": set(),
                             "written_halves": set()}  # fmt: skip
    weights = {inputs.get("q_weight"), inputs.get("k_weight")} - {None}
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.rsqrt.default and node.args[0].target is aten.add.Tensor:
            facts["graph_eps"] = node.args[0].args[1]
        elif node.target is aten.mean.dim:
            facts["norm_widths"].add(mla_prologue._val(node.args[0]).shape[-1])
        elif node.target is aten.slice.Tensor:
            start, end = (list(node.args[2:4]) + [0, _NO_END])[:2]
            step = node.args[4] if len(node.args) > 4 else 1
            facts["slices"].add((start, min(end, _NO_END), step))
        elif node.target is aten.add.Tensor and _is_weight(node.args[0], weights):
            facts["weight_offsets"].add(node.args[1])  # Gemma's (1 + w)
        elif node.target is prims.convert_element_type.default:
            facts["casts"].add(node.args[1])
        elif node.target is aten.expand.default:
            facts["repeats"].add(repeat_kind(node))
        elif node.target is aten.unsqueeze.default and val_shape(node) is not None:
            facts["unsqueezes"].add((node.args[1] % len(val_shape(node)), len(val_shape(node))))
        elif node.target is aten.split.Tensor and val_shape(node.args[0]) is not None:  # torch.chunk's halves
            rank = len(val_shape(node.args[0]))
            facts["splits"].add((node.args[1], (node.args[2] if len(node.args) > 2 else 0) % rank))
        elif node.target is aten.cat.default and val_shape(node) is not None:
            facts["cat_dims"].add((node.args[1] if len(node.args) > 1 else 0) % len(val_shape(node)))
        elif node.target is aten.sub.Tensor and all(getattr(a, "target", None) is aten.mul.Tensor for a in node.args):
            # x1 * cos - x2 * sin: which chunk each product takes (the tracer left getitem's index a wildcard)
            facts["written_halves"].add(tuple(_chunk_index(m.args[0]) for m in node.args))
        elif node.target is aten.div.Tensor and not isinstance(node.args[1], torch.fx.Node):
            facts.setdefault("graph_scales", []).append(node.args[1])
    scales = facts.pop("graph_scales", [])
    if len(scales) == 2:  # k's write comes first in the pattern
        facts["graph_k_scale"], facts["graph_v_scale"] = scales
    return facts


def _chunk_index(node) -> int | None:
    """i where node is ``torch.chunk(x, ...)[i]`` (post-grad ``getitem(split(x, size, dim), i)``)."""
    if getattr(node, "target", None) is operator.getitem and getattr(node.args[0], "target", None) is aten.split.Tensor:
        return node.args[1]
    return None


def repeat_kind(expand: torch.fx.Node) -> str:
    """``expand(unsqueeze(x, d), sizes)`` as Inductor writes a repeat along the last dim: "pairs"
    with the new dim last and 2 wide (``repeat_interleave(2, -1)``: x0 x0 x1 x1 ...), "tiles"
    with it second to last and 2 wide (``cat([x, x], -1)``: x0 x1 ... x0 x1 ...), else "other"."""
    source, sizes = expand.args[0], list(expand.args[1])
    if getattr(source, "target", None) is not aten.unsqueeze.default or len(sizes) < 2:
        return "other"
    dim = source.args[1] % len(sizes)
    if dim == len(sizes) - 1 and sizes[-1] == 2:
        return "pairs"
    return "tiles" if dim == len(sizes) - 2 and sizes[-2] == 2 else "other"


@dataclasses.dataclass(frozen=True)
class GlobalVariance:
    """A full-width norm's global mean of squares as a tensor-parallel graph computes it:
    ``wait_tensor(all_reduce(local, "sum", group)) / divisor``, or column ``column`` of that
    when q and k share one [T, 2] all-reduce (vLLM's ``forward_qk``)."""

    reduced: torch.fx.Node  # the wait_tensor: the all-reduced sums
    column: int | None
    divisor: float
    group: str
    world: int | None  # the group's size, where this process can read it
    local: torch.fx.Node  # this rank's part: a [T, 1] mean of squares, or what stands there


def _all_reduce_ops():
    try:
        return torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.wait_tensor.default
    except (AttributeError, RuntimeError):  # torch built without distributed
        return None, None


def _group_size(group) -> int | None:
    try:
        from torch.distributed.distributed_c10d import _get_group_size_by_name

        return int(_get_group_size_by_name(group))
    except Exception:  # no such group in this process, or no torch.distributed
        return None


def _last_dim(node: torch.fx.Node, dim) -> bool:
    value = _compat.fake_value(node) if "val" in node.meta else None
    return dim == -1 or (value is not None and dim == value.dim() - 1)


def global_variance(node) -> GlobalVariance | str:
    """Follow a norm's variance input back to its all-reduce; a reason where it does not lead there."""
    all_reduce, wait = _all_reduce_ops()
    if not isinstance(node, torch.fx.Node) or all_reduce is None:
        return "the variance is not a graph value after an all-reduce"
    column = None
    if node.target is operator.getitem and getattr(node.args[0], "target", None) is aten.split.Tensor:
        split = node.args[0]
        if split.args[1] != 1 or not _last_dim(split.args[0], split.args[2] if len(split.args) > 2 else 0):
            return f"the variance is a piece of {split.name} other than a column"
        column, node = node.args[1], split.args[0]
    elif node.target is aten.slice.Tensor and len(node.args) == 4 and node.args[3] == node.args[2] + 1:
        if not _last_dim(node.args[0], node.args[1]):
            return f"the variance is a slice of {node.args[0].name} other than a column"
        column, node = node.args[2], node.args[0]
    if node.target is not aten.div.Tensor or isinstance(node.args[1], torch.fx.Node):
        return f"the variance is {node.target}, not an all-reduced sum divided by a constant"
    divisor, reduced = node.args[1], node.args[0]
    if getattr(reduced, "target", None) is not wait or getattr(reduced.args[0], "target", None) is not all_reduce:
        return f"the divided variance is {getattr(reduced, 'target', reduced)}, not the result of an all-reduce"
    _, op, group = reduced.args[0].args[:3]
    if op != "sum":
        return f"the variance's all-reduce is {op!r}, not a sum"
    local = reduced.args[0].args[0]
    if column is not None:
        if local.target is not aten.cat.default or not _last_dim(local, local.args[1] if len(local.args) > 1 else 0):
            return f"the all-reduced variances are {local.target}, not a cat of each side's local mean"
        local = local.args[0][column]
    return GlobalVariance(reduced, column, float(divisor), str(group), _group_size(group), local)


def mean_square_source(node) -> torch.fx.Node | None:
    """x where node is ``x.float().pow(2).mean(-1, keepdim=True)``: a mean of squares over all of
    x's last dim."""
    if getattr(node, "target", None) is not aten.mean.dim or not (len(node.args) > 2 and node.args[2]):
        return None
    value = _compat.fake_value(node)
    if list(node.args[1]) not in ([-1], [value.dim() - 1] if value is not None else [-1]):
        return None
    square = node.args[0]
    if square.target is aten.pow.Tensor_Scalar and square.args[1] == 2:
        upcast = square.args[0]
    elif square.target is aten.mul.Tensor and square.args[0] is square.args[1]:
        upcast = square.args[0]
    else:
        return None
    if upcast.target is not prims.convert_element_type.default or upcast.args[1] != torch.float32:
        return None
    return upcast.args[0]


def _variance_facts(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Per side, the global variance (or why not) and whether its local part is the mean of
    squares of the same q (k) the norm's tail reads."""
    facts = {}
    for side in ("q", "k"):
        found = global_variance(inputs.get(f"{side}_var"))
        own = not isinstance(found, str) and mean_square_source(found.local) is inputs.get(side)
        facts[side] = (found, own)
    return facts


def _is_weight(node, weights: set) -> bool:
    """A norm weight, upcast to fp32 (bf16 models) or as it is (fp32 models: no cast)."""
    if getattr(node, "target", None) is prims.convert_element_type.default and node.args[1] == torch.float32:
        node = node.args[0]
    return node in weights


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    p = variant.params
    for name in ("eps", "k_scale", "v_scale"):
        if name in values and not isinstance(values[name], (int, float)):
            return f"{name} is a tensor, not a Python number (got {values[name]}); the fused op takes it as a constant"
    reason = _dtype_reason(values, p)
    if reason:
        return reason
    q, cos, k_cache = values["q"], values["cos"], values["k_cache"]
    head_dim, kv_heads = k_cache.shape[-1], k_cache.shape[1 if p["layout"] == "hf" else 2]
    heads = q.shape[-1] // head_dim if p["norm"] in _FULL_WIDTH else q.shape[-2]
    rot = cos.shape[-1] if p["layout"] == "hf" and p["rope"] != "chunk" else 2 * cos.shape[-1]
    if p["tp"]:
        reason = _tp_reason(values, heads * head_dim, kv_heads * head_dim)
    elif p["norm"] == "none":
        reason = _no_norm_reason(values)
    else:
        reason = _norm_reason(values, p["norm"], heads, kv_heads, head_dim)
    if reason:
        return reason
    if p["rope"] == "gptj":
        reason = _pairs_reason(values, rot, head_dim, p["rotary"], p["upcast"])
    elif p["rope"] == "chunk":
        reason = _chunk_reason(values, rot, head_dim)
    else:
        reason = _rope_reason(values["slices"], rot, head_dim, p["layout"], p["rotary"])
    if reason:
        return reason
    # GPT-J pairs read cos / sin's first half only, as HF's code does: no duplicated halves needed.
    # gpt-oss's written-out halves read its half-width cos / sin as they are.
    reason = mla_prologue.angles_reason(values) if p["layout"] == "hf" and p["rope"] == "neox" else None
    if reason:
        return reason
    if heads % kv_heads:
        return f"{heads} query heads do not share {kv_heads} kv heads evenly"
    return _cache_reason(values, p, kv_heads, head_dim)


_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _dtype_reason(values, p) -> Reason:
    for name in ("q", "k", "v", "q_weight", "k_weight"):
        if name not in values:  # no q/k norm: no weights
            continue
        dtype = values[name].dtype
        if dtype not in _ACTIVATION_DTYPES:
            return f"{name} is {dtype}: the fused GQA prologue's kernel takes bf16, fp16 or fp32 (it computes in fp32)"
    q, cos = values["q"], values["cos"]
    if p["layout"] == "hf" and p["upcast"] and cos.dtype != q.dtype:
        return (f"cos / sin are {cos.dtype}, q is {q.dtype}: this variant's RoPE (Cohere's) upcasts q / k and "
                "cos / sin in q's dtype, as its rotary embedding casts them, and rounds once")  # fmt: skip
    if p["layout"] == "hf" and p["rope_fp32"] and not p["upcast"] and cos.dtype != torch.float32:
        return (f"cos / sin are {cos.dtype}: this variant's RoPE multiplies by fp32 cos / sin (OLMo-2's, ERNIE-4.5's) "
                "and rounds once")  # fmt: skip
    if p["layout"] == "hf" and not p["rope_fp32"] and cos.dtype != q.dtype:
        return f"cos / sin are {cos.dtype}, q is {q.dtype}: HF's RoPE rounds its products in q's dtype"
    return None


def _norm_reason(values, norm: str, heads: int, kv_heads: int, head_dim: int) -> Reason:
    widths = values["norm_widths"]
    if norm in _FULL_WIDTH and widths != {heads * head_dim, kv_heads * head_dim}:
        return (f"the q/k norms reduce over {sorted(widths)} dims, not the whole projections "
                f"({heads * head_dim}, {kv_heads * head_dim}): per-head where full-width is expected")  # fmt: skip
    if norm in ("qwen", "per_head") and widths != {head_dim}:
        return f"the q/k norms reduce over {sorted(widths)} dims, not one head ({head_dim}): full-width where per-head is expected"
    if norm == "qwen" and values["weight_offsets"] != {1.0}:
        return f"the norm weight offsets are {sorted(values['weight_offsets'])}, not Gemma's 1 + w"
    if norm in ("per_head", "olmo") and values["weight_offsets"]:
        return f"the norm weight has offsets {sorted(values['weight_offsets'])} where a plain x * w is expected"
    return None


def _no_norm_reason(values) -> Reason:
    """The no-norm variants begin at RoPE: a q or k with an RMS norm in front belongs to a normed
    variant (one that declined it says why), not to RoPE and a cache write after a norm left out."""
    if values["normed_inputs"]:
        sides = " and ".join(values["normed_inputs"])
        if values["centred_inputs"]:
            return (f"a LayerNorm (x - mean, as Cohere's use_qk_norm writes it) sits between the projection and "
                    f"RoPE of {sides}: the no-norm variants take an attention without q/k norms, and the fused GQA "
                    "prologue's normed variants take RMS norms only")  # fmt: skip
        return (f"an RMS norm sits between the projection and RoPE of {sides}: the no-norm variants take an "
                "attention without q/k norms; the normed variants, tried first, declined this norm")  # fmt: skip
    return None


def _tp_reason(values, q_width: int, k_width: int) -> Reason:
    """The variances are the global means of squares of this rank's q and k: all-reduced sums of
    their local means, divided by the group's size."""
    tokens = values["q"].shape[0]
    divisors = set()
    for side, width in (("q", q_width), ("k", k_width)):
        found, own = values["variances"][side]
        if isinstance(found, str):
            return f"{side}: {found}"
        if not own:
            return f"{side}'s all-reduced part is not the mean of squares of this {side}'s {width} columns"
        if found.world is None:
            return f"cannot read the size of process group {found.group!r}: the world size the variance divides by is unchecked"
        if found.divisor != found.world:
            return (f"{side}'s all-reduced variance is divided by {found.divisor:g}, not by the group's {found.world} "
                    f"ranks: not the global mean")  # fmt: skip
        variance, weight = values[f"{side}_var"], values[f"{side}_weight"]
        if variance.dtype != torch.float32 or tuple(variance.shape) != (tokens, 1):
            return f"{side}'s variance is {variance.dtype} {tuple(variance.shape)}, not fp32 ({tokens}, 1)"
        if tuple(weight.shape) != (width,):
            return f"{side}'s norm weight is {tuple(weight.shape)}, not this rank's ({width},) columns"
        divisors.add(found.divisor)
    if len(divisors) > 1:
        return f"q and k divide their variances by different sizes {sorted(divisors)}"
    return None


def _rope_reason(slices: set, rot: int, head_dim: int, layout: str, rotary: str = "partial") -> Reason:
    steps = {step for *_, step in slices} - {None, 1}
    if steps:
        return f"RoPE slices with steps {sorted(steps)}: GPT-J pairs where NeoX halves are expected"
    if rotary == "full" and rot != head_dim:
        return f"RoPE covers {rot} of {head_dim} dims where all are expected"
    if rotary == "partial" and rot >= head_dim:
        return f"RoPE covers all {head_dim} dims: this family fuses full RoPE in HF's spelling only"
    if rot % 2:
        return f"rotary_dim {rot} is odd"
    half = rot // 2
    if rotary == "full":  # rotate_half's x[..., :D/2], x[..., D/2:]; no pass-through
        want = {(0, half, 1), (half, _NO_END, 1)}
    elif layout == "hf":  # x[..., :rot], x[..., rot:], rotate_half's x[..., :rot/2], x[..., rot/2:]
        want = {(0, rot, 1), (rot, _NO_END, 1), (0, half, 1), (half, _NO_END, 1)}
    else:  # x[..., :half], x[..., half:rot], x[..., rot:]
        want = {(0, half, 1), (half, rot, 1), (rot, _NO_END, 1)}
    if {(a, min(b, _NO_END), 1) for a, b, _ in slices} != want:
        return (f"RoPE slices {sorted(s[:2] for s in slices)} are not NeoX halves of the first {rot} dims "
                f"(cos/sin width) with the rest passed through")  # fmt: skip
    return None


def _pairs_reason(values, rot: int, head_dim: int, rotary: str, upcast: bool = False) -> Reason:
    """HF GLM-4's GPT-J RoPE: cos / sin's first half repeated pairwise, x's even and odd lanes of
    the first ``rot`` dims (all of them with full RoPE) stacked back pair by pair. The tracer left
    every int a wildcard: the repeat's and the stack's new dims, the slices. ``upcast`` (Cohere):
    the angles come repeated from the rotary embedding, before the cos, outside the match: their
    repeat is read back from the cos / sin inputs (``angle_repeats``), and no half is sliced."""
    repeats = values["angle_repeats"] if upcast else values["repeats"]
    if None in repeats:  # Cohere's: cos / sin built before a graph break, or without a repeat
        return ("no repeat of cos / sin's angles in the graph: nothing shows that GPT-J pairs (2i, 2i + 1) share "
                "one angle (Cohere's rotary embedding repeat_interleaves them before the cos)")  # fmt: skip
    if repeats != {"pairs"}:
        kinds = ", ".join(sorted(repeats))
        return (f"cos / sin are repeated as {kinds}, not pairwise (repeat_interleave): GPT-J pairs (2i, 2i + 1) "
                "would not share one angle (a NeoX cos / sin layout on interleaved pairs)")  # fmt: skip
    if values["unsqueezes"] != {(1, 4), (4, 5)}:
        return (f"new dims at {sorted(values['unsqueezes'])} (dim, rank): not HF's cos / sin over heads, the "
                "pairwise repeat and rotate_half's pair stack, each on the last dim")  # fmt: skip
    if rotary == "full" and rot != head_dim:
        return f"RoPE covers {rot} of {head_dim} dims where all are expected"
    if rotary == "partial" and rot >= head_dim:
        return f"RoPE covers all {head_dim} dims: the full-RoPE variant takes it"
    half = rot // 2
    want = {(0, _NO_END, 2), (1, _NO_END, 2)} | (set() if upcast else {(0, half, 1)})  # x's pairs; cos / sin's half
    if rotary == "partial":  # x[..., :rot], x[..., rot:]
        want |= {(0, rot, 1), (rot, _NO_END, 1)}
    got = {(a, min(b, _NO_END), step) for a, b, step in values["slices"]}
    if got != want:
        angles = "" if upcast else " with cos / sin's first half"
        return f"RoPE slices {sorted(got)} (start, end, step) are not GPT-J pairs of the first {rot} dims{angles}"
    return None


def _chunk_reason(values, rot: int, head_dim: int) -> Reason:
    """gpt-oss's written-out halves: ``torch.chunk(x, 2, -1)`` of the whole head (a split of the
    last dim at half the head), cos / sin half as wide, ``cat((x1 * cos - x2 * sin, x2 * cos + x1 *
    sin), -1)``. The tracer left the split's size and dim, getitem's index and the cat's dim
    wildcards."""
    if rot != head_dim:
        return (f"cos / sin are {rot // 2} wide, not half the head ({head_dim // 2}): RoPE on written-out halves "
                "of all of it is expected")  # fmt: skip
    if values["splits"] != {(head_dim // 2, 3)} or values["cat_dims"] != {3}:
        return (f"the halves are split as {sorted(values['splits'])} (size, dim) and joined on dims "
                f"{sorted(values['cat_dims'])}, not torch.chunk's two halves of the head's last dim joined back "
                "on it")  # fmt: skip
    if values["written_halves"] != {(0, 1)}:
        return (f"the rotation's first half reads chunks {sorted(values['written_halves'])} (x1 * cos, x2 * sin), "
                "not (0, 1): the halves are swapped, a rotation the fused GQA prologue does not take")  # fmt: skip
    return None


def _cache_reason(values, p, kv_heads: int, head_dim: int) -> Reason:
    k_cache, v_cache, where = values["k_cache"], values["v_cache"], values["where"]
    rank = 3 if p["cache"] == "flat" else 4
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != rank or not cache.is_contiguous():
            return f"{name} {tuple(cache.shape)} is not a contiguous {rank}-D cache (strides {cache.stride()})"
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        return f"the K and V caches differ: {tuple(k_cache.shape)} {k_cache.dtype}, {tuple(v_cache.shape)} {v_cache.dtype}"
    heads_axis = 1 if p["layout"] == "hf" else 2
    if k_cache.shape[heads_axis] != kv_heads or k_cache.shape[-1] != head_dim:
        return f"cache {tuple(k_cache.shape)} does not hold {kv_heads} kv heads of {head_dim} on dims {heads_axis}, 3"
    if where.dtype not in (torch.int32, torch.int64) or where.dim() != 1:
        return f"the cache index {where.dtype} {tuple(where.shape)} is not a 1-D int tensor"
    want = FP8 if p["cache"] == "fp8" else values["q"].dtype
    if k_cache.dtype != want:
        return f"cache dtype {k_cache.dtype}, expected {want}"
    if p["cache"] == "fp8" and FP8 not in values["casts"]:
        return f"the cache write casts to {sorted(map(str, values['casts']))}, not float8_e4m3fn"
    return None


# ------------------------------------------------------------------------------------------
# Replacements
# ------------------------------------------------------------------------------------------


def _call(lowering: str, **kwargs):
    """(q_out, new k_cache, new v_cache): the Triton op through ``auto_functionalized``, or the
    canonical functional decomposition (lowering "inductor")."""
    if lowering == "inductor":
        return gqa_ops.gqa_prologue_canonical(**kwargs)
    return _compat.auto_functionalized(torch.ops.fusion_compiler.gqa_prologue.default, **kwargs)


def _heads(x: torch.Tensor, lead_dims: int, head_dim: int) -> int:
    """Heads in x's per-token dims (static sizes), after its ``lead_dims`` token dims."""
    return math.prod(x.shape[lead_dims:]) // head_dim


def replacement(variant: Variant, lowering: str):
    if lowering not in ("triton", "inductor"):
        raise ValueError(f"no replacement for lowering {lowering!r}")
    p = variant.params
    full_width, offset = p["norm"] in _FULL_WIDTH, 1.0 if p["norm"] == "qwen" else 0.0
    # Round where the matched code rounds: MiniMax's norm (every spelling) and HF's plain per-head
    # norm round x * rstd before the weight multiply (Gemma's rounds once); HF's RoPE runs in the
    # activation dtype, one rounding per op (without a norm, on the projections' own rows). OLMo's
    # full-width norm multiplies its weight in fp32 and rounds once, as Gemma's does; OLMo's RoPE
    # and ERNIE-4.5's GPT-J pairs (``rope_fp32``) take fp32 products on fp32 cos / sin, one rounding,
    # and so do Cohere's on its cos / sin in x's dtype, upcast (exactly: the op upcasts them too).
    rounding = dict(round_normalized=p["norm"] in ("minimax", "per_head"), round_rope_products=p["layout"] == "hf" and not p["rope_fp32"])
    if p["rope"] == "gptj":
        rounding["interleaved_rope"] = True

    def fused(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps, k_scale, v_scale, q_var, k_var):
        head_dim, kv_heads = k_cache.shape[-1], k_cache.shape[1 if p["layout"] == "hf" else 2]
        lead = v.shape[:-2] if p["layout"] == "hf" and p["cache"] != "flat" else v.shape[:-1]
        # Token counts as -1, never computed: under dynamic shapes a size expression of ours could
        # be bound to an equal one computed later in the graph (another layer's), a cycle.
        # cat(freqs, freqs) rows (gpt-oss's: freqs), [B or 1, S]; slot = batch * max_len + position
        if p["layout"] == "hf":
            if p["upcast"]:  # Cohere's repeat_interleave(freqs, 2): every other lane, unit stride for the kernel
                cos, sin = (x.reshape(-1, x.shape[-1])[:, ::2].contiguous() for x in (cos, sin))
            else:
                half = cos.shape[-1] if p["rope"] == "chunk" else cos.shape[-1] // 2  # gpt-oss's: half-width
                cos, sin = cos.reshape(-1, cos.shape[-1])[:, :half], sin.reshape(-1, sin.shape[-1])[:, :half]
            max_len = k_cache.shape[2]
            if lead[0] == 1 or p["cache"] == "flat":  # one sequence, or flat slots already
                slots = where
            else:
                slots = (torch.arange(lead[0], device=where.device)[:, None] * max_len + where).reshape(-1)
        else:
            slots = where
        # The TP variants hand over the divided global variance (divisor 1); patterns/gqa_prologue_tp_variance.py
        # later gives the op the all-reduced sums and the world size instead.
        variances = dict(q_variance=q_var, k_variance=k_var, variance_divisor=1.0) if p["tp"] else {}
        q_out, k_new, v_new = _call(
            lowering,
            q=q.reshape(-1, _heads(q, len(lead), head_dim), head_dim), k=k.reshape(-1, kv_heads, head_dim),
            v=v.reshape(-1, kv_heads, head_dim),
            q_norm_weight=q_weight, k_norm_weight=k_weight, eps=eps, weight_offset=offset, full_width_norm=full_width,
            cos=cos, sin=sin, positions=None, k_cache=k_cache, v_cache=v_cache, slots=slots,
            k_scale=k_scale, v_scale=v_scale, cache_heads_first=p["layout"] == "hf" and p["cache"] != "flat",
            **variances, **rounding,
        )  # fmt: skip
        if p["layout"] == "hf":
            q_out = q_out.view(*lead, -1, head_dim).transpose(1, 2)
        return q_out, k_new, v_new

    # One wrapper per search signature: the tracer hands over exactly the search's arguments.
    if p["tp"]:

        def replace_tp(q, k, v, q_weight, k_weight, q_var, k_var, cos, sin, k_cache, v_cache, where, eps,
                       k_scale=1.0, v_scale=1.0):  # fmt: skip
            return fused(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps, k_scale, v_scale, q_var, k_var)

        def replace_tp_bf16(q, k, v, q_weight, k_weight, q_var, k_var, cos, sin, k_cache, v_cache, where, eps):
            return replace_tp(q, k, v, q_weight, k_weight, q_var, k_var, cos, sin, k_cache, v_cache, where, eps)

        return replace_tp if p["cache"] == "fp8" else replace_tp_bf16

    if p["norm"] == "none":

        def replace_no_norm(q, k, v, cos, sin, k_cache, v_cache, where):
            # No weights: the op skips the norm (its eps, any positive number, is unused).
            return fused(q, k, v, None, None, cos, sin, k_cache, v_cache, where, 1e-6, 1.0, 1.0, None, None)

        return replace_no_norm

    def replace(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps, k_scale=1.0, v_scale=1.0):
        return fused(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps, k_scale, v_scale, None, None)

    def replace_bf16(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps):
        return replace(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache, where, eps)

    return replace if p["cache"] == "fp8" else replace_bf16


# ------------------------------------------------------------------------------------------
# Sites: every K-cache write of a rotated row (partly, or wholly after a q/k norm)
# ------------------------------------------------------------------------------------------

_THROUGH = (
    prims.convert_element_type.default, aten.clamp_min.default, aten.clamp_max.default, aten.div.Tensor,
    aten.permute.default, aten.reshape.default, aten.view.default, aten.clone.default,
)  # fmt: skip


def _passes_through(node) -> bool:
    """A node the K rows pass through on their way to the cache: a cast or view (``_THROUGH``),
    or continuous batching's ``squeeze(0)`` of its packed sequence (a squeeze of another dim, as
    DeepSeek's indexer squeezes its one head, stops the walk: that cache is no GQA site)."""
    if getattr(node, "target", None) is aten.squeeze.dim:
        return node.args[1] == 0
    return getattr(node, "target", None) in _THROUGH


def _rotates_pairs_hf(node) -> bool:
    """HF GLM / GLM-4's ``x * cos + rotate_pairs_hf(x) * sin``: a product with ``stack((-x2,
    x1), -1).flatten(-2)``, post-grad ``reshape(cat([unsqueeze(neg(x2)), unsqueeze(x1)]))``."""
    if getattr(node, "target", None) is not aten.add.Tensor:
        return False
    for mul in node.args:
        for x in mul.args if getattr(mul, "target", None) is aten.mul.Tensor else ():
            x = mla_prologue._strip(x)  # ERNIE-4.5 turns the pairs in fp32: rotate_half(x).float()
            x = x.args[0] if getattr(x, "target", None) in (aten.reshape.default, aten.view.default) else x
            if getattr(x, "target", None) is aten.cat.default and any(
                getattr(part, "target", None) is aten.unsqueeze.default
                and getattr(part.args[0], "target", None) is aten.neg.default
                for part in x.args[0]
            ):
                return True
    return False


def _rotation(node) -> bool:
    """A RoPE's rotated half or halves (mla_prologue.is_site), or HF's GPT-J pairs rotation."""
    if not isinstance(node, torch.fx.Node) or mla_prologue.is_complex_rope(node):
        return False  # complex RoPE: MLA's (DeepSeek-V2), a reported miss of that family
    return mla_prologue.is_site(node) or _rotates_pairs_hf(node)


def _is_rotation(node) -> bool:
    """A RoPE's rotated half (``_rotation``), or the cat / stack of the two (fp32 NeoX halves,
    GPT-J pairs): any RoPE layout, so one this family does not fuse is still a site."""
    for _ in range(4):
        if not isinstance(node, torch.fx.Node) or node.target not in (*_THROUGH, aten.unsqueeze.default):
            break
        node = node.args[0]
    if not isinstance(node, torch.fx.Node):
        return False
    if node.target is aten.cat.default:
        return any(_is_rotation(x) for x in node.args[0] if isinstance(x, torch.fx.Node) and x is not node)
    return _rotation(node)


_GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def _before_projection(node, want) -> torch.fx.Node | None:
    """The first node ``want`` accepts upstream of ``node`` with no GEMM between (a q/k norm's,
    not the decoder norm's before a projection), along tensors only: a view's symbolic sizes can
    be read off the normed hidden states the projection takes."""

    def inputs(n):
        if n.target in _GEMMS:
            return []
        return [m for m in n.all_input_nodes if not isinstance(m.meta.get("val"), (torch.SymInt, int))]

    return walk(node, want, 14, inputs)


def _normed(node) -> bool:
    """An RMSNorm's (or a LayerNorm's) rsqrt upstream of ``node``: a q/k norm."""
    return _before_projection(node, lambda n: n.target is aten.rsqrt.default) is not None


def _centred(node) -> bool:
    """A LayerNorm's ``x - mean`` upstream of ``node``: the mean as ``mean`` (Cohere's
    ``use_qk_norm``) or as ``var_mean``'s (``nn.LayerNorm`` decomposed: StableLM, Phi)."""
    return _before_projection(node, lambda n: n.target is aten.sub.Tensor and _is_mean(n.args[1])) is not None


def _is_mean(node) -> bool:
    if getattr(node, "target", None) is operator.getitem and node.args[1] == 1:
        return getattr(node.args[0], "target", None) is aten.var_mean.correction
    return getattr(node, "target", None) is aten.mean.dim


def _halves_of_one_rotation(first, second) -> bool:
    """``x1·cos - x2·sin`` and ``x2·cos + x1·sin``: the products of both read the same x halves
    and the same cos / sin."""

    def factors(node):
        if not isinstance(node, torch.fx.Node) or node.target not in (aten.sub.Tensor, aten.add.Tensor):
            return None
        muls = [a for a in node.args if isinstance(a, torch.fx.Node) and a.target is aten.mul.Tensor]
        return frozenset(x for m in muls for x in m.args) if len(muls) == 2 else None

    a, b = factors(first), factors(second)
    return a is not None and a == b


def _roped_rows(node, hf_cache: bool, halves: bool = False) -> bool:
    """K rows that are a RoPE's output (through casts and views). ``halves``: written to HF's
    static or flat cache, where a rotation's two halves written out with no norm in front
    (gpt-oss's ``_apply_rotary_emb``) is a site too."""
    for _ in range(6):
        if not isinstance(node, torch.fx.Node):
            return False
        if mla_prologue.complex_rope_of_heads(node):
            return hf_cache or _normed(node)  # Llama-4's complex RoPE of whole heads: a reported miss
        if _rotation(node):
            # HF's rotation written as it is (full RoPE: no pass-through to cat back): a site
            # written to one of HF's caches (the no-norm variants' layouts), or after a q/k norm.
            return hf_cache or _normed(node)
        if node.target is aten.cat.default:
            # [rotated | passed through], or a rotation's own two halves (full rotary). The
            # latter is a candidate (a near miss: RoPE on all dims) only after a q/k norm:
            # DeepSeek V3's k_rot, written to its cache straight from kv_a_proj, is no GQA site.
            parts = node.args[0]
            if len(parts) == 2 and halves and _halves_of_one_rotation(*parts) and _is_rotation(parts[1]):
                return True  # written-out halves, the x1 * cos - x2 * sin one second (swapped: a near miss)
            if len(parts) != 2 or not _is_rotation(parts[0]):
                return False
            return not _halves_of_one_rotation(*parts) or _normed(parts[0]) or halves
        if not _passes_through(node):
            return False
        node = node.args[0]
    return False


def _static_cache_write(node: torch.fx.Node) -> bool:
    """HF's static-cache write: ``index_copy_`` along the sequence dim of [B, kv_heads, len, D],
    an ``index_put`` at ``[None, None, positions]``."""
    indices = node.args[1]
    return len(indices) == 3 and indices[0] is None and indices[1] is None


def _flat_cache_write(node: torch.fx.Node) -> bool:
    """HF continuous batching's write: ``index_copy_(0, slots, rows)`` into a flat [slots,
    kv_heads, D] cache that is itself a graph value (serving code flattens a paged cache with a
    view first), an ``index_put`` at ``[slots]``."""
    cache = node.args[0]
    return (len(node.args[1]) == 1 and len(val_shape(cache) or ()) == 3
            and getattr(cache, "target", None) not in (aten.reshape.default, aten.view.default))  # fmt: skip


def _hf_cache_write(node: torch.fx.Node) -> bool:
    return _static_cache_write(node) or _flat_cache_write(node)


def _norm_after_rope(rows) -> bool:
    """K rows that are an RMS norm of RoPE'd rows (HunYuan's ``key_layernorm`` after
    ``apply_rotary_pos_emb``)."""
    rsqrt = upstream(rows, lambda n: getattr(n, "target", None) is aten.rsqrt.default, 6)
    mean = upstream(rsqrt, lambda n: getattr(n, "target", None) is aten.mean.dim, 3) if rsqrt is not None else None
    square = mean.args[0] if mean is not None else None
    if getattr(square, "target", None) not in (aten.pow.Tensor_Scalar, aten.mul.Tensor):
        return False
    return _roped_rows(mla_prologue._strip(square.args[0]), True)


def is_site(node: torch.fx.Node) -> bool:
    """A K-cache write of RoPE'd rows; in HF's caches also of a q/k norm's rows after the RoPE, a
    reported miss."""
    if node.op != "call_function" or node.target is not aten.index_put.default or len(node.args) < 3:
        return False
    rows, hf_cache = node.args[2], _hf_cache_write(node)
    return _roped_rows(rows, hf_cache, hf_cache) or (hf_cache and _norm_after_rope(rows))


def _k_norm(rows: torch.fx.Node) -> dict | None:
    """The RMS norm on k's path into the cache rows, as the model computes it: its width (the
    mean's last dim) and whether its weight is Gemma's ``1 + w``; None when k has no norm."""
    rsqrt = upstream(rows, lambda n: getattr(n, "target", None) is aten.rsqrt.default, 24)
    if rsqrt is None:
        return None
    mean = upstream(rsqrt, lambda n: getattr(n, "target", None) is aten.mean.dim, 3)
    width = (val_shape(mean.args[0]) or (None,))[-1] if mean is not None else None
    scaled = downstream(rsqrt, lambda n: getattr(n, "target", None) is aten.mul.Tensor
                        and any(_is_norm_weight(a) for a in n.args), 4)  # fmt: skip
    gemma = scaled is not None and any(getattr(a, "target", None) is aten.add.Tensor for a in scaled.args)
    # MiniMax / Qwen3-MoE round x·rstd to the activation dtype before the weight multiply.
    rounded = scaled is not None and any(getattr(a, "target", None) is prims.convert_element_type.default
                                         and a.args[1] != torch.float32 for a in scaled.args)  # fmt: skip
    return {"width": width, "gemma": gemma, "weighted": scaled is not None, "rounded_first": rounded}


def _is_norm_weight(node) -> bool:
    """A norm weight: a graph input (1-D), or ``w + 1`` of one (Gemma)."""
    if getattr(node, "target", None) is aten.add.Tensor:
        node = node.args[0]
    return isinstance(node, torch.fx.Node) and node.op in ("placeholder", "get_attr") and len(val_shape(node) or ()) == 1


def _rotary_dim(rows: torch.fx.Node, head_dim: int) -> int:
    node = rows
    for _ in range(6):
        if getattr(node, "target", None) is aten.cat.default and len(node.args[0]) == 2:
            rotated = (val_shape(node.args[0][0]) or (head_dim,))[-1]
            return head_dim if _halves_of_one_rotation(*node.args[0]) else rotated
        if not _passes_through(node):
            break
        node = node.args[0]
    return head_dim


def _interleaved_pairs(rows: torch.fx.Node) -> torch.fx.Node | None:
    """A slice with step 2 above the K rows (``x[..., ::2]``, ``x[..., 1::2]``): GPT-J's pairs."""
    return upstream(rows, is_pair_slice, 16)


def _angles_repeat(angles) -> str | None:
    """How cos / sin ``angles`` repeat their angles along the last dim (``repeat_kind``), in
    ``apply_rotary_pos_emb`` or before the cos (Cohere's rotary embedding): the first expand
    walked back along the angles' elementwise ops; None where there is none."""

    def back(n):
        return [n.args[0]] if n.target in mla_prologue._ELEMENTWISE and isinstance(n.args[0], torch.fx.Node) else []

    if not isinstance(angles, torch.fx.Node):
        return None
    expand = walk(angles, lambda n: n.target is aten.expand.default, 10, back)
    return repeat_kind(expand) if expand is not None else None


def _pair_angles(rotation: torch.fx.Node) -> bool:
    """Whether the products of HF's GPT-J rotation (``x * cos``, ``rotate_half(x) * sin``) read
    cos / sin repeated pairwise (``_angles_repeat``)."""
    return any(getattr(mul, "target", None) is aten.mul.Tensor and _angles_repeat(mul.args[1]) == "pairs"
               for mul in rotation.args)  # fmt: skip


def _pairs_departure(rows: torch.fx.Node, pairs: torch.fx.Node) -> tuple[torch.fx.Node, str]:
    """Why GPT-J pairs (step-2 slices above the K rows) did not fuse: no HF rotate_half on them,
    cos / sin not repeated pairwise, a q/k norm in front, or another spelling of the rest."""
    rotation = upstream(rows, _rotates_pairs_hf, 8)
    if rotation is None:
        return pairs, ("k is rotated by interleaved (GPT-J) RoPE, pairs (2i, 2i + 1) taken by step-2 slices but not "
                       "as HF's GLM-4 writes them (x * cos + rotate_half(x) * sin, rotate_half stacking "
                       "(-x[..., 1::2], x[..., 0::2]) pair by pair): the fused GQA prologue takes GPT-J pairs in that "
                       "spelling")  # fmt: skip
    if not _pair_angles(rotation):
        return rotation, ("k's GPT-J pairs (2i, 2i + 1) turn by cos / sin that are not repeated pairwise "
                          "(repeat_interleave of their first half, as HF's GLM-4 writes them): the two lanes of a "
                          "pair would turn by different angles, which is no rotation the fused GQA prologue "
                          "takes")  # fmt: skip
    if _normed(rows):
        return rows, ("q/k are RMS-normalised before GPT-J pairs: the fused GQA prologue takes GPT-J pairs without "
                      "q/k norms (HF's GLM-4) only")  # fmt: skip
    turned, cached = _compat.fake_value(rotation), _compat.fake_value(rows)
    if turned is not None and cached is not None and turned.dtype == torch.float32 != cached.dtype:
        paired = _compat.fake_value(pairs)
        here = ("rotate_half(x.float()), the pairs taken of the upcast" if paired is not None
                and paired.dtype == torch.float32 else "rotate_half(x).float(), the pairs taken in x's dtype")  # fmt: skip
        return rotation, (f"k's GPT-J pairs are turned in fp32 and rounded once to {cached.dtype} (here {here}), but "
                          "neither as ERNIE-4.5 nor as Cohere writes it: the fused GQA prologue takes fp32 GPT-J pairs "
                          "over the whole head as x.float() * cos + rotate_half(x).float() * sin on fp32 cos / sin "
                          "whose first half apply_rotary_pos_emb repeat_interleaves (ERNIE-4.5), or as "
                          "rotate_half(x.float()) on cos / sin in x's dtype repeated pairwise before the cos "
                          "(Cohere)")  # fmt: skip
    return rotation, ("k's GPT-J pairs turn by cos / sin repeated pairwise, but not in HF GLM-4's spelling (bf16 "
                      "products, cos / sin's first half repeat_interleave'd inside apply_rotary_pos_emb), e.g. in "
                      "bf16 on angles repeated before the cos: the fused GQA prologue's GPT-J variants with bf16 "
                      "products take GLM-4's spelling")  # fmt: skip


def _rotated_input(rotation: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor a RoPE rotates: the source of ``rotate_half``'s (or the written-out halves')
    slices, through casts."""
    for mul in rotation.args:
        for x in mla_prologue._mul_operands(mul) or ():
            x = mla_prologue._strip(x)
            if mla_prologue._is_rotate_half(x):
                x = next((p for p in x.args[0] if getattr(p, "target", None) is not aten.neg.default), None)
            source = mla_prologue._sliced_from(x)
            if source is not None:
                return source
    return None


def _back_through_views(node, steps: int = 4):
    """``node``, then what it passes through (``_passes_through``) on the way back, ``steps`` at most."""
    for _ in range(steps):
        yield node
        if not _passes_through(node):
            return
        node = node.args[0]


def _piece_of_wider(node) -> bool:
    """A split piece or slice of a wider tensor, through the head views on the way back."""
    return any(mla_prologue._sliced_from(n) is not None for n in _back_through_views(node))


def _scale_of(node) -> float | None:
    """``x * c`` for a Python number c, through the head views and casts on the way back."""
    for n in _back_through_views(node):
        if getattr(n, "target", None) is aten.mul.Tensor:
            numbers = [a for a in n.args if isinstance(a, (int, float))]
            return float(numbers[0]) if numbers else None
    return None


def _rope_input_departure(anchor: torch.fx.Node, rows: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """What k is before an un-normed RoPE where no variant takes it: a piece split off a wider
    projection into one shared head (MLA's decoupled RoPE key: MiniCPM3), k scaled by a constant
    (Falcon-H1's key_multiplier), or the rotation's two halves written out otherwise than gpt-oss does."""
    rotation = upstream(rows, _rotation, 8)
    if rotation is None or _normed(rows):
        return None
    source = _rotated_input(rotation)
    shape = val_shape(rows) or ()
    if source is not None and len(shape) == 4 and shape[1] == 1 and _piece_of_wider(source):
        return source, ("k is one RoPE head split off the compressed kv projection and cached beside its normed "
                        "latent (MLA's decoupled RoPE key, as MiniCPM3 writes it): the fused GQA prologue takes per-"
                        "head K rows of a k projection, and the MLA prologue takes DeepSeek's spelling of this "
                        "attention")  # fmt: skip
    scale = _scale_of(source) if source is not None else None
    if scale is not None:
        return source, (f"k is scaled by a constant ({scale:g}) between its projection and its RoPE, as Falcon-H1's "
                        "key_multiplier does: the fused GQA prologue takes k's projection rows as they are, or "
                        "RMS-normalised")  # fmt: skip
    cat = upstream(rows, lambda n: getattr(n, "target", None) is aten.cat.default and len(n.args[0]) == 2
                   and _halves_of_one_rotation(*n.args[0]), 6)  # fmt: skip
    spelled = _written_halves(cat) if cat is not None else None
    if spelled is not None and spelled != _GPT_OSS_HALVES:
        return cat, (f"k is rotated by NeoX halves written out as {spelled}, not as gpt-oss's _apply_rotary_emb "
                     f"writes them ({_GPT_OSS_HALVES}): the fused GQA prologue takes that spelling of the rotation "
                     "and HF's x * cos + rotate_half(x) * sin only")  # fmt: skip
    return None


_GPT_OSS_HALVES = "cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin))"
_CLAMPS = (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)


def _k_path_departure(anchor: torch.fx.Node, rows: torch.fx.Node, head_dim: int | None):
    """What k's or v's way into HF's cache has that no variant takes, read off the graph: a
    LayerNorm as q/k norm (StableLM, Phi), a clamp (OLMoE's and DBRX's clip_qkv), an RMS norm
    written with ``pow(., -0.5)`` (Gemma-3n), k split head by head out of one fused projection
    (GPT-NeoX), v scaled by a constant before its write (MiMo-V2-Flash); else None."""
    rotation = upstream(rows, _rotation, 8)
    source = _rotated_input(rotation) if rotation is not None else None
    k = source if source is not None else rows  # k's own path: not the cos / sin or positions feeding the RoPE
    if _centred(k):
        return k, ("q/k pass a LayerNorm (x - mean, as StableLM's and Phi's qk_layernorm write it) between their "
                   "projection and RoPE: the fused GQA prologue takes RMS norms, or no norm")  # fmt: skip
    clamp = _before_projection(k, lambda n: n.target in _CLAMPS and not _clamps_a_cast(n))
    if clamp is not None:
        bounds = _clamp_bounds(clamp)
        return clamp, (f"k is clamped{bounds} between its projection and its RoPE (clip_qkv, as OLMoE and DBRX write "
                       "it): the fused GQA prologue takes the projection's rows, or their RMS norm, as they are")  # fmt: skip
    power = _before_projection(k, lambda n: n.target is aten.pow.Tensor_Scalar and n.args[1] == -0.5)
    if power is not None:
        return power, ("k's RMS norm is written x * pow(mean(x^2) + eps, -0.5), as Gemma-3n writes it: the fused GQA "
                       "prologue's norms are the spellings with rsqrt")  # fmt: skip
    fused = _split_after_heads(source, head_dim) if source is not None and head_dim else None
    if fused is not None:
        width = val_shape(fused)[-1]
        return fused, (f"k is split head by head out of one fused projection whose heads hold [q | k | v] ({width} = "
                       f"{width // head_dim} x {head_dim} a head, GPT-NeoX's query_key_value): the fused GQA prologue "
                       "takes k's own projection, or a [q | k | v] projection split before its heads")  # fmt: skip
    v_rows = _v_rows(anchor)
    scale = _scale_of(v_rows) if v_rows is not None else None
    if scale is not None:
        return v_rows, (f"v is scaled by a constant ({scale:g}) between its projection and its cache write, as "
                        "MiMo-V2-Flash's attention_value_scale does: the fused GQA prologue writes v's projection "
                        "rows as they are")  # fmt: skip
    return None


def _clamps_a_cast(node) -> bool:
    """A clamp inside an FP8 cast (saturation to the format's range), not the model's."""
    return any(getattr(u, "target", None) is prims.convert_element_type.default and u.args[1] == FP8 for u in node.users)


def _clamp_bounds(node) -> str:
    """' to [lo, hi]' (or one side) read off a clamp and a clamp of the other side before it."""
    bounds = {}
    for n in (node.args[0], node):
        target = getattr(n, "target", None)
        if target is aten.clamp.default:
            bounds.update(zip(("low", "high"), n.args[1:3]))
        elif target is aten.clamp_min.default:
            bounds["low"] = n.args[1]
        elif target is aten.clamp_max.default:
            bounds["high"] = n.args[1]
    low, high = (b if isinstance(b, (int, float)) else None for b in (bounds.get("low"), bounds.get("high")))
    if low is not None and high is not None:
        return f" to [{low:g}, {high:g}]"
    if low is not None or high is not None:
        return f" to >= {low:g}" if low is not None else f" to <= {high:g}"
    return ""


def _split_after_heads(source: torch.fx.Node, head_dim: int) -> torch.fx.Node | None:
    """The [B, heads, S, n x head_dim] (or [B, S, heads, ...]) tensor k is a split piece of, when
    the split comes after the head view: each head's row holds q, k and v."""
    for node in _back_through_views(source, 6):
        whole = mla_prologue._sliced_from(node)
        shape = val_shape(whole) if whole is not None else None
        if shape and len(shape) == 4 and isinstance(shape[-1], int) and shape[-1] > head_dim:
            return whole
    return None


def _v_rows(anchor: torch.fx.Node) -> torch.fx.Node | None:
    """The rows of the V-cache write beside the K write ``anchor``: another ``index_put`` at the
    same positions."""
    positions = [i for i in anchor.args[1] if isinstance(i, torch.fx.Node)]
    for user in positions[0].users if positions else ():
        if user is not anchor and user.target is aten.index_put.default and user.args[1] == anchor.args[1]:
            return user.args[2] if isinstance(user.args[2], torch.fx.Node) else None
    return None


def _written_halves(cat: torch.fx.Node) -> str:
    """A rotation's two written-out halves as the model spells them, e.g. ``cat((x1 * cos - x2 *
    sin, x2 * cos + x1 * sin))``: x1, x2 the first and second half of the head (torch.chunk's
    pieces or slices), cos / sin the angles read back to their aten.cos / aten.sin (else named by
    their order: the first product's is cos)."""
    angles: dict[torch.fx.Node, str] = {}

    def angle(node):
        if node not in angles:
            found = upstream(node, lambda n: getattr(n, "target", None) in (aten.cos.default, aten.sin.default), 8)
            named = {aten.cos.default: "cos", aten.sin.default: "sin"}.get(getattr(found, "target", None))
            angles[node] = named or ("cos", "sin", "angle")[min(len(angles), 2)]
        return angles[node]

    def half(node):
        node = mla_prologue._strip(node)
        index = _chunk_index(node)
        if index is None and getattr(node, "target", None) is aten.slice.Tensor:
            index = 0 if (list(node.args[2:3]) or [0])[0] == 0 else 1
        return f"x{index + 1}" if index is not None else "x"

    def product(mul):
        x, theta = mul.args if half(mul.args[0]) != "x" or half(mul.args[1]) == "x" else mul.args[::-1]
        return f"{half(x)} * {angle(theta)}"

    parts = [f"{product(p.args[0])} {'-' if p.target is aten.sub.Tensor else '+'} {product(p.args[1])}"
             for p in cat.args[0]]  # fmt: skip
    return f"cat(({', '.join(parts)}))"


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """The site in the model's terms where its math departs from every variant: the K rows'
    dtype, GPT-J's interleaved RoPE, k without a norm outside HF's static cache, or k's norm (per
    head with a plain weight into a paged cache, or over the whole projection with Gemma's);
    else None, for Inductor's FailedMatch text (registry.failed_match_reason)."""
    rows = anchor.args[2]
    value = _compat.fake_value(rows) if isinstance(rows, torch.fx.Node) and "val" in rows.meta else None
    if value is not None and value.dtype not in _ACTIVATION_DTYPES:
        return rows, f"the K rows are {value.dtype}: the fused GQA prologue's kernel takes bf16, fp16 or fp32"
    complex_rope = upstream(rows, mla_prologue.complex_rope_of_heads, 12) if isinstance(rows, torch.fx.Node) else None
    if complex_rope is not None:
        return complex_rope, _complex_rope_reason(rows, complex_rope)
    if isinstance(rows, torch.fx.Node) and _norm_after_rope(rows):
        return rows, ("q/k are RMS-normalised after their RoPE (a norm of the rotated heads, as HunYuan's "
                      "query_layernorm / key_layernorm run after apply_rotary_pos_emb), so the cached K rows are a "
                      "norm's: the fused GQA prologue takes q/k norms before RoPE only")  # fmt: skip
    pairs = _interleaved_pairs(rows) if isinstance(rows, torch.fx.Node) else None
    if pairs is not None:
        return _pairs_departure(rows, pairs)
    if isinstance(rows, torch.fx.Node) and not _normed(rows) and not _hf_cache_write(anchor):
        return rows, ("k has no RMS norm between its projection and its RoPE, and is written to a paged cache: the "
                      "fused GQA prologue takes an attention without q/k norms in HF's code (its static cache, or "
                      "continuous batching's flat one) only")  # fmt: skip
    departure = _rope_input_departure(anchor, rows) if isinstance(rows, torch.fx.Node) else None
    if departure is not None:
        return departure
    head_dim = (val_shape(anchor.args[0]) or (None,))[-1]
    departure = _k_path_departure(anchor, rows, head_dim) if isinstance(rows, torch.fx.Node) else None
    if departure is not None:
        return departure
    norm = _k_norm(rows) if isinstance(rows, torch.fx.Node) else None
    if norm is None or head_dim is None or norm["width"] is None:
        return None
    per_head = norm["width"] == head_dim
    rotary = _rotary_dim(rows, head_dim)
    if per_head and not norm["gemma"]:
        if _hf_cache_write(anchor):
            return _norm_combination(rows, norm, rotary, head_dim)
        return rows, (f"q/k are RMS-normalised per head with a plain weight (x * w), then RoPE over {rotary} of "
                      f"{head_dim} dims, written to a paged cache: the fused GQA prologue takes that norm in HF's "
                      "code (its static cache, or continuous batching's flat one) only")  # fmt: skip
    if per_head or not norm["gemma"]:
        return _norm_combination(rows, norm, rotary, head_dim)
    return rows, (f"q/k are RMS-normalised over the whole projection ({norm['width']} wide) with Gemma's (1 + w) "
                  f"weight, then RoPE over {rotary} of {head_dim} dims: the fused GQA prologue takes per-head norms "
                  "(a plain x * w weight as Qwen3-MoE and GLM-4-MoE write it, or Qwen3.5's 1 + w) or MiniMax-M2's "
                  "whole-projection x * w norm")  # fmt: skip


def _complex_rope_reason(rows: torch.fx.Node, rope: torch.fx.Node) -> str:
    """k turned in complex numbers (Llama-4's ``apply_rotary_emb``), and normalised after that
    where it is (Llama-4's ``qk_norm``, an RMS norm without a weight: its L2 norm)."""
    dtype = str(getattr(rope.meta.get("val"), "dtype", "its dtype")).removeprefix("torch.")
    after = ""
    if _norm_after_rope(rows):
        norm = _k_norm(rows)
        weight = " with no weight" if norm is not None and not norm["weighted"] else ""
        after = f", then RMS-normalised{weight} after its RoPE (as Llama-4's qk_norm is)"
    return (f"k is rotated in complex numbers, view_as_real(view_as_complex(x) * freqs_cis) on GPT-J pairs (2i, "
            f"2i + 1) in {dtype}, as Llama-4's apply_rotary_emb writes its RoPE{after}: the fused GQA prologue takes "
            "RoPE as real cos / sin products, and q/k norms before the RoPE only")  # fmt: skip


# (per head, Gemma's weight, x·rstd rounded before the weight, RoPE in fp32 or None: any) of each
# norm the variants take: Qwen3-MoE's, MiniMax's, Qwen3.5's, OLMo-2's.
_NORM_SPELLINGS = {(True, False, True, None), (False, False, True, None), (True, True, False, None),
                   (False, False, False, True)}  # fmt: skip


def _norm_combination(rows, norm: dict, rotary: int, head_dim: int) -> tuple[torch.fx.Node, str] | None:
    """The q/k norm and RoPE as the model spells them, where no variant takes that norm before
    that RoPE (the variants' spellings are whole model codes); None where one does (another
    departure: Inductor's FailedMatch text)."""
    rotation = upstream(rows, _rotation, 8)
    value = _compat.fake_value(rotation) if rotation is not None else None
    fp32_rope = value is not None and value.dtype == torch.float32
    key = (norm["width"] == head_dim, norm["gemma"], norm["rounded_first"])
    if (*key, None) in _NORM_SPELLINGS or (*key, fp32_rope) in _NORM_SPELLINGS:
        return None
    width = "per head" if norm["width"] == head_dim else f"over the whole projection ({norm['width']} wide)"
    weight = "Gemma's (1 + w)" if norm["gemma"] else "a plain (x * w)"
    rounding = "rounded to the activation dtype before" if norm["rounded_first"] else "in fp32, rounded once after"
    rope = f"in {value.dtype}" if value is not None else "in another spelling"
    return rows, (f"q/k are RMS-normalised {width} with {weight} weight, x·rstd {rounding} the weight multiply, then "
                  f"RoPE over {rotary} of {head_dim} dims {rope}: no fused GQA prologue variant takes that combination "
                  "(MiniMax-M2, OLMo-2, Qwen3-MoE, Qwen3.5 and Gemma-3 each write one)")  # fmt: skip


def _facts_with_angles(nodes, inputs):
    facts = facts_of(nodes, inputs)
    facts.update(mla_prologue.angle_facts(inputs))
    if "q_var" in inputs:
        facts["variances"] = _variance_facts(inputs)
    if "q_weight" not in inputs:  # the no-norm variants: q and k must come with no norm in front
        facts["normed_inputs"] = [side for side in ("q", "k") if _normed(inputs.get(side))]
        # a LayerNorm has an rsqrt too: only the normed sides can be centred
        facts["centred_inputs"] = [side for side in facts["normed_inputs"] if _centred(inputs.get(side))]
        # Cohere's cos / sin come repeated pairwise from its rotary embedding, outside the match
        facts["angle_repeats"] = {_angles_repeat(inputs.get(name)) for name in ("cos", "sin")}
    return facts


FAMILY = Family(
    name="gqa_prologue",
    variants=VARIANTS,
    dtype_combos=DTYPE_COMBOS,
    example_inputs=example_inputs,
    scalars=SCALARS,
    guard=guard,
    replacement=replacement,
    facts_of=_facts_with_angles,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, gqa_ops.__name__),
    distinct_inputs=(("q", "k"),),  # q's and k's paths have the same shape
)
