"""DeepSeek V3.2 decode attention as a serving engine runs it, in plain torch.

HF's ``DeepseekV32Attention`` has no FP8 and no latent cache, so the path the fusions target in
production (norm -> RoPE -> FP8 quant -> paged cache write) does not exist there. This module
writes it from DeepSeek's inference code (``inference/model.py`` and ``kernel.py`` of
DeepSeek-V3.2, docs/MODELS.md) in the form vLLM's MLA backend runs it:

* the layer's input RMSNorm (with the residual add), then FP8 ``act_quant`` for the fused
  q_a / kv_a GEMM (``fused_qkv_a_proj``: 7168 -> 1536 + 512 + 64);
* q_a RMSNorm + FP8 group quant of q_c, shared by the q_b and indexer wq_b GEMMs;
* kv_a RMSNorm; interleaved (GPT-J) RoPE on k_pe and q's last 64 dims, YaRN angles from a
  ``cos_sin_cache`` table read at ``positions``;
* absorbed MLA decode (q_nope @ W_UK, attention over the latent, then W_UV);
* a paged latent cache ``[blocks, block_size, row]`` written at ``slot_mapping``: bf16 rows
  ``[kv | k_pe]`` (576) or ``fp8_ds_mla`` rows (656 B: FP8 kv, 4 fp32 scales, bf16 k_pe);
* the DSA indexer: wq_b, wk, LayerNorm with bias, NeoX RoPE on the first 64 of 128 dims, FP8
  quant (per-128 scale, optionally ue8m0), the indexer cache (132 B/token: 128 FP8 bytes + one
  fp32 scale, token-major), head weights ``weights_proj(x) * n_heads^-0.5 * q_scale *
  softmax_scale``, logits ``sum_h relu(q_h . k) * w_h * k_scale`` and top-k.

FP8 GEMMs are simulated (dequantise, matmul in fp32): correct, not fast. Their weights are bf16,
or with ``ReferenceConfig.fp8_weights`` DeepSeek's served format (the checkpoint's, HF's
``weight_block_size`` [128, 128]): e4m3 codes [N, K] and a fp32 ``<weight>_scale_inv``
[ceil(N/128), ceil(K/128)], w ~ wq[n, k] * sw[n // 128, k // 128], quantised by ``build`` from
the bf16 weights it draws (HF's ``Fp8Quantize``, as ``ops/moe_experts_fp8.quantize_weight``
writes it for the FP8 experts). Each such GEMM is

    y[t, n] = sum_kb (sum_{k in kb} xq[t, k] * wq[n, k]) * sx[t, kb] * sw[n // 128, kb]

formed as the dequantised product in fp32 (``fp8_linear``), rounded to bf16. The attention and
the top-k are plain torch too; they are not what the fusions target. Everything a step runs is
ordinary model code: nothing in it calls the compiler's ops (the FP8 weights' quantiser runs once,
at build time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import nn

from .paged_kv import ReferenceStep, padded_context_of, random_block_table

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    hidden_size: int
    q_lora_rank: int
    kv_lora_rank: int
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_layers: int = 2
    rms_norm_eps: float = 1e-6
    block_size: int = 64
    kv_cache_dtype: str = "fp8_ds_mla"  # or "bf16"
    scale_ue8m0: bool = True  # DeepSeek V3.2's `scale_fmt: ue8m0`
    # The FP8 GEMMs' weights as the checkpoint serves them (e4m3 codes + a fp32 scale per 128 x 128
    # block, ``<weight>_scale_inv``); off: bf16 weights, what every benchmark so far measured.
    fp8_weights: bool = False
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position: int = 163840

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        mscale = 0.1 * math.log(self.rope_factor) + 1.0
        return self.qk_head_dim**-0.5 * mscale * mscale

    def latent_row(self) -> tuple[int, torch.dtype]:
        if self.kv_cache_dtype == "bf16":
            return self.kv_lora_rank + self.qk_rope_head_dim, torch.bfloat16
        if self.kv_cache_dtype == "fp8_ds_mla":
            return self.kv_lora_rank + 4 * (self.kv_lora_rank // 128) + 2 * self.qk_rope_head_dim, torch.uint8
        raise ValueError(f"kv_cache_dtype must be 'bf16' or 'fp8_ds_mla', got {self.kv_cache_dtype!r}")


REAL = ReferenceConfig(
    hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, num_heads=128, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
)  # fmt: skip
# Tiny widths for CPU: every quant group (128) and the rope/indexer split keep their structure.
TINY = ReferenceConfig(
    hidden_size=256, q_lora_rank=256, kv_lora_rank=128, num_heads=4, qk_nope_head_dim=32,
    qk_rope_head_dim=32, v_head_dim=32, index_n_heads=4, index_head_dim=128, index_topk=8,
    block_size=4, max_position=4096,
)  # fmt: skip


# ------------------------------------------------------------------------------------------
# DeepSeek inference building blocks, written as model code writes them
# ------------------------------------------------------------------------------------------


def act_quant(x: torch.Tensor, block: int, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek ``act_quant``: per-``block`` amax (>= 1e-4), scale amax/448 (or a power of two)."""
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return y.flatten(-2), scale.squeeze(-1)


