"""The fused prologue kernels against their references at real DeepSeek widths, one role at a
time, over the layouts and weight dtypes real graphs pass (strided GEMM-output views, fp32
norm weights). Prints mismatch counts; exits non-zero on any mismatch beyond one FP8 step.

    python bench/diagnostics/mla_kernel_check.py
"""

from __future__ import annotations

import itertools
import sys

import torch

from fusion_compiler.ops import mla_kv_prologue as kv_op
from fusion_compiler.ops import mla_q_prologue as q_op


def bytes_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.numel() == 0:
        return 0
    view = torch.uint8 if a.element_size() == 1 else {2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


def main() -> int:
    import triton

    from fusion_compiler.kernels import KERNEL_VERSIONS

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, kernels {KERNEL_VERSIONS['mla_prologue']}", flush=True)
    failures = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randn(8192, 64, device="cuda", generator=gen)
    for tokens, weight_dtype, strided, ue8m0, rounding in itertools.product(
        (1, 64, 4096), (torch.float32, torch.bfloat16), (True, False), (True, False), (True, False)
    ):
        qkv = torch.randn(tokens, 2112, device="cuda", generator=gen).to(torch.bfloat16)
        if not strided:
            qkv = qkv.clone()
        q_c = qkv[:, :1536] if strided else qkv[:, :1536].contiguous()
        kv_c = qkv[:, 1536:2048] if strided else qkv[:, 1536:2048].contiguous()
        k_pe = qkv[:, 2048:] if strided else qkv[:, 2048:].contiguous()
        positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
        slots = torch.randperm(8192, device="cuda", generator=gen)[:tokens]
        args = dict(
            q_c=q_c, q_weight=(1 + 0.1 * torch.randn(1536, device="cuda", generator=gen)).to(weight_dtype),
            q_quant_group=128, q_ue8m0=ue8m0,
            kv_c=kv_c, k_pe=k_pe, kv_weight=(1 + 0.1 * torch.randn(512, device="cuda", generator=gen)).to(weight_dtype),
            index_k=torch.randn(tokens, 128, device="cuda", generator=gen).to(torch.bfloat16),
            index_k_weight=torch.ones(128, device="cuda", dtype=torch.bfloat16),
            index_k_bias=torch.zeros(128, device="cuda", dtype=torch.bfloat16),
            cos=table[:, :32], sin=table[:, 32:], positions=positions, slots=slots,
            latent_cache=torch.zeros(128, 64, 656, dtype=torch.uint8, device="cuda"),
            index_cache=torch.zeros(128, 64, 132, dtype=torch.uint8, device="cuda"),
            cache_ue8m0=ue8m0, round_before_quant=rounding,
        )
        ref_args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        ref = kv_op.mla_kv_prologue_reference(**ref_args)
        out = kv_op.mla_kv_prologue(**args)
        diffs = {name: bytes_differing(o, r) for name, o, r in zip(("q_out", "q_scale", "kv_out", "k_pe_out", "index_k_out"), out, ref)}
        diffs["latent_cache"] = bytes_differing(args["latent_cache"], ref_args["latent_cache"])
        diffs["index_cache"] = bytes_differing(args["index_cache"], ref_args["index_cache"])
        bad = {k: v for k, v in diffs.items() if v}
        print(f"kv op T={tokens} weight={weight_dtype} strided={strided} ue8m0={ue8m0} round={rounding}: {bad or 'bit-equal'}", flush=True)
        failures += bool(bad)
    for tokens in (1, 64, 4096):
        q = torch.randn(tokens, 128, 192, device="cuda", generator=gen).to(torch.bfloat16)
        args = dict(
            q_pe=q[..., 128:], q_other=torch.randn(tokens, 128, 512, device="cuda", generator=gen).to(torch.bfloat16),
            index_q=torch.randn(tokens, 64, 128, device="cuda", generator=gen).to(torch.bfloat16),
            index_weights=torch.randn(tokens, 64, device="cuda", generator=gen).to(torch.bfloat16),
            index_weights_scale=0.0110, index_q_fp8=True, ue8m0=True,
            cos=table[:, :32], sin=table[:, 32:], positions=torch.randint(0, 8192, (tokens,), device="cuda", generator=gen),
        )
        ref = q_op.mla_q_prologue_reference(**args)
        out = q_op.mla_q_prologue(**args)
        diffs = {name: bytes_differing(o, r) for name, o, r in zip(("q_out", "index_q_out", "weights_out"), out, ref)}
        bad = {k: v for k, v in diffs.items() if v}
        print(f"q op T={tokens}: {bad or 'bit-equal'}", flush=True)
        failures += bool(bad)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
