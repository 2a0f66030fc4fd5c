"""Gated DeltaNet decode core on the H200: eager vs stock Inductor vs fla's kernels vs ours (issue 6).

The region is one GDN layer's decode step between the projections and out_proj (post in_proj ->
pre out_proj), written as our serving-engine reference writes it
(``model_adapters/reference/qwen35_gdn.py``, ``GatedDeltaNet.core``: the ``slots`` variant of
patterns/gdn.py), at Qwen3.5's real dims: 16 key heads, 64 value heads, head dims 128, conv
kernel 4, an fp32 recurrent state [64, 128, 128] (4 MiB) per sequence. The conv state is kept
HF-wide ([conv_dim, K], the oldest column shifted out unread) because fla's conv update reads
that layout in place. The eager row is our reference's torch code, not HF's module (HF's cache
has no state slots; tests/patterns/test_gdn.py covers HF's decode path).

    eager     the reference's torch code (state gathered / scattered at the slots with index_put_)
    inductor  torch.compile of the same module, stock
    fla       fla-core 0.6.0's kernels with eager glue, as vLLM composes them:
              ``fla.modules.causal_conv1d.causal_conv1d_update`` (in place on the conv state,
              SiLU inside), q / k / v made contiguous (fla's recurrence reads [B, 1, H, D] rows
              with no stride arguments: 3 small copies), ``fused_recurrent_gated_delta_rule_fwd_kernel``
              launched as fla's wrapper launches it but with the final state written over the
              initial one (in place; the wrapper allocates a new state, which would add a copy
              back), q/k L2-norm, the decay from A_log / dt_bias and sigmoid(b) inside the kernel,
              then ``fla.modules.norm.layernorm_gated.rmsnorm_fn`` (vLLM's RMSNormGated:
              per-head groups, norm before gate). fla has no state-slot indexing in its gated
              delta rule kernels: sequence i must sit in state row i. Its timing rows therefore
              run on rows 0..B-1 of the same state tensors (the same bytes); its correctness row
              permutes the states so that the reference's slots come first, runs, and permutes
              back, so it is compared slot for slot with eager.
    ours      torch.compile with the fusion backend, strict, one ``gdn`` site expected
              (lowering "triton": the one-kernel op ``fusion_compiler::gdn_decode``).
    ours_tile ours with the kernel's conv as a [C, K] tile (kernels/gdn_decode.py ``Tiling.conv_taps``
              False), the form before gdn_decode-8 made per-tap vectors the default: the A/B
    ours_fla  the same with the gdn family's lowering "fla" (``fusion_compiler::gdn_decode_fla``:
              fla's three kernels behind the op, the state rows gathered at the slots and
              scattered back around them).

Inputs (the projections' outputs and both states) are random, fresh per rotation; the
projections are not timed. Every variant is timed as CUDA-graph replays in the same run;
kernel counts come from the profiler; bytes are what the region must move (each state row read
once and written once, activations and parameters once). ``state_pct_bw`` counts the recurrent
state's bytes only (the issue's bar: >= 60% of HBM at batch 256), against the same run's
device-to-device copy bandwidth.

    python bench/gdn_decode.py --out bench/results/gdn_decode_h200.json
    python bench/gdn_decode.py --smoke      # CPU, tiny dims: correctness logic only (no graphs, no profiler)
"""

from __future__ import annotations

import argparse
import traceback
import dataclasses
import os
import sys

if "--smoke" in sys.argv:  # before triton is imported: fla's kernels run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler.kernels import gdn_decode as gdn_kernel  # noqa: E402
from fusion_compiler.model_adapters.reference import qwen35_gdn as ref  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

TOKENS = (1, 8, 64, 256)
SMOKE_TOKENS = (1, 3)
L2_BYTES = 60 * 2**20
DEVICE = "cuda"  # --smoke sets "cpu"
SITE = "linear_attn"
# HF's conv cache width (K columns): the layout fla's causal_conv1d_update updates in place.
REAL = dataclasses.replace(ref.REAL, conv_state_width=ref.REAL.conv_kernel)
TINY = dataclasses.replace(ref.TINY, conv_state_width=ref.TINY.conv_kernel)


class Core(ref.GatedDeltaNet):
    """The reference layer's ``core`` as a module's forward (so the site has a module path)."""

    def forward(self, mixed_qkv, z, b, a, conv_state, recurrent_state, state_slots):
        return self.core(mixed_qkv, z, b, a, conv_state, recurrent_state, state_slots)


