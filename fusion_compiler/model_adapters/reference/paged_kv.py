"""The pieces of a serving engine's GQA decode step that the MiniMax-M2.5 and Qwen3.5 references
share: the RoPE cos/sin table, partial NeoX RoPE, the paged KV cache (write, read, per-sequence
context) and decode attention over that cache; and what every reference decode step shares
(DeepSeek V3.2's too): a shuffled block table, each sequence's padded context, random inputs.

These are *model code*: the compiler's patterns are written against the op sequences below (the
torch calls, in this order), so a change of spelling here is a change of what gets matched.

Cache layout, as vLLM's: ``[num_blocks, block_size, kv_heads, head_dim]`` per cache (one for K,
one for V), addressed by a flat slot ``block * block_size + offset``; bf16 or FP8 e4m3 with one
per-tensor scale per cache (``value / scale`` clamped to +-448 and rounded to FP8, as vLLM's
``fp8`` kv-cache dtype).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """A GQA attention layer with a paged KV cache, as the serving references build it; each
    model's reference subclasses it with its own defaults (rope_theta, ...)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 1e4
    rms_norm_eps: float = 1e-6
    block_size: int = 16
    kv_cache_dtype: str = "bf16"  # or "fp8"
    max_position: int = 4096  # RoPE table rows: a step's positions must stay below (REAL: the checkpoint's)

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def cache_dtype(self) -> torch.dtype:
        return cache_dtype_of(self.kv_cache_dtype)


def load_hf_attention(ours, hf_attention):
    """``ours`` (a reference Attention) with HF's q/k/v projections stacked into its qkv_proj
    and its q/k norm and o_proj weights, in HF's dtype and on its device."""
    ours = ours.to(hf_attention.q_proj.weight.dtype)
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([hf_attention.q_proj.weight, hf_attention.k_proj.weight, hf_attention.v_proj.weight]))
        ours.q_norm_weight.copy_(hf_attention.q_norm.weight)
        ours.k_norm_weight.copy_(hf_attention.k_norm.weight)
        ours.o_proj.weight.copy_(hf_attention.o_proj.weight)
    return ours.to(hf_attention.q_proj.weight.device)


def cache_dtype_of(kv_cache_dtype: str) -> torch.dtype:
    """The torch dtype of a kv-cache dtype name: "bf16" or "fp8" (e4m3)."""
    if kv_cache_dtype not in ("bf16", "fp8"):
        raise ValueError(f"kv_cache_dtype must be 'bf16' or 'fp8', got {kv_cache_dtype!r}")
    return torch.bfloat16 if kv_cache_dtype == "bf16" else FP8


