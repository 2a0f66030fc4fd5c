"""GQA-aware single-query ("decode") attention over an un-repeated K/V cache, one op.

    fusion_compiler::decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale,
                                      bool sparse_mask=False) -> Tensor

It replaces HF transformers' decode step ``repeat_kv(k), repeat_kv(v)`` +
``scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, scale=scale)``, reading the
cache as it is (``repeat_kv`` materialises G copies of the whole cache every step).

Semantics (``decode_attention_reference`` is the numerical truth, plain torch, any device):

    q        [B, H, 1, D]      any strides (usually a transpose of [B, 1, H, D])
    k, v     [B, Hkv, S, D], [B, Hkv, S, Dv]   any strides (HF's StaticCache: contiguous);
             H % Hkv == 0, query head h reads kv head h // (H // Hkv) (HF's ``repeat_kv``:
             ``repeat_interleave`` on dim 1); q, k, v all fp16, all bf16 or all fp32
    mask     None, or [B or 1, 1, 1, S] (any strides, e.g. an expanded view): bool (True =
             attend) or floating additive (added to the scaled scores; -inf = masked). Per-head
             or per-query masks (dim 1 or 2 of size > 1) are rejected.
    scores   (q.float() @ k_rep.float()^T) * scale (+ mask), softmax in fp32
    out      (p @ v_rep.float()).to(q.dtype), a new contiguous [B, H, 1, Dv]
    sparse_mask  a hint, not semantics: the mask rules positions out (DSA's top-k, a static
             cache's unwritten tail), so the kernel reads the mask first, loads no K / V row
             it rules out and visits no tile outside its first..last kept position. Off, it
             loads every row and reads the mask beside them (no load waits on another).
             patterns/decode_attention.py sets it wherever there is a mask.

A row with every position masked gives NaN, like sdpa. The kernel rounds p to V's dtype before
the P @ V product (tensor-core operands), so bf16 / fp16 outputs agree with the reference to
their tolerance, not bit for bit; fp32 to ~1e-6.

On CUDA the op runs ``kernels/decode_attention.py`` (split-KV flash decoding, no host syncs);
elsewhere the reference; the fake impl gives the contiguous output's shape and dtype.
"""

from __future__ import annotations

import math

import torch

from ._checks import require_dtype, require_size_eq

__all__ = ["SUPPORTED_DTYPES", "decode_attention_reference"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, bool sparse_mask=False) -> Tensor"


def _validate(q, k, v, mask, scale) -> tuple[int, int, int]:
    """(heads, kv_heads, Dv)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_dtype(t, SUPPORTED_DTYPES, name)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (q [B, H, 1, D], k / v [B, Hkv, S, D]), got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, heads, q_len, head_dim = q.shape
    require_size_eq(q_len, 1, "q dim 2 (one query per sequence)")
    _, kv_heads, seq_len, _ = k.shape
    dv = v.shape[3]
    require_size_eq(k.shape[0], batch, "k dim 0 (batch, q's)")
    require_size_eq(k.shape[3], head_dim, "k dim 3 (head_dim, q's)")
    for d, (name, size) in enumerate((("batch", batch), ("kv_heads", kv_heads), ("seq_len", seq_len))):
        require_size_eq(v.shape[d], size, f"v dim {d} ({name}, k's)")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads evenly")
    if isinstance(seq_len, int) and seq_len < 1:
        raise ValueError("k / v must hold at least one position (S >= 1)")
    if mask is not None:
        _validate_mask(mask, batch, seq_len)
    for name, t in (("k", k), ("v", v), ("mask", mask)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, expected {q.device} (q's)")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return heads, kv_heads, dv


def _validate_mask(mask, batch, seq_len) -> None:
    if mask.dtype != torch.bool and mask.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"mask dtype {mask.dtype} not supported; expected bool or one of {SUPPORTED_DTYPES}")
    if mask.dim() != 4:
        raise ValueError(f"mask must be 4-D [B or 1, 1, 1, S], got shape {tuple(mask.shape)}")
    if mask.shape[1] != 1:
        raise ValueError(f"per-head masks are not supported: mask dim 1 must be 1, got shape {tuple(mask.shape)}")
    if mask.shape[2] != 1:
        raise ValueError(f"per-query masks are not supported: mask dim 2 must be 1, got shape {tuple(mask.shape)}")
    if isinstance(mask.shape[0], int) and isinstance(batch, int) and mask.shape[0] not in (1, batch):
        raise ValueError(f"mask dim 0 must be 1 or the batch {batch}, got shape {tuple(mask.shape)}")
    require_size_eq(mask.shape[3], seq_len, "mask dim 3 (seq_len)")


def decode_attention_reference(q, k, v, mask, scale):
    """Plain torch, any device: upcast, ``repeat_interleave`` the kv heads, fp32 softmax."""
    heads, kv_heads, _ = _validate(q, k, v, mask, scale)
    group = heads // kv_heads
    k_rep = k.float().repeat_interleave(group, dim=1)
    v_rep = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ k_rep.transpose(-1, -2)) * scale  # [B, H, 1, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    p = torch.softmax(scores, dim=-1)
    return (p @ v_rep).to(q.dtype).contiguous()


@torch.library.custom_op("fusion_compiler::decode_attention", mutates_args=(), schema=_SCHEMA)
def _op(q, k, v, mask, scale, sparse_mask=False):
    return decode_attention_reference(q, k, v, mask, scale)


@_op.register_fake
def _fake(q, k, v, mask, scale, sparse_mask=False):
    heads, _, dv = _validate(q, k, v, mask, scale)
    return q.new_empty((q.shape[0], heads, 1, dv))


@_op.register_kernel("cuda")
def _cuda(q, k, v, mask, scale, sparse_mask=False):
    # Imported lazily: only CUDA needs triton, and the import must come after any
    # TRITON_INTERPRET setting.
    from fusion_compiler.kernels.decode_attention import decode_attention_fwd

    heads, _, dv = _validate(q, k, v, mask, scale)
    out = torch.empty((q.shape[0], heads, 1, dv), dtype=q.dtype, device=q.device)
    decode_attention_fwd(q, k, v, mask, scale, out, skip_masked=sparse_mask)
    return out
