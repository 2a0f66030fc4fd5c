"""GQA attention prologue: q/k RMSNorm + partial NeoX or GPT-J RoPE + K/V cache write, one op
(issue 5: MiniMax-M2.5's full-width QK-norm; Qwen3.5's per-head Gemma QK-norm; issue 29: HF's
plain per-head QK-norm, and no QK-norm at all: Mixtral, Qwen2-MoE, GLM-4-MoE by default, GLM-4's
GPT-J pairs).

    fusion_compiler::gqa_prologue(Tensor q, Tensor k, Tensor v, Tensor? q_norm_weight,
        Tensor? k_norm_weight, float eps, float weight_offset, bool full_width_norm,
        Tensor cos, Tensor sin, Tensor? positions, Tensor(a!) k_cache, Tensor(b!) v_cache,
        Tensor slots, float k_scale, float v_scale, bool cache_heads_first,
        Tensor? q_variance=None, Tensor? k_variance=None, float variance_divisor=1.0,
        bool round_normalized=False, bool round_rope_products=False,
        bool interleaved_rope=False) -> Tensor q_out

    fusion_compiler::gqa_prologue_variance(Tensor q, Tensor k) -> Tensor   [T, 2] fp32

Semantics (``gqa_prologue_reference`` is the numerical truth); T tokens, D = head_dim:

    q, k, v      [T, heads, D], [T, kv_heads, D], [T, kv_heads, D], unit stride along D, any
                 token and head strides: views of one fused qkv GEMM output (MiniMax, vLLM), of
                 separate projections (HF), or of Qwen3.5's per-head [q | gate] rows (head
                 stride 2D)
    norm(x, w)   RMSNorm in fp32, ``x * rstd * (w + weight_offset)`` rounded to x.dtype; with
                 ``round_normalized`` ``x * rstd`` is rounded to x.dtype first and the product
                 with the weight rounded again (HF's ``weight * x.to(dtype)``: MiniMax's
                 ``MiniMaxM2RMSNorm``, vLLM's ``MiniMaxText01RMSNormTP``; Qwen3.5's Gemma norm
                 rounds once). Over all of a token's heads when ``full_width_norm`` (MiniMax: q
                 over 6144, k over 1024, weights [heads * D] and [kv_heads * D]), else per head
                 (Qwen3.5: weights [D], Gemma ``weight_offset`` 1.0). Both weights None: no
                 norm, norm(x) = x (the attention has no q/k norms; eps and weight_offset are
                 unused, full_width_norm must be False and no variances given)
    variances    tensor parallelism (full width only): the mean of squares is given, not
                 computed: q's is ``q_variance[t] / variance_divisor`` (fp32, correctly rounded
                 division), k's likewise; q_variance, k_variance [T, 1] fp32, any token stride.
                 The all-reduced sum of the ranks' local means and the world size (what vLLM's
                 ``MiniMaxText01RMSNormTP`` divides), or an already global mean and 1.0. Here q,
                 k and the weights are this rank's heads and weight shards.
    rope(x)      NeoX (rotate-half) on each head's first ``rotary_dim = 2 * cos.shape[-1]``
                 dims (up to all D), pairs (i, i + rotary_dim / 2); with ``interleaved_rope``
                 GPT-J's pairs (2i, 2i + 1) instead, kept in place (HF's GLM / GLM-4:
                 ``rotate_half`` on ``x[..., 0::2]``, ``x[..., 1::2]``, cos / sin
                 ``repeat_interleave``d). Pair i turns by angle i, one angle per pair: cos / sin
                 [N, rotary_dim / 2] read at
                 row ``positions[t]`` (vLLM's cos_sin_cache halves), or without positions at row
                 ``t % N``, N dividing T: one row per token (HF's per-row ``position_ids``), or
                 one per position of a sequence repeated over the batch (HF's default [1, S]
                 ``position_ids``, tokens batch-major). Any dtype; fp32 math rounded once, or
                 with ``round_rope_products`` each product and each sum rounded to x.dtype (HF's
                 ``x * cos + rotate_half(x) * sin`` on bf16 tensors, cos / sin in x.dtype); dims
                 past rotary_dim pass through
    q_out        rope(norm(q, q_norm_weight))                   [T, heads, D] contiguous, q.dtype
    k_cache      rope(norm(k, k_norm_weight))[t] at flat slot ``slots[t]``; v_cache v[t]. The
                 caches are [blocks, block_size, kv_heads, D] (paged, vLLM), or with
                 ``cache_heads_first`` [blocks, kv_heads, block_size, D] (HF's static cache
                 [batch, kv_heads, max_len, D]: slot = batch * max_len + position). Slot s is
                 row s % block_size of block s // block_size; slot -1 writes nothing. FP8
                 caches store ``value / scale`` (correctly rounded), clamped to +-448 and rounded
                 to e4m3 (per-tensor k_scale / v_scale). A 3-D cache [slots, kv_heads, D] is
                 flat, one row per slot (HF's continuous batching: ``index_copy_`` along dim 0),
                 a paged cache of block_size 1 (cache_heads_first must be False).

``gqa_prologue_variance`` is the other side of that all-reduce: each token's local means of
squares, ``[mean(q[t].float()**2), mean(k[t].float()**2)]`` over all of q's and of k's columns
(q [T, q_width], k [T, k_width], unit stride along the last dim), the [T, 2] that vLLM's
``forward_qk`` all-reduces in one call.

The rounding flags make the op round where the matched code rounds, so a fused model keeps
eager's bits (a greedy decode that rounds elsewhere can take another token at a near tie): HF's
MiniMax code sets both, HF's Qwen3.5 code the RoPE one (its Gemma norm rounds once), HF's code
without q/k norms the RoPE one (on the projections' own rows), serving
code (fp32 RoPE) the norm one for MiniMax. In fp32 the roundings are exact.

On CUDA the op runs ``kernels/gqa_prologue.py``. The pattern family
``patterns/gqa_prologue.py`` emits it.
"""