def fp8_linear(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
               weight_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """An FP8 GEMM, simulated: dequantise the activation (and with ``weight_scale`` the FP8
    weight, ``weight_dequant``), multiply in fp32, return bf16."""
    x = (x_fp8.float().unflatten(-1, (-1, 128)) * x_scale.unsqueeze(-1)).flatten(-2)
    if weight_scale is None:
        return (x @ weight.float().t()).to(torch.bfloat16)
    return (x @ weight_dequant(weight, weight_scale).t()).to(torch.bfloat16)


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek ``weight_dequant`` in fp32: wq[n, k] * s[n // block, k // block], the last blocks
    partial where N or K is not a multiple of ``block``."""
    n, k = weight.shape
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return weight.float() * full[:n, :k]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3) ...; cos/sin [T, rot/2] broadcast over heads."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Halves (x_i, x_{i + rot/2})."""
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def yarn_cos_sin_cache(cfg: ReferenceConfig) -> torch.Tensor:
    """[max_position, rot] fp32: cos | sin, DeepSeek's ``precompute_freqs_cis`` (YaRN)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
    smooth = 1 - ramp
    freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(cfg.max_position, dtype=torch.float64), freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t.view(torch.uint8)``: each element's bytes, little-endian, along the last dim.

    One-byte dtypes (the FP8 codes) are a view. Wider ones (fp32 scales, bf16 k_pe) are taken
    apart with shifts of a same-width integer view, which every Inductor lowers as pointwise
    code: a float -> uint8 view is an eager fallback in Inductor (before torch 2.13 without a
    contiguous copy), and on the GPU the indexer's unrealised [T, 1] scale reaches it with a
    last-dim stride of 0, so stock Inductor 2.11 failed to compile the layer ("self.stride(-1)
    must be 1 to view Float as Byte"). patterns/spellings.py ``as_bytes`` is the same code."""
    if t.element_size() == 1:
        return t.view(torch.uint8)
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    parts = [(bits >> (8 * i)) & 0xFF for i in range(t.element_size())]
    return torch.stack(parts, dim=-1).to(torch.uint8).flatten(-2)


def index_cache_rows(k: torch.Tensor, cfg: ReferenceConfig) -> torch.Tensor:
    """Indexer cache rows of keys ``k`` [T, index_head_dim]: FP8 codes, then the fp32 scale."""
    k_fp8, k_scale = act_quant(k, cfg.index_head_dim, cfg.scale_ue8m0)
    return torch.cat([as_bytes(k_fp8), as_bytes(k_scale)], dim=-1)


def latent_cache_rows(kv: torch.Tensor, k_pe: torch.Tensor, cfg: ReferenceConfig, fp8: bool) -> torch.Tensor:
    """Latent cache rows: bf16 ``[kv | k_pe]``, or (``fp8``) kv's FP8 codes, its fp32 scales (one
    per 128) and k_pe's bf16 bytes."""
    if not fp8:
        return torch.cat([kv, k_pe], dim=-1)
    kv_fp8, kv_scale = act_quant(kv, 128, cfg.scale_ue8m0)
    return torch.cat([as_bytes(kv_fp8), as_bytes(kv_scale), as_bytes(k_pe)], dim=-1)


# ------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """DeepSeek inference ``RMSNorm``: the weight stays fp32, one rounding at the end."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Indexer(nn.Module):
    """DSA lightning indexer: picks the top-k context tokens each query attends to.

    ``pinned_topk`` (None in a real step): indices returned instead of the computed top-k (the
    indexer cache is still written). bench/decode.py pins compiled modes to eager's selection to
    compare them without the near-ties among 2048-of-4097 scores; None leaves the graph as is."""

    pinned_topk: torch.Tensor | None = None
    fp8_linear_weights = ("wq_b",)

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Parameter(torch.empty(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank))
        self.register_buffer("wq_b_scale_inv", None)  # with FP8 weights (quantize_fp8_weights_)
        self.wk = nn.Parameter(torch.empty(cfg.index_head_dim, cfg.hidden_size))
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Parameter(torch.empty(cfg.index_n_heads, cfg.hidden_size))

    def forward(self, x, qr_fp8, qr_scale, cos, sin, slots, index_cache, context_slots, context_valid):
        cfg = self.cfg
        tokens, heads, dim, rot = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        q = fp8_linear(qr_fp8, qr_scale, self.wq_b, self.wq_b_scale_inv).view(tokens, heads, dim)
        q_pe, q_nope = torch.split(q, [rot, dim - rot], dim=-1)
        q = torch.cat([rope_neox(q_pe, cos.unsqueeze(1), sin.unsqueeze(1)), q_nope], dim=-1)
        q_fp8, q_scale = act_quant(q, dim, cfg.scale_ue8m0)
        weights = (x @ self.weights_proj.t()).float() * heads**-0.5
        weights = weights * q_scale.squeeze(-1) * dim**-0.5

        k = self.k_norm(x @ self.wk.t())
        k_pe, k_nope = torch.split(k, [rot, dim - rot], dim=-1)
        k = torch.cat([rope_neox(k_pe, cos, sin), k_nope], dim=-1)
        rows = index_cache_rows(k, cfg)
        index_cache.view(-1, index_cache.shape[-1]).index_put_((slots,), rows)

        # Scoring reads the cache back (the new token included), as DeepGEMM's logits kernel does.
        cached = index_cache.view(-1, index_cache.shape[-1])[context_slots]  # [T, L, dim + 4]
        k_ctx = cached[..., :dim].view(FP8).float()
        k_ctx_scale = cached[..., dim:].contiguous().view(torch.float32).squeeze(-1)
        scores = torch.relu(torch.einsum("thd,tld->thl", q_fp8.float(), k_ctx))
        logits = (scores * weights.unsqueeze(-1)).sum(1) * k_ctx_scale
        logits = logits.masked_fill(~context_valid, float("-inf"))
        topk = logits.topk(min(cfg.index_topk, logits.shape[-1]), dim=-1).indices
        return topk if self.pinned_topk is None else self.pinned_topk


class MLAAttention(nn.Module):
    """Absorbed MLA decode with the DSA indexer, over a paged latent cache."""

    fp8_linear_weights = ("fused_qkv_a_proj", "q_b_proj")

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        q_rank, kv_rank, rot = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.fused_qkv_a_proj = nn.Parameter(torch.empty(q_rank + kv_rank + rot, cfg.hidden_size))
        self.q_a_layernorm = RMSNorm(q_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Parameter(torch.empty(cfg.num_heads * cfg.qk_head_dim, q_rank))
        for name in self.fp8_linear_weights:  # with FP8 weights (quantize_fp8_weights_)
            self.register_buffer(f"{name}_scale_inv", None)
        self.kv_a_layernorm = RMSNorm(kv_rank, cfg.rms_norm_eps)
        self.w_uk = nn.Parameter(torch.empty(cfg.num_heads, cfg.qk_nope_head_dim, kv_rank))
        self.w_uv = nn.Parameter(torch.empty(cfg.num_heads, kv_rank, cfg.v_head_dim))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, cfg.num_heads * cfg.v_head_dim))
        self.indexer = Indexer(cfg)

    def forward(self, x, x_fp8, x_scale, cos_sin_cache, positions, slots, latent_cache, index_cache, context_slots, context_valid):
        cfg = self.cfg
        tokens, heads, kv_rank, rot = x.shape[0], cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)

        qkv = fp8_linear(x_fp8, x_scale, self.fused_qkv_a_proj, self.fused_qkv_a_proj_scale_inv)
        q_c, kv_c, k_pe = torch.split(qkv, [cfg.q_lora_rank, kv_rank, rot], dim=-1)
        qr_fp8, qr_scale = act_quant(self.q_a_layernorm(q_c), 128, cfg.scale_ue8m0)

        kv = self.kv_a_layernorm(kv_c)
        k_pe = rope_gptj(k_pe, cos, sin)
        rows = latent_cache_rows(kv, k_pe, cfg, fp8=latent_cache.dtype == torch.uint8)
        latent_cache.view(-1, latent_cache.shape[-1]).index_put_((slots,), rows)

        q = fp8_linear(qr_fp8, qr_scale, self.q_b_proj, self.q_b_proj_scale_inv).view(tokens, heads, cfg.qk_head_dim)
        q_nope, q_pe = torch.split(q, [cfg.qk_nope_head_dim, rot], dim=-1)
        q_absorbed = torch.einsum("thd,hdc->thc", q_nope, self.w_uk)
        q = torch.cat([q_absorbed, rope_gptj(q_pe, cos.unsqueeze(1), sin.unsqueeze(1))], dim=-1)

        topk = self.indexer(x, qr_fp8, qr_scale, cos, sin, slots, index_cache, context_slots, context_valid)
        out = self._attend(q, latent_cache, context_slots, context_valid, topk)
        return out.flatten(1) @ self.o_proj.t()

    def _attend(self, q, latent_cache, context_slots, context_valid, topk):
        """Sparse MLA over the latent cache: plain torch, correct rather than fast."""
        cfg = self.cfg
        kv_rank = cfg.kv_lora_rank
        rows = latent_cache.view(-1, latent_cache.shape[-1])[context_slots]  # [T, L, row]
        if latent_cache.dtype == torch.uint8:
            groups = kv_rank // 128
            kv = rows[..., :kv_rank].view(FP8).float().unflatten(-1, (groups, 128))
            scale = rows[..., kv_rank : kv_rank + 4 * groups].contiguous().view(torch.float32)
            kv = (kv * scale.unsqueeze(-1)).flatten(-2)
            k_pe = rows[..., kv_rank + 4 * groups :].contiguous().view(torch.bfloat16).float()
        else:
            kv, k_pe = rows[..., :kv_rank].float(), rows[..., kv_rank:].float()
        keys = torch.cat([kv, k_pe], dim=-1)
        scores = torch.einsum("thc,tlc->thl", q.float(), keys) * cfg.softmax_scale
        selected = torch.zeros_like(context_valid).scatter(-1, topk, True) & context_valid
        probs = scores.masked_fill(~selected.unsqueeze(1), float("-inf")).softmax(-1)
        latent = torch.einsum("thl,tlc->thc", probs, kv)
        return torch.einsum("thc,hcv->thv", latent, self.w_uv.float()).to(q.dtype)


