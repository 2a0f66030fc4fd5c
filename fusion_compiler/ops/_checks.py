"""Argument checks shared by the fused ops' reference, fake and CUDA paths.

Concrete sizes raise ``ValueError`` naming the offending value; symbolic sizes (under tracing)
become ``torch._check`` so the check does not specialise the graph.
"""

from __future__ import annotations

import torch


def require_size_eq(actual, expected, what: str) -> None:
    if isinstance(actual, int) and isinstance(expected, int):
        if actual != expected:
            raise ValueError(f"{what}: got {actual}, expected {expected}")
    else:
        torch._check(actual == expected, lambda: f"{what}: got {actual}, expected {expected}")


def require_shape(t: torch.Tensor, shape: tuple, name: str) -> None:
    if t.dim() != len(shape):
        raise ValueError(f"{name} must have {len(shape)} dims {shape}, got shape {tuple(t.shape)}")
    for d, (actual, expected) in enumerate(zip(t.shape, shape)):
        if expected is not None:
            require_size_eq(actual, expected, f"{name} dim {d}")


def require_dtype(t: torch.Tensor, dtypes: tuple, name: str) -> None:
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} dtype {t.dtype} not supported: the kernel takes {names}")


def require_last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.dim() and t.shape[-1] != 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")


def require_same_device(tensors: dict, like: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != like.device:
            raise ValueError(f"{name} is on {t.device}, expected {like.device}")


def require_slots_in_range(slots: torch.Tensor, num_slots: int) -> None:
    """Reference path only: reading slot values syncs the host on CUDA."""
    if slots.numel() == 0:
        return
    lo, hi = int(slots.min()), int(slots.max())
    if lo < -1 or hi >= num_slots:
        bad = lo if lo < -1 else hi
        raise ValueError(f"slot {bad} out of range: slots must be -1 (padding) or in [0, {num_slots})")
