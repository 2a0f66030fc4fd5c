"""DeepSeek V3.2's DSA indexer at decode, scores to sparse mask, as one op.

    fusion_compiler::dsa_topk_mask(Tensor q, Tensor k, Tensor weights, Tensor? mask, float scale,
                                   float weight_scale, int topk) -> Tensor

It replaces the indexer's tail in HF transformers' ``DeepseekV32Indexer`` plus the attention's
scatter of its indices into a mask (``modeling_deepseek_v32.py``):

    scores = relu(q.float() @ k.float()^T * scale)              [B, S, H, T]
    index  = (weights.float() * weight_scale) @ scores          [B, S, T]  (sum over heads)
    index  = index.masked_fill(~mask, -inf)  |  index + mask
    top    = index.topk(min(topk, T)).indices
    index_mask = ones.scatter(-1, top, False)                   True = not selected

Eager runs that as ~10 kernels on the GPU (an fp32 GEMM against the whole indexer cache, the
head reduction as a second GEMM, relu/scale, the mask, a two-kernel top-k sort of T scores,
two scatter kernels); the op is a score kernel and a select kernel, and it never sorts: the
k-th largest score is found by a radix select and the mask written from it.

Semantics (``dsa_topk_mask_reference`` is the numerical truth, plain torch, any device):

    q        [B, S, H, D]   the indexer's queries after RoPE, any strides
    k        [B, T, D]      the indexer key cache, any strides, fp16 / bf16 / fp32 (products
                            in fp32 either way; a mix of dtypes is exact but slower on the GPU)
    weights  [B, S, H]      the per-head weights before ``.float() * weight_scale``
    mask     None, or [B, S, T]: bool (True = may attend) or floating additive
    keep     [B, S, T] bool: t is among the ``min(topk, T)`` largest scores of its row, and
             (bool mask) the mask allows t

So with a bool mask the result is ``mask & ~index_mask``, what HF's SDPA path builds from the
scatter. Where fewer than ``topk`` positions are allowed, HF's top-k also picks masked (-inf)
positions, in no defined order; with a bool mask ``keep`` leaves every masked position out, so
``~keep`` equals HF's ``index_mask`` wherever the mask allows attention. An additive mask is
only added to the scores (``keep`` then holds exactly ``topk`` positions, masked ones last and
lowest position first among equal scores); whatever consumes the mask masks them again. Ties at the k-th
score are broken towards the lower position (``torch.topk`` leaves the order undefined); the
kernel sums each dot product in another order than the reference, so a position whose score
is within rounding of the k-th may be swapped for its neighbour.
"""

from __future__ import annotations

import math

import torch

from ._checks import require_dtype, require_size_eq

__all__ = ["SUPPORTED_DTYPES", "dsa_topk_mask_reference", "index_scores_reference", "keep_from_scores"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_SCHEMA = (
    "(Tensor q, Tensor k, Tensor weights, Tensor? mask, float scale, float weight_scale, int topk) -> Tensor"
)


def _validate(q, k, weights, mask, scale, weight_scale, topk) -> None:
    require_dtype(q, SUPPORTED_DTYPES, "q")
    require_dtype(k, SUPPORTED_DTYPES, "k")
    require_dtype(weights, SUPPORTED_DTYPES, "weights")
    if q.dim() != 4 or k.dim() != 3 or weights.dim() != 3:
        raise ValueError(
            f"expected q [B, S, H, D], k [B, T, D], weights [B, S, H]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(weights.shape)}"
        )
    batch, seq, heads, dim = q.shape
    require_size_eq(k.shape[0], batch, "k dim 0 (batch, q's)")
    require_size_eq(k.shape[2], dim, "k dim 2 (head_dim, q's)")
    for d, size in enumerate((batch, seq, heads)):
        require_size_eq(weights.shape[d], size, f"weights dim {d} (q's)")
    if mask is not None:
        if mask.dtype != torch.bool and mask.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"mask dtype {mask.dtype} not supported; expected bool or one of {SUPPORTED_DTYPES}")
        if mask.dim() != 3:
            raise ValueError(f"mask must be [B, S, T], got shape {tuple(mask.shape)}")
        for d, (size, what) in enumerate(((batch, "batch"), (seq, "queries"), (k.shape[1], "keys, k's T"))):
            require_size_eq(mask.shape[d], size, f"mask dim {d} ({what})")
    for name, t in (("k", k), ("weights", weights), ("mask", mask)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, expected {q.device} (q's)")
    if not (math.isfinite(scale) and scale > 0):
        # relu(x * scale) = scale * relu(x) only for scale > 0; HF's is head_dim ** -0.5.
        raise ValueError(f"scale must be finite and positive, got {scale}")
    if not math.isfinite(weight_scale):
        raise ValueError(f"weight_scale must be finite, got {weight_scale}")
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")


def index_scores_reference(q, k, weights, mask, scale, weight_scale, dtype=torch.float32):
    """The masked index scores [B, S, T] in ``dtype`` (float64 for tests' truth)."""
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.to(dtype), k.to(dtype)) * scale)
    index = torch.einsum("bsh,bsht->bst", weights.to(dtype) * weight_scale, scores)
    if mask is not None:
        index = index.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else index + mask.to(dtype)
    return index


def keep_from_scores(index: torch.Tensor, mask, topk: int) -> torch.Tensor:
    """keep [B, S, T] from masked scores: the top ``min(topk, T)``, lower position on ties."""
    keys = index.shape[-1]
    count = min(topk, keys)
    # A stable descending sort puts the lower position first among equal scores.
    order = torch.sort(index, dim=-1, descending=True, stable=True).indices[..., :count]
    keep = torch.zeros(index.shape, dtype=torch.bool, device=index.device).scatter(-1, order, True)
    return keep & mask if mask is not None and mask.dtype == torch.bool else keep


def dsa_topk_mask_reference(q, k, weights, mask, scale, weight_scale, topk):
    """Plain torch, any device: fp32 scores as HF computes them, then the top-k mask."""
    _validate(q, k, weights, mask, scale, weight_scale, topk)
    return keep_from_scores(index_scores_reference(q, k, weights, mask, scale, weight_scale), mask, topk)


@torch.library.custom_op("fusion_compiler::dsa_topk_mask", mutates_args=(), schema=_SCHEMA)
def _op(q, k, weights, mask, scale, weight_scale, topk):
    return dsa_topk_mask_reference(q, k, weights, mask, scale, weight_scale, topk)


@_op.register_fake
def _fake(q, k, weights, mask, scale, weight_scale, topk):
    _validate(q, k, weights, mask, scale, weight_scale, topk)
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.bool)


@_op.register_kernel("cuda")
def _cuda(q, k, weights, mask, scale, weight_scale, topk):
    # Imported lazily: only CUDA needs triton, and the import must come after any
    # TRITON_INTERPRET setting.
    from fusion_compiler.kernels.dsa_topk_mask import dsa_topk_mask_fwd

    _validate(q, k, weights, mask, scale, weight_scale, topk)
    keep = torch.empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.bool, device=q.device)
    dsa_topk_mask_fwd(q, k, weights, mask, scale, weight_scale, topk, keep)
    return keep
