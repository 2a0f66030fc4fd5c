"""decode_attention's ``skip_masked`` launch (the op's ``sparse_mask``) against the dense one, on the
GPU: does a top-k mask's share of K / V rows become a share of the time?

DeepSeek V3.2 as HF runs it (K / V expanded per head: 128 / 128 heads, D 192, Dv 128) at batch
1, 8 and 64, context 4096 (and 16384 at batch 1 and 8), masks:
  - ``topk``: DSA's top 2048 of the context per sequence (random positions), what
    dsa_topk_mask hands the attention;
  - ``all``: every position kept (the skip's cost where it cannot save anything);
  - ``tail``: a static cache twice the context, its unwritten half masked (HF's StaticCache).
MiniMax-M2.5 (48 / 8 heads of 128) and Qwen3.5's full attention (32 / 2 heads of 256) at batch 1
and 64 with ``all`` and ``tail``: every masked site now launches the skip (its cost where nothing
is masked, its gain on a static cache's tail). ``--only REGEX`` picks cases by "model batch
context mask".

Per case and launch: the max relative error against the fp32 reference on one input set, the
µs per call as CUDA-graph replays over rotated input sets (bench/common.py ``graph_time_us``),
GB/s over the K / V bytes of the kept rows and over the whole cache, and % of the same run's
copy bandwidth (kept rows). Each case in its own try/except. ~2 minutes.

    python bench/diagnostics/decode_attention_sparse.py --out bench/results/decode_attention_sparse_h200.json

``--smoke``: on CPU under Triton's interpreter, tiny widths and context, the errors only:

    TRITON_INTERPRET=1 python bench/diagnostics/decode_attention_sparse.py --smoke --out /tmp/sparse_smoke.json
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402

from fusion_compiler.kernels import decode_attention as kernel  # noqa: E402
from fusion_compiler.ops.decode_attention import decode_attention_reference  # noqa: E402

MODELS = {"deepseek-v3.2": (128, 128, 192, 128), "minimax-m2.5": (48, 8, 128, 128), "qwen3.5": (32, 2, 256, 256)}
SMOKE_MODELS = {"deepseek-v3.2": (4, 4, 48, 32), "minimax-m2.5": (6, 2, 32, 32), "qwen3.5": (4, 2, 64, 64)}
TOP_K = 2048
# (model, batch, context, mask)
CASES = [("deepseek-v3.2", b, 4096, m) for b in (1, 8, 64) for m in ("topk", "all", "tail")]
CASES += [("deepseek-v3.2", b, 16384, "topk") for b in (1, 8)]
CASES += [(m, b, 4096, mask) for m in ("minimax-m2.5", "qwen3.5") for b in (1, 64) for mask in ("all", "tail")]
L2_DEFEAT_BYTES = 256 * 2**20
MAX_ROTATIONS = 8


def make_set(dims, batch: int, context: int, top_k: int, kind: str, seed: int, device: str) -> dict:
    heads, kv_heads, d, dv = dims
    seq = 2 * context if kind == "tail" else context
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, 1, heads, d, generator=gen, device=device).bfloat16().transpose(1, 2)
    k = torch.randn(batch, kv_heads, seq, d, generator=gen, device=device, dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, seq, dv, generator=gen, device=device, dtype=torch.bfloat16)
    if kind == "topk":
        keep = torch.zeros(batch, seq, dtype=torch.bool, device=device)
        keep.scatter_(1, torch.rand(batch, seq, generator=gen, device=device).topk(top_k, dim=1).indices, True)
    else:
        keep = torch.arange(seq, device=device)[None, :].expand(batch, seq) < context
    out = torch.empty(batch, heads, 1, dv, dtype=torch.bfloat16, device=device)
    return {"q": q, "k": k, "v": v, "mask": keep[:, None, None, :].contiguous(), "out": out, "scale": d**-0.5}


def reference(s: dict, rows: int = 4) -> torch.Tensor:
    """The fp32 reference a few sequences at a time (its fp32 copy of DeepSeek's batch-64 cache
    would not fit)."""
    parts = [decode_attention_reference(s["q"][i:i + rows], s["k"][i:i + rows], s["v"][i:i + rows],
                                        s["mask"][i:i + rows], s["scale"]).float()
             for i in range(0, s["q"].shape[0], rows)]  # fmt: skip
    return torch.cat(parts)


def run_case(model: str, batch: int, context: int, kind: str, bandwidth: float | None, smoke: bool = False) -> dict:
    dims = (SMOKE_MODELS if smoke else MODELS)[model]
    heads, kv_heads, d, dv = dims
    if smoke:
        batch, context = min(batch, 2), context // 64
    top_k = TOP_K * context // 4096
    device = "cpu" if smoke else "cuda"
    seq = 2 * context if kind == "tail" else context
    row_bytes = kv_heads * (d + dv) * 2
    kept = batch * (top_k if kind == "topk" else context)
    set_bytes = batch * seq * row_bytes
    rotations = 1 if smoke else max(1, min(MAX_ROTATIONS, -(-L2_DEFEAT_BYTES // set_bytes)))
    sets = [make_set(dims, batch, context, top_k, kind, seed, device) for seed in range(rotations)]
    row = {"model": model, "batch": batch, "context": context, "cache_positions": seq, "mask": kind, "top_k": top_k,
           "kept_rows": kept, "kept_bytes": kept * row_bytes, "cache_bytes": set_bytes, "rotations": rotations}  # fmt: skip
    s0 = sets[0]
    want = reference(s0)
    for label, skip in (("dense", False), ("skip", True)):
        s0["out"].fill_(float("nan"))
        kernel.decode_attention_fwd(s0["q"], s0["k"], s0["v"], s0["mask"], s0["scale"], s0["out"], skip_masked=skip)
        row[f"{label}_max_rel_err"] = common.max_relative_error(s0["out"].float(), want)
        if smoke:
            continue
        us = common.graph_time_us(lambda i, skip=skip: kernel.decode_attention_fwd(
            sets[i]["q"], sets[i]["k"], sets[i]["v"], sets[i]["mask"], sets[i]["scale"], sets[i]["out"],
            skip_masked=skip), rotations)  # fmt: skip
        row[f"{label}_us"] = us
        row[f"{label}_kept_gbs"] = kept * row_bytes / us / 1e3
        row[f"{label}_cache_gbs"] = set_bytes / us / 1e3
        row[f"{label}_kept_pct_bw"] = 100 * kept * row_bytes / us / 1e3 / bandwidth
    if not smoke:
        row["skip_speedup"] = row["dense_us"] / row["skip_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny: the errors only")
    parser.add_argument("--only", default="", help="the cases whose 'model batch context mask' this regex finds")
    args = parser.parse_args()
    bandwidth = None if args.smoke else common.copy_bandwidth_gbs()
    result = {"what": __doc__.split("\n\n")[0], "device": None if args.smoke else common.device_facts(),
              "copy_bandwidth_gbs": bandwidth, "smoke": args.smoke, "rows": []}  # fmt: skip
    for case in [c for c in CASES if re.search(args.only, " ".join(map(str, c)))]:
        try:
            row = run_case(*case, bandwidth, smoke=args.smoke)
            timed = "" if args.smoke else (
                f"dense {row['dense_us']:.1f} us, skip {row['skip_us']:.1f} us (x{row['skip_speedup']:.2f}), "
                f"kept {row['skip_kept_pct_bw']:.0f}% of copy, ")  # fmt: skip
            print(f"{row['model']} B={row['batch']} S={row['context']} {row['mask']}: {timed}"
                  f"err {row['dense_max_rel_err']:.1e}/{row['skip_max_rel_err']:.1e}", flush=True)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - recorded, the rest go on
            row = {"case": list(case), "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
            print(f"{case}: {row['error']}", flush=True)
        result["rows"].append(row)
        common.write_json(args.out, result)
        gc.collect()
        if not args.smoke:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
