"""The torch.compile backend: Inductor's `compile_fx` with our post-grad pass installed.

Registered as `fusion_compiler` through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="fusion_compiler")` works after install with no import.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from . import _compat
from .config import FusionConfig
from .cudagraph import StepGraphs, plan_inputs
from .passes import FusionPass, MatchReport, UnknownModuleError
from .verify import verify_first_call

log = logging.getLogger("fusion_compiler")

# torch.compile modes whose Inductor settings carry no change of ours: each means our own CUDA
# graphs (FusionConfig.cudagraphs, on by default) and Inductor as it is.
_OUR_MODES = (None, "default", "reduce-overhead")
# Inductor's key for its own CUDA graphs: in options it sets our flag instead.
_INDUCTOR_CUDAGRAPHS = ("triton.cudagraphs", "triton_cudagraphs")


class FusionOptionsError(_compat.ReachesCaller, ValueError):
    """torch.compile's `mode` or `options` asked for something this backend does not have.
    A ValueError and, like stock Inductor's errors for these, a RuntimeError."""


def compile_settings(
    base: FusionConfig, mode: str | None = None, options: Mapping | None = None
) -> tuple[FusionConfig, dict]:
    """(our config, Inductor settings patched in while we compile) for torch.compile's `mode`
    and `options`, on top of `base`.

    mode: None, "default" and "reduce-overhead" run our CUDA graphs (`base.cudagraphs`); any
    other mode Inductor knows passes its settings through, with our graphs where its own would
    have run ("max-autotune") and none where not ("max-autotune-no-cudagraphs"); an unknown mode
    is stock's RuntimeError. options: FusionConfig fields go to the config; Inductor config keys
    are patched in (`triton.cudagraphs` sets our `cudagraphs`); anything else is an error.
    """
    fields: dict = {}
    inductor: dict = {}
    if mode not in _OUR_MODES:
        try:
            settings = _compat.inductor_mode_options(mode)
        except RuntimeError as error:
            raise FusionOptionsError(str(error)) from None
        if not settings.pop(_INDUCTOR_CUDAGRAPHS[0], False):
            fields["cudagraphs"] = False
        inductor.update(settings)
    names = [f.name for f in dataclasses.fields(FusionConfig)]
    unknown, problems = [], []
    for key, value in (options or {}).items():
        if key in names:
            fields[key] = value
        elif key in _INDUCTOR_CUDAGRAPHS:
            fields["cudagraphs"] = bool(value)
        elif key.replace("-", "_") == "post_grad_custom_post_pass":
            problems.append(f"{key} is where fusion_compiler installs its own pass")
        else:
            problem = _compat.inductor_option_problem(key, value)
            if problem is None:
                inductor[key.replace("-", "_")] = value
            elif "not an Inductor config key" in problem:
                unknown.append(key)
            else:
                problems.append(problem)
    if unknown:
        problems.insert(0, f"unknown option(s) {unknown}: an option is a FusionConfig field ({', '.join(names)}) "
                           "or an Inductor config key (torch._inductor.list_options())")
    if problems:
        raise FusionOptionsError("; ".join(problems))
    try:
        config = dataclasses.replace(base, **fields) if fields else base
    except (TypeError, ValueError) as error:
        raise FusionOptionsError(f"options {dict(options or {})}: {error}") from None
    return config, inductor


