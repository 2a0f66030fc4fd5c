"""The torch.compile backend: Inductor's `compile_fx` with our post-grad pass installed.

Registered as `fusion_compiler` through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fusion_compiler")` works after install with no import.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence

import torch

from . import _compat
from .config import FusionConfig
from .cudagraph import StepGraphs, plan_inputs
from .passes import FusionPass, MatchReport
from .verify import verify_first_call

log = logging.getLogger("fusion_compiler")


class FusionBackend:
    """A torch.compile backend holding one config and the report of everything it compiled.

    >>> backend = FusionBackend(FusionConfig(strict=True))
    >>> compiled = torch.compile(model, backend=backend)
    >>> compiled(*inputs); print(backend.report.format())
    """

    def __init__(self, config: FusionConfig | None = None):
        self.config = config or FusionConfig()
        self.report = MatchReport()
        self.compiles = 0
        self.step_graphs: list[StepGraphs] = []  # one per compiled CUDA graph (cudagraph.py)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
        self.compiles += 1
        fusion_pass = FusionPass(self.config, self.report)
        first_graph = len(self.report.graphs)
        # compile_fx runs pre-grad passes on gm in place; verify needs the untouched graph.
        reference = copy.deepcopy(gm) if self.config.verify else None
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in example_inputs)
        plan = plan_inputs(gm, example_inputs, self.config.cudagraph_slot_inputs) if on_cuda else None
        with _compat.inductor_patches(fusion_pass, use_caches=self.config.inductor_cache):
            compiled = _compat.compile_fx(gm, example_inputs)
        if self.config.cudagraphs and on_cuda:
            compiled = StepGraphs(compiled, plan, self.config.cudagraph_buckets, name=f"graph {self.compiles}")
            self.step_graphs.append(compiled)
            log.info("fusion_compiler: graph %d runs in CUDA graphs: %d batch inputs (%d slot inputs padded with -1)",
                     self.compiles, len(plan.batch), len(plan.slots))
        if self.config.verify:
            sites = [s for g in self.report.graphs[first_graph:] for s in g.matched()]
            return verify_first_call(reference, compiled, sites, self.config.verify_rtol)
        return compiled


def fusion_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], options: dict | None = None
) -> Callable:
    """Entry point for `torch.compile(m, backend="fusion_compiler", options={...})`.

    `options` are FusionConfig fields (e.g. `{"strict": True}`); the report of a named
    backend is in `fusion_compiler.last_report()`.
    """
    backend = FusionBackend(FusionConfig(**(options or {})))
    _LAST.append(backend)
    del _LAST[:-1]
    return backend(gm, example_inputs)


_LAST: list[FusionBackend] = []


def last_report() -> MatchReport | None:
    """The report of the most recent compile through the registered `"fusion_compiler"` backend."""
    return _LAST[-1].report if _LAST else None


def compile(model: torch.nn.Module | Callable, config: FusionConfig | None = None, **compile_kwargs):
    """`torch.compile(model)` through fusion_compiler. The returned object carries
    `.fusion_backend` (config, compile count) and `.fusion_report`."""
    backend = FusionBackend(config)
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    try:
        compiled.fusion_backend = backend
        compiled.fusion_report = backend.report
    except AttributeError:  # some callables refuse attributes; the backend is still reachable
        log.debug("could not attach the fusion backend to %r", compiled)
    return compiled
