"""Offline sm_90 (H200) SASS of our Triton kernels, as the launchers would launch them, on a machine
with no GPU: the tool sessions 13 and 14 rebuilt twice to read where a latency-bound kernel's time
goes (bench/NOTES.md).

A launcher is called on CPU tensors with its kernel swapped for a recorder, so the grid, arguments
and constexprs are exactly the launch's; Triton's own binder for the NVIDIA backend then
specialises them as the runtime would (``tt.divisibility`` 16 on 16-aligned pointers and
multiples of 16, integers equal to 1 as constexpr 1: without that every access compiles scalar
and the counts mislead), and ``triton.compile`` targets ("cuda", 90, 32). The Triton wheel's
``cuobjdump`` disassembles the cubin. Uses Triton 3.6's binder internals
(``create_function_from_signature``, ``JITFunction._pack_args``): they move between versions.

    python bench/sass_offline.py gdn [--tokens 1] [--conv-tile] [--sass out.sass]
    python bench/sass_offline.py router --model minimax-m2.5 [--knob maxnreg=0] [--sass out.sass]
    python bench/sass_offline.py gqa --model qwen3.5 [--tokens 1] [--hf] [--fp-fusion on] [--ptx out.ptx]
    python bench/sass_offline.py check     # the shipped launches compile (tests/bench runs it)
    python bench/sass_offline.py check --write bench/results/sass_offline_snapshot.json
    python bench/sass_offline.py check --against bench/results/sass_offline_snapshot.json [--only REGEX]

prints the launch's grid, registers / stack / shared memory, and instruction counts by class
(all, BAR, SHFL, STS, LDS, LDG, STG, ATOM, MEMBAR, FFMA, HFMA2, STL, LDL) and the listing's
SHA-256; ``check`` does so for every shipped launch (``shipped_cases``: every kernel the passes'
ops launch, at the three models' widths) and ``--write`` keeps the counts as a snapshot that
``--against`` compares with, exiting 1 on any difference: a refactor of the kernels' launch code
shows it changed no kernel (issue 26). ``--sass`` writes the listing, ``--llir`` and
``--ptx`` Triton's LLVM IR and PTX. For the GQA prologue also the PTX's half-precision FMAs
(``half_fmas``): with HF's rounded RoPE (``--hf``) any one is a product fused unrounded into a
sum, which eager's bf16 ops round (``kernels/gqa_prologue.py`` ``_rotated``); ``--fp-fusion``
overrides the launch's ``enable_fp_fusion`` (``on`` shows the contraction those launches turn off).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("sass_offline: unset TRITON_INTERPRET (the kernels must compile for the GPU target)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CLASSES = ("BAR", "SHFL", "STS", "LDS", "LDG", "STG", "ATOMG", "MEMBAR")
EXTRA_CLASSES = ("FFMA", "HFMA2", "STL", "LDL")  # fp32 / half FMAs; local stores / loads (spills, stack)


class _Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self):
        self.grid = self.args = self.kwargs = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs

        return launch


def captured_launches(module, kernel_names, call) -> dict[str, _Recorder]:
    """What ``call()`` (a launcher of ``module``) would launch as each ``module.<name>``: a
    recorder per name (its ``args`` None where that kernel was not launched)."""
    reals = {name: getattr(module, name) for name in kernel_names}
    recorders = {name: _Recorder() for name in kernel_names}
    for name, recorder in recorders.items():
        setattr(module, name, recorder)
    try:
        call()
    finally:
        for name, real in reals.items():
            setattr(module, name, real)
    return recorders


def captured_launch(module, kernel_name: str, call) -> _Recorder:
    """What ``call()`` (a launcher of ``module``) would launch as ``module.<kernel_name>``."""
    recorder = captured_launches(module, (kernel_name,), call)[kernel_name]
    if recorder.args is None:
        raise RuntimeError(f"{kernel_name} was not launched")
    return recorder


def compile_sm90(kernel, args, kwargs):
    """The compiled kernel for sm_90, specialised by Triton's binder as a launch would be."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {"debug": False, **kwargs}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    compile_options = {k: v for k, v in kwargs.items() if k in options.__dict__}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=compile_options)


def _cuobjdump(compiled, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def summary(compiled) -> dict:
    sass = _cuobjdump(compiled, "-sass")
    usage = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", _cuobjdump(compiled, "-res-usage"))
    counts = {"instructions": len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))}
    counts.update({c: len(re.findall(rf"\b{c}\b", sass)) for c in CLASSES + EXTRA_CLASSES})
    # The listing's hash, less its "Function : name" lines: the same code under another name hashes the same.
    code = "\n".join(line for line in sass.splitlines() if "Function :" not in line)
    return {"registers": int(usage[1]), "stack": int(usage[2]), "shared": int(usage[3]), **counts,
            "sass_sha256": hashlib.sha256(code.encode()).hexdigest(), "sass": sass}  # fmt: skip