class Region(torch.nn.Module):
    def __init__(self, cfg: ref.GdnConfig):
        super().__init__()
        self.linear_attn = Core(cfg)
        with torch.no_grad():  # the gated norm's weight away from its init of ones
            self.linear_attn.norm_weight.normal_(1.0, 0.1)

    def forward(self, mixed_qkv, z, b, a, conv_state, recurrent_state, state_slots):
        return self.linear_attn(mixed_qkv, z, b, a, conv_state, recurrent_state, state_slots)


# ------------------------------------------------------------------------------------------
# fla-core 0.6.0's kernels
# ------------------------------------------------------------------------------------------


def fla_available() -> str | None:
    """None when fla's kernels import, else why not."""
    try:
        import fla.modules.causal_conv1d  # noqa: F401
        import fla.modules.norm.layernorm_gated  # noqa: F401
        import fla.ops.gated_delta_rule.fused_recurrent  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means no fla row
        return f"{type(error).__name__}: {error}"
    return None


class FlaCore:
    """The region on fla's kernels; sequence i in state row i (fla has no slot indexing)."""

    def __init__(self, layer: ref.GatedDeltaNet):
        import triton
        from fla.modules.causal_conv1d import causal_conv1d_update
        from fla.modules.norm.layernorm_gated import rmsnorm_fn
        from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel

        self.layer, self.cfg = layer, layer.cfg
        if self.cfg.state_width != self.cfg.conv_kernel:
            raise ValueError("fla's causal_conv1d_update keeps a conv state of conv_kernel columns (HF's width)")
        self._conv, self._norm, self._recurrent = causal_conv1d_update, rmsnorm_fn, fused_recurrent_gated_delta_rule_fwd_kernel
        self._bk = triton.next_power_of_2(self.cfg.key_head_dim)
        self._bv = min(8, triton.next_power_of_2(self.cfg.value_head_dim))  # fla's wrapper's choice
        if DEVICE == "cpu":
            # --smoke only: the Triton interpreter has no benchmarker for the conv update's
            # autotuner; one config leaves nothing to tune (on CUDA fla tunes on the first call,
            # the correctness run, before any graph is captured).
            from fla.modules.causal_conv1d import ops as conv_ops

            tuner = conv_ops.causal_conv1d_update_kernel.fn
            tuner.configs = tuner.configs[:1]

    def __call__(self, mixed_qkv, z, b, a, conv_state, recurrent_state, state_slots=None):
        cfg, layer = self.cfg, self.layer
        n, hk, hv, dk, dv = mixed_qkv.shape[0], cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim
        # [N, conv_dim], cache [>= N, conv_dim, K] updated in place at rows 0..N-1.
        x, _ = self._conv(mixed_qkv, conv_state, weight=layer.conv_weight, activation="silu")
        q, k, v = x.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        # fla's kernel takes no strides: q / k / v must be contiguous rows (3 copies; a reshape
        # of the split alone is a view with the conv's row stride when N > 1).
        q, k, v = (x.contiguous().reshape(n, 1, heads, d) for x, heads, d in ((q, hk, dk), (k, hk, dk), (v, hv, dv)))
        o = torch.empty_like(v)
        nv = -(-dv // self._bv)
        self._recurrent[(nv * n * hv,)](
            q=q, k=k, v=v, g=a.reshape(n, 1, hv), gk=None, gv=None, beta=b.reshape(n, 1, hv),
            A_log=layer.A_log, dt_bias=layer.dt_bias, o=o, h0=recurrent_state, ht=recurrent_state,
            cu_seqlens=None, scale=dk**-0.5, T=1, H=hk, HV=hv, K=dk, V=dv, BK=self._bk, BV=self._bv,
            IS_BETA_HEADWISE=True, USE_QK_L2NORM_IN_KERNEL=True, APPLY_BETA_SIGMOID=True, ALLOW_NEG_EIGVAL=False,
            STATE_V_FIRST=False, num_warps=1, num_stages=3,
        )  # fmt: skip
        out = self._norm(o.reshape(n * hv, dv), layer.norm_weight, None, z=z.reshape(n * hv, dv),
                         eps=cfg.rms_norm_eps, group_size=dv, norm_before_gate=True)  # fmt: skip
        return out.reshape(n, hv * dv)


def run_fla_at_slots(fla, inputs: dict) -> torch.Tensor:
    """fla on the reference's slots: permute the states so the slots come first (row i = the
    slot of sequence i), run, permute back into ``inputs``' states."""
    slots = inputs["state_slots"].long()
    rows = inputs["conv_state"].shape[0]
    rest = torch.ones(rows, dtype=torch.bool, device=slots.device)
    rest[slots] = False
    order = torch.cat([slots, rest.nonzero().squeeze(1)])
    conv, recurrent = inputs["conv_state"][order].contiguous(), inputs["recurrent_state"][order].contiguous()
    out = fla(inputs["mixed_qkv"], inputs["z"], inputs["b"], inputs["a"], conv, recurrent)
    inputs["conv_state"][order] = conv
    inputs["recurrent_state"][order] = recurrent
    return out


# ------------------------------------------------------------------------------------------
# Inputs, bytes, correctness
# ------------------------------------------------------------------------------------------


def num_slots(tokens: int) -> int:
    return tokens + max(2, tokens // 4)  # spare slots that must stay untouched


def make_inputs(cfg: ref.GdnConfig, tokens: int, gen: torch.Generator) -> dict:
    slots = num_slots(tokens)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)

    return {
        "mixed_qkv": randn(tokens, cfg.conv_dim),
        "z": randn(tokens, cfg.value_dim),
        "b": randn(tokens, cfg.num_value_heads),
        "a": randn(tokens, cfg.num_value_heads),
        "conv_state": randn(*cfg.conv_state_shape(slots)),
        "recurrent_state": randn(*cfg.recurrent_state_shape(slots), scale=0.1, dtype=torch.float32),
        "state_slots": torch.randperm(slots, generator=gen, device=DEVICE)[:tokens],
    }


def region_bytes(cfg: ref.GdnConfig, tokens: int) -> tuple[int, int]:
    """(all bytes the region moves, the recurrent state's read + write alone)."""
    state = 2 * cfg.num_value_heads * cfg.key_head_dim * cfg.value_head_dim * 4
    conv = 2 * cfg.conv_dim * cfg.state_width * 2
    activations = (cfg.conv_dim + 2 * cfg.value_dim + 2 * cfg.num_value_heads) * 2 + 8  # in, z, b, a, out, slot
    params = cfg.conv_dim * cfg.conv_kernel * 2 + cfg.value_head_dim * 2 + 2 * cfg.num_value_heads * 2
    return tokens * (state + conv + activations) + params, tokens * state


def clone_inputs(inputs: dict) -> dict:
    return {k: v.clone() for k, v in inputs.items()}


def compare(out, inputs, eager_out, eager_inputs) -> dict:
    """Output and both states against eager: the written slots by relative error, every other
    slot bitwise unchanged."""
    result = {"out_rel_err": relative_error(out, eager_out)}
    written = torch.zeros(inputs["conv_state"].shape[0], dtype=torch.bool, device=out.device)
    written[eager_inputs["state_slots"].long()] = True
    for state in ("conv_state", "recurrent_state"):
        a, b = inputs[state], eager_inputs[state]
        result[f"{state}_written_rel_err"] = relative_error(a[written], b[written])
        result[f"{state}_untouched_slots_equal"] = bool(torch.equal(a[~written], b[~written]))
    return result


# ------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------


def build_variants(region, cfg, tokens: int, fla_reason: str | None):
    torch._dynamo.reset()
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected={"gdn": {SITE: 1}}, cudagraphs=False))
    variants = {"eager": region, "inductor": torch.compile(region), "ours": torch.compile(region, backend=backend)}
    variants["ours_tile"] = _with_conv_tile(variants["ours"])
    if fla_reason is None:
        variants["fla"] = FlaCore(region.linear_attn)
        # The gdn family's lowering "fla": the same site, fla's kernels behind our op (slots
        # gathered and scattered around them, kernels/gdn_fla.py).
        fla_config = fc.FusionConfig(strict=True, expected={"gdn": {SITE: 1}}, families={"gdn": "fla"}, cudagraphs=False)
        fla_backend = fc.FusionBackend(fla_config)
        variants["ours_fla"] = torch.compile(region, backend=fla_backend)
    return variants, backend


