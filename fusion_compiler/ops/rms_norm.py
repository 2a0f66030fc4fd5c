"""Custom ops for the RMSNorm families: (residual add +) RMSNorm, optional Gemma ``x * (1 + w)``,
and the gated RMSNorm ``rms(x) * w * silu(gate)`` (Qwen3.5 GDN's output norm, norm before gate).

    fusion_compiler::rms_norm(Tensor x, Tensor weight, float eps, float weight_offset,
                              ScalarType out_dtype) -> Tensor
    fusion_compiler::add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps,
                                  float weight_offset, ScalarType out_dtype)
                                  -> (Tensor out, Tensor sum)
    fusion_compiler::gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps,
                                    float weight_offset, ScalarType out_dtype) -> Tensor

Semantics (``*_reference`` below is the numerical truth, in plain torch, on any device):

    sum  = x + residual                  # in x.dtype, exactly eager's add
    h    = sum.float()                   # or x.float() without residual
    rstd = rsqrt(mean(h * h, dim=-1) + eps)
    out  = (h * rstd * (weight.float() + weight_offset)).to(out_dtype)
    gated: out = (h * rstd * (weight.float() + weight_offset) * silu(gate.float())).to(out_dtype)

This is vLLM's ``rms_norm`` / ``fused_add_rms_norm`` (fp32 math, weight applied in fp32; Gemma
passes ``w.float() + 1``).  HF's DeepSeek/MiniMax ``weight * x.to(bf16)`` differs by one bf16
rounding; with an fp32 weight that product is fp32, which is why ``out_dtype`` is explicit.
The gated form is vLLM's ``RMSNormGated.forward_static`` (``norm_before_gate=True``, SiLU, no
groups: all fp32, one rounding); HF's ``Qwen3_5MoeRMSNormGated`` rounds the normalised x to bf16
and multiplies the weight in bf16 first, one bf16 rounding apart.

Implementations: CPU and every non-CUDA device run the reference; CUDA runs the Triton kernel
in ``fusion_compiler.kernels.rms_norm`` (no host syncs, outputs from ``torch.empty``, so the op
can be captured in a CUDA graph); the fake impl gives contiguous outputs of the right shape
and dtype.  Outputs are always contiguous, whatever the layout of the inputs.
"""

from __future__ import annotations

import math

import torch

from ._checks import require_size_eq

__all__ = [
    "SUPPORTED_DTYPES",
    "add_rms_norm",
    "add_rms_norm_reference",
    "gated_rms_norm",
    "gated_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]

# Dtypes the Triton kernel handles (x, residual, weight, out_dtype); the op accepts these only,
# on every device, so CPU and CUDA share one contract.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# Validation (shared by reference, fake and CUDA impls)
# --------------------------------------------------------------------------------------------


def _validate(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float,
    out_dtype: torch.dtype,
) -> None:
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dim (the normalised one), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"weight dtype {weight.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if out_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if weight.dim() != 1:
        raise ValueError(f"weight must be 1-D [N], got shape {tuple(weight.shape)}")
    require_size_eq(weight.shape[0], x.shape[-1], "weight size must equal x.shape[-1]")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if residual is not None:
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} must equal x dtype {x.dtype}")
        if residual.dim() != x.dim():
            raise ValueError(
                f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}"
            )
        for d, (rs, xs) in enumerate(zip(residual.shape, x.shape)):
            require_size_eq(rs, xs, f"residual shape must equal x shape (dim {d})")
        if residual.device != x.device:
            raise ValueError(f"residual is on {residual.device}, x on {x.device}")
    if isinstance(eps, (int, float)):
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps must be finite and > 0, got {eps}")
    else:  # SymFloat under tracing
        torch._check(eps > 0, lambda: f"eps must be > 0, got {eps}")
    if isinstance(weight_offset, (int, float)) and not math.isfinite(weight_offset):
        raise ValueError(f"weight_offset must be finite, got {weight_offset}")


# --------------------------------------------------------------------------------------------
# Reference (the numerical truth; also the CPU / default implementation of the ops)
# --------------------------------------------------------------------------------------------


def _rms_norm_math(s: torch.Tensor, weight, eps, weight_offset, out_dtype, gate=None) -> torch.Tensor:
    h = s.float()
    rstd = torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + eps)
    y = h * rstd * (weight.float() + weight_offset)
    if gate is not None:
        y = y * torch.nn.functional.silu(gate.float())
    return y.to(out_dtype).contiguous()


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch RMSNorm (fp32 math) over the last dim; any device."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _validate(x, None, weight, eps, weight_offset, out_dtype)
    return _rms_norm_math(x, weight, eps, weight_offset, out_dtype)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch residual add + RMSNorm; returns ``(out, x + residual)``; any device."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _validate(x, residual, weight, eps, weight_offset, out_dtype)
    s = x + residual
    return _rms_norm_math(s, weight, eps, weight_offset, out_dtype), s.contiguous()