class FusionBackend:
    """A torch.compile backend holding one config and the report of everything it compiled.

    >>> backend = FusionBackend(FusionConfig(strict=True))
    >>> compiled = torch.compile(model, backend=backend)
    >>> compiled(*inputs); print(backend.report.format())

    torch.compile's `mode` and `options`, given with this backend, apply on top of its config
    (see `compile_settings`); every graph goes into the one report. `inductor_options`: Inductor
    config patched in while this backend compiles. `root`: the model compiled, from which the
    module paths of every graph are named (`qualify_module_paths`); without it, the model is
    looked for among the modules running when a graph compiles.
    """

    def __init__(
        self,
        config: FusionConfig | None = None,
        inductor_options: Mapping | None = None,
        root: torch.nn.Module | None = None,
    ):
        self.config = config or FusionConfig()
        self.inductor_options = dict(inductor_options or {})
        # The model compiled, where the caller knows it (fc.compile, inspect): module paths of a
        # graph Dynamo resumed inside one of its submodules are qualified from it.
        self._root = weakref.ref(root) if isinstance(root, torch.nn.Module) else None
        self.report = MatchReport()
        self.compiles = 0
        # One per graph compiled for CUDA inputs (cudagraph.py); the report reads them too.
        self.step_graphs: list[StepGraphs] = self.report.step_graphs

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[torch.Tensor],
        mode: str | None = None,
        options: Mapping | None = None,
    ) -> Callable:
        config, inductor_options = compile_settings(self.config, mode, options)
        inductor_options = {**self.inductor_options, **inductor_options}
        _LAST[:] = [self]
        self.compiles += 1
        check_expected_paths(config.expected, _frame_roots(gm))
        root = self._root() if self._root is not None else None
        qualified = qualify_module_paths(gm, [root] if root is not None else _compat.calling_modules())
        fusion_pass = FusionPass(config, self.report)
        first_graph = len(self.report.graphs)
        # compile_fx runs pre-grad passes on gm in place; verify needs the untouched graph.
        reference = copy.deepcopy(gm) if config.verify else None
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in example_inputs)
        plan = plan_inputs(gm, example_inputs, config.cudagraph_slot_inputs) if on_cuda else None
        with _compat.reraise_ours(), _compat.inductor_patches(
            fusion_pass, use_caches=config.inductor_cache, extra=inductor_options
        ):
            compiled = _compat.compile_fx(gm, example_inputs)
        if config.cudagraphs and on_cuda:
            name = f"graph {first_graph}"
            compiled = StepGraphs(compiled, plan, config.cudagraph_buckets, name=name, strict=config.strict)
            self.step_graphs.append(compiled)
            log.info("%s runs in CUDA graphs: %d batch inputs (%d slot inputs padded with -1)",
                     name, len(plan.batch), len(plan.slots))
        if config.verify:
            sites = [s for g in self.report.graphs[first_graph:] for s in g.matched()]
            compiled = verify_first_call(reference, compiled, sites, config.verify_rtol)
        if qualified:
            compiled = SharedFrameGraph.around(compiled, self.report, first_graph, example_inputs, qualified)
        return compiled


def fusion_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[torch.Tensor],
    mode: str | None = None,
    options: Mapping | None = None,
) -> Callable:
    """Entry point for `torch.compile(m, backend="fusion_compiler", mode=..., options={...})`.

    `mode` and `options` as `compile_settings` reads them. All graphs of one torch.compile call
    (prefill, decode, recompiles) go to one FusionBackend: `fusion_compiler.last_backend()`,
    whose report is `fusion_compiler.last_report()`.
    """
    wrapper = _compat.calling_torch_compile()
    backend = getattr(wrapper, _BACKEND_ATTR, None)
    if backend is None and wrapper is None:
        # Called other than through torch.compile (torch._dynamo.optimize): one backend per
        # distinct mode and options in this process.
        backend = _BY_SETTINGS.get(repr((mode, options)))
    if backend is None:
        config, inductor_options = compile_settings(FusionConfig(), mode, options)
        backend = FusionBackend(config, inductor_options)
        if wrapper is not None:
            setattr(wrapper, _BACKEND_ATTR, backend)
        else:
            _BY_SETTINGS[repr((mode, options))] = backend
    return backend(gm, example_inputs)


_BACKEND_ATTR = "_fusion_compiler_backend"
_BY_SETTINGS: dict[str, FusionBackend] = {}
_LAST: list[FusionBackend] = []


def last_backend() -> FusionBackend | None:
    """The FusionBackend that compiled the most recent graph (through the registered
    `"fusion_compiler"` backend or any other route): its config, report and step graphs."""
    return _LAST[-1] if _LAST else None


def last_report() -> MatchReport | None:
    """The report of `last_backend()`: every graph of the most recent compile."""
    return _LAST[-1].report if _LAST else None


