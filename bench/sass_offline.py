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
    python bench/sass_offline.py router --model minimax-m2.5 [--knob _MAXNREG=128] [--sass out.sass]
    python bench/sass_offline.py gqa --model qwen3.5 [--tokens 1] [--hf] [--fp-fusion on] [--ptx out.ptx]
    python bench/sass_offline.py check     # the shipped launches compile (tests/bench runs it)

prints the launch's grid, registers / stack / shared memory, and instruction counts by class
(all, BAR, SHFL, STS, LDS, LDG, STG, ATOM, MEMBAR); ``--sass`` writes the listing, ``--llir`` and
``--ptx`` Triton's LLVM IR and PTX. For the GQA prologue also the PTX's half-precision FMAs
(``half_fmas``): with HF's rounded RoPE (``--hf``) any one is a product fused unrounded into a
sum, which eager's bf16 ops round (``kernels/gqa_prologue.py`` ``_rotated``); ``--fp-fusion``
overrides the launch's ``enable_fp_fusion`` (``on`` shows the contraction those launches turn off).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

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
    counts.update({c: len(re.findall(rf"\b{c}\b", sass)) for c in CLASSES})
    return {"registers": int(usage[1]), "stack": int(usage[2]), "shared": int(usage[3]), **counts, "sass": sass}


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
    with common.module_knobs(K, _CONV_TAPS=not conv_tile):
        return captured_launch(K, "_gdn_decode_kernel", lambda: K.gdn_decode_fwd(*args, out, counters=counters))


ROUTER_KERNELS = ("_router_gemm_kernel", "_moe_route_kernel")


def _knob_value(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def router_launch(model: str, tokens: int, knobs: dict) -> _Recorder:
    """The GEMM-fused router launch (moe_router_fwd) at bench/moe_router_check.py's real widths."""
    launch = router_launches(model, tokens, knobs)["_router_gemm_kernel"]
    if launch.args is None:
        raise RuntimeError("_router_gemm_kernel was not launched")
    return launch


def router_launches(model: str, tokens: int, knobs: dict) -> dict[str, _Recorder]:
    """moe_router_fwd's launches (the GEMM launch; above 16 tokens also the routing kernel)."""
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
    with common.module_knobs(K, **knobs):
        return captured_launches(K, ROUTER_KERNELS,
                                 lambda: K.moe_router_fwd(named, x, w, *outs, gate_weight=gate_w, gate=gate))  # fmt: skip


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


def half_fmas(compiled) -> list[str]:
    """The PTX's half-precision FMA instructions (``fma.rn.bf16``, ``fma.rn.f16``, their x2 forms)."""
    return re.findall(r"^\s*(fma\.\S*(?:bf16|f16)\S*\s.*?);?$", compiled.asm["ptx"], re.M)


def check_shipped() -> int:
    """Compile the shipped launches of the GDN, routing and GQA prologue kernels at the models'
    widths for sm_90 (the GDN step at 1 and 64 sequences, both conv forms; each model's router at
    1, 2 and 64 tokens, both of its kernels, and its routing from logits; MiniMax's and Qwen3.5's
    prologue at 1 and 4096 tokens, serving and HF paths, an HF one failing if its PTX has a
    half-precision FMA); one line each. Returns the number that failed. The CPU tests run the kernels in
    Triton's interpreter, which executes the Python and so never compiles a branch it does not
    take: session 15 lost a device call to an int64 branch compiled for int32 keys."""
    from moe_router_check import MODELS

    from fusion_compiler.kernels import gdn_decode, gqa_prologue, moe_route

    cases = [(f"gdn tokens={t}{' tile' if tile else ''}", gdn_decode._gdn_decode_kernel,
              lambda t=t, tile=tile: {"_gdn_decode_kernel": gdn_launch(t, tile)})
             for t in (1, 64) for tile in (False, True)]  # fmt: skip
    cases += [(f"router {m} tokens={t} {name}", getattr(moe_route, name),
               lambda m=m, t=t, name=name: {name: router_launches(m, t, {})[name]})
              for m in MODELS for t in (1, 2, 64) for name in ROUTER_KERNELS]  # fmt: skip
    cases += [(f"route from logits {m} tokens=3", moe_route._moe_route_kernel,
               lambda m=m: {"_moe_route_kernel": logits_route_launch(m, 3)}) for m in MODELS]  # fmt: skip
    cases += [(f"gqa {m} tokens={t} {'hf' if hf else 'serving'}", gqa_prologue._gqa_prologue_kernel,
               lambda m=m, t=t, hf=hf: {"_gqa_prologue_kernel": gqa_launch(m, t, hf)})
              for m in GQA_MODELS for t in (1, 4096) for hf in (False, True)]  # fmt: skip
    failures = 0
    for label, kernel, launch in cases:
        recorder = next(iter(launch().values()))
        if recorder.args is None:
            continue  # this kernel is not launched at this size
        try:
            compiled = compile_sm90(kernel, recorder.args, recorder.kwargs)
            result = summary(compiled)
            fused = half_fmas(compiled) if recorder.kwargs.get("ROUND_ROPE") else []
            if fused:
                raise RuntimeError(f"{len(fused)} half-precision FMAs fuse rounded RoPE products: {fused[0]}")
            print(f"ok    {label}: registers {result['registers']}, instructions {result['instructions']}", flush=True)
        except Exception as error:  # noqa: BLE001 - every failure is reported, then counted
            failures += 1
            print(f"FAIL  {label}: {type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}", flush=True)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=("gdn", "router", "gqa", "check"),
                        help="check: compile every shipped launch (check_shipped); exit status 1 if any fails")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--conv-tile", action="store_true", help="gdn: the tile conv (_CONV_TAPS False; gdn_decode-7)")
    parser.add_argument("--model", help="router: deepseek-v3.2 (default), minimax-m2.5 or qwen3.5; gqa: minimax-m2.5 "
                                            "(default) or qwen3.5")  # fmt: skip
    parser.add_argument("--knob", action="append", default=[], help="router: NAME=VALUE (int or str), a kernels/moe_route.py knob")
    parser.add_argument("--hf", action="store_true", help="gqa: HF's layout and roundings (gqa_launch)")
    parser.add_argument("--fp-fusion", choices=("on", "off"), help="gqa: override the launch's enable_fp_fusion")
    parser.add_argument("--sass", help="write the SASS listing here")
    parser.add_argument("--llir", help="write Triton's LLVM IR here")
    parser.add_argument("--ptx", help="write the PTX here")
    args = parser.parse_args()
    if args.kernel == "check":
        sys.exit(1 if check_shipped() else 0)
    if args.kernel == "gdn":
        launch = gdn_launch(args.tokens, args.conv_tile)
        from fusion_compiler.kernels.gdn_decode import _gdn_decode_kernel as kernel
    elif args.kernel == "gqa":
        launch = gqa_launch(args.model or "minimax-m2.5", args.tokens, args.hf)
        if args.fp_fusion:
            launch.kwargs = {**launch.kwargs, "enable_fp_fusion": args.fp_fusion == "on"}
        from fusion_compiler.kernels.gqa_prologue import _gqa_prologue_kernel as kernel
    else:
        knobs = {k: _knob_value(v) for k, v in (item.split("=", 1) for item in args.knob)}
        launch = router_launch(args.model or "deepseek-v3.2", args.tokens, knobs)
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
