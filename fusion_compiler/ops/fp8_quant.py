"""The FP8 activation-quant contract every fused op with an FP8 output follows.

DeepSeek's inference ``act_quant`` (``inference/kernel.py``), per group of ``group`` values
along the last dim:

    amax  = max(|x|) over the group, clamped to >= 1e-4
    scale = amax / 448                        # or, with ue8m0, 2 ** ceil(log2(amax / 448))
    y     = clamp(x / scale, -448, 448)  ->  float8_e4m3fn
    scale -> float32, one per group, row-major [*leading, dim / group]

A NaN anywhere in a group makes that group's scale NaN and so every output of the group NaN
(``torch.amax`` propagates NaN; the Triton kernels do the same on purpose).
DeepGEMM reads scales column-major (MN-major); ``scales_column_major`` gives that layout.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def group_scale(amax: torch.Tensor, ue8m0: bool, exact: bool = True) -> torch.Tensor:
    """fp32 scale from a group's fp32 amax (already clamped).

    exact=False is the form Inductor fuses (fp32 division, exp2(ceil(log2))), for the canonical
    decomposition: it can differ in the last bit of a plain scale, and for ue8m0 pick the lower
    power of two when amax/448 lies within an fp32 log2 rounding above one (~2^-20 of groups)."""
    if not exact:
        scale = amax / FP8_MAX
        return torch.exp2(torch.ceil(torch.log2(scale))) if ue8m0 else scale
    # Correctly rounded on every device: torch on CUDA divides by a Python scalar as a multiply
    # by its reciprocal (up to 1 ulp off); the kernels use IEEE division.
    scale = (amax.double() / FP8_MAX).float()
    if ue8m0:
        # Exactly the next power of two >= scale (fp32 log2 can round a value just above a
        # power of two down onto it); DeepGEMM and DeepSeek's kernel do this on the bits.
        mantissa, exponent = torch.frexp(scale)
        power = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))
        scale = torch.where(torch.isfinite(scale), power, scale)  # NaN stays NaN
    return scale


def fp8_group_quant_reference(
    x: torch.Tensor, group: int = 128, ue8m0: bool = False, exact: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y float8_e4m3fn shaped like x, scale float32 [*x.shape[:-1], x.shape[-1] // group])."""
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quant group {group}")
    groups = x.float().unflatten(-1, (x.shape[-1] // group, group))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = group_scale(amax, ue8m0, exact)
    y = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return y.flatten(-2), scale.squeeze(-1)


def fp8_group_dequant_reference(y: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """fp32 values back from ``fp8_group_quant_reference``'s outputs."""
    return (y.float().unflatten(-1, (y.shape[-1] // group, group)) * scale.unsqueeze(-1)).flatten(-2)


def scales_column_major(scale: torch.Tensor) -> torch.Tensor:
    """The same [tokens, groups] values stored column-major (stride (1, tokens)), as DeepGEMM reads."""
    return scale.t().contiguous().t()
