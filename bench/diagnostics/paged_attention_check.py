"""The reference layers' shared attention op (``fusion_compiler_ref::paged_decode_attention``) on
the GPU: its split-KV kernel straight from the paged cache (kernels/paged_decode_attention.py)
against the gathered path it replaced (each sequence's K/V rows gathered, then SDPA).

For MiniMax-M2.5 (48 query / 8 kv heads, D 128) and Qwen3.5's full attention (32 / 2, D 256),
T = 1, 8, 64 sequences of context 4096 (block size 16, blocks shuffled), bf16 and FP8 caches:
  - max and norm relative error of the kernel and of the gathered path against the fp32
    reference (``paged_decode_attention_reference``), and whether the op dispatches to the kernel;
  - µs per call of each path as CUDA-graph replays (bench/common.py ``graph_time_us``; input
    sets rotated so the caches come from HBM), the K/V bytes the attention must read (valid
    positions x kv heads x (D + Dv) x cache element size), GB/s and % of the same-run copy
    bandwidth.
Each case runs in its own try/except (an error is recorded, the rest go on). ~1 minute.

    python bench/diagnostics/paged_attention_check.py --out bench/results/paged_attention_h200.json

``--smoke``: on CPU under Triton's interpreter, tiny widths and context, correctness only (the
op's CPU path is the gathered one there, so ``uses_kernel`` is false):

    TRITON_INTERPRET=1 python bench/diagnostics/paged_attention_check.py --smoke --out /tmp/paged_smoke.json
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402

from fusion_compiler.kernels import paged_decode_attention as kernel  # noqa: E402
from fusion_compiler.model_adapters.reference import paged_kv  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

MODELS = {"minimax": (48, 8, 128), "qwen35_full": (32, 2, 256)}  # heads, kv heads, head dim
SMOKE_MODELS = {"minimax": (12, 2, 128), "qwen35_full": (16, 1, 256)}
TOKENS = (1, 8, 64)
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": paged_kv.FP8}
BLOCK_SIZE = 16
SCALES = {"bf16": (1.0, 1.0), "fp8": (0.021, 0.017)}
# Rotated input sets: enough caches that one call's K/V are not left in L2 (50 MB) by the last.
L2_DEFEAT_BYTES = 256 * 2**20
MAX_ROTATIONS = 16


def make_inputs(heads, kv_heads, d, tokens, context, dtype_name, gen, device):
    """One input set on ``device``: q bf16, the two caches (random everywhere), the padded context."""
    table_gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device=device)))
    num_blocks, table = paged_kv.random_block_table(tokens, context, BLOCK_SIZE, table_gen)
    slots, valid = paged_kv.padded_context_of(table["block_table"], table["seq_lens"], BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, d)
    dtype = CACHE_DTYPES[dtype_name]
    k_scale, v_scale = SCALES[dtype_name]
    caches = [torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(2)]
    q = torch.randn(tokens, heads, d, generator=gen, device=device).bfloat16()
    return dict(q=q, k_cache=caches[0], v_cache=caches[1], k_scale=k_scale, v_scale=v_scale,
                context_slots=slots.to(device), context_valid=valid.to(device))  # fmt: skip


def run_case(model, heads, kv_heads, d, tokens, dtype_name, context, bandwidth, device="cuda",
             split_factors=()) -> dict:  # fmt: skip
    """One (model, T, cache dtype): errors, then (on CUDA) both paths' graph-replay times."""
    row = {"model": model, "heads": heads, "kv_heads": kv_heads, "head_dim": d, "tokens": tokens,
           "cache_dtype": dtype_name, "context": context, "block_size": BLOCK_SIZE}  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(tokens * 1000 + d)
    first = make_inputs(heads, kv_heads, d, tokens, context, dtype_name, gen, device)
    args = tuple(first.values())
    row["uses_kernel"] = paged_kv._kernel_or_none(*args) is not None
    ref = paged_kv.paged_decode_attention_reference(*args, kv_heads)
    out = kernel.paged_decode_attention_fwd(*args)
    old = paged_kv._gathered_attention(*args)
    op = torch.ops.fusion_compiler_ref.paged_decode_attention(*args)
    row["kernel_rel_err"] = relative_error(out, ref)
    row["kernel_max_rel_err"] = common.max_relative_error(out, ref)
    row["gathered_rel_err"] = relative_error(old, ref)
    row["gathered_max_rel_err"] = common.max_relative_error(old, ref)
    row["op_equals_kernel"] = bool(torch.equal(op, out))
    row["op_rel_err"] = relative_error(op, ref)
    ctx = first["context_slots"].shape[1]
    row["splits"], row["tiles_per_split"] = kernel.split_plan(tokens, kv_heads, ctx, kernel.block_s_for(d, d), None,
                                                                kernel.TARGET_PROGRAMS)
    del ref, out, old, op
    valid_positions = int(first["context_valid"].sum())
    kv_bytes = valid_positions * kv_heads * 2 * d * first["k_cache"].element_size()
    row["kv_bytes"] = kv_bytes
    if device != "cuda":
        return row
    gc.collect()
    torch.cuda.empty_cache()
    rotations = max(1, min(MAX_ROTATIONS, math.ceil(L2_DEFEAT_BYTES / kv_bytes)))
    sets = [first] + [make_inputs(heads, kv_heads, d, tokens, context, dtype_name, gen, device)
                      for _ in range(rotations - 1)]  # fmt: skip
    row["rotations"] = rotations
    variants = {
        "kernel": lambda s: kernel.paged_decode_attention_fwd(*s.values()),
        "gathered": lambda s: paged_kv._gathered_attention(*s.values()),
    }
    for label, fn in variants.items():
        try:
            us = common.graph_time_us(lambda i, fn=fn: fn(sets[i]), rotations)
            row[f"{label}_us"] = us
            row[f"{label}_gbs"] = kv_bytes / us / 1e3
            row[f"{label}_pct_copy_bw"] = 100 * kv_bytes / us / 1e3 / bandwidth
        except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the other
            row[f"{label}_error"] = f"{type(e).__name__}: {e}"
    if "kernel_us" in row and "gathered_us" in row:
        row["speedup"] = row["gathered_us"] / row["kernel_us"]
    # The split rule's alternatives: num_splits' count times each factor (clamped to the tiles).
    for factor in split_factors:
        splits = row["splits"] * factor
        fn = lambda i, n=splits: kernel.paged_decode_attention_fwd(*sets[i].values(), splits=n)  # noqa: E731
        row.setdefault("kernel_us_by_splits", {})[str(kernel.split_plan(tokens, kv_heads, ctx, kernel.block_s_for(d, d), splits)[0])] = (
            common.graph_time_us(fn, rotations))
    del sets, first
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--split-factors", nargs="*", type=int, default=[],
                        help="also time the kernel with the default split count times each factor")
    parser.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny widths: errors only")
    args = parser.parse_args()
    if args.smoke:
        device, models, args.context, bandwidth = "cpu", SMOKE_MODELS, 40, float("nan")
        import triton

        facts = {"device": "cpu (interpreter)", "torch": torch.__version__, "triton": triton.__version__}
    elif not torch.cuda.is_available():
        print("needs CUDA (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        device, models = "cuda", MODELS
        facts = common.device_facts()
        bandwidth = common.copy_bandwidth_gbs()
    facts["kernel_version"] = kernel.KERNEL_VERSION
    print(f"# {facts['device']}, torch {facts['torch']}, triton {facts['triton']}, copy {bandwidth:.0f} GB/s",
          flush=True)  # fmt: skip
    rows, failures = [], 0
    start = time.perf_counter()
    for model in args.models:
        heads, kv_heads, d = models[model]
        for tokens in args.tokens:
            for dtype_name in CACHE_DTYPES:
                try:
                    row = run_case(model, heads, kv_heads, d, tokens, dtype_name, args.context, bandwidth, device,
                                   args.split_factors)  # fmt: skip
                    # On the GPU the op must dispatch to the kernel (bit-equal to it); on CPU it gathers.
                    dispatched = args.smoke or (row["uses_kernel"] and row["op_equals_kernel"])
                    bad = row["kernel_max_rel_err"] > 3e-2 or not dispatched
                except Exception as e:  # noqa: BLE001 - record and go on
                    row = {"model": model, "tokens": tokens, "cache_dtype": dtype_name,
                           "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}  # fmt: skip
                    bad = True
                failures += bad
                rows.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                               if k != "traceback"), flush=True)  # fmt: skip
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                common.write_json(args.out, {"device": facts, "copy_bandwidth_gbs": bandwidth, "rows": rows})
    print(f"# {len(rows)} cases, {failures} failed or off, {time.perf_counter() - start:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