class DecoderLayer(nn.Module):
    """The attention half of a DeepSeek V3.2 decoder layer (deepseek_v32_decode_layer.py adds the
    MoE half)."""

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)

    def forward(self, hidden, residual, cos_sin_cache, positions, slots, latent_cache, index_cache, context_slots, context_valid):
        residual = hidden + residual
        x = self.input_layernorm(residual)
        x_fp8, x_scale = act_quant(x, 128, self.cfg.scale_ue8m0)
        out = self.self_attn(x, x_fp8, x_scale, cos_sin_cache, positions, slots, latent_cache, index_cache, context_slots, context_valid)
        return out, residual


class ReferenceModel(nn.Module):
    """A stack of ``cfg.num_layers`` layers over paged caches: one decode token per sequence.
    ``make_layer()`` builds each layer (default: the attention half, ``DecoderLayer(cfg)``)."""

    def __init__(self, cfg: ReferenceConfig, make_layer: Callable[[], nn.Module] | None = None):
        super().__init__()
        self.cfg = cfg
        make_layer = make_layer or (lambda: DecoderLayer(cfg))
        self.layers = nn.ModuleList(make_layer() for _ in range(cfg.num_layers))
        self.register_buffer("cos_sin_cache", yarn_cos_sin_cache(cfg), persistent=False)

    def forward(self, hidden, residual, positions, slots, block_table, seq_lens, latent_caches, index_caches):
        context_slots, context_valid = padded_context_of(block_table, seq_lens, self.cfg.block_size)
        for layer, latent_cache, index_cache in zip(self.layers, latent_caches, index_caches):
            hidden, residual = layer(
                hidden, residual, self.cos_sin_cache, positions, slots, latent_cache, index_cache,
                context_slots, context_valid,
            )  # fmt: skip
        return hidden + residual


