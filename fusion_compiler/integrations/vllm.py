"""fusion_compiler inside vLLM 0.33: our pass in vLLM's one slot for a third-party post-grad pass.

vLLM takes exactly one user pass: an `InductorPass` in
``CompilationConfig.inductor_compile_config["post_grad_custom_post_pass"]``. Its backend
(`VllmBackend.configure_post_pass`) adds it to `PostGradPassManager`, which runs it after
vLLM's own fusions and before vLLM lowers its IR ops, cleans up and defunctionalises. Three
ways to fill the slot:

- Python: ``CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass":
  VllmFusionPass(FusionConfig(...))})``.
- CLI: ``--compilation-config '{"inductor_passes": {"post_grad_custom_post_pass":
  "fusion_compiler.vllm_pass"}}'``. vLLM resolves the string as
  ``__import__("fusion_compiler").__dict__["vllm_pass"]``, so the pass must be an attribute of
  the top-level package: the package sets it when vLLM is already loaded, and this module sets
  it on import. Its config comes from ``FUSION_COMPILER_VLLM_OPTIONS`` (FusionConfig fields as
  JSON), read once, at import.
- The ``vllm.general_plugins`` entry point `register`: with ``FUSION_COMPILER_VLLM=1`` every
  VllmConfig built afterwards gets `vllm_pass` in the slot (unless it already holds one of
  ours); unset or ``0``, it changes nothing.

This module imports vLLM; the package itself imports it only when vLLM is already loaded.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import sys

import torch
import vllm
from vllm.compilation.passes import inductor_pass as vllm_inductor_pass
from vllm.compilation.passes.inductor_pass import InductorPass

from ..config import FusionConfig
from ..passes.fusion_pass import FusionPass, pass_uuid
from ..patterns import vllm_ir, vllm_rope
from ..patterns.registry import Family, source_text

log = logging.getLogger("fusion_compiler")

SLOT = "post_grad_custom_post_pass"
# vLLM's spellings, each run before the core family of its name.
VLLM_FAMILIES = (vllm_ir.FAMILY, vllm_rope.FAMILY)
ENABLE_ENV = "FUSION_COMPILER_VLLM"
OPTIONS_ENV = "FUSION_COMPILER_VLLM_OPTIONS"


class VllmFusionPass(FusionPass, InductorPass):
    """`FusionPass` as a vLLM `InductorPass`, matching vLLM's own spellings (patterns/vllm_ir.py,
    patterns/vllm_rope.py) before the core variants. Its report (``.report``) marks each graph
    with the vLLM version and compile range it was compiled for."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewritten = vllm_ir.functionalize_maybe_inplace(graph)
        if rewritten:
            log.info("fusion_compiler: %d in-place vLLM IR norm call(s) made functional", rewritten)
        super().__call__(graph)

    def families_for(self, name: str) -> tuple[Family, ...]:
        core = super().families_for(name)
        ours = tuple(f for f in VLLM_FAMILIES if f.name == name)
        return (*ours, *core)

    def pipeline(self) -> str:
        # vLLM's pass context holds the compile range; outside vLLM's backend there is none.
        context = vllm_inductor_pass._pass_context
        where = f"compile range {context.compile_range}" if context is not None else "outside vLLM's backend"
        return f"vllm {vllm.__version__}, {where}"

    def uuid(self) -> str:
        # Part of vLLM's config hash and of Inductor's cache key (PostGradPassManager.uuid).
        return InductorPass.hash_dict({
            "fusion_pass": pass_uuid(self.config),
            "vllm_spellings": [source_text(family) for family in VLLM_FAMILIES],
            "integration": inspect.getsource(sys.modules[__name__]),
            "vllm": vllm.__version__,
        })  # fmt: skip


def pass_from_env() -> VllmFusionPass:
    """The pass the CLI string and the plugin install: default config, or the FusionConfig
    fields in ``FUSION_COMPILER_VLLM_OPTIONS`` (JSON)."""
    options = os.environ.get(OPTIONS_ENV)
    if not options:
        return VllmFusionPass()
    try:
        fields = json.loads(options)
    except json.JSONDecodeError as e:
        raise ValueError(f"{OPTIONS_ENV} is not JSON ({e}): {options!r}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{OPTIONS_ENV} must be a JSON object of FusionConfig fields, got {options!r}")
    return VllmFusionPass(FusionConfig(**fields))


vllm_pass = pass_from_env()
sys.modules[__name__.split(".")[0]].vllm_pass = vllm_pass


def register() -> None:
    """The ``vllm.general_plugins`` entry point; vLLM calls it in every process it starts."""
    value = os.environ.get(ENABLE_ENV, "")
    if value in ("", "0"):
        return
    if value != "1":
        raise ValueError(f"{ENABLE_ENV}={value!r}: 1 installs fusion_compiler's pass in vLLM; 0 or unset does not")
    install()


def install() -> None:
    """Fill the pass slot of every VllmConfig built from now on in this process. It happens at
    the config's construction because vLLM hashes the config (the pass's uuid included) into its
    compile-cache key before its backend reads the slot."""
    from vllm.config import VllmConfig

    post_init = VllmConfig.__post_init__
    if getattr(post_init, "_fills_fusion_compiler_slot", False):
        return

    @functools.wraps(post_init)
    def __post_init__(self) -> None:
        fill_slot(self.compilation_config.inductor_compile_config)
        post_init(self)

    __post_init__._fills_fusion_compiler_slot = True
    VllmConfig.__post_init__ = __post_init__
    log.info("fusion_compiler: %s=1, installed in vLLM %s's %s", ENABLE_ENV, vllm.__version__, SLOT)


def fill_slot(inductor_compile_config: dict) -> None:
    current = inductor_compile_config.get(SLOT)
    if current is None:
        inductor_compile_config[SLOT] = vllm_pass
    elif not isinstance(current, VllmFusionPass):
        raise RuntimeError(
            f"{ENABLE_ENV}=1, but {SLOT} already holds {current!r}; vLLM runs one third-party "
            "post-grad pass: unset FUSION_COMPILER_VLLM or remove the other pass"
        )
