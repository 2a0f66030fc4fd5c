"""The GDN decode kernel's tiling on the H200 (issue 6): value columns per program x warps.

The kernel (kernels/gdn_decode.py) spreads each value head's Dv columns over ``split``
programs, each looping over ``chunks`` blocks of ``block_v``
columns; a split head's gated RMSNorm is finished by the last of its programs to arrive. This
times the bare launcher (no compile) at Qwen3.5's real dims for every tiling (``tilings``), at
batch 1, 8, 64, 256, as CUDA-graph replays over input sets rotated past L2, and checks each
tiling against the op's torch reference (outputs, both states, untouched slots) on a pristine
copy of the first input set.

    python bench/diagnostics/gdn_tiling_sweep.py --out bench/results/gdn_tiling_sweep_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402
from gdn_decode import L2_BYTES, REAL, Region, clone_inputs, compare, make_inputs, region_bytes  # noqa: E402

from fusion_compiler.kernels import gdn_decode as K  # noqa: E402
from fusion_compiler.ops.gdn_decode import gdn_decode_reference  # noqa: E402

SWEEP_TOKENS = (1, 8, 64, 256)


def tilings(value_dim: int = 128) -> list:
    """Every (block, split, warps) with 32 to 64 state registers a thread."""
    out = []
    for block_v in (8, 16, 32, 64, 128):
        for split in (1, 2, 4, 8):
            chunks = value_dim // block_v // split
            if chunks < 1:
                continue
            for warps in (1, 2, 4, 8):
                if not 32 <= block_v * 128 // (warps * 32) <= 64:
                    continue
                out.append(K.Tiling(block_v, chunks=chunks, split=split, num_warps=warps))
    return out


def op_args(layer, inputs: dict) -> list:
    return [
        inputs["mixed_qkv"], inputs["z"], inputs["b"], inputs["a"], layer.conv_weight, layer.A_log, layer.dt_bias,
        layer.norm_weight, layer.cfg.rms_norm_eps, 1e-6, inputs["conv_state"], inputs["recurrent_state"],
        inputs["state_slots"],
    ]  # fmt: skip


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="*", default=SWEEP_TOKENS)
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = REAL
    layer = Region(cfg).cuda().to(torch.bfloat16).linear_attn
    bandwidth = common.copy_bandwidth_gbs()
    rows = []
    for tokens in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        size, state_size = region_bytes(cfg, tokens)
        rotations = max(1, min(8, -(-2 * L2_BYTES // size)))
        sets = [make_inputs(cfg, tokens, gen) for _ in range(rotations)]
        outs = [torch.empty(tokens, cfg.value_dim, dtype=torch.bfloat16, device="cuda") for _ in sets]
        pristine = clone_inputs(sets[0])  # the timed replays update sets[0]'s states
        ref_inputs = clone_inputs(pristine)
        ref_out = gdn_decode_reference(*op_args(layer, ref_inputs))
        for tile in tilings(cfg.value_head_dim):
            row = {"tokens": tokens, **dataclasses.asdict(tile)}
            try:
                check = clone_inputs(pristine)
                out = torch.full_like(ref_out, float("nan"))
                K.gdn_decode_fwd(*op_args(layer, check), out, tiling_override=tile)
                row["vs_reference"] = compare(out, check, ref_out, ref_inputs)

                def call(i, tile=tile):
                    K.gdn_decode_fwd(*op_args(layer, sets[i]), outs[i], tiling_override=tile)

                us = common.graph_time_us(call, rotations, replays=15)
                row.update(us=round(us, 2), state_pct_bw=round(100 * state_size / (us * 1e-6) / 1e9 / bandwidth, 2),
                           pct_bw=round(100 * size / (us * 1e-6) / 1e9 / bandwidth, 2))  # fmt: skip
            except Exception as error:  # noqa: BLE001 - a tiling that fails is a result
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            rows.append(row)
            print(row, flush=True)
        best = min((r for r in rows if r["tokens"] == tokens and "us" in r), key=lambda r: r["us"])
        print(f"T={tokens}: best {({k: best[k] for k in ('block_v', 'chunks', 'split', 'num_warps')})} {best['us']} us "
              f"({best['state_pct_bw']}% of copy bandwidth on the state bytes)", flush=True)  # fmt: skip
    common.write_json(args.out, {"device": common.device_facts(), "copy_bandwidth_gbs": bandwidth,
                                 "kernel": K.KERNEL_VERSION, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