def expected_sites(model: ReferenceModel, prefix: str = "") -> dict[str, dict[str, int]]:
    """Sites per family in one step: the four RoPE sites (kv, q in the attention; k, q in the
    indexer) and two norms per layer (the input norm; q_a, which feeds the FP8 GEMMs)."""
    mla, norms = {}, {}
    for i in range(len(model.layers)):
        layer = f"{prefix}layers.{i}"
        mla[f"{layer}.self_attn"] = 2
        mla[f"{layer}.self_attn.indexer"] = 2
        norms[f"{layer}.input_layernorm"] = 1
        norms[f"{layer}.self_attn.q_a_layernorm"] = 1
    return {"mla_prologue": mla, "add_rms_norm": norms}


# ------------------------------------------------------------------------------------------
# Building a decode step
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def build(cfg: ReferenceConfig, device="cpu", seed: int = 0) -> ReferenceModel:
    """Random weights (bf16), seeded; norm weights around 1 so a missing multiply shows. With
    ``cfg.fp8_weights`` the FP8 GEMMs' weights are then quantised (``quantize_fp8_weights_``)."""
    gen = torch.Generator().manual_seed(seed)
    model = ReferenceModel(cfg)
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight"):  # DeepSeek keeps RMSNorm weights in fp32
            p.data = 1 + 0.1 * torch.randn(p.shape, generator=gen)
            continue
        if name.endswith("k_norm.weight"):
            value = 1 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith("k_norm.bias"):
            value = 0.1 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
        p.data = value.to(torch.bfloat16)
    if cfg.fp8_weights:
        quantize_fp8_weights_(model)
    return model.to(device)