from __future__ import annotations

import torch

from ._checks import require_dtype, require_shape, require_size_eq, require_slots_in_range
from .padding_slots import padded_scatter_rows
from .rope import cos_sin_for_tokens, rope_interleaved_reference, rope_neox_reference

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FP8_MAX = 448.0
_CACHE_DTYPES = _FLOATS + (torch.float8_e4m3fn,)

_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, float weight_offset, "
    "bool full_width_norm, Tensor cos, Tensor sin, Tensor? positions, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slots, float k_scale, float v_scale, bool cache_heads_first, Tensor? q_variance=None, "
    "Tensor? k_variance=None, float variance_divisor=1.0, bool round_normalized=False, "
    "bool round_rope_products=False, bool interleaved_rope=False) -> Tensor"
)
ARG_NAMES = (
    "q", "k", "v", "q_norm_weight", "k_norm_weight", "eps", "weight_offset", "full_width_norm", "cos", "sin",
    "positions", "k_cache", "v_cache", "slots", "k_scale", "v_scale", "cache_heads_first", "q_variance",
    "k_variance", "variance_divisor", "round_normalized", "round_rope_products", "interleaved_rope",
)  # fmt: skip
# The tensor-parallel arguments' defaults: the op computes the full-width means itself.
NO_VARIANCE = {"q_variance": None, "k_variance": None, "variance_divisor": 1.0}
# The defaults of the arguments after cache_heads_first: no variances given, one rounding each,
# NeoX pairs.
DEFAULTS = {**NO_VARIANCE, "round_normalized": False, "round_rope_products": False, "interleaved_rope": False}


def paged_view(cache: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """The cache as [blocks, block_size, kv_heads, D] (a view); a flat [slots, kv_heads, D] one
    as blocks of one row."""
    if cache.dim() == 3:
        return cache.unsqueeze(1)
    return cache.transpose(1, 2) if heads_first else cache


def unpaged_view(paged: torch.Tensor, cache: torch.Tensor, heads_first: bool) -> torch.Tensor:
    """``paged_view``'s inverse: ``paged`` in ``cache``'s own layout."""
    if cache.dim() == 3:
        return paged.squeeze(1)
    return paged.transpose(1, 2) if heads_first else paged


def _require_float(t: torch.Tensor, name: str, dtypes: tuple = _FLOATS) -> None:
    """A dtype the kernel cannot take, said as a miss reason (the pattern family reports it)."""
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} dtype {t.dtype} is not one the fused GQA prologue takes ({names}): its kernel "
                         f"computes in fp32")  # fmt: skip


