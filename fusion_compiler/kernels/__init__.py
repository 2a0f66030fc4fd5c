"""Triton kernels, one file per family. Nothing here imports graph code.

One is reference-only (its first line says so): ``paged_decode_attention``, which only the
serving-engine reference layers (model_adapters/reference/) launch; no stage runs it, so it is not
in ``_KERNEL_MODULES``."""

import importlib

from ..stages import STAGES

KERNEL_VERSIONS: dict[str, str] = {}

# A stage (stages.STAGES) -> the kernel modules whose KERNEL_VERSIONs it runs; and each of those
# modules (a family's own lowering's too, e.g. gdn's "fla": gdn_fla) -> itself.
_KERNEL_MODULES: dict[str, tuple[str, ...]] = {stage.name: stage.kernels for stage in STAGES if stage.kernels}
_KERNEL_MODULES.update(
    (module, (module,))
    for stage in STAGES
    for module in (*stage.kernels, *(m for _, mods in stage.lowerings for m in mods))
)


def _register_versions() -> None:
    for name, modules in _KERNEL_MODULES.items():
        KERNEL_VERSIONS[name] = "+".join(importlib.import_module(f".{m}", __name__).KERNEL_VERSION for m in modules)


try:
    _register_versions()
except ImportError:
    # No triton (non-Linux): CPU ops still run their references; a CUDA launch raises.
    KERNEL_VERSIONS.update(dict.fromkeys(_KERNEL_MODULES, "triton-missing"))