def rope_cos_sin_cache(rotary_dim: int, rope_theta: float, max_position: int) -> torch.Tensor:
    """[max_position, rotary_dim] fp32: cos of the rotary_dim / 2 frequencies, then sin."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def rope_neox_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """NeoX (rotate-half) RoPE on the first ``rotary_dim`` dims of x [T, heads, D]; cos / sin
    [T, rotary_dim / 2]. fp32 math, one rounding; the other dims pass through."""
    half = rotary_dim // 2
    first, second = x[..., :half].float(), x[..., half:rotary_dim].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = torch.cat([first * c - second * s, second * c + first * s], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


def write_cache(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float) -> None:
    """cache [blocks, block_size, kv_heads, D] at flat ``slots`` [T] <- values [T, kv_heads, D],
    divided by ``scale``, clamped and rounded for an FP8 cache. As the DeepSeek reference, an
    ``index_put_`` (compiles without data-dependent shapes); every slot must be valid here (the
    fused op also skips vLLM's padding slot -1, which index_put_ would wrap to the last row)."""
    rows = (values.float() / scale).clamp(-448.0, 448.0) if cache.dtype == FP8 else values
    cache.view(-1, *cache.shape[2:]).index_put_((slots,), rows.to(cache.dtype))


def read_cache(cache: torch.Tensor, slots: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n, kv_heads, D] rows at flat ``slots`` in ``dtype``; FP8 rows dequantised (fp32 only)."""
    rows = cache.view(-1, *cache.shape[2:])[slots]
    return rows.float() * scale if cache.dtype == FP8 else rows.to(dtype)


def context_of(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """(context_slots [B, max_len], context_valid [B, max_len]) of each sequence's positions."""
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=block_table.device)
    slots = block_table[:, pos // block_size] * block_size + pos % block_size
    return slots, pos[None, :] < seq_lens[:, None]


def padded_context_of(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """(context_slots [B, blocks * block_size], context_valid) of each sequence: every position its
    block table can hold, so the shapes do not depend on the lengths (no host sync, one compiled
    graph and one CUDA graph for every length, as serving engines size their decode metadata)."""
    width = block_table.shape[1] * block_size
    pos = torch.arange(width, device=block_table.device)
    slots = block_table[:, pos // block_size] * block_size + pos % block_size
    return slots, pos.unsqueeze(0) < seq_lens.unsqueeze(1)


def paged_decode_attention(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid, num_kv_heads):
    """Decode attention: q [T, heads, D], token t the last token of sequence t, attending to
    ``context_slots[t]`` (its sequence's slots, the new one included, padded where
    ``context_valid`` is False); query head h reads kv head h // (heads / num_kv_heads); scale
    D^-0.5. Returns [T, heads, D] fp32 (the caller rounds to its activation dtype).

    The attention core is one opaque op (``fusion_compiler_ref::paged_decode_attention``), as a
    serving engine's attention backend is: every mode (eager, stock Inductor, ours) runs the same
    kernels, so a comparison of the layers measures the fusion around it."""
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"the caches hold {k_cache.shape[2]} kv heads, not {num_kv_heads}")
    return torch.ops.fusion_compiler_ref.paged_decode_attention(
        q, k_cache, v_cache, float(k_scale), float(v_scale), context_slots, context_valid
    )


@torch.library.custom_op("fusion_compiler_ref::paged_decode_attention", mutates_args=())
def _paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
                            v_scale: float, context_slots: torch.Tensor, context_valid: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """On CUDA: the split-KV flash-decoding kernel (``kernels/paged_decode_attention.py``) reads
    each valid position's K/V row straight from the cache through ``context_slots`` (no gathered
    copy; FP8 rows fed to the MMAs exactly, the scales applied to the fp32 scores and
    accumulator). Elsewhere (CPU), and on CUDA where the kernel does not apply (see
    ``_kernel_or_none``), ``_gathered_attention``."""
    out = _kernel_or_none(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid)
    if out is not None:
        return out
    return _gathered_attention(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid)


def _kernel_or_none(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid):
    """The kernel's result, or None where the gathered path must run. The kernel computes the
    same attention (the reference's, in fp32 accumulation), so falling back never changes
    semantics; it is done only for these reasons:
      - not every tensor on CUDA (CPU runs the gather + SDPA; the kernel is GPU code);
      - triton not importable (a non-Linux install);
      - arguments the kernel was not built for (``paged_decode_attention.unsupported``): q not
        fp16 / bf16 / fp32, a cache neither q's dtype nor FP8 e4m3 (e.g. bf16 caches under an
        fp32 q: the gathered path computes those in fp32), head dims above 256 (its tiles were
        sized up to Qwen3.5's 256), an empty context, malformed shapes (the gathered path then
        raises its own error).
    One difference that is not a fallback: a token with no valid position at all (a CUDA-graph
    bucket's padding row, seq_len 0) gets NaN from the kernel, as from the reference, where
    torch's SDPA (the gathered path) returns 0; such rows are never read back (cudagraph.py)."""
    tensors = (q, k_cache, v_cache, context_slots, context_valid)
    if not all(t.is_cuda for t in tensors):
        return None
    try:
        from ...kernels import paged_decode_attention as kernel
    except ImportError:
        return None
    if kernel.unsupported(q, k_cache, v_cache, context_slots, context_valid) is not None:
        return None
    return kernel.paged_decode_attention_fwd(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid)


def _gathered_attention(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid):
    """Each sequence's K/V rows gathered once (no copy per query head: a GQA group's G query
    heads are G queries of one SDPA call over their kv head), FP8 rows dequantised to fp32,
    bf16 / fp16 rows kept as they are (exact), then ``scaled_dot_product_attention`` with the
    context mask. The gather is [T, context, kv_heads, D]: at MiniMax's widths and batch 64
    0.5 GiB a cache in bf16, where the repeat to every query head in fp32 it replaces was 6 GiB
    (11 ms a layer on the H200, bench/NOTES.md)."""
    tokens, ctx = context_slots.shape
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    dtype = q.dtype if k_cache.dtype == q.dtype and v_cache.dtype == q.dtype else torch.float32
    flat = context_slots.clamp(min=0).flatten()

    def rows(cache, scale):  # [T, kv_heads, context, D]
        return read_cache(cache, flat, scale, dtype).view(tokens, ctx, kv_heads, -1).transpose(1, 2)

    grouped_q = q.to(dtype).view(tokens, kv_heads, heads // kv_heads, head_dim)
    mask = context_valid.view(tokens, 1, 1, ctx)
    out = F.scaled_dot_product_attention(grouped_q, rows(k_cache, k_scale), rows(v_cache, v_scale),
                                         attn_mask=mask, scale=head_dim**-0.5)  # fmt: skip
    return out.reshape(tokens, heads, -1).float()


@_paged_decode_attention.register_fake
def _(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]), dtype=torch.float32)


def paged_decode_attention_reference(q, k_cache, v_cache, k_scale, v_scale, context_slots, context_valid, num_kv_heads):
    """The same attention in fp32 with every kv head repeated to its query heads (the op's
    numerical truth, for tests)."""
    tokens, ctx = context_slots.shape
    heads, head_dim = q.shape[1], q.shape[2]
    keys = read_cache(k_cache, context_slots.clamp(min=0).flatten(), k_scale)
    values = read_cache(v_cache, context_slots.clamp(min=0).flatten(), v_scale)
    keys = keys.view(tokens, ctx, num_kv_heads, head_dim).repeat_interleave(heads // num_kv_heads, 2)
    values = values.view(tokens, ctx, num_kv_heads, -1).repeat_interleave(heads // num_kv_heads, 2)
    scores = torch.einsum("thd,tchd->thc", q.float(), keys) * head_dim**-0.5
    scores = scores.masked_fill(~context_valid[:, None, :], float("-inf"))
    return torch.einsum("thc,tchd->thd", scores.softmax(-1), values)


class DecodeStack(nn.Module):
    """Decoder layers over paged K/V caches, one decode token per sequence: layer i reads
    ``(hidden, residual)``, attends through ``k_caches[i]`` / ``v_caches[i]`` and returns the
    next pair (vLLM's residual stream: each layer's first add + norm takes the previous layer's
    output and residual). Owns the RoPE table. Returns ``hidden + residual`` of the last layer."""

    def __init__(self, cfg: AttentionConfig, layers):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(layers)
        table = rope_cos_sin_cache(cfg.rotary_dim, cfg.rope_theta, cfg.max_position)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(self, hidden, residual, positions, slots, block_table, seq_lens, k_caches, v_caches,
                k_scale: float = 1.0, v_scale: float = 1.0):  # fmt: skip
        context_slots, context_valid = padded_context_of(block_table, seq_lens, self.cfg.block_size)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            hidden, residual = layer(hidden, residual, self.cos_sin_cache, positions, slots, k_cache, v_cache,
                                     k_scale, v_scale, context_slots, context_valid)  # fmt: skip
        return hidden + residual


# ------------------------------------------------------------------------------------------
# Random decode steps
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ReferenceStep:
    """Inputs of one decode step, as keyword arguments of a reference model's ``forward``.
    List-valued arguments are the per-layer caches and states, which the step writes."""

    kwargs: dict

    def caches(self) -> list[torch.Tensor]:
        return [t for v in self.kwargs.values() if isinstance(v, list) for t in v]

    def clone(self) -> ReferenceStep:
        return ReferenceStep({k: _map_tensors(v, torch.Tensor.clone) for k, v in self.kwargs.items()})

    def to(self, device) -> ReferenceStep:
        return ReferenceStep({k: _map_tensors(v, lambda t: t.to(device)) for k, v in self.kwargs.items()})


def _map_tensors(value, fn):
    if isinstance(value, list):
        return [fn(t) for t in value]
    return fn(value) if isinstance(value, torch.Tensor) else value


def random_block_table(tokens: int, context: int, block_size: int, gen: torch.Generator,
                       max_position: int | None = None) -> tuple[int, dict]:  # fmt: skip
    """``tokens`` sequences of ``context`` cached tokens each, their blocks shuffled over a pool
    two blocks larger than they need, each decoding its next token at position ``context`` (its
    slot is written this step). Returns (num_blocks, {positions, slots, block_table, seq_lens}).

    ``max_position``: the rows of the model's RoPE table; the new token's position ``context``
    must be one of them (an index past the table is a device-side assert on the GPU)."""
    if max_position is not None and not 0 <= context < max_position:
        raise ValueError(f"context {context}: the new token's position must be below the RoPE table's "
                         f"{max_position} rows (the config's max_position)")  # fmt: skip
    blocks_per_seq = -(-(context + 1) // block_size)
    num_blocks = tokens * blocks_per_seq + 2
    block_table = torch.randperm(num_blocks, generator=gen)[: tokens * blocks_per_seq].view(tokens, blocks_per_seq)
    return num_blocks, {
        "positions": torch.full((tokens,), context, dtype=torch.long),
        "slots": block_table[:, context // block_size] * block_size + context % block_size,
        "block_table": block_table,
        "seq_lens": torch.full((tokens,), context + 1, dtype=torch.long),
    }


def random_kv_step(cfg: AttentionConfig, num_layers: int, tokens: int, context: int, dtype: torch.dtype,
                   gen: torch.Generator) -> dict:  # fmt: skip
    """The kwargs of a decode step through ``num_layers`` GQA layers (on CPU): random hidden and
    residual [tokens, hidden], the block table's tensors, and per layer a K and a V cache full of
    random values (so unwritten slots are recognisable)."""
    num_blocks, table = random_block_table(tokens, context, cfg.block_size, gen, cfg.max_position)
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    return {
        "hidden": torch.randn(tokens, cfg.hidden_size, generator=gen).to(dtype),
        "residual": torch.randn(tokens, cfg.hidden_size, generator=gen).to(dtype),
        **table,
        "k_caches": [torch.randn(shape, generator=gen).to(cfg.cache_dtype) for _ in range(num_layers)],
        "v_caches": [torch.randn(shape, generator=gen).to(cfg.cache_dtype) for _ in range(num_layers)],
    }
