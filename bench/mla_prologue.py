"""DeepSeek V3.2 attention prologue region on the H200: eager vs stock Inductor vs ours.

The region is everything of one layer's attention between the GEMMs, written as the serving
engine reference writes it (model_adapters/reference/deepseek_v32.py) at real widths, FP8
caches (fp8_ds_mla latent, 132 B/token indexer) and ue8m0 scales:

  before q_b:  q_a RMSNorm + FP8 quant; kv_a RMSNorm + GPT-J RoPE + FP8 + latent-cache write;
               indexer k LayerNorm + NeoX RoPE + FP8 + indexer-cache write;
  after q_b:   q_pe RoPE + concat with the absorbed q; indexer q NeoX RoPE + FP8 + head weights.

Its inputs are the GEMM outputs (random, fresh per rotation), so the GEMMs are not timed.
Every variant is timed as CUDA-graph replays in the same run; kernel counts come from the
profiler; bytes are what the region must move (read once, written once).

    python bench/mla_prologue.py --out bench/results/mla_prologue_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler.model_adapters.reference import deepseek_v32 as ref  # noqa: E402
from fusion_compiler.inspect.counting import count_cuda_kernels  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

TOKENS = (1, 8, 64, 256, 4096)
L2_BYTES = 60 * 2**20


class Region(torch.nn.Module):
    """One layer's prologue, in the reference model's own spelling."""

    def __init__(self, cfg: ref.ReferenceConfig):
        super().__init__()
        self.cfg = cfg
        self.q_norm = torch.nn.Parameter(1 + 0.1 * torch.randn(cfg.q_lora_rank))
        self.kv_norm = torch.nn.Parameter(1 + 0.1 * torch.randn(cfg.kv_lora_rank))
        self.k_norm = torch.nn.LayerNorm(cfg.index_head_dim, eps=1e-6).to(torch.bfloat16)
        with torch.no_grad():
            self.k_norm.weight.normal_(1, 0.1)
            self.k_norm.bias.normal_(0, 0.1)
        self.register_buffer("cos_sin_cache", ref.yarn_cos_sin_cache(cfg), persistent=False)

    def forward(self, qkv, k_lin, q, q_absorbed, iq, w_lin, positions, slots, latent_cache, index_cache):
        cfg = self.cfg
        rot, heads, dim = cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        q_c, kv_c, k_pe = torch.split(qkv, [cfg.q_lora_rank, cfg.kv_lora_rank, rot], dim=-1)
        qr_fp8, qr_scale = ref.act_quant(ref.rms_norm(q_c, self.q_norm, cfg.rms_norm_eps), 128, True)

        kv = ref.rms_norm(kv_c, self.kv_norm, cfg.rms_norm_eps)
        k_pe = ref.rope_gptj(k_pe, cos, sin)
        kv_fp8, kv_scale = ref.act_quant(kv, 128, True)
        rows = torch.cat([ref.as_bytes(kv_fp8), ref.as_bytes(kv_scale), ref.as_bytes(k_pe)], dim=-1)
        latent_cache.view(-1, latent_cache.shape[-1]).index_put_((slots,), rows)

        k = self.k_norm(k_lin)
        k_rot, k_pass = torch.split(k, [rot, dim - rot], dim=-1)
        k = torch.cat([ref.rope_neox(k_rot, cos, sin), k_pass], dim=-1)
        k_fp8, k_scale = ref.act_quant(k, dim, True)
        index_cache.view(-1, index_cache.shape[-1]).index_put_((slots,), torch.cat([ref.as_bytes(k_fp8), ref.as_bytes(k_scale)], dim=-1))

        q_nope, q_pe = torch.split(q, [cfg.qk_nope_head_dim, rot], dim=-1)
        q_full = torch.cat([q_absorbed, ref.rope_gptj(q_pe, cos.unsqueeze(1), sin.unsqueeze(1))], dim=-1)

        iq_rot, iq_pass = torch.split(iq, [rot, dim - rot], dim=-1)
        iq = torch.cat([ref.rope_neox(iq_rot, cos.unsqueeze(1), sin.unsqueeze(1)), iq_pass], dim=-1)
        iq_fp8, iq_scale = ref.act_quant(iq, dim, True)
        weights = w_lin.float() * heads**-0.5
        weights = weights * iq_scale.squeeze(-1) * dim**-0.5
        return qr_fp8, qr_scale, q_full, iq_fp8, weights


class RegionTypedCaches(Region):
    """The same work writing FP8 values, scales and k_pe into separate typed caches, as
    DeepSeek's own reference keeps kv_cache and pe_cache apart: no byte views, which stock
    Inductor on torch 2.11 cannot lower here ("stride(-1) must be 1 to view Float as Byte")."""

    def forward(self, qkv, k_lin, q, q_absorbed, iq, w_lin, positions, slots,
                latent_fp8, latent_scale, latent_pe, index_fp8, index_scale):  # fmt: skip
        cfg = self.cfg
        rot, heads, dim, rank = cfg.qk_rope_head_dim, cfg.index_n_heads, cfg.index_head_dim, cfg.kv_lora_rank
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        q_c, kv_c, k_pe = torch.split(qkv, [cfg.q_lora_rank, rank, rot], dim=-1)
        qr_fp8, qr_scale = ref.act_quant(ref.rms_norm(q_c, self.q_norm, cfg.rms_norm_eps), 128, True)
        kv_fp8, kv_scale = ref.act_quant(ref.rms_norm(kv_c, self.kv_norm, cfg.rms_norm_eps), 128, True)
        latent_fp8.index_put_((slots,), kv_fp8)
        latent_scale.index_put_((slots,), kv_scale)
        latent_pe.index_put_((slots,), ref.rope_gptj(k_pe, cos, sin))
        k = self.k_norm(k_lin)
        k_rot, k_pass = torch.split(k, [rot, dim - rot], dim=-1)
        k_fp8, k_scale = ref.act_quant(torch.cat([ref.rope_neox(k_rot, cos, sin), k_pass], dim=-1), dim, True)
        index_fp8.index_put_((slots,), k_fp8)
        index_scale.index_put_((slots,), k_scale)
        q_nope, q_pe = torch.split(q, [cfg.qk_nope_head_dim, rot], dim=-1)
        q_full = torch.cat([q_absorbed, ref.rope_gptj(q_pe, cos.unsqueeze(1), sin.unsqueeze(1))], dim=-1)
        iq_rot, iq_pass = torch.split(iq, [rot, dim - rot], dim=-1)
        iq = torch.cat([ref.rope_neox(iq_rot, cos.unsqueeze(1), sin.unsqueeze(1)), iq_pass], dim=-1)
        iq_fp8, iq_scale = ref.act_quant(iq, dim, True)
        weights = w_lin.float() * heads**-0.5 * iq_scale.squeeze(-1) * dim**-0.5
        return qr_fp8, qr_scale, q_full, iq_fp8, weights


PACKED_KEYS = ("qkv", "k_lin", "q", "q_absorbed", "iq", "w_lin", "positions", "slots", "latent_cache", "index_cache")
TYPED_KEYS = PACKED_KEYS[:-2] + ("latent_fp8", "latent_scale", "latent_pe", "index_fp8", "index_scale")


def region_bytes(cfg: ref.ReferenceConfig, tokens: int) -> int:
    """Bytes the region must move: GEMM outputs read once, results and cache rows written once."""
    rot, h, hi, d = cfg.qk_rope_head_dim, cfg.num_heads, cfg.index_n_heads, cfg.index_head_dim
    row, _ = cfg.latent_row()
    per_token = (
        (cfg.q_lora_rank + cfg.kv_lora_rank + rot) * 2 + d * 2 + 8 + 8 + rot * 4  # qkv, k_lin, pos, slot, cos|sin
        + cfg.q_lora_rank + cfg.q_lora_rank // 128 * 4 + row + d + 4  # q_a fp8 + scales, cache rows
        + h * rot * 2 + h * cfg.kv_lora_rank * 2 + h * (cfg.kv_lora_rank + rot) * 2  # q_pe, q_absorbed in; q out
        + hi * d * 2 + hi * d + hi * 2 + hi * 4  # index q in/out, weights in/out
    )
    return tokens * per_token


def make_inputs(cfg: ref.ReferenceConfig, tokens: int, gen: torch.Generator):
    rot, h = cfg.qk_rope_head_dim, cfg.num_heads
    row, _ = cfg.latent_row()
    blocks = max(64, 2 * (-(-tokens // cfg.block_size)))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    slots = torch.randperm(blocks * cfg.block_size, generator=gen, device="cuda")[:tokens]
    return {
        "qkv": randn(tokens, cfg.q_lora_rank + cfg.kv_lora_rank + rot),
        "k_lin": randn(tokens, cfg.index_head_dim),
        "q": randn(tokens, h, cfg.qk_head_dim),
        "q_absorbed": randn(tokens, h, cfg.kv_lora_rank),
        "iq": randn(tokens, cfg.index_n_heads, cfg.index_head_dim),
        "w_lin": randn(tokens, cfg.index_n_heads),
        "positions": torch.randint(0, 8192, (tokens,), generator=gen, device="cuda"),
        "slots": slots,
        "latent_cache": torch.randint(0, 255, (blocks, cfg.block_size, row), generator=gen, device="cuda", dtype=torch.uint8),
        "index_cache": torch.randint(0, 255, (blocks, cfg.block_size, cfg.index_head_dim + 4), generator=gen, device="cuda", dtype=torch.uint8),
        "latent_fp8": torch.zeros(blocks * cfg.block_size, cfg.kv_lora_rank, device="cuda", dtype=torch.float8_e4m3fn),
        "latent_scale": torch.zeros(blocks * cfg.block_size, cfg.kv_lora_rank // 128, device="cuda"),
        "latent_pe": torch.zeros(blocks * cfg.block_size, rot, device="cuda", dtype=torch.bfloat16),
        "index_fp8": torch.zeros(blocks * cfg.block_size, cfg.index_head_dim, device="cuda", dtype=torch.float8_e4m3fn),
        "index_scale": torch.zeros(blocks * cfg.block_size, 1, device="cuda"),
    }


def clone_inputs(inputs: dict, keys=PACKED_KEYS) -> dict:
    return {k: inputs[k].clone() for k in keys}


def pick(inputs: dict, keys) -> dict:
    return {k: inputs[k] for k in keys}


def kernel_times_us(fn, calls: int = 20) -> dict:
    """Mean device µs per call of every kernel `fn` launches (profiler, outside a graph)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        total = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if total and "memcpy" not in event.key.lower() and "memset" not in event.key.lower():
            out[event.key[:90]] = round(total / calls, 2)
    return out