def _validate(q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm, cos, sin, positions,
              k_cache, v_cache, slots, k_scale, v_scale, cache_heads_first, q_variance=None, k_variance=None,
              variance_divisor=1.0, round_normalized=False, round_rope_products=False,
              interleaved_rope=False) -> tuple[int, int, int, int]:  # fmt: skip
    """(heads, kv_heads, head_dim, rotary_dim)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight),
                    ("cos", cos), ("sin", sin)):  # fmt: skip
        if t is not None:
            _require_float(t, name)
    _require_float(k_cache, "k_cache", _CACHE_DTYPES)
    _require_float(v_cache, "v_cache", _CACHE_DTYPES)
    if k_cache.dim() not in (3, 4) or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must be 4-D (paged) or 3-D (flat) alike, got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")  # fmt: skip
    if k_cache.dim() == 3 and cache_heads_first:
        raise ValueError(f"a flat cache {tuple(k_cache.shape)} is [slots, kv_heads, D]: cache_heads_first must be False")
    _, _, kv_heads, head_dim = paged_view(k_cache, cache_heads_first).shape
    if q.dim() != 3:
        raise ValueError(f"q must be [T, heads, head_dim], got {tuple(q.shape)}")
    tokens, heads = q.shape[0], q.shape[1]
    require_shape(q, (tokens, heads, head_dim), "q")
    require_shape(k, (tokens, kv_heads, head_dim), "k")
    require_shape(v, (tokens, kv_heads, head_dim), "v")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads evenly")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together: both tensors (q/k norms) or both None (none)")
    if q_norm_weight is None:
        if full_width_norm or q_variance is not None or k_variance is not None:
            raise ValueError("without norm weights there is no norm: full_width_norm must be False, no variances")
    else:
        norm_widths = (heads * head_dim, kv_heads * head_dim) if full_width_norm else (head_dim, head_dim)
        require_shape(q_norm_weight, (norm_widths[0],), "q_norm_weight")
        require_shape(k_norm_weight, (norm_widths[1],), "k_norm_weight")
    rotary_dim = 2 * cos.shape[-1]
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(f"cos and sin must be [rows, rotary_dim / 2] alike, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} (twice the cos width) must be in (0, {head_dim}]")
    if positions is None:
        _require_rows_repeat(cos.shape[0], tokens)
    else:
        require_shape(positions, (tokens,), "positions")
    require_shape(slots, (tokens,), "slots")
    if not (eps > 0 and k_scale > 0 and v_scale > 0):
        raise ValueError(f"eps, k_scale and v_scale must be > 0, got {eps}, {k_scale}, {v_scale}")
    _validate_variances(q_variance, k_variance, variance_divisor, full_width_norm, tokens)
    return heads, kv_heads, head_dim, rotary_dim


def _require_rows_repeat(rows, tokens) -> None:
    """Without positions token t reads cos / sin row t % rows: rows must divide the tokens."""
    what = (f"cos / sin have {rows} rows for {tokens} tokens: without positions each row must serve "
            f"the same number of tokens (one per token, or one per position repeated over the batch)")  # fmt: skip
    if isinstance(rows, int) and isinstance(tokens, int):
        if rows != tokens and (rows < 1 or tokens % rows):
            raise ValueError(what)
    else:  # one expression, which the sizes' symbols decide without a guard (B * S % S, s0 % 1)
        torch._check(tokens % rows == 0, lambda: what)


def _validate_variances(q_variance, k_variance, divisor, full_width_norm, tokens) -> None:
    if q_variance is None and k_variance is None:
        return
    if q_variance is None or k_variance is None:
        raise ValueError("q_variance and k_variance come together (got one of them)")
    if not full_width_norm:
        raise ValueError("q_variance / k_variance replace a full-width norm's means; full_width_norm is False")
    for name, t in (("q_variance", q_variance), ("k_variance", k_variance)):
        require_dtype(t, (torch.float32,), name)
        require_shape(t, (tokens, 1), name)
    if not divisor > 0:
        raise ValueError(f"variance_divisor must be > 0, got {divisor}")


def _norm(x, weight, eps, weight_offset, full_width, round_normalized, variance=None, divisor=1.0):
    if weight is None:  # no q/k norm: x enters RoPE as it is
        return x
    h = (x.reshape(x.shape[0], -1) if full_width else x).float()
    if variance is None:
        variance = (h * h).mean(dim=-1, keepdim=True)
    else:  # the mean of squares given (tensor parallelism); the division rounds once
        variance = variance / divisor
    normalized = h * torch.rsqrt(variance + eps)
    if round_normalized:
        normalized = normalized.to(x.dtype).float()
    return (normalized * (weight.float() + weight_offset)).to(x.dtype).view(x.shape)


def _rope(x, cos, sin, rotary_dim, round_products, interleaved=False):
    """cos / sin: fp32 [T, rotary_dim / 2]. ``interleaved``: GPT-J pairs (2i, 2i + 1) in place."""
    if not round_products:
        rope = rope_interleaved_reference if interleaved else rope_neox_reference
        return torch.cat([rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)

    def rounded(t):
        return t.to(x.dtype).float()

    half = rotary_dim // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        first, second = x[..., 0:rotary_dim:2].float(), x[..., 1:rotary_dim:2].float()
    else:
        first, second = x[..., :half].float(), x[..., half:rotary_dim].float()
    rotated = [rounded(rounded(first * cos) - rounded(second * sin)).to(x.dtype),
               rounded(rounded(second * cos) + rounded(first * sin)).to(x.dtype)]  # fmt: skip
    rotated = [torch.stack(rotated, dim=-1).flatten(-2)] if interleaved else rotated
    return torch.cat(rotated + [x[..., rotary_dim:]], dim=-1)


def _cos_sin(cos, sin, positions, tokens):
    """Per-token fp32 cos / sin [T, rotary_dim / 2]: rows at the positions, or row t % rows."""
    if positions is None and cos.shape[0] != tokens:
        positions = torch.arange(tokens, device=cos.device) % cos.shape[0]
    return cos_sin_for_tokens(cos, sin, positions)


def _write(cache, heads_first, slots, rows, scale):
    paged = paged_view(cache, heads_first)
    keep = slots >= 0
    values, kept = rows[keep], slots[keep]
    if cache.dtype == torch.float8_e4m3fn:
        values = (values.double() / scale).float().clamp(-FP8_MAX, FP8_MAX)  # division rounded once
    paged[kept // paged.shape[1], kept % paged.shape[1]] = values.to(cache.dtype)


def gqa_prologue_reference(q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm, cos, sin,
                           positions, k_cache, v_cache, slots, k_scale, v_scale, cache_heads_first=False,
                           q_variance=None, k_variance=None, variance_divisor=1.0, round_normalized=False,
                           round_rope_products=False, interleaved_rope=False):  # fmt: skip
    """Plain torch, any device; writes the caches in place and returns q_out."""
    *_, rotary_dim = _validate(
        q, k, v, q_norm_weight, k_norm_weight, eps, weight_offset, full_width_norm, cos, sin, positions,
        k_cache, v_cache, slots, k_scale, v_scale, cache_heads_first, q_variance, k_variance, variance_divisor,
    )  # fmt: skip
    paged = paged_view(k_cache, cache_heads_first)
    require_slots_in_range(slots, paged.shape[0] * paged.shape[1])
    cos, sin = _cos_sin(cos, sin, positions, q.shape[0])
    norm = (eps, weight_offset, full_width_norm, round_normalized)
    rope = (cos, sin, rotary_dim, round_rope_products, interleaved_rope)
    q_out = _rope(_norm(q, q_norm_weight, *norm, q_variance, variance_divisor), *rope)
    k_out = _rope(_norm(k, k_norm_weight, *norm, k_variance, variance_divisor), *rope)
    _write(k_cache, cache_heads_first, slots, k_out, k_scale)
    _write(v_cache, cache_heads_first, slots, v, v_scale)
    return q_out.contiguous()


def gqa_prologue_canonical(**kwargs):
    """The same math as a functional graph Inductor fuses (lowering "inductor"): returns
    (q_out, new k_cache, new v_cache), as ``auto_functionalized`` does. Padding slots (-1) write
    the first live row's slot with its own row (ops/padding_slots.py)."""
    args = {name: kwargs[name] if name in kwargs else DEFAULTS[name] for name in ARG_NAMES}
    *_, rotary_dim = _validate(**args)
    cos, sin, positions = args["cos"], args["sin"], args["positions"]
    if positions is None:  # row t % rows, spelled without a size comparison (sizes may be symbolic)
        positions = torch.arange(args["q"].shape[0], device=cos.device) % cos.shape[0]
    cos, sin = cos_sin_for_tokens(cos, sin, positions)
    norm = (args["eps"], args["weight_offset"], args["full_width_norm"], args["round_normalized"])
    rope = (cos, sin, rotary_dim, args["round_rope_products"], args["interleaved_rope"])
    divisor = args["variance_divisor"]
    q_out = _rope(_norm(args["q"], args["q_norm_weight"], *norm, args["q_variance"], divisor), *rope)
    k_out = _rope(_norm(args["k"], args["k_norm_weight"], *norm, args["k_variance"], divisor), *rope)
    slots, heads_first = args["slots"], args["cache_heads_first"]

    def write(cache, rows, scale):
        paged = paged_view(cache, heads_first)
        if cache.dtype == torch.float8_e4m3fn:
            rows = (rows.double() / scale).float().clamp(-FP8_MAX, FP8_MAX)
        block = paged.shape[1]
        targets, rows = padded_scatter_rows(slots, rows.to(cache.dtype), lambda t: paged[t // block, t % block])
        written = torch.ops.aten.index_put.default(paged, [targets // block, targets % block], rows)
        return unpaged_view(written, cache, heads_first)

    k_new = write(args["k_cache"], k_out, args["k_scale"])
    return q_out.contiguous(), k_new, write(args["v_cache"], args["v"], args["v_scale"])


@torch.library.custom_op("fusion_compiler::gqa_prologue", mutates_args=("k_cache", "v_cache"), schema=_SCHEMA)
def _op(*args):
    return gqa_prologue_reference(*args)


@_op.register_fake
def _fake(*args):
    heads, _, head_dim, _ = _validate(*args)
    q = args[0]
    return q.new_empty((q.shape[0], heads, head_dim))


def _all_args(args: tuple) -> tuple:
    """The op's arguments with the defaults the caller left out (the dispatcher hands an
    implementation only what was passed)."""
    return tuple(args) + tuple(DEFAULTS[name] for name in ARG_NAMES[len(args) :])


@_op.register_kernel("cuda")
def _cuda(*args):
    from fusion_compiler.kernels.gqa_prologue import gqa_prologue_fwd

    *args, interleaved_rope = _all_args(args)
    heads, _, head_dim, _ = _validate(*args)
    q = args[0]
    for i in (ARG_NAMES.index("k_cache"), ARG_NAMES.index("v_cache")):  # a flat cache: blocks of one row
        args[i] = paged_view(args[i], False) if args[i].dim() == 3 else args[i]
    q_out = torch.empty((q.shape[0], heads, head_dim), dtype=q.dtype, device=q.device)
    gqa_prologue_fwd(*args, q_out, interleaved_rope=interleaved_rope)
    return q_out


# ------------------------------------------------------------------------------------------
# The local side of a tensor-parallel full-width norm
# ------------------------------------------------------------------------------------------


def _validate_variance(q, k) -> None:
    for name, t in (("q", q), ("k", k)):
        require_dtype(t, _FLOATS, name)
        if t.dim() != 2:
            raise ValueError(f"{name} must be [T, width], got {tuple(t.shape)}")
    require_size_eq(k.shape[0], q.shape[0], "k tokens (q's)")


def gqa_prologue_variance_reference(q, k):
    """[T, 2] fp32: each token's mean of squares over q's columns, then over k's."""
    _validate_variance(q, k)
    return torch.cat([q.float().pow(2).mean(-1, keepdim=True), k.float().pow(2).mean(-1, keepdim=True)], dim=-1)


@torch.library.custom_op("fusion_compiler::gqa_prologue_variance", mutates_args=(), schema="(Tensor q, Tensor k) -> Tensor")
def _variance_op(q, k):
    return gqa_prologue_variance_reference(q, k)


@_variance_op.register_fake
def _variance_fake(q, k):
    _validate_variance(q, k)
    return q.new_empty((q.shape[0], 2), dtype=torch.float32)


@_variance_op.register_kernel("cuda")
def _variance_cuda(q, k):
    from fusion_compiler.kernels.gqa_prologue import gqa_prologue_variance_fwd

    _validate_variance(q, k)
    out = torch.empty((q.shape[0], 2), dtype=torch.float32, device=q.device)
    gqa_prologue_variance_fwd(q, k, out)
    return out
