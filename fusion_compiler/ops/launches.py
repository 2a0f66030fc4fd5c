"""How many GPU kernels each fused op launches on CUDA in a decode step: one number per op.

The CPU tier cannot see a GPU launch. On CPU, Inductor's wrapper code names every launch of a
compiled graph (inspect/counting.py): its generated kernels, extern GEMMs, and each call of one
of our ops. Each of those calls is counted here as the kernels its CUDA implementation launches,
which is what the op's launcher in ``kernels/`` does at decode sizes (one token per sequence, a
few sequences). That count, with Inductor's kernels and the extern calls counted one each, is
the "CPU proxy of the GPU count" (`inspect.counting.cuda_launch_proxy`).

Where the count depends on the size, the decode-step count is the one stated, and the comment
says where it changes. None: no fixed count (the proxy refuses to count the op).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

CUDA_LAUNCHES: Mapping[str, int | None] = MappingProxyType({
    # kernels/rms_norm.py: one _rms_norm_fwd_kernel, the residual add and the gate inside it.
    "rms_norm": 1,
    "add_rms_norm": 1,
    "gated_rms_norm": 1,
    # kernels/gqa_prologue.py: one _gqa_prologue_kernel (norms, RoPE, both cache writes).
    "gqa_prologue": 1,
    "gqa_prologue_variance": 1,  # one _variance_kernel (q's and k's rows)
    # ops/gqa_prologue_vllm.py: gqa_prologue on vLLM's cache views (a padded batch: a cat more).
    "gqa_prologue_vllm": 1,
    # kernels/mla_{kv,q}_prologue.py: one kernel per call, every role present in it.
    "mla_kv_prologue": 1,
    "mla_q_prologue": 1,
    # kernels/moe_route.py: one _moe_route_kernel; moe_router (the router GEMM with it) one
    # launch up to MoeRouteConfig.fused_gemm_max_tokens tokens, two above.
    "moe_route": 1,
    "moe_router": 1,
    # kernels/moe_experts.py: gate/up then down, two GEMV-style launches (the grouped path above
    # SMALL_BATCH_MAX_TOKENS: four, kernels/moe_experts_grouped.py's plan mode).
    "moe_experts": 2,
    "moe_experts_fp8": 2,
    # kernels/decode_attention.py: the split-KV kernel and its combine (one launch when the
    # cache fits one split).
    "decode_attention": 2,
    # kernels/dsa_topk_mask.py: the score kernel and the radix select.
    "dsa_topk_mask": 2,
    # kernels/gdn_decode.py: one _gdn_decode_kernel (conv, recurrence, gated norm, both states).
    "gdn_decode": 1,
    # The same kernel inside vLLM (ops/gdn_decode_vllm.py), for a batch of decode tokens alone;
    # any other batch runs vLLM's own op, then the gated norm in torch (not a decode step).
    "gdn_decode_vllm": 1,
    # kernels/gdn_fla.py: fla-core's kernels plus gathers, scatters and casts in eager torch.
    "gdn_decode_fla": None,
    # kernels/skinny_gemm.py: one launch up to its MAX_TOKENS rows; torch.mm (cuBLAS) above.
    "merged_linear": 1,
})  # fmt: skip


def cuda_launches(op: str) -> int:
    """The CUDA launches of one call of ``fusion_compiler::<op>`` (``op`` with or without the
    namespace and overload: ``"rms_norm"``, ``"fusion_compiler::rms_norm"``,
    ``"torch.ops.fusion_compiler.rms_norm.default"``)."""
    name = op.removeprefix("torch.ops.").replace("::", ".").removeprefix("fusion_compiler.").split(".")[0]
    if name not in CUDA_LAUNCHES:
        raise KeyError(f"fusion_compiler::{name} has no CUDA launch count in ops/launches.py")
    count = CUDA_LAUNCHES[name]
    if count is None:
        raise ValueError(f"fusion_compiler::{name} launches no fixed number of CUDA kernels")
    return count


__all__ = ["CUDA_LAUNCHES", "cuda_launches"]