def gdn_launch(tokens: int, conv_tile: bool) -> _Recorder:
    """gdn_decode at Qwen3.5's dims (16 / 64 heads of 128, conv 4, HF's state width 4)."""
    from fusion_compiler.kernels import gdn_decode as K

    hk, hv, d, kernel = 16, 64, 128, 4
    conv_dim, bf16 = 2 * hk * d + hv * d, torch.bfloat16
    args = [torch.randn(tokens, conv_dim, dtype=bf16), torch.randn(tokens, hv * d, dtype=bf16),
            torch.randn(tokens, hv, dtype=bf16), torch.randn(tokens, hv, dtype=bf16),
            torch.randn(conv_dim, 1, kernel, dtype=bf16), torch.rand(hv), torch.randn(hv), torch.randn(d, dtype=bf16),
            1e-6, 1e-6, torch.randn(tokens + 1, conv_dim, kernel, dtype=bf16), torch.randn(tokens + 1, hv, d, d),
            torch.arange(tokens)]  # fmt: skip
    out, counters = torch.empty(tokens, hv * d, dtype=bf16), torch.zeros(tokens * hk, dtype=torch.int32)
    tile = dataclasses.replace(K.tiling(tokens, d, hv), conv_taps=not conv_tile)
    return captured_launch(K, "_gdn_decode_kernel",
                           lambda: K.gdn_decode_fwd(*args, out, counters=counters, tiling_override=tile))


def gdn_vllm_launch(tokens: int) -> _Recorder:
    """gdn_decode on vLLM 0.33's path (ops/gdn_decode_vllm.py) at Qwen3.5's dims: the SSM state
    [slot, Hv, Dv, Dk] and conv state [slot, K - 1, conv_dim] passed as their transposes, one padded
    row past the batch, slot 0 as padding, vLLM's arithmetic."""
    from fusion_compiler.kernels import gdn_decode as K

    hk, hv, d, kernel = 16, 64, 128, 4
    conv_dim, bf16 = 2 * hk * d + hv * d, torch.bfloat16
    ssm = torch.randn(tokens + 2, hv, d, d).transpose(-1, -2)
    conv = torch.randn(tokens + 2, kernel - 1, conv_dim, dtype=bf16).transpose(-1, -2)
    args = [torch.randn(tokens + 1, conv_dim, dtype=bf16), torch.randn(tokens + 1, hv * d, dtype=bf16),
            torch.randn(tokens + 1, hv, dtype=bf16), torch.randn(tokens + 1, hv, dtype=bf16),
            torch.randn(conv_dim, kernel, dtype=bf16), torch.rand(hv), torch.randn(hv), torch.randn(d, dtype=bf16),
            1e-6, 1e-6, conv, ssm,
            torch.arange(1, tokens + 2, dtype=torch.int32)]  # fmt: skip
    out, counters = torch.empty(tokens + 1, hv * d, dtype=bf16), torch.zeros((tokens + 1) * hk, dtype=torch.int32)
    return captured_launch(K, "_gdn_decode_kernel", lambda: K.gdn_decode_fwd(
        *args, out, counters=counters, rows=tokens, min_slot=1, vllm_math=True))  # fmt: skip


ROUTER_KERNELS = ("_router_gemm_kernel", "_moe_route_kernel")


def _knob_value(text: str) -> int | bool | str | tuple | None:
    """A ``MoeRouteConfig`` field's value from the command line: an int, true / false, none, a
    comma-separated tuple (``w_hints=,evict_last``), else the string."""
    if text.lower() in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[text.lower()]
    if "," in text:
        return tuple(text.split(","))
    return int(text) if text.lstrip("-").isdigit() else text


def router_config(knobs: list[str]):
    """The ``MoeRouteConfig`` of ``--knob FIELD=VALUE`` items (none: the shipped one)."""
    from fusion_compiler.kernels.moe_route import MoeRouteConfig

    return MoeRouteConfig(**{k: _knob_value(v) for k, v in (item.split("=", 1) for item in knobs)})


def router_launch(model: str, tokens: int, config=None) -> _Recorder:
    """The GEMM-fused router launch (moe_router_fwd) at bench/moe_router_check.py's real widths."""
    launch = router_launches(model, tokens, config)["_router_gemm_kernel"]
    if launch.args is None:
        raise RuntimeError("_router_gemm_kernel was not launched")
    return launch


def router_launches(model: str, tokens: int, config=None) -> dict[str, _Recorder]:
    """moe_router_fwd's launches (the GEMM launch; above 16 tokens also the routing kernel) with
    ``config`` (a ``MoeRouteConfig``; None: the shipped launch policy)."""
    from moe_router_check import AB_GATE, MODELS

    from fusion_compiler.kernels import moe_route as K
    from fusion_compiler.ops import moe_route as ops

    hidden, experts, routing, logits_dtype = MODELS[model]
    x, w = torch.randn(tokens, hidden, dtype=torch.bfloat16), torch.randn(experts, hidden, dtype=torch.bfloat16)
    bias = None if routing[3] == 1 else torch.randn(experts)
    named = dict(zip(ops._ROUTER_ARG_NAMES, (x, w, bias, *routing, logits_dtype)))
    gate_w = torch.randn(1, hidden, dtype=torch.bfloat16) if model in AB_GATE else None
    gate = torch.empty(tokens, 1, dtype=torch.bfloat16) if gate_w is not None else None
    outs = (torch.empty(tokens, experts, dtype=logits_dtype), torch.empty(tokens, named["top_k"], dtype=named["weights_dtype"]),
            torch.empty(tokens, named["top_k"], dtype=torch.int64))  # fmt: skip
    return captured_launches(K, ROUTER_KERNELS,
                             lambda: K.moe_router_fwd(named, x, w, *outs, gate_weight=gate_w, gate=gate, config=config))  # fmt: skip


