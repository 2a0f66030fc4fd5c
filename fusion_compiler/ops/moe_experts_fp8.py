"""The routed experts of a MoE layer with FP8 expert weights in DeepSeek's served format.

    fusion_compiler::moe_experts_fp8(Tensor hidden, Tensor top_k_ids, Tensor top_k_weights,
                                     Tensor gate_up_proj, Tensor gate_up_scale,
                                     Tensor down_proj, Tensor down_scale) -> Tensor

The bf16 op (ops/moe_experts.py) with each GEMM replaced by DeepSeek V3's block-scaled FP8 GEMM
(``moe_experts_fp8_reference`` is the numerical truth). Weights as transformers 5.17's
``FP8Experts`` holds them (integrations/finegrained_fp8.py, ``weight_block_size`` [128, 128]):

    gate_up_proj   float8_e4m3fn [E, 2I, H]                    gate rows then up rows
    gate_up_scale  float32 [E, ceil(2I/128), ceil(H/128)]      HF's ``gate_up_proj_scale_inv``
    down_proj      float8_e4m3fn [E, H, I]
    down_scale     float32 [E, ceil(H/128), ceil(I/128)]       HF's ``down_proj_scale_inv``

one fp32 scale per 128 x 128 block, w[n, k] ~ wq[n, k] * s[n // 128, k // 128] (a block row of
the gate/up scale can span the gate / up boundary where I % 128 != 0, as in HF's layout; HF's
floor of 2 scale rows for 2I < 128 is not taken: exactly ceil(2I/128)). ``quantize_weight``
makes this format from float weights (HF's ``Fp8Quantize``: amax / 448, an all-zero block 1).

Activations are quantised per row in 1 x 128 groups along the reduced dim (the last group masked
where the dim is not a multiple of 128), DeepSeek inference's ``act_quant`` as
ops/fp8_quant.py writes it: sx = max(amax(|x_group|), 1e-4) / 448 in fp32 (correctly rounded),
xq = e4m3(clamp(x / sx, +-448)). The 1e-4 floor is what defines an all-zero group: sx =
1e-4 / 448 and all its codes 0 (it also coarsens a group whose amax is below 1e-4; a NaN makes
its group NaN). Each FP8 GEMM is

    y[r, n] = sum_kb (sum_{k in kb} xq[r, k] * wq[n, k]) * sx[r, kb] * sw[n // 128, kb]

For each pair (t, k) with 0 <= e = ids[t, k] < E (any other id is padding and contributes
nothing; a token of only padding gets zeros):

    gate, up = FP8 GEMM of x_t (quantised along H) with gate_up_proj[e]   each rounded to hidden's dtype
    act      = silu(gate) * up                  silu in fp32, rounded; the product in fp32, rounded
    y        = FP8 GEMM of act (quantised along I) with down_proj[e]      rounded to hidden's dtype
    out[t]   = sum_k float(w[t, k]) * float(y_(t,k))                      fp32, rounded once

The rounding points are the bf16 op's; only the GEMMs differ. The reference forms each GEMM as
the dequantised product (equal to the sum above up to accumulation order) in fp32, or in
float64 with ``accumulate=torch.float64``: "the float64 dequantised product", the same
quantised operands with no rounding in the GEMMs.

On CUDA (``_cuda``) kernels/moe_experts_fp8.py, two paths chosen by the number of tokens as the
bf16 op's (its split, ``SMALL_BATCH_MAX_TOKENS``; the FP8 kernels' own is not measured yet):

* up to it: two GEMV-style launches that read each pair's expert once (x quantised on the fly
  per program, act written quantised);
* above: the pairs grouped by expert (kernels/moe_experts_grouped.py's plan and combine), e4m3
  ``tl.dot`` per 128-group with the scales applied to each group's partial product.

Neither syncs the host; a CUDA graph captures both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import require_dtype, require_last_dim_contiguous, require_same_device, require_shape
from .fp8_quant import FP8_DTYPE, FP8_MAX, fp8_group_quant_reference, group_scale
from .moe_experts import SMALL_BATCH_MAX_TOKENS

BLOCK = 128  # weight blocks 128 x 128, activation groups 1 x 128
_HIDDEN = (torch.bfloat16, torch.float16, torch.float32)
_IDS = (torch.int64, torch.int32)
_ROUTING = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

_SCHEMA = (
    "(Tensor hidden, Tensor top_k_ids, Tensor top_k_weights, Tensor gate_up_proj, Tensor gate_up_scale, "
    "Tensor down_proj, Tensor down_scale) -> Tensor"
)


def _blocks(n):
    return (n + BLOCK - 1) // BLOCK


def validate(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale) -> None:
    """The op's argument checks (reference, fake and CUDA paths): ValueError naming the value."""
    require_dtype(hidden, _HIDDEN, "hidden")
    require_dtype(top_k_ids, _IDS, "top_k_ids")
    require_dtype(top_k_weights, _ROUTING, "top_k_weights")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, H], got shape {tuple(hidden.shape)}")
    tokens, size = hidden.shape
    require_shape(top_k_ids, (tokens, None), "top_k_ids")
    require_shape(top_k_weights, tuple(top_k_ids.shape), "top_k_weights")
    require_dtype(gate_up_proj, (FP8_DTYPE,), "gate_up_proj")
    require_dtype(down_proj, (FP8_DTYPE,), "down_proj")
    require_shape(gate_up_proj, (None, None, size), "gate_up_proj")
    experts, double, _ = gate_up_proj.shape
    if isinstance(double, int) and double % 2:
        raise ValueError(f"gate_up_proj's {double} rows are not gate and up halves")
    require_shape(down_proj, (experts, size, double // 2), "down_proj")
    for name, weight, scale in (("gate_up", gate_up_proj, gate_up_scale), ("down", down_proj, down_scale)):
        require_last_dim_contiguous(weight, f"{name}_proj")
        require_dtype(scale, (torch.float32,), f"{name}_scale")
        require_shape(scale, (experts, _blocks(weight.shape[1]), _blocks(weight.shape[2])), f"{name}_scale")
    tensors = dict(top_k_ids=top_k_ids, top_k_weights=top_k_weights, gate_up_proj=gate_up_proj,
                   gate_up_scale=gate_up_scale, down_proj=down_proj, down_scale=down_scale)  # fmt: skip
    require_same_device(tensors, hidden)


# ------------------------------------------------------------------------------------------
# The format: weights by 128 x 128 blocks, activations by 1 x 128 groups
# ------------------------------------------------------------------------------------------


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight stack [..., N, K] -> (float8_e4m3fn [..., N, K], float32 scales
    [..., ceil(N/128), ceil(K/128)]), HF's ``Fp8Quantize``: per 128 x 128 block (the last ones
    partial) s = amax / 448, an all-zero block s = 1, wq = e4m3(clamp(w / s, +-448))."""
    n, k = weight.shape[-2:]
    padded = F.pad(weight.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = padded.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [..., N/128, 128, K/128, 128]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, group_scale(amax, ue8m0=False), torch.ones_like(amax))
    codes = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.flatten(-4, -3).flatten(-2)[..., :n, :k].contiguous(), scale


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``quantize_weight``'s inverse in ``dtype``: wq[n, k] * s[n // 128, k // 128]."""
    n, k = codes.shape[-2:]
    full = scale.to(dtype).repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return codes.to(dtype) * full[..., :n, :k]


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [..., K] -> (float8_e4m3fn [..., K], float32 scales [..., ceil(K/128)]): DeepSeek's
    ``act_quant`` (ops/fp8_quant.py) on x.float(), the last group zero-padded (zeros change no amax)."""
    k = x.shape[-1]
    codes, scale = fp8_group_quant_reference(F.pad(x.float(), (0, -k % BLOCK)), BLOCK)
    return codes[..., :k], scale


def fp8_gemm(codes, scale, weight, weight_scale, accumulate=torch.float32) -> torch.Tensor:
    """The block-scaled FP8 GEMM of rows [R, K] (``quantize_activation``'s outputs) with one
    expert's weight [N, K] and its scales: the dequantised product in ``accumulate``, [R, N]."""
    k = codes.shape[-1]
    x = codes.to(accumulate) * scale.to(accumulate).repeat_interleave(BLOCK, dim=-1)[..., :k]
    return x @ dequantize_weight(weight, weight_scale, accumulate).T


# ------------------------------------------------------------------------------------------
# The op
# ------------------------------------------------------------------------------------------


def moe_experts_fp8_reference(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj,
                              down_scale, accumulate=torch.float32) -> torch.Tensor:  # fmt: skip
    """The op's semantics in plain torch, one expert at a time (any device). ``accumulate``: the
    GEMMs' and the combine's dtype, fp32 (the op) or float64 (truth)."""
    validate(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale)
    tokens, top_k = top_k_ids.shape
    experts, inter, dtype = gate_up_proj.shape[0], down_proj.shape[2], hidden.dtype
    total = torch.zeros(tokens, hidden.shape[1], dtype=accumulate, device=hidden.device)
    flat_ids = top_k_ids.reshape(-1).long()
    flat_w = top_k_weights.reshape(-1).to(accumulate)
    rows = torch.arange(tokens * top_k, device=hidden.device)
    for e in torch.unique(flat_ids[(flat_ids >= 0) & (flat_ids < experts)]).tolist():
        pairs = rows[flat_ids == e]
        gate_up = fp8_gemm(*quantize_activation(hidden[pairs // top_k]), gate_up_proj[e], gate_up_scale[e], accumulate)
        gate, up = gate_up.to(dtype).float().split(inter, dim=-1)
        act = (F.silu(gate).to(dtype).float() * up).to(dtype)
        y = fp8_gemm(*quantize_activation(act), down_proj[e], down_scale[e], accumulate).to(dtype)
        total.index_add_(0, pairs // top_k, y.to(accumulate) * flat_w[pairs, None])
    return total.to(dtype)


@torch.library.custom_op("fusion_compiler::moe_experts_fp8", mutates_args=(), schema=_SCHEMA)
def _op(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale):
    return moe_experts_fp8_reference(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj,
                                     down_scale)  # fmt: skip


@_op.register_fake
def _fake(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale):
    validate(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale)
    return torch.empty_like(hidden)


@_op.register_kernel("cuda")
def _cuda(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale):
    from fusion_compiler.kernels import moe_experts_fp8 as kernels  # (its launchers run ``validate``)

    small = hidden.shape[0] <= SMALL_BATCH_MAX_TOKENS
    launch = kernels.small_batch_experts_fp8 if small else kernels.grouped_experts_fp8
    return launch(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale)


def moe_experts_fp8(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale, down_proj, down_scale):
    """Front end of ``torch.ops.fusion_compiler.moe_experts_fp8``."""
    return torch.ops.fusion_compiler.moe_experts_fp8(hidden, top_k_ids, top_k_weights, gate_up_proj, gate_up_scale,
                                                     down_proj, down_scale)  # fmt: skip
