"""Triton kernels, one file per family. Nothing here imports graph code."""

import importlib

KERNEL_VERSIONS: dict[str, str] = {}

# A family (or lowering, or graph pass) -> the kernel modules whose KERNEL_VERSIONs it runs.
_KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "add_rms_norm": ("rms_norm",),
    "gated_rms_norm": ("rms_norm",),  # the same kernel, gated
    "mla_prologue": ("mla_kv_prologue", "mla_q_prologue"),
    "moe_routing": ("moe_route",),
    "gqa_prologue": ("gqa_prologue",),
    "gdn_decode": ("gdn_decode",),
    "gdn": ("gdn_decode",),  # the family's name (patterns/gdn.py)
    "gdn_fla": ("gdn_fla",),  # the family's lowering "fla"
    "decode_attention": ("decode_attention",),
    "dsa_topk_mask": ("dsa_topk_mask",),
    "merge_projections": ("skinny_gemm",),  # merged_linear's small-M path
}


def _register_versions() -> None:
    for name, modules in _KERNEL_MODULES.items():
        KERNEL_VERSIONS[name] = "+".join(importlib.import_module(f".{m}", __name__).KERNEL_VERSION for m in modules)


try:
    _register_versions()
except ImportError:
    # No triton (non-Linux): CPU ops still run their references; a CUDA launch raises.
    KERNEL_VERSIONS.update(dict.fromkeys(_KERNEL_MODULES, "triton-missing"))
