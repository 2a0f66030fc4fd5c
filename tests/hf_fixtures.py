"""HF's tiny decode step of one of our models, compiled once per session with every family on.

tests/patterns/test_merge_projections.py and tests/patterns/test_gqa_prologue.py,
test_mla_prologue.py and test_moe_routing.py each compiled exactly this (the adapter's tiny model
at its default depth, bf16, strict against the adapter's expected sites, ``make_decode_step``'s
default step) and read a different part of the result: 5-11 s of CPU Inductor per model per file.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import DecodeStep, get_adapter, make_decode_step


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    model: torch.nn.Module
    expected: dict
    report: Any  # the backend's match report
    compiles: int  # after both compiled calls
    eager: torch.Tensor
    fused: torch.Tensor  # the first compiled call's logits
    again: torch.Tensor  # the second compiled call's, on the same step (same tensors)
    eager_step: DecodeStep  # its cache as the eager step left it
    fused_cache: Any  # a copy of the cache as the first compiled call left it


@functools.cache
def default_decode_run(name: str) -> DecodeRun:
    """Built and run on first use; every later caller gets the same (read-only) result."""
    adapter = get_adapter(name)
    model = adapter.build_hf(size="tiny", layers=adapter.default_layers, dtype=torch.bfloat16)
    expected = adapter.expected_sites(model)
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    # Whatever test triggers this, compile from a clean Dynamo cache (see tests/conftest.py).
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    eager_step, fused_step = make_decode_step(model), make_decode_step(model)
    eager = eager_step.run(model)
    fused = fused_step.run(compiled)
    fused_cache = copy.deepcopy(fused_step.cache)
    # The second call must happen here: every test starts with torch._dynamo.reset(), after
    # which a call would recompile.
    again = fused_step.run(compiled)
    return DecodeRun(model=model, expected=expected, report=backend.report, compiles=backend.compiles, eager=eager,
                     fused=fused, again=again, eager_step=eager_step, fused_cache=fused_cache)  # fmt: skip
