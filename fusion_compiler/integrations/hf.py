"""HF transformers: compile the forward that `generate()` calls, and derive a model's expected sites.

`fusion_compiler.compile(model)` lands here for a model with `generate` (a `GenerationMixin`).
`torch.compile(model)` returns a wrapper whose `.generate()` is the model's own, which calls
the uncompiled forward. So the model is compiled in place (`nn.Module.compile`): `model(...)`
and generate's `self(...)` go through our backend, prefill and decode alike.

HF's own compile in `generate()` (`torch.compile(self.__call__, **compile_config)`, on CUDA
with a compileable cache such as `cache_implementation="static"`) then compiles nothing: Dynamo
does not trace `Module._wrapped_call_impl` as a top-level frame, and the in-place compiled
`_call_impl` it calls installs its own backend before any frame Dynamo traces. The in-place
backend compiles every graph (checked on torch 2.13 with a tiny HF model and a counting outer
backend: it saw no graph). So `generation_config.compile_config` is left alone (set to our
backend it would change nothing, and HF would warn on every `generate()` with a DynamicCache
that it skips "the compile_config you set"), and HF's own compile is turned off
(`generation_config.disable_compile`): it adds nothing but a second Dynamo context around every
step.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..backend import FusionBackend
from ..config import FusionConfig

log = logging.getLogger("fusion_compiler")


def expected_sites(model: torch.nn.Module, config: FusionConfig | None = None) -> dict[str, dict[str, int]]:
    """Sites each family should fuse in one decode step of an HF model: family -> {module path:
    count}. From the adapter of its ``config.model_type`` (``model_adapters.ADAPTERS``), else from
    its module tree (``model_adapters.base.structural_sites``). Runs one small eager decode step
    (16 tokens of context) with forward hooks, to see which norms run; call it before compiling.
    Families and graph passes that ``config`` turns off are left out."""
    from ..model_adapters import adapter_for

    config = config or FusionConfig()
    off = config.sites_off()
    sites = adapter_for(model).expected_sites(model)
    return {family: per_module for family, per_module in sites.items() if family not in off and per_module}


def compile_for_generate(model: torch.nn.Module, config: FusionConfig, **compile_kwargs) -> torch.nn.Module:
    """Compile `model` in place through one FusionBackend; return `model` with `.fusion_backend`
    and `.fusion_report`.

    With `strict` and no `expected`, the expected sites are `expected_sites(model, config)`.
    `compile_kwargs` are torch.compile's (mode, dynamic, fullgraph, options)."""
    if config.strict and not config.expected:
        config = dataclasses.replace(config, expected=expected_sites(model, config))
        log.info("strict: expected sites of %s from its model adapter: %s", type(model).__name__,
                 ", ".join(f"{f} {sum(m.values())}" for f, m in config.expected.items()))
    backend = FusionBackend(config, root=model)
    model.compile(backend=backend, **compile_kwargs)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        # HF's own compile of __call__ would wrap ours and trace nothing, but its frames would
        # still pass through a second Dynamo context on every step.
        generation_config.disable_compile = True
    model.fusion_backend = backend
    model.fusion_report = backend.report
    return model
