"""What the vLLM tier shares: a real VllmConfig on CPU, compiling through vLLM's own backend, and
the one stand-in the CPU machine needs. Imports vLLM: only the vLLM tier (``-m vllm``) uses it.

vLLM's `FixFunctionalizationPass` (the pass manager's last step) names
``torch.ops._C.rotary_embedding``, an op of vLLM's CUDA extension, which cannot load without
libcuda. Where it is missing, `define_missing_c_ops` defines its schema (no implementation: the
pass only compares node targets with it; nothing calls it).
"""

from __future__ import annotations

import torch

SLOT = "post_grad_custom_post_pass"
_C_STANDINS = []


def define_missing_c_ops() -> None:
    if hasattr(torch.ops._C, "rotary_embedding"):
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define(
        "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox) -> ()"
    )
    _C_STANDINS.append(lib)


def vllm_config(inductor_compile_config: dict | None = None, **compilation):
    """vLLM's compiled mode (VLLM_COMPILE) on the CPU, no custom ops: the graphs vLLM compiles."""
    from vllm.config import CompilationConfig, DeviceConfig, VllmConfig

    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        compilation_config=CompilationConfig(
            mode=3, custom_ops=["none"], inductor_compile_config=dict(inductor_compile_config or {}), **compilation
        ),
    )


def compile_with_vllm_backend(config, build, inputs, dynamic_batches=()):
    """Build the module under ``config`` (vLLM layers need the current config), then run it
    eagerly and through vLLM's own `VllmBackend` (which adds the slot's pass to its
    PostGradPassManager). Returns (eager outputs, compiled outputs, the backend).

    ``dynamic_batches``: as vLLM's ``@support_torch_compile`` does, dim 0 (tokens) of every
    input is marked dynamic, and the compiled module is also run on each ``inputs`` of this
    list (other token counts); eager and compiled outputs are then lists, one per call."""
    from vllm.compilation.backends import VllmBackend
    from vllm.config import set_current_vllm_config

    define_missing_c_ops()
    with set_current_vllm_config(config), torch.no_grad():
        module = build()
        backend = VllmBackend(config)
        if not dynamic_batches:
            eager = module(*[t.clone() for t in inputs])
            compiled = torch.compile(module, backend=backend)(*[t.clone() for t in inputs])
            return eager, compiled, backend
        step = torch.compile(module, backend=backend)
        eager, compiled = [], []
        for batch in (inputs, *dynamic_batches):
            copies = [t.clone() for t in batch]
            for t in copies:
                torch._dynamo.mark_dynamic(t, 0)
            eager.append(module(*[t.clone() for t in batch]))
            compiled.append(step(*copies))
    return eager, compiled, backend
