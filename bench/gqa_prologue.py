"""GQA attention prologue region on the H200: eager vs stock Inductor vs ours (issue 5).

The region is one attention layer's work between the qkv GEMM and attention, written as the
serving-engine references write it (model_adapters/reference/{minimax_m2,qwen35}.py
``after_qkv``) at real widths:

  MiniMax-M2.5  split q | k | v (6144 | 1024 | 1024), full-width q / k RMSNorm, NeoX RoPE on 64
                of 128 dims, K / V into paged caches (bf16, or FP8 with per-tensor scales);
  Qwen3.5       q out of each head's [q | gate] row (32 x 256), per-head Gemma q / k norm,
                NeoX RoPE on 64 of 256 dims, K / V into paged bf16 caches.

Inputs are the GEMM's output (random, fresh per rotation); the GEMM is not timed. Every variant
is timed as CUDA-graph replays in the same run; kernel counts come from the profiler; bytes are
what the region must move (read once, written once).

    python bench/gqa_prologue.py --out bench/results/gqa_prologue_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler.kernels.gqa_prologue import GqaPrologueConfig  # noqa: E402
from fusion_compiler.model_adapters.reference import minimax_m2 as minimax  # noqa: E402
from fusion_compiler.model_adapters.reference import qwen35 as qwen  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

TOKENS = (1, 8, 64, 256, 4096)
L2_BYTES = 60 * 2**20
FP8 = torch.float8_e4m3fn
DEVICE = "cuda"  # a CPU smoke run sets "cpu"
# name: (reference module, kv cache dtype, k_scale, v_scale)
CONFIGS = {
    "minimax-m2.5/bf16": (minimax, "bf16", 1.0, 1.0),
    "qwen3.5/bf16": (qwen, "bf16", 1.0, 1.0),
    "minimax-m2.5/fp8": (minimax, "fp8", 0.05, 0.02),
}


class Region(torch.nn.Module):
    """The reference attention's ``after_qkv``: q out (Qwen's gate is consumed after attention,
    so it is not an output of the region)."""

    def __init__(self, ref, cfg, k_scale: float, v_scale: float):
        super().__init__()
        self.attn = ref.Attention(cfg).to(torch.bfloat16)
        offset = 0.0 if ref is qwen else 1.0  # Gemma's weights are offsets from 1
        with torch.no_grad():
            self.attn.q_norm_weight.normal_(offset, 0.1)
            self.attn.k_norm_weight.normal_(offset, 0.1)
        self.register_buffer("table", ref.rope_cos_sin_cache(cfg), persistent=False)
        self.scales = (k_scale, v_scale)

    def forward(self, qkv, positions, slots, k_cache, v_cache):
        out = self.attn.after_qkv(qkv, self.table, positions, slots, k_cache, v_cache, *self.scales)
        return out[0] if isinstance(out, tuple) else out


def region_bytes(cfg, tokens: int, cache_bytes: int) -> int:
    q, kv, rot = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.rotary_dim
    per_token = (q + 2 * kv) * 2 + rot * 4 + 16 + q * 2 + 2 * kv * cache_bytes  # in; cos|sin, pos, slot; q out, K/V rows
    return tokens * per_token


def make_inputs(cfg, tokens: int, gen: torch.Generator) -> dict:
    q_in = 2 * cfg.q_width if isinstance(cfg, qwen.ReferenceConfig) else cfg.q_width  # Qwen: [q | gate] per head
    width = q_in + 2 * cfg.kv_width
    blocks = max(64, 2 * (-(-tokens // cfg.block_size)))
    cache_shape = (blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    return {
        "qkv": torch.randn(tokens, width, generator=gen, device=DEVICE).to(torch.bfloat16),
        "positions": torch.randint(0, cfg.max_position, (tokens,), generator=gen, device=DEVICE),
        "slots": torch.randperm(blocks * cfg.block_size, generator=gen, device=DEVICE)[:tokens],
        "k_cache": torch.randn(cache_shape, generator=gen, device=DEVICE).to(cfg.cache_dtype),
        "v_cache": torch.randn(cache_shape, generator=gen, device=DEVICE).to(cfg.cache_dtype),
    }


def clone_inputs(inputs: dict) -> dict:
    return {k: v.clone() for k, v in inputs.items()}


def compare(ours_out, ours_in, eager_out, eager_in) -> dict:
    result = {"q_rel_err": relative_error(ours_out, eager_out)}
    slots = eager_in["slots"]
    for cache in ("k_cache", "v_cache"):
        a, b = ours_in[cache].view(-1, *ours_in[cache].shape[2:]), eager_in[cache].view(-1, *eager_in[cache].shape[2:])
        written = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
        written[slots] = True
        result[f"{cache}_untouched_rows_equal"] = bool(torch.equal(a[~written].view(torch.uint8), b[~written].view(torch.uint8)))
        if a.dtype == FP8:
            codes_a, codes_b = a[written].view(torch.uint8).int(), b[written].view(torch.uint8).int()
            result[f"{cache}_fp8_codes_differing"] = int((codes_a != codes_b).sum())
            result[f"{cache}_fp8_codes_more_than_one_step"] = int(((codes_a & 0x7F) - (codes_b & 0x7F)).abs().gt(1).sum())
            result[f"{cache}_fp8_codes"] = codes_a.numel()
        else:
            result[f"{cache}_written_rel_err"] = relative_error(a[written], b[written])
    return result


def _timed(ours, sets, rotations, size, bandwidth, config=None) -> tuple[float, float]:
    """(µs, % of HBM) of ours launched with ``config`` (a ``GqaPrologueConfig``; None: the shipped
    policy). The op calls the launcher without a config, so inside the compiled region the
    launcher is bound to ``config``."""
    from fusion_compiler.kernels import gqa_prologue as kernel

    bound = {} if config is None else {"gqa_prologue_fwd": functools.partial(kernel.gqa_prologue_fwd, config=config)}
    with torch.no_grad(), common.module_knobs(kernel, **bound):
        us = common.graph_time_us(lambda i: ours(**sets[i]), rotations)
    return us, round(100 * size / us / 1e3 / bandwidth, 1)


def _sweep_lanes(ours, sets, rotations, size, bandwidth, lanes_list, warps_list) -> dict:
    """% of HBM by (head-block lanes, warps, grid order, roles): "lanes/warps/order" -> %, order
    "tokens" (every q program first) or "interleaved" (role fastest); with "/kv1" k's program
    also caches v (two roles a token, ``GqaPrologueConfig.kv_one_program``)."""
    out = {}
    for lanes, warps, interleaved, kv_one in itertools.product(lanes_list, warps_list, (False, True), (False, True)):
        key = f"{lanes}/{warps}/{'interleaved' if interleaved else 'tokens'}" + ("/kv1" if kv_one else "")
        config = GqaPrologueConfig(block_lanes_full_width_norm=lanes, block_lanes_per_head_norm=lanes,
                                   interleave_roles=interleaved, kv_one_program=kv_one, warps=warps)
        out[key] = _timed(ours, sets, rotations, size, bandwidth, config)[1]
    return out


# Role sets for ``--sweep-roles``: the shipped grid, and k's program also caching v ("kv1").
ROLE_SETS = {"shipped": {}, "kv1": {"config": GqaPrologueConfig(kv_one_program=True)}}


def _sweep_roles(ours, sets, rotations, size, bandwidth, names) -> dict:
    """µs and % of HBM by role set (``ROLE_SETS``) at the shipped lanes / warps / grid order."""
    out = {}
    for name in names:
        us, pct = _timed(ours, sets, rotations, size, bandwidth, **ROLE_SETS[name])
        out[name] = {"us": round(us, 2), "pct_bw": pct}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--sweep-lanes", type=int, nargs="*", default=[],
                        help="at the largest token count, also time ours with these head-block sizes (lanes)")
    parser.add_argument("--sweep-warps", type=int, nargs="*", default=[4, 8], help="... and these warps per program")
    parser.add_argument("--sweep-roles", nargs="*", default=[], choices=list(ROLE_SETS),
                        help="at the largest token count, also time ours with these role sets")
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth_gbs()
    rows = []
    for name in args.configs:
        ref, cache_dtype, k_scale, v_scale = CONFIGS[name]
        cfg = dataclasses.replace(ref.REAL, kv_cache_dtype=cache_dtype)
        torch.manual_seed(0)
        region = Region(ref, cfg, k_scale, v_scale).cuda()
        cache_bytes = 1 if cache_dtype == "fp8" else 2
        for tokens in args.tokens:
            gen = torch.Generator(device=DEVICE).manual_seed(tokens)
            size = region_bytes(cfg, tokens, cache_bytes)
            rotations = max(1, min(8, -(-2 * L2_BYTES // size)))
            sets = [make_inputs(cfg, tokens, gen) for _ in range(rotations)]
            torch._dynamo.reset()
            backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected={"gqa_prologue": {"attn": 1}}, cudagraphs=False))
            variants = {"eager": region, "inductor": torch.compile(region), "ours": torch.compile(region, backend=backend)}
            row = {"config": name, "tokens": tokens, "bytes": size, "rotations": rotations}
            outputs = {}
            with torch.no_grad():
                for label, fn in list(variants.items()):
                    inputs = clone_inputs(sets[0])
                    try:
                        outputs[label] = (fn(**inputs), inputs)
                    except Exception as error:  # noqa: BLE001 - a variant that fails is a result
                        row[f"{label}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                        print(f"{name} T={tokens}: {label} failed: {row[f'{label}_error']}", flush=True)
                        del variants[label]
                for label in ("ours", "inductor"):
                    if label in outputs:
                        row[f"{label}_vs_eager"] = compare(*outputs[label], *outputs["eager"])
                row["report"] = backend.report.to_dict()
                common.time_variants(variants, sets, rotations, size, bandwidth, row)
            if "inductor_us" in row and "ours_us" in row:
                row["speedup_vs_inductor"] = row["inductor_us"] / row["ours_us"]
            if tokens == max(args.tokens) and args.sweep_lanes and "ours" in variants:
                row["ours_pct_bw_by_block_lanes"] = _sweep_lanes(variants["ours"], sets, rotations, size, bandwidth,
                                                                 args.sweep_lanes, args.sweep_warps)
            if tokens == max(args.tokens) and args.sweep_roles and "ours" in variants:
                row["ours_by_roles"] = _sweep_roles(variants["ours"], sets, rotations, size, bandwidth, args.sweep_roles)
                print("   ours by roles:", row["ours_by_roles"], flush=True)
            summary = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                       if k.endswith(("_kernels", "_us", "_pct_bw")) or k.startswith("speedup")}  # fmt: skip
            print(f"{name} T={tokens:5d} {summary}", flush=True)
            print("   ours vs eager:", row.get("ours_vs_eager"), flush=True)
            if "ours_pct_bw_by_block_lanes" in row:
                print("   ours % of HBM by block lanes / warps:", row["ours_pct_bw_by_block_lanes"], flush=True)
            rows.append(row)
    common.write_json(args.out, {"device": common.device_facts(), "copy_bandwidth_gbs": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