def compile(model: torch.nn.Module | Callable, config: FusionConfig | None = None, **compile_kwargs):
    """`torch.compile(model)` through fusion_compiler; `compile_kwargs` are torch.compile's.
    The returned object carries `.fusion_backend` (config, compile count, step graphs) and
    `.fusion_report`.

    An HF model with `generate` is compiled in place, so that `model(...)` and `generate()`
    run the compiled forward, and is returned itself (integrations/hf.py). With `strict` and no
    `expected`, its expected sites come from its model adapter.
    `expected` paths must name modules of `model` (UnknownModuleError).
    """
    config = config or FusionConfig()
    if isinstance(model, torch.nn.Module):
        check_expected_paths(config.expected, [model], every_path=True)
        if callable(getattr(model, "generate", None)) and hasattr(model, "generation_config"):
            from .integrations import hf

            return hf.compile_for_generate(model, config, **compile_kwargs)
    backend = FusionBackend(config, root=model if isinstance(model, torch.nn.Module) else None)
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    try:
        compiled.fusion_backend = backend
        compiled.fusion_report = backend.report
    except AttributeError:  # some callables refuse attributes; the backend is still reachable
        log.debug("could not attach the fusion backend to %r", compiled)
    return compiled


# --------------------------------------------------------------------------------------------------
# Expected module paths
# --------------------------------------------------------------------------------------------------

_ROOT_LOCAL = re.compile(r"^L\[['\"]([^'\"]+)['\"]\]")


def _frame_roots(gm: torch.fx.GraphModule) -> list[torch.nn.Module]:
    """The modules nn_module_stack's paths start from (``L['self']``: a local of the frame
    Dynamo compiles), where this torch lets us reach them."""
    owners = _frame_owners(gm)
    return [owners[n] for n in sorted(owners)]


def _frame_owners(gm: torch.fx.GraphModule, also: Iterable[str] = ()) -> dict[str, torch.nn.Module]:
    """Local name -> module, for the locals of the frame Dynamo compiles that nn_module_stack's
    paths start from, and those named in `also` that are modules."""
    names = set(also)
    for node in gm.graph.nodes:
        for raw, _ in (node.meta.get("nn_module_stack") or {}).values():
            found = _ROOT_LOCAL.match(raw)
            if found:
                names.add(found.group(1))
    local = _compat.compiling_frame_locals() if names else {}
    return {n: local[n] for n in names if isinstance(local.get(n), torch.nn.Module)}


def qualify_module_paths(gm: torch.fx.GraphModule, roots: Sequence[torch.nn.Module]) -> Qualified | None:
    """Name the modules of a graph from the model, in place: where the graph breaks (HF's
    "eager" experts loop over ``nonzero``), Dynamo compiles a submodule's forward as a frame of
    its own, whose ``nn_module_stack`` paths start at its ``self`` (``L['self'].gate`` in a MoE
    block) and whose own ops have none. Each local such a path starts from that is a module
    under one of `roots` (the first that holds it) gets its path there put in front
    (``L['self'].model.layers.0.mlp.gate``, which ``normalize_module_path`` reads as
    ``model.layers.0.mlp.gate``), and the frame's own ops get its ``self``'s path. Returns
    Qualified, or None where nothing was."""
    owners = _frame_owners(gm, also=("self",))
    prefixes, holders = {}, {}
    for root in roots if owners else ():
        paths = {id(m): path for path, m in root.named_modules()}
        for name, module in owners.items():
            if name not in prefixes and paths.get(id(module)):
                prefixes[name], holders[name] = paths[id(module)], root
    if not prefixes:
        return None
    own = {str(id(owners["self"])): (f"L['self'].{prefixes['self']}", type(owners["self"]))} if "self" in prefixes else None
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {key: (_prefixed(raw, prefixes), kind) for key, (raw, kind) in stack.items()}
        elif own and node.op in ("call_function", "call_method", "call_module"):
            node.meta["nn_module_stack"] = dict(own)
    return Qualified(prefixes, owners.get("self") if "self" in prefixes else None, holders.get("self"))


@dataclasses.dataclass
class Qualified:
    """What `qualify_module_paths` did to one graph: local -> module path put in front, and the
    frame's ``self`` (where it is a submodule) with the model it was found in."""

    prefixes: dict[str, str]
    owner: torch.nn.Module | None
    root: torch.nn.Module | None