def _with_conv_tile(ours):
    """``ours`` with the kernel's conv as the [C, K] tile (``Tiling.conv_taps`` False) while it
    runs: the op launches with the launcher's own ``tiling`` choice, so that choice is wrapped (a
    CUDA graph records the launch made during its capture, so the captured kernel is the tile one)."""
    shipped = gdn_kernel.tiling

    def tile_conv(*args):
        return dataclasses.replace(shipped(*args), conv_taps=False)

    def run(**inputs):
        with common.module_knobs(gdn_kernel, tiling=tile_conv):
            return ours(**inputs)

    return run


def check_row(variants, sets, row, label_prefix: str) -> None:
    """Every variant once on a clone of set 0; the results against eager go into row."""
    outputs = {}
    for label, fn in list(variants.items()):
        inputs = clone_inputs(sets[0])
        try:
            out = run_fla_at_slots(fn, inputs) if label == "fla" else fn(**inputs)
            outputs[label] = (out, inputs)
        except Exception as error:  # noqa: BLE001 - a variant that fails is a result
            row[f"{label}_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            print(f"{label_prefix}: {label} failed: {row[f'{label}_error']}", flush=True)
            if DEVICE == "cpu":
                traceback.print_exc()
            del variants[label]
    for label in ("ours", "ours_tile", "inductor", "fla", "ours_fla"):
        if label in outputs and "eager" in outputs:
            row[f"{label}_vs_eager"] = compare(*outputs[label], *outputs["eager"])


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="JSON path (required unless --smoke)")
    parser.add_argument("--tokens", type=int, nargs="*", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny dims: build, match and compare every variant; no graphs, no profiler")  # fmt: skip
    args = parser.parse_args()
    if args.smoke:
        DEVICE = "cpu"
    elif not args.out:
        parser.error("--out is required unless --smoke")
    cfg = TINY if args.smoke else REAL
    tokens_list = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    fla_reason = fla_available()
    if fla_reason:
        print(f"fla not importable, no fla rows: {fla_reason}", flush=True)
    bandwidth = None if args.smoke else common.copy_bandwidth_gbs()
    torch.manual_seed(0)
    region = Region(cfg).to(torch.bfloat16).to(DEVICE)
    rows = []
    facts = {"device": "cpu (smoke)", "torch": torch.__version__} if args.smoke else common.device_facts()
    for tokens in tokens_list:
        gen = torch.Generator(device=DEVICE).manual_seed(tokens)
        size, state_size = region_bytes(cfg, tokens)
        rotations = 1 if args.smoke else max(1, min(8, -(-2 * L2_BYTES // size)))
        sets = [make_inputs(cfg, tokens, gen) for _ in range(rotations)]
        variants, backend = build_variants(region, cfg, tokens, fla_reason)
        row = {"tokens": tokens, "bytes": size, "state_bytes": state_size, "rotations": rotations,
               "num_slots": num_slots(tokens)}  # fmt: skip
        if fla_reason:
            row["fla_error"] = f"not importable: {fla_reason}"
        with torch.no_grad():
            check_row(variants, sets, row, f"T={tokens}")
            row["report"] = backend.report.to_dict()
            if not args.smoke:
                common.time_variants(variants, sets, rotations, size, bandwidth, row)
                for label in variants:  # the recurrent state's bytes alone (the bar at batch 256)
                    row[f"{label}_state_pct_bw"] = 100 * state_size / row[f"{label}_us"] / 1e3 / bandwidth
        for other in ("inductor", "fla", "eager"):
            if f"{other}_us" in row and "ours_us" in row:
                row[f"speedup_vs_{other}"] = row[f"{other}_us"] / row["ours_us"]
        summary = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()
                   if k.endswith(("_kernels", "_us", "_state_pct_bw")) or k.startswith("speedup")}  # fmt: skip
        print(f"T={tokens:4d} {summary}", flush=True)
        print(f"   fused sites: {backend.report.per_variant()}", flush=True)
        for label in ("ours", "ours_tile", "inductor", "fla", "ours_fla"):
            if f"{label}_vs_eager" in row:
                print(f"   {label} vs eager: { {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row[f'{label}_vs_eager'].items()} }", flush=True)  # fmt: skip
        rows.append(row)
        if args.out:  # after every row: a run cut short by its time limit keeps what it measured
            common.write_json(args.out, {"device": facts, "kernel": gdn_kernel.KERNEL_VERSION, "copy_bandwidth_gbs": bandwidth,
                                         "config": dataclasses.asdict(cfg), "eager": "model_adapters/reference/qwen35_gdn.py GatedDeltaNet.core", "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