def logits_route_launch(model: str, tokens: int) -> _Recorder:
    """moe_route_fwd (routing from given logits, the ``moe_route`` op) at the model's widths."""
    from moe_router_check import MODELS

    from fusion_compiler.kernels import moe_route as K
    from fusion_compiler.ops import moe_route as ops

    _, experts, routing, logits_dtype = MODELS[model]
    bias = None if routing[3] == 1 else torch.randn(experts)
    named = dict(zip(ops._ARG_NAMES, (torch.randn(tokens, experts, dtype=logits_dtype), bias, *routing)))
    weights = torch.empty(tokens, routing[0], dtype=routing[-1])
    ids = torch.empty(tokens, routing[0], dtype=torch.int64)
    return captured_launch(K, "_moe_route_kernel", lambda: K.moe_route_fwd(named, weights, ids))


# name: (q heads, kv heads, head_dim, rotary_dim, full-width norm, q inside [q | gate] head rows)
GQA_MODELS = {
    "minimax-m2.5": (48, 8, 128, 64, True, False),
    "qwen3.5": (32, 2, 256, 64, False, True),
}


def gqa_launch(model: str, tokens: int, hf: bool) -> _Recorder:
    """gqa_prologue_fwd at the model's real widths. ``hf``: HF's path (heads-first static bf16
    cache, per-token bf16 cos / sin rows, each RoPE product and sum rounded; MiniMax's norm also
    rounds ``x * rstd``); else the serving path (paged bf16 cache, fp32 table at positions)."""
    from fusion_compiler.kernels import gqa_prologue as K

    heads, kv_heads, d, rot, full_width, gated = GQA_MODELS[model]
    bf16 = torch.bfloat16
    q_width = (2 if gated else 1) * heads * d
    qkv = torch.randn(tokens, q_width + 2 * kv_heads * d, dtype=bf16)
    q = qkv[:, :q_width].view(tokens, heads, -1)[..., :d]
    k = qkv[:, q_width : q_width + kv_heads * d].view(tokens, kv_heads, d)
    v = qkv[:, q_width + kv_heads * d :].view(tokens, kv_heads, d)
    widths = (heads * d, kv_heads * d) if full_width else (d, d)
    q_w, k_w = (torch.randn(w, dtype=bf16) for w in widths)
    blocks = tokens + 1
    cache_shape = (blocks, kv_heads, 16, d) if hf else (blocks, 16, kv_heads, d)
    k_cache, v_cache = torch.empty(cache_shape, dtype=bf16), torch.empty(cache_shape, dtype=bf16)
    if hf:
        cos, sin, positions = torch.rand(tokens, rot // 2, dtype=bf16), torch.rand(tokens, rot // 2, dtype=bf16), None
    else:
        table = torch.rand(64, rot)
        cos, sin, positions = table[:, : rot // 2], table[:, rot // 2 :], torch.arange(tokens) % 64
    q_out = torch.empty(tokens, heads, d, dtype=bf16)
    args = (q, k, v, q_w, k_w, 1e-6, 1.0 if gated else 0.0, full_width, cos, sin, positions, k_cache, v_cache,
            torch.arange(tokens), 1.0, 1.0, hf, None, None, 1.0, hf and full_width, hf, q_out)  # fmt: skip
    return captured_launch(K, "_gqa_prologue_kernel", lambda: K.gqa_prologue_fwd(*args))


# GLM-4 (HF glm4, GLM-4-9B-0414's widths): q heads, kv heads, head_dim, rotary_dim; no q/k norms
GQA_GPTJ_WIDTHS = (32, 2, 128, 64)


def gqa_gptj_launch(tokens: int) -> _Recorder:
    """gqa_prologue_fwd on HF GLM-4's path: no q/k norms, GPT-J pairs over half the head, heads-first
    static bf16 cache, per-token bf16 cos / sin rows, each RoPE product and sum rounded."""
    from fusion_compiler.kernels import gqa_prologue as K

    heads, kv_heads, d, rot = GQA_GPTJ_WIDTHS
    bf16 = torch.bfloat16
    q, k, v = (torch.randn(tokens, h, d, dtype=bf16) for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (torch.empty(tokens + 1, kv_heads, 16, d, dtype=bf16) for _ in range(2))
    cos, sin = torch.rand(tokens, rot // 2, dtype=bf16), torch.rand(tokens, rot // 2, dtype=bf16)
    q_out = torch.empty(tokens, heads, d, dtype=bf16)
    args = (q, k, v, None, None, 1e-6, 0.0, False, cos, sin, None, k_cache, v_cache, torch.arange(tokens), 1.0, 1.0,
            True, None, None, 1.0, False, True, q_out)  # fmt: skip
    return captured_launch(K, "_gqa_prologue_kernel", lambda: K.gqa_prologue_fwd(*args, interleaved_rope=True))


# Qwen3-8B (HF qwen3): q heads, kv heads, head_dim; per-head q/k norms, NeoX RoPE over the head
GQA_FLAT_WIDTHS = (32, 8, 128)


def gqa_flat_launch(tokens: int) -> _Recorder:
    """gqa_prologue as ops/gqa_prologue.py launches it for HF continuous batching (variant
    ``per_head.hf_flat_full_rope``): flat [slots, kv_heads, D] bf16 caches, blocks of one row,
    per-token bf16 cos / sin rows, each RoPE product and sum rounded; padding rows share one slot."""
    from fusion_compiler.kernels import gqa_prologue as K

    heads, kv_heads, d = GQA_FLAT_WIDTHS
    q, k, v = (torch.randn(tokens, h, d, dtype=BF16) for h in (heads, kv_heads, kv_heads))
    k_cache, v_cache = (torch.empty(tokens + 1, kv_heads, d, dtype=BF16).unsqueeze(1) for _ in range(2))
    cos, sin = torch.rand(tokens, d // 2, dtype=BF16), torch.rand(tokens, d // 2, dtype=BF16)
    q_out = torch.empty(tokens, heads, d, dtype=BF16)
    slots = torch.arange(tokens).clamp(max=tokens - 2) if tokens > 1 else torch.arange(tokens)
    args = (q, k, v, torch.randn(d, dtype=BF16), torch.randn(d, dtype=BF16), 1e-6, 0.0, False, cos, sin, None,
            k_cache, v_cache, slots, 1.0, 1.0, False, None, None, 1.0, False, True, q_out)  # fmt: skip
    return captured_launch(K, "_gqa_prologue_kernel", lambda: K.gqa_prologue_fwd(*args))


def half_fmas(compiled) -> list[str]:
    """The PTX's half-precision FMA instructions (``fma.rn.bf16``, ``fma.rn.f16``, their x2 forms)."""
    return re.findall(r"^\s*(fma\.\S*(?:bf16|f16)\S*\s.*?);?$", compiled.asm["ptx"], re.M)


# The shipped kernels the check does not reach through the launchers above: what the passes' ops
# launch, at the three models' real widths (/work/shared/docs/MODELS.md). Each builder calls the
# op's own CUDA entry (``ops.<op>._cuda``: validation, output allocation, launcher) or, where the op
# is a thin wrapper, the launcher, on CPU tensors, so the launch config is the shipped one.
BF16 = torch.bfloat16
NORM_WIDTHS = {"deepseek-v3.2": 7168, "minimax-m2.5": 3072, "qwen3.5": 4096}


def rms_norm_launch(hidden: int, tokens: int, residual: bool, gate: bool = False) -> dict[str, _Recorder]:
    """rms_norm_fwd as ops/rms_norm.py launches it (add_rms_norm: with the residual; gated_rms_norm:
    Qwen3.5's GDN output norm, rows of 128 per value head, with the gate)."""
    from fusion_compiler.kernels import rms_norm as K

    x = torch.randn(tokens, hidden, dtype=BF16)
    extra = {"residual": torch.randn_like(x), "sum_out": torch.empty_like(x)} if residual else {}
    if gate:
        extra["gate"] = torch.randn_like(x)
    call = lambda: K.rms_norm_fwd(x, torch.randn(hidden, dtype=BF16), 1e-6, 0.0, torch.empty_like(x), **extra)  # noqa: E731
    return captured_launches(K, ("_rms_norm_fwd_kernel",), call)


def _mla_rope(tokens: int):
    """DeepSeek V3.2's fp32 cos / sin table (rotary 64) and positions, as the serving path passes them."""
    table = torch.rand(4096, 64)
    return table[:, :32], table[:, 32:], torch.randint(0, 4096, (tokens,))


def mla_q_launch(tokens: int, hf: bool) -> dict[str, _Recorder]:
    """mla_q_prologue at DeepSeek V3.2's widths: q role (128 heads, rot 64 + absorbed 512) and the
    indexer's q role (64 heads x 128, FP8 with ue8m0 scales folded into the weights). ``hf``: HF's
    de-interleaved RoPE with per-token bf16 cos / sin rows, no absorbed part, bf16 index q."""
    from fusion_compiler.kernels import mla_q_prologue as K
    from fusion_compiler.ops import mla_q_prologue as ops

    q = torch.randn(tokens, 128, 192, dtype=BF16)
    if hf:
        cos, sin, positions = torch.rand(tokens, 32, dtype=BF16), torch.rand(tokens, 32, dtype=BF16), None
    else:
        cos, sin, positions = _mla_rope(tokens)
    named = {**ops.DEFAULTS, "q_pe": q[..., 128:], "q_other": None if hf else torch.randn(tokens, 128, 512, dtype=BF16),
             "deinterleave_rope": hf, "index_q": torch.randn(tokens, 64, 128, dtype=BF16),
             "index_weights": torch.randn(tokens, 64, dtype=BF16), "index_weights_scale": 64**-0.5 * 128**-0.5,
             "index_q_fp8": not hf, "ue8m0": not hf, "cos": cos, "sin": sin, "positions": positions}  # fmt: skip
    return captured_launches(K, ("_mla_q_prologue_kernel",), lambda: ops._cuda(*(named[n] for n in ops._ARG_NAMES)))


def mla_kv_launch(tokens: int, hf: bool) -> dict[str, _Recorder]:
    """mla_kv_prologue at DeepSeek V3.2's widths, its three roles: q_a norm (1536, FP8 groups of 128,
    ue8m0), kv_a norm + k_pe RoPE into the ``fp8_ds_mla`` latent cache (656 B rows), the indexer's
    k LayerNorm + RoPE into its FP8 cache (132 B rows); slices of one fused [q_c | kv_c | k_pe]
    GEMM output. ``hf``: HF's path (bf16 q_c, de-interleaved RoPE, no caches, kv and index k returned)."""
    from fusion_compiler.kernels import mla_kv_prologue as K
    from fusion_compiler.ops import mla_kv_prologue as ops

    qkv = torch.randn(tokens, 1536 + 512 + 64, dtype=BF16)
    blocks = tokens // 64 + 2
    cos, sin, positions = _mla_rope(tokens)
    if hf:
        cos, sin, positions = cos[positions].to(BF16), sin[positions].to(BF16), None
    named = {**ops.DEFAULTS, "q_c": qkv[:, :1536], "q_weight": torch.randn(1536),
             "q_quant_group": 0 if hf else 128, "q_ue8m0": not hf,
             "kv_c": qkv[:, 1536:2048], "k_pe": qkv[:, 2048:], "kv_weight": torch.randn(512),
             "deinterleave_rope": hf, "index_k": torch.randn(tokens, 128, dtype=BF16),
             "index_k_weight": torch.randn(128, dtype=BF16), "index_k_bias": torch.randn(128, dtype=BF16),
             "cos": cos, "sin": sin, "positions": positions,
             "slots": None if hf else torch.randperm(blocks * 64)[:tokens],
             "latent_cache": None if hf else torch.zeros(blocks, 64, 656, dtype=torch.uint8),
             "index_cache": None if hf else torch.zeros(blocks, 64, 132, dtype=torch.uint8),
             "cache_ue8m0": not hf, "return_kv": hf, "return_index_k": hf}  # fmt: skip
    return captured_launches(K, ("_mla_kv_prologue_kernel",), lambda: ops._cuda(*(named[n] for n in ops._ARG_NAMES)))


# name: (q width, k width) of the gqa prologue's q / k rows before the TP all-reduce of their variance
GQA_VARIANCE_WIDTHS = {"minimax-m2.5": (6144, 1024)}


def gqa_variance_launch(model: str, tp: int, tokens: int) -> dict[str, _Recorder]:
    """gqa_prologue_variance_fwd (the TP-variance fold: MiniMax's full-width QK norm split over
    ``tp`` ranks)."""
    from fusion_compiler.kernels import gqa_prologue as K

    q_width, k_width = GQA_VARIANCE_WIDTHS[model]
    qkv = torch.randn(tokens, (q_width + 2 * k_width) // tp, dtype=BF16)
    q, k = qkv[:, : q_width // tp], qkv[:, q_width // tp : (q_width + k_width) // tp]
    out = torch.empty(tokens, 2)
    return captured_launches(K, ("_variance_kernel",), lambda: K.gqa_prologue_variance_fwd(q, k, out))


def skinny_launch(n: int, k: int) -> dict[str, _Recorder]:
    """skinny_gemm at one token (MAX_TOKENS), bf16 x and weight, as merged_linear launches it; the
    shapes are bench/skinny_gemm_check.py's projections of the three models."""
    from fusion_compiler.kernels import skinny_gemm as K

    x, w = torch.randn(1, k, dtype=BF16), torch.randn(n, k, dtype=BF16)
    return captured_launches(K, ("_skinny_gemm_kernel",), lambda: K.skinny_gemm(x, w))


# name: (q heads, kv heads, qk head dim, v head dim) of the SDPA sites decode_attention takes in HF
DECODE_ATTENTION_MODELS = {
    "deepseek-v3.2": (128, 128, 192, 128),  # HF's expanded MLA cache (G = 1)
    "minimax-m2.5": (48, 8, 128, 128),
    "qwen3.5": (32, 2, 256, 256),
}


def decode_attention_launch(model: str, batch: int, seq_len: int, sparse: bool = False) -> dict[str, _Recorder]:
    """decode_attention (ops/decode_attention.py's CUDA entry) over HF's static bf16 cache with its
    bool mask row (``sparse``: the skip launch, which loads no row the mask rules out); the split
    kernel and, when it splits, the combine kernel."""
    from fusion_compiler.kernels import decode_attention as K
    from fusion_compiler.ops import decode_attention as ops

    heads, kv_heads, d, dv = DECODE_ATTENTION_MODELS[model]
    q = torch.randn(batch, 1, heads, d, dtype=BF16).transpose(1, 2)  # HF: [B, 1, H, D] transposed
    # torch.empty: never touched, so DeepSeek's 13 GB of batch-64 cache costs no memory here
    k, v = torch.empty(batch, kv_heads, seq_len, d, dtype=BF16), torch.empty(batch, kv_heads, seq_len, dv, dtype=BF16)
    mask = torch.ones(batch, 1, 1, seq_len, dtype=torch.bool)
    return captured_launches(K, ("_split_kernel", "_combine_kernel"), lambda: ops._cuda(q, k, v, mask, d**-0.5, sparse))


def dsa_topk_launch(batch: int, keys: int, masked: bool) -> dict[str, _Recorder]:
    """dsa_topk_mask at DeepSeek V3.2's indexer widths (64 heads x 128, top 2048 of ``keys``) for
    one decode query per sequence; ``masked``: HF's bool causal mask."""
    from fusion_compiler.kernels import dsa_topk_mask as K
    from fusion_compiler.ops import dsa_topk_mask as ops

    q, k = torch.randn(batch, 1, 64, 128, dtype=BF16), torch.randn(batch, keys, 128, dtype=BF16)
    weights = torch.randn(batch, 1, 64, dtype=BF16)
    mask = torch.ones(batch, 1, keys, dtype=torch.bool) if masked else None
    return captured_launches(K, ("_score_kernel", "_select_kernel"),
                             lambda: ops._cuda(q, k, weights, mask, 128**-0.5, 64**-0.5, 2048))  # fmt: skip


def scatter_rows_launch(tokens: int) -> dict[str, _Recorder]:
    """gdn_fla's state write-back (lowering "fla"): Qwen3.5's recurrent state rows (64 x 128 x 128 fp32)."""
    from fusion_compiler.kernels import gdn_fla as K

    dst, src = torch.empty(tokens + 1, 64, 128, 128), torch.empty(tokens, 64, 128, 128)
    return captured_launches(K, ("_scatter_rows_kernel",), lambda: K.scatter_rows(dst, src, torch.arange(tokens)))


def shipped_cases() -> list[tuple[str, str, object]]:
    """(label, kernel name, thunk returning its launch's recorders) for every shipped launch the
    check compiles: the GDN step at 1 and 64 sequences, both conv forms, and on vLLM's state layout; each model's router at 1,
    2 and 64 tokens, both of its kernels, and its routing from logits; MiniMax's and Qwen3.5's GQA
    prologue at 1 and 4096 tokens, serving and HF paths (and HF GLM-4's GPT-J one, and HF continuous batching's flat cache at 1 and 64); and the rest of kernels/ (issue 26):
    rms_norm (add_rms_norm at each model's hidden width, 1 and 64 tokens, plain at 1; Qwen3.5's
    gated norm), the MLA q and kv prologues (serving at 1 and 4096 tokens, HF at 1), the TP
    variance, skinny_gemm at bench/skinny_gemm_check.py's projections, decode_attention (each
    model at batch 1 and 64, and its skip of masked rows), dsa_topk_mask and gdn_fla's scatter_rows."""
    from moe_router_check import MODELS
    from skinny_gemm_check import SHAPES

    cases = [(f"gdn tokens={t}{' tile' if tile else ''}", "_gdn_decode_kernel",
              lambda t=t, tile=tile: {"_gdn_decode_kernel": gdn_launch(t, tile)})
             for t in (1, 64) for tile in (False, True)]  # fmt: skip
    cases += [(f"gdn vllm tokens={t}", "_gdn_decode_kernel", lambda t=t: {"_gdn_decode_kernel": gdn_vllm_launch(t)})
              for t in (1, 64)]  # fmt: skip
    cases += [(f"router {m} tokens={t} {name}", name, lambda m=m, t=t: router_launches(m, t))
              for m in MODELS for t in (1, 2, 64) for name in ROUTER_KERNELS]  # fmt: skip
    cases += [(f"route from logits {m} tokens=3", "_moe_route_kernel",
               lambda m=m: {"_moe_route_kernel": logits_route_launch(m, 3)}) for m in MODELS]  # fmt: skip
    cases += [(f"gqa {m} tokens={t} {'hf' if hf else 'serving'}", "_gqa_prologue_kernel",
               lambda m=m, t=t, hf=hf: {"_gqa_prologue_kernel": gqa_launch(m, t, hf)})
              for m in GQA_MODELS for t in (1, 4096) for hf in (False, True)]  # fmt: skip
    cases += [(f"gqa glm4 tokens={t} hf gptj", "_gqa_prologue_kernel",
               lambda t=t: {"_gqa_prologue_kernel": gqa_gptj_launch(t)}) for t in (1, 4096)]  # fmt: skip
    cases += [(f"gqa qwen3 tokens={t} hf flat", "_gqa_prologue_kernel",
               lambda t=t: {"_gqa_prologue_kernel": gqa_flat_launch(t)}) for t in (1, 64)]  # fmt: skip
    cases += [(f"add_rms_norm {m} hidden={n} tokens={t}", "_rms_norm_fwd_kernel",
               lambda n=n, t=t: rms_norm_launch(n, t, True)) for m, n in NORM_WIDTHS.items() for t in (1, 64)]  # fmt: skip
    cases += [(f"rms_norm {m} hidden={n} tokens=1", "_rms_norm_fwd_kernel", lambda n=n: rms_norm_launch(n, 1, False))
              for m, n in NORM_WIDTHS.items()]  # fmt: skip
    cases += [(f"gated_rms_norm qwen3.5 rows={64 * t}x128", "_rms_norm_fwd_kernel",
               lambda t=t: rms_norm_launch(128, 64 * t, False, gate=True)) for t in (1, 64)]  # fmt: skip
    cases += [(f"mla_q_prologue deepseek-v3.2 tokens={t} {'hf' if hf else 'serving'}", "_mla_q_prologue_kernel",
               lambda t=t, hf=hf: mla_q_launch(t, hf)) for t, hf in ((1, False), (4096, False), (1, True))]  # fmt: skip
    cases += [(f"mla_kv_prologue deepseek-v3.2 tokens={t} {'hf' if hf else 'serving'}", "_mla_kv_prologue_kernel",
               lambda t=t, hf=hf: mla_kv_launch(t, hf)) for t, hf in ((1, False), (4096, False), (1, True))]  # fmt: skip
    cases += [(f"gqa variance {m} tp={tp} tokens=1", "_variance_kernel", lambda m=m, tp=tp: gqa_variance_launch(m, tp, 1))
              for m in GQA_VARIANCE_WIDTHS for tp in (2, 8)]  # fmt: skip
    cases += [(f"skinny_gemm {name} N={n} K={k}", "_skinny_gemm_kernel", lambda n=n, k=k: skinny_launch(n, k))
              for name, (n, k) in SHAPES.items()]  # fmt: skip
    cases += [(f"decode_attention {m} batch={b} S=4096 {name}", name, lambda m=m, b=b: decode_attention_launch(m, b, 4096))
              for m in DECODE_ATTENTION_MODELS for b in (1, 64) for name in ("_split_kernel", "_combine_kernel")]  # fmt: skip
    cases += [(f"decode_attention {m} batch={b} S=4096 sparse _split_kernel", "_split_kernel",
               lambda m=m, b=b: decode_attention_launch(m, b, 4096, sparse=True))
              for m in DECODE_ATTENTION_MODELS for b in (1, 64)]  # fmt: skip
    cases += [(f"dsa_topk_mask deepseek-v3.2 batch=1 keys=4096{' masked' if masked else ''} {name}", name,
               lambda masked=masked: dsa_topk_launch(1, 4096, masked))
              for masked in (False, True) for name in ("_score_kernel", "_select_kernel")]  # fmt: skip
    cases += [("gdn_fla scatter_rows qwen3.5 tokens=1", "_scatter_rows_kernel", lambda: scatter_rows_launch(1))]
    return cases


def _kernel(recorder_name: str, label: str):
    """The @triton.jit function a case's recorder stood in for."""
    from fusion_compiler.kernels import (decode_attention, dsa_topk_mask, gdn_decode, gdn_fla, gqa_prologue,
                                         mla_kv_prologue, mla_q_prologue, moe_route, rms_norm, skinny_gemm)  # fmt: skip

    modules = (gdn_decode, moe_route, gqa_prologue, rms_norm, mla_q_prologue, mla_kv_prologue, skinny_gemm,
               decode_attention, dsa_topk_mask, gdn_fla)  # fmt: skip
    found = [m for m in modules if hasattr(m, recorder_name)]
    if len(found) != 1:
        raise RuntimeError(f"{label}: {recorder_name} is in {len(found)} kernel modules")
    return getattr(found[0], recorder_name)


SNAPSHOT_KEYS = ("grid", "num_warps", "registers", "stack", "shared", "instructions", *CLASSES, *EXTRA_CLASSES,
                 "sass_sha256")  # fmt: skip


def check_shipped(only: str | None = None) -> tuple[int, dict[str, dict]]:
    """Compile the shipped launches (``shipped_cases``; ``only``: those whose label it matches)
    for sm_90, one line each, an HF GQA launch failing if its PTX has a half-precision FMA.
    Returns the number that failed and each compiled launch's counts by label (``SNAPSHOT_KEYS``).
    The CPU tests run the kernels in Triton's interpreter, which executes the Python and so never
    compiles a branch it does not take: session 15 lost a device call to an int64 branch compiled
    for int32 keys."""
    failures, counts = 0, {}
    for label, name, launch in shipped_cases():
        if only and not re.search(only, label):
            continue
        try:
            recorder = launch()[name]
            if recorder.args is None:
                print(f"skip  {label}: not launched at this size", flush=True)
                continue
            compiled = compile_sm90(_kernel(name, label), recorder.args, recorder.kwargs)
            result = summary(compiled)
            fused = half_fmas(compiled) if recorder.kwargs.get("ROUND_ROPE") else []
            if fused:
                raise RuntimeError(f"{len(fused)} half-precision FMAs fuse rounded RoPE products: {fused[0]}")
            row = {"grid": list(recorder.grid), "num_warps": recorder.kwargs.get("num_warps"), **result}
            counts[label] = {k: row[k] for k in SNAPSHOT_KEYS}
            print(f"ok    {label}: registers {result['registers']}, instructions {result['instructions']}, "
                  f"FFMA {result['FFMA']}, spill STL/LDL {result['STL']}/{result['LDL']}", flush=True)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - every failure is reported, then counted
            failures += 1
            print(f"FAIL  {label}: {type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}", flush=True)
    return failures, counts


SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sass_offline_snapshot.json")


def differences(expected: dict[str, dict], actual: dict[str, dict]) -> list[str]:
    """One line per launch whose counts differ from the snapshot's, or that one side lacks."""
    lines = [f"missing  {label}: in the snapshot, not compiled now" for label in expected if label not in actual]
    lines += [f"new      {label}: compiled now, not in the snapshot" for label in actual if label not in expected]
    for label in expected.keys() & actual.keys():
        changed = [f"{k} {expected[label].get(k)} -> {actual[label].get(k)}" for k in SNAPSHOT_KEYS
                   if expected[label].get(k) != actual[label].get(k)]  # fmt: skip
        if changed:
            lines.append(f"changed  {label}: " + ", ".join(changed))
    return sorted(lines)


def run_check(only: str | None, write: str | None, against: str | None) -> int:
    """``check``: compile, then write the counts to ``write`` and / or compare them with the
    snapshot ``against`` (with ``only``, just its launches). The exit status: 1 if a launch failed
    to compile or differs from the snapshot, else 0."""
    start = time.perf_counter()
    failures, counts = check_shipped(only)
    seconds = round(time.perf_counter() - start, 1)
    print(f"{len(counts)} launches compiled, {failures} failed, in {seconds} s", flush=True)
    if write:
        common.write_json(write, {"what": "bench/sass_offline.py check: sm_90 SASS counts of every shipped launch",
                                  "target": "cuda sm_90 (ptxas and cuobjdump of the Triton wheel)",
                                  "seconds": seconds, "launches": counts})  # fmt: skip
    if against:
        with open(against) as f:
            expected = json.load(f)["launches"]
        if only:
            expected = {label: row for label, row in expected.items() if re.search(only, label)}
        diff = differences(expected, counts)
        print("\n".join(diff) if diff else f"same as {against}: {len(counts)} launches", flush=True)
        failures += len(diff)
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=("gdn", "router", "gqa", "check"),
                        help="check: compile every shipped launch (check_shipped); exit status 1 if any fails "
                             "or differs from --against")  # fmt: skip
    parser.add_argument("--only", metavar="REGEX", help="check: only the launches whose label this matches (re.search)")
    parser.add_argument("--write", metavar="FILE", help=f"check: write the counts here (the snapshot: {SNAPSHOT})")
    parser.add_argument("--against", metavar="FILE",
                        help="check: compare the counts with this snapshot; exit status 1 on any difference")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--conv-tile", action="store_true", help="gdn: the tile conv (Tiling.conv_taps False; gdn_decode-7)")
    parser.add_argument("--model", help="router: deepseek-v3.2 (default), minimax-m2.5 or qwen3.5; gqa: minimax-m2.5 "
                                            "(default) or qwen3.5")  # fmt: skip
    parser.add_argument("--knob", action="append", default=[],
                        help="router: FIELD=VALUE, a MoeRouteConfig field (kernels/moe_route.py); int, true / false, "
                             "none, a,b tuple or str")  # fmt: skip
    parser.add_argument("--hf", action="store_true", help="gqa: HF's layout and roundings (gqa_launch)")
    parser.add_argument("--fp-fusion", choices=("on", "off"), help="gqa: override the launch's enable_fp_fusion")
    parser.add_argument("--sass", help="write the SASS listing here")
    parser.add_argument("--llir", help="write Triton's LLVM IR here")
    parser.add_argument("--ptx", help="write the PTX here")
    args = parser.parse_args()
    if args.kernel == "check":
        sys.exit(run_check(args.only, args.write, args.against))
    if args.kernel == "gdn":
        launch = gdn_launch(args.tokens, args.conv_tile)
        from fusion_compiler.kernels.gdn_decode import _gdn_decode_kernel as kernel
    elif args.kernel == "gqa":
        launch = gqa_launch(args.model or "minimax-m2.5", args.tokens, args.hf)
        if args.fp_fusion:
            launch.kwargs = {**launch.kwargs, "enable_fp_fusion": args.fp_fusion == "on"}
        from fusion_compiler.kernels.gqa_prologue import _gqa_prologue_kernel as kernel
    else:
        launch = router_launch(args.model or "deepseek-v3.2", args.tokens, router_config(args.knob))
        from fusion_compiler.kernels.moe_route import _router_gemm_kernel as kernel
    compiled = compile_sm90(kernel, launch.args, launch.kwargs)
    result = summary(compiled)
    for path, text in ((args.sass, result["sass"]), (args.llir, compiled.asm["llir"]), (args.ptx, compiled.asm["ptx"])):
        if path:
            with open(path, "w") as f:
                f.write(text)
    print(f"grid {tuple(launch.grid)}, num_warps {launch.kwargs.get('num_warps')}")
    print(", ".join(f"{k} {v}" for k, v in result.items() if k != "sass"))
    if args.kernel == "gqa":
        fused = half_fmas(compiled)
        print(f"half-precision FMAs in the PTX: {len(fused)}" + "".join(f"\n    {line}" for line in fused[:8]))


if __name__ == "__main__":
    main()