class SharedFrameGraph:
    """A graph compiled in a submodule's frame runs for every module of that code whose frame
    passes its guards: Dynamo passes a module's parameters as graph inputs (torch 2.13), so one
    graph compiled in layer 0's MoE block serves each layer's. On its first call with another
    module's parameters, the graph's sites are reported again, under that module's path
    (`GraphReport.run_for`), so each layer is credited with what ran for it."""

    def __init__(self, compiled, report: MatchReport, graphs: list, index: int, own: str, relative: str, root):
        self.compiled, self.report, self.graphs = compiled, report, graphs
        self.index, self.own, self.relative, self.root = index, own, relative, weakref.ref(root)
        self.seen: set[int] = set()

    @classmethod
    def around(cls, compiled, report: MatchReport, first_graph: int, example_inputs, qualified: Qualified):
        """`compiled` wrapped where its frame's ``self`` is a submodule whose parameters (or
        buffers) are graph inputs; else `compiled` itself."""
        owner = qualified.owner
        if owner is None or qualified.root is None or not report.graphs[first_graph:]:
            return compiled
        tensors = {id(t): name for name, t in (*owner.named_parameters(), *owner.named_buffers())}
        index = next((i for i, x in enumerate(example_inputs) if id(x) in tensors), None)
        if index is None:
            return compiled
        shared = cls(compiled, report, report.graphs[first_graph:], index, qualified.prefixes["self"],
                     tensors[id(example_inputs[index])], qualified.root)  # fmt: skip
        shared.seen.add(id(example_inputs[index]))
        return shared

    def __call__(self, *args):
        key = id(args[self.index]) if len(args) > self.index else None
        if key is not None and key not in self.seen:
            self.seen.add(key)
            self._ran_for(args[self.index])
        return self.compiled(*args)

    def _ran_for(self, tensor) -> None:
        root = self.root()
        name = next((n for n, t in (*root.named_parameters(), *root.named_buffers()) if t is tensor), None) if root else None
        if name is None or not name.endswith("." + self.relative):
            return
        other = name[: -len(self.relative) - 1]
        if other != self.own:
            for g in self.graphs:
                self.report.graphs.append(g.run_for(self.own, other, len(self.report.graphs)))


def _prefixed(raw: str, prefixes: dict[str, str]) -> str:
    found = _ROOT_LOCAL.match(raw)
    prefix = prefixes.get(found.group(1)) if found else None
    return raw if prefix is None else f"{found.group(0)}.{prefix}{raw[found.end():]}"


def check_expected_paths(
    expected: Mapping[str, Mapping[str, int]], roots: Iterable[torch.nn.Module], every_path: bool = False
) -> None:
    """UnknownModuleError for an expected module path that names no module under `roots`.

    With `every_path`, each path must name a module of a root (the model fc.compile was given).
    Otherwise (a graph's frame: it may be a resumed or nested frame whose root is not the
    model's) a path is checked only where its first name is a child of a root.
    """
    roots = list(roots)
    if not roots or not expected:
        return
    bad = []
    for family, per_module in expected.items():
        for path in per_module:
            if any(_resolves(root, path) for root in roots):
                continue
            first = path.split(".")[0]
            anchored = [r for r in roots if first in dict(r.named_children())]
            if every_path or anchored:
                bad.append(f"{family} at {path!r}: {_why_unknown((anchored or roots)[0], path)}")
    if bad:
        raise UnknownModuleError(
            f"{len(bad)} expected module path(s) name no module of the compiled model:\n  " + "\n  ".join(bad)
        )


def _resolves(root: torch.nn.Module, path: str) -> bool:
    if not path:
        return True
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False


def _why_unknown(root: torch.nn.Module, path: str) -> str:
    """Where the path leaves the module tree, and the nearest names there."""
    module, walked = root, []
    for name in path.split("."):
        children = dict(module.named_children())
        if name not in children:
            where = ".".join(walked) or "the model"
            close = difflib.get_close_matches(name, list(children), n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            return f"{where} has no submodule {name!r}{hint}"
        module = children[name]
        walked.append(name)
    return "not a module"