def gated_rms_norm_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch ``rms(x) * w * silu(gate)`` (fp32 math, one rounding); any device."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _validate(x, None, weight, eps, weight_offset, out_dtype)
    _validate_gate(x, gate)
    return _rms_norm_math(x, weight, eps, weight_offset, out_dtype, gate)


def _validate_gate(x: torch.Tensor, gate: torch.Tensor) -> None:
    if gate.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gate dtype {gate.dtype} not supported; expected one of {SUPPORTED_DTYPES}")
    if gate.dim() != x.dim():
        raise ValueError(f"gate shape {tuple(gate.shape)} must equal x shape {tuple(x.shape)}")
    for d, (gs, xs) in enumerate(zip(gate.shape, x.shape)):
        require_size_eq(gs, xs, f"gate shape must equal x shape (dim {d})")
    if gate.device != x.device:
        raise ValueError(f"gate is on {gate.device}, x on {x.device}")


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

_RMS_NORM_SCHEMA = (
    "(Tensor x, Tensor weight, float eps, float weight_offset, ScalarType out_dtype) -> Tensor"
)
_ADD_RMS_NORM_SCHEMA = (
    "(Tensor x, Tensor residual, Tensor weight, float eps, float weight_offset, "
    "ScalarType out_dtype) -> (Tensor out, Tensor sum)"
)

_GATED_RMS_NORM_SCHEMA = (
    "(Tensor x, Tensor gate, Tensor weight, float eps, float weight_offset, "
    "ScalarType out_dtype) -> Tensor"
)


def _launcher():
    # Imported lazily: only CUDA needs triton, and the import must come after any
    # TRITON_INTERPRET setting.
    from fusion_compiler.kernels.rms_norm import rms_norm_fwd

    return rms_norm_fwd


@torch.library.custom_op("fusion_compiler::rms_norm", mutates_args=(), schema=_RMS_NORM_SCHEMA)
def _rms_norm_op(x, weight, eps, weight_offset, out_dtype):
    return rms_norm_reference(x, weight, eps, weight_offset, out_dtype)


@_rms_norm_op.register_fake
def _rms_norm_fake(x, weight, eps, weight_offset, out_dtype):
    _validate(x, None, weight, eps, weight_offset, out_dtype)
    return x.new_empty(x.shape, dtype=out_dtype)


@_rms_norm_op.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps, weight_offset, out_dtype):
    _validate(x, None, weight, eps, weight_offset, out_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launcher()(x, weight, eps, weight_offset, out)
    return out


@torch.library.custom_op(
    "fusion_compiler::add_rms_norm", mutates_args=(), schema=_ADD_RMS_NORM_SCHEMA
)
def _add_rms_norm_op(x, residual, weight, eps, weight_offset, out_dtype):
    return add_rms_norm_reference(x, residual, weight, eps, weight_offset, out_dtype)


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, residual, weight, eps, weight_offset, out_dtype):
    _validate(x, residual, weight, eps, weight_offset, out_dtype)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)


@_add_rms_norm_op.register_kernel("cuda")
def _add_rms_norm_cuda(x, residual, weight, eps, weight_offset, out_dtype):
    _validate(x, residual, weight, eps, weight_offset, out_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launcher()(x, weight, eps, weight_offset, out, residual=residual, sum_out=s)
    return out, s


@torch.library.custom_op(
    "fusion_compiler::gated_rms_norm", mutates_args=(), schema=_GATED_RMS_NORM_SCHEMA
)
def _gated_rms_norm_op(x, gate, weight, eps, weight_offset, out_dtype):
    return gated_rms_norm_reference(x, gate, weight, eps, weight_offset, out_dtype)


@_gated_rms_norm_op.register_fake
def _gated_rms_norm_fake(x, gate, weight, eps, weight_offset, out_dtype):
    _validate(x, None, weight, eps, weight_offset, out_dtype)
    _validate_gate(x, gate)
    return x.new_empty(x.shape, dtype=out_dtype)


@_gated_rms_norm_op.register_kernel("cuda")
def _gated_rms_norm_cuda(x, gate, weight, eps, weight_offset, out_dtype):
    _validate(x, None, weight, eps, weight_offset, out_dtype)
    _validate_gate(x, gate)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launcher()(x, weight, eps, weight_offset, out, gate=gate)
    return out


# --------------------------------------------------------------------------------------------
# Python API
# --------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch.ops.fusion_compiler.rms_norm``; ``out_dtype=None`` means ``x.dtype``."""
    return torch.ops.fusion_compiler.rms_norm(
        x, weight, eps, weight_offset, x.dtype if out_dtype is None else out_dtype
    )


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.fusion_compiler.add_rms_norm``; returns ``(out, x + residual)``."""
    return torch.ops.fusion_compiler.add_rms_norm(
        x, residual, weight, eps, weight_offset, x.dtype if out_dtype is None else out_dtype
    )


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``torch.ops.fusion_compiler.gated_rms_norm``: ``rms(x) * w * silu(gate)``."""
    return torch.ops.fusion_compiler.gated_rms_norm(
        x, gate, weight, eps, weight_offset, x.dtype if out_dtype is None else out_dtype
    )
