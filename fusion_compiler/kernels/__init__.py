"""Triton kernels, one file per family. Nothing here imports graph code."""

KERNEL_VERSIONS: dict[str, str] = {}


def _register_versions() -> None:
    from . import rms_norm

    KERNEL_VERSIONS["add_rms_norm"] = rms_norm.KERNEL_VERSION


try:
    _register_versions()
except ImportError:
    # No triton (non-Linux): CPU ops still run their references; a CUDA launch raises.
    KERNEL_VERSIONS["add_rms_norm"] = "triton-missing"
