"""Triton kernels, one file per family. Nothing here imports graph code."""

KERNEL_VERSIONS: dict[str, str] = {}


def _register_versions() -> None:
    from . import decode_attention, dsa_topk_mask, gdn_decode, gdn_fla, gqa_prologue, mla_kv_prologue, mla_q_prologue, moe_route, rms_norm

    KERNEL_VERSIONS["add_rms_norm"] = rms_norm.KERNEL_VERSION
    KERNEL_VERSIONS["gated_rms_norm"] = rms_norm.KERNEL_VERSION  # the same kernel, gated
    KERNEL_VERSIONS["mla_prologue"] = (
        f"{mla_kv_prologue.KERNEL_VERSION}+{mla_q_prologue.KERNEL_VERSION}"
    )
    KERNEL_VERSIONS["moe_routing"] = moe_route.KERNEL_VERSION
    KERNEL_VERSIONS["gqa_prologue"] = gqa_prologue.KERNEL_VERSION
    KERNEL_VERSIONS["gdn_decode"] = gdn_decode.KERNEL_VERSION
    KERNEL_VERSIONS["gdn"] = gdn_decode.KERNEL_VERSION  # the family's name (patterns/gdn.py)
    KERNEL_VERSIONS["gdn_fla"] = gdn_fla.KERNEL_VERSION  # the family's lowering "fla"
    KERNEL_VERSIONS["decode_attention"] = decode_attention.KERNEL_VERSION
    KERNEL_VERSIONS["dsa_topk_mask"] = dsa_topk_mask.KERNEL_VERSION


try:
    _register_versions()
except ImportError:
    # No triton (non-Linux): CPU ops still run their references; a CUDA launch raises.
    KERNEL_VERSIONS["add_rms_norm"] = "triton-missing"
    KERNEL_VERSIONS["gated_rms_norm"] = "triton-missing"
    KERNEL_VERSIONS["mla_prologue"] = "triton-missing"
    KERNEL_VERSIONS["moe_routing"] = "triton-missing"
    KERNEL_VERSIONS["gqa_prologue"] = "triton-missing"
    KERNEL_VERSIONS["gdn_decode"] = "triton-missing"
    KERNEL_VERSIONS["gdn"] = "triton-missing"
    KERNEL_VERSIONS["gdn_fla"] = "triton-missing"
    KERNEL_VERSIONS["dsa_topk_mask"] = "triton-missing"