def compare(ours_out, ours_in, eager_out, eager_in) -> dict:
    """FP8 bytes differing, bf16/fp32 relative errors, cache rows, untouched rows."""
    names = ("qr_fp8", "qr_scale", "q_full", "iq_fp8", "weights")
    result = {}
    for name, a, b in zip(names, ours_out, eager_out):
        if a.dtype == torch.float8_e4m3fn:
            result[f"{name}_bytes_differing"] = int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
            result[f"{name}_bytes"] = a.numel()
        else:
            result[f"{name}_rel_err"] = relative_error(a, b)
    slots = eager_in["slots"]
    for cache in ("latent_cache", "index_cache"):
        a, b = ours_in[cache].view(-1, ours_in[cache].shape[-1]), eager_in[cache].view(-1, eager_in[cache].shape[-1])
        written = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
        written[slots] = True
        result[f"{cache}_written_bytes_differing"] = int((a[written] != b[written]).sum())
        result[f"{cache}_untouched_rows_equal"] = bool(torch.equal(a[~written], b[~written]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    args = parser.parse_args()
    cfg = ref.REAL
    torch.manual_seed(0)
    region = Region(cfg).cuda()
    bandwidth = common.copy_bandwidth_gbs()
    rows = []
    for tokens in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        size = region_bytes(cfg, tokens)
        rotations = max(1, min(8, -(-2 * L2_BYTES // size)))
        sets = [make_inputs(cfg, tokens, gen) for _ in range(rotations)]
        variants = {}
        torch._dynamo.reset()
        variants["eager"] = region
        variants["inductor"] = torch.compile(region)
        backend = fc.FusionBackend(fc.FusionConfig(strict=True, cudagraphs=False))
        variants["ours"] = torch.compile(region, backend=backend)
        typed = RegionTypedCaches(cfg).cuda()
        typed.load_state_dict(region.state_dict())
        variants["inductor_typed_caches"] = torch.compile(typed)
        variants["eager_typed_caches"] = typed
        keys = {name: TYPED_KEYS if "typed" in name else PACKED_KEYS for name in variants}
        outputs, row = {}, {"tokens": tokens, "bytes": size, "rotations": rotations}
        with torch.no_grad():
            for name, fn in list(variants.items()):
                inputs = clone_inputs(sets[0], keys[name])
                try:
                    outputs[name] = (fn(**inputs), inputs)
                except Exception as error:  # noqa: BLE001 - a variant that cannot compile is a result
                    row[f"{name}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                    print(f"T={tokens}: {name} failed: {row[f'{name}_error']}", flush=True)
                    del variants[name]
        for name in ("ours", "inductor"):
            if name in outputs:
                row[f"{name}_vs_eager"] = compare(*outputs[name], *outputs["eager"])
        row["report"] = backend.report.to_dict()
        with torch.no_grad():
            for name, fn in variants.items():
                count = count_cuda_kernels(lambda fn=fn, k=keys[name]: fn(**pick(sets[0], k)))
                row[f"{name}_kernels"] = count.count
                if name != "eager" and name != "eager_typed_caches":
                    row[f"{name}_kernel_names"] = count.names
                    row[f"{name}_kernel_us"] = kernel_times_us(lambda fn=fn, k=keys[name]: fn(**pick(sets[0], k)))
                us = common.graph_time_us(lambda i, fn=fn, k=keys[name]: fn(**pick(sets[i], k)), rotations)
                row[f"{name}_us"] = us
                row[f"{name}_gbs"] = size / us / 1e3
                row[f"{name}_pct_bw"] = 100 * size / us / 1e3 / bandwidth
        for base in ("inductor", "inductor_typed_caches"):
            if f"{base}_us" in row and "ours_us" in row:
                row[f"speedup_vs_{base}"] = row[f"{base}_us"] / row["ours_us"]
        summary = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items() if k.endswith(("_kernels", "_us", "_pct_bw")) or k.startswith("speedup")}
        print(f"T={tokens:5d} {summary}", flush=True)
        print("   ours vs eager:", row.get("ours_vs_eager"), flush=True)
        print("   ours kernels (us):", row.get("ours_kernel_us"), flush=True)
        rows.append(row)
    common.write_json(args.out, {"device": common.device_facts(), "copy_bandwidth_gbs": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