@torch.no_grad()
def quantize_fp8_weights_(model: nn.Module) -> nn.Module:
    """In place: each weight an ``fp8_linear`` reads (its module's ``fp8_linear_weights``) becomes
    e4m3 codes, with its block scales in the buffer ``<weight>_scale_inv`` (the FP8 experts' own
    quantiser, HF's ``Fp8Quantize``; build time only, so no step calls it)."""
    from fusion_compiler.ops.moe_experts_fp8 import quantize_weight

    for module in model.modules():
        for name in getattr(module, "fp8_linear_weights", ()):
            codes, scale = quantize_weight(getattr(module, name))
            setattr(module, name, nn.Parameter(codes, requires_grad=False))
            setattr(module, f"{name}_scale_inv", scale)
    return model


def make_step(cfg: ReferenceConfig, tokens: int = 2, context: int = 6, device="cpu", seed: int = 1) -> ReferenceStep:
    """Random caches, a shuffled block table, and the new token of each sequence at position
    ``context`` (its slot is written this step).

    Every cache row holds what a layer writes for a random token (``_written_rows``): FP8 rows
    quantised from N(0, 1) values, as the kv_a RMSNorm and the indexer's LayerNorm leave them,
    with their own scales, and N(0, 1) k_pe. Random bytes instead decode to values up to 448 x
    their scale: attention logits with a spread of ~150, a one-hot softmax whose winner a
    last-bit difference of q flips, so compiled and eager steps differed by tens of percent."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, table = random_block_table(tokens, context, cfg.block_size, gen, cfg.max_position)
    rows = num_blocks * cfg.block_size

    def cache(kind: str) -> torch.Tensor:
        return _written_rows(rows, kind, cfg, gen).view(num_blocks, cfg.block_size, -1)

    kwargs = {
        "hidden": torch.randn(tokens, cfg.hidden_size, generator=gen).to(torch.bfloat16),
        "residual": torch.randn(tokens, cfg.hidden_size, generator=gen).to(torch.bfloat16),
        **table,
        "latent_caches": [cache("latent") for _ in range(cfg.num_layers)],
        "index_caches": [cache("index") for _ in range(cfg.num_layers)],
    }
    return ReferenceStep(kwargs).to(device)


def _written_rows(rows: int, kind: str, cfg: ReferenceConfig, gen: torch.Generator, chunk: int = 1 << 15) -> torch.Tensor:
    """``rows`` cache rows as the layer writes them for random tokens: ``kind`` "latent" (bf16
    ``[kv | k_pe]`` or ``fp8_ds_mla`` bytes) or "index" (128 FP8 bytes + an fp32 scale), from
    N(0, 1) kv / k_pe / index-k values, quantised by ``act_quant`` in chunks of rows."""
    width, dtype = cfg.latent_row() if kind == "latent" else (cfg.index_head_dim + 4, torch.uint8)
    out = torch.empty(rows, width, dtype=dtype)
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        if kind == "index":
            k = torch.randn(n, cfg.index_head_dim, generator=gen).to(torch.bfloat16)
            out[start : start + n] = index_cache_rows(k, cfg)
            continue
        kv = torch.randn(n, cfg.kv_lora_rank, generator=gen).to(torch.bfloat16)
        k_pe = torch.randn(n, cfg.qk_rope_head_dim, generator=gen).to(torch.bfloat16)
        out[start : start + n] = latent_cache_rows(kv, k_pe, cfg, fp8=dtype == torch.uint8)
    return out
