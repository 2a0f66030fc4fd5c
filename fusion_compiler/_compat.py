"""Every use of torch's private compiler APIs goes through this module.

Torch's `torch._inductor.pattern_matcher` and friends move between releases; we
support torch 2.11 (the H200), 2.13 (CI) and 2.14 (vLLM 0.33). When one of them
moves, this is the only file that changes.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import typing

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 11):
    raise ImportError(f"fusion_compiler needs torch >= 2.11, found {torch.__version__}")

from torch._inductor import config as inductor_config  # noqa: E402
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2  # noqa: E402
from torch._inductor.compile_fx import compile_fx  # noqa: E402
from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402
from torch._inductor.pattern_matcher import (  # noqa: E402
    FailedMatch,
    Match,
    PatternMatcherPass,
    fwd_only,
    is_match,
    register_replacement,
)

from torch._inductor.fx_passes.post_grad import view_to_reshape as _view_to_reshape  # noqa: E402

__all__ = [
    "canonical_size",
    "trace_like_post_grad",
    "JOINT_GRAPH_DROPS_ROUND_TRIPS",
    "run_with_fake_mode",
    "auto_functionalized",
    "auto_functionalized_v2",
    "op_name",
    "op_arguments",
    "op_return_count",
    "default_overload",
    "CustomGraphPass",
    "FailedMatch",
    "Match",
    "PatternMatcherPass",
    "TORCH_VERSION",
    "compile_fx",
    "fake_value",
    "fwd_only",
    "inductor_patches",
    "inductor_config",
    "inductor_mode_options",
    "inductor_option_problem",
    "ReachesCaller",
    "reraise_ours",
    "compiling_frame_locals",
    "calling_torch_compile",
    "is_match",
    "patterns_rooted_at",
    "register_replacement",
    "run_and_get_code",
    "stable_topological_sort",
]


@contextlib.contextmanager
def inductor_patches(post_grad_pass: CustomGraphPass, use_caches: bool, extra: dict | None = None):
    """Install our post-grad pass; unless `use_caches`, turn off the FX-graph and
    AOTAutograd caches (a cache hit would skip the pass). `extra`: the caller's own Inductor
    settings (torch.compile's mode and options), applied first."""
    from torch._functorch import config as functorch_config

    patches: dict = {**(extra or {}), "post_grad_custom_post_pass": post_grad_pass}
    functorch_patches: dict = {}
    if not use_caches:
        patches["fx_graph_cache"] = False
        if hasattr(functorch_config, "enable_autograd_cache"):
            functorch_patches["enable_autograd_cache"] = False
    with inductor_config.patch(patches), functorch_config.patch(functorch_patches):
        yield


def canonical_size(size: torch.SymInt):
    """(the sympy expression of a symbolic size after the shape env's known equalities, its
    value in the example the graph was traced with, or None)."""
    node = size.node
    expr = node.shape_env.replace(node.expr) if node.shape_env is not None else node.expr
    return expr, node.hint


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    from torch._inductor.pattern_matcher import stable_topological_sort as _sort

    _sort(graph)


def patterns_rooted_at(matcher: PatternMatcherPass, node: torch.fx.Node) -> list:
    """The registered patterns whose output op is `node`'s (Inductor keys them by op and target)."""
    return [entry.pattern for entry in matcher.patterns.get((node.op, node.target), [])]


def failed_match_parts(result) -> tuple[str, tuple]:
    """(format string, format arguments) of Inductor's ``FailedMatch``: the kind of failure
    (``function_mismatch: node={}, pattern={}``, ``multiple_users {}``, ``constant_args: ...``,
    ``list[{}]: {}``, ...) and the nodes, patterns and nested failures it names."""
    args = (*getattr(result, "args", ()), *getattr(result, "kwargs", {}).values())
    return getattr(result, "format_string", str(result)), args


def match_with_progress(pattern, node: torch.fx.Node) -> tuple[object, int]:
    """``pattern.match(node)`` (a Match or a FailedMatch) and how many of the pattern's
    sub-patterns were bound to graph nodes when it stopped: of several variants that fail at one
    node, the one that got furthest is the one the model's code is closest to."""
    from torch._inductor.pattern_matcher import MatchContext

    context = MatchContext([pattern], graph=node.graph)
    try:
        result = context.match(pattern, node)
    except FailedMatch as failure:
        result = failure
    return result, sum(1 for bound in context.pattern_to_node.values() if bound is not None)


def pattern_call(pattern) -> dict | None:
    """What a pattern node expects, for the words of a miss: ``targets`` (the ops it accepts),
    ``inputs`` (the names of its keyword-argument inputs: the search function's parameters),
    ``arity`` and ``users`` (an int, or None for any number); None for a pattern that is not an
    op call (an input, a wildcard, a list)."""
    from torch._inductor.pattern_matcher import KeywordArg, _TargetExpr

    if isinstance(pattern, KeywordArg):
        return {"targets": [], "inputs": [pattern.name], "arity": 0, "users": None}
    if not isinstance(pattern, _TargetExpr):
        return None
    args = list(getattr(pattern, "args", ()))
    users = pattern.users if isinstance(pattern.users, int) else None
    inputs = [a.name for a in args if isinstance(a, KeywordArg)]
    return {"targets": list(pattern.fns), "inputs": inputs, "arity": len(args), "users": users}


def _replacement_trace_kwargs() -> dict:
    parameter = inspect.signature(register_replacement).parameters.get("get_decomp_fn")
    return {} if parameter is None else {"get_decomp_fn": parameter.default}


# The keyword arguments with which Inductor's check traces a replacement for a match, right after
# the extra check accepts it (``trace_fn(replace_fn, args, get_decomp_fn=get_decomp_fn)``, the
# default of register_replacement's ``get_decomp_fn`` where it has one): a trace of ours with the
# same function, arguments and these is the one Inductor asks for next.
REPLACEMENT_TRACE_KWARGS: dict = _replacement_trace_kwargs()


def fake_value(node: object):
    """The FakeTensor (or SymInt/scalar) a post-grad node carries in `meta['val']`, or None."""
    if isinstance(node, torch.fx.Node):
        return node.meta.get("val")
    return None


def run_and_get_code(fn):
    """Run `fn()`; return its result and the source of every module Inductor generated."""
    from torch._inductor.utils import run_and_get_code as _run_and_get_code

    return _run_and_get_code(fn)


def _joint_graph_drops_round_trips() -> bool:
    """Torch 2.11's joint-graph `pointless_convert` folds `x.to(bf16).to(float32)` into
    `x.to(float32)`: the model's rounding to bf16 is gone from the graph our pass sees. Later
    versions keep a narrowing intermediate (their rule tests the dtypes' itemsize)."""
    from torch._inductor.fx_passes import joint_graph

    return "itemsize" not in inspect.getsource(joint_graph.pointless_convert)


JOINT_GRAPH_DROPS_ROUND_TRIPS: bool = _joint_graph_drops_round_trips()

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fold_convert_chains(gm: torch.fx.GraphModule) -> None:
    """The same folding on a pattern's trace, so the pattern looks like the graph."""
    convert = torch.ops.prims.convert_element_type.default
    for node in list(gm.graph.nodes):
        inner = node.args[0] if node.target is convert else None
        if getattr(inner, "target", None) is convert and inner.args[1] in _FLOATS and node.args[1] in _FLOATS:
            source = inner.args[0]
            if source.meta.get("val") is not None and source.meta["val"].dtype == node.args[1]:
                node.replace_all_uses_with(source)
            else:
                node.args = (source, node.args[1])
    gm.graph.eliminate_dead_code()


def trace_like_post_grad(fn, args, **kwargs) -> torch.fx.GraphModule:
    """`fwd_only`, then the rewrites the real graph went through before our pass: every `view`
    becomes `reshape` (post-grad), and on torch 2.11 convert chains fold (joint graph)."""
    gm = fwd_only(fn, args, **kwargs)
    if JOINT_GRAPH_DROPS_ROUND_TRIPS:
        _fold_convert_chains(gm)
    _view_to_reshape(gm)
    gm.recompile()
    return gm


def graph_module_lazy(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule that writes and compiles its Python code only when first called (an
    interpreter or a matcher reading its graph never does): torch's ``_LazyGraphModule``, where
    this torch has it."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - every torch we support (2.11-2.14) has it
        return torch.fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def run_with_fake_mode(target, args, kwargs):
    """Fake outputs for a node a pass builds (inside Inductor's post-grad passes)."""
    from torch._inductor.virtualized import V

    with V.fake_mode:
        return target(*args, **kwargs)


def op_name(target: object) -> str | None:
    """``namespace::name`` of an operator overload (``vllm_ir::rms_norm``), None for anything else:
    lets a pattern module recognise another library's op without importing that library."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


def op_arguments(op) -> list[tuple[str, bool, object]]:
    """(name, written in place, default or ``NO_DEFAULT``) for each argument of an overload."""
    return [
        (a.name, a.alias_info is not None and a.alias_info.is_write,
         a.default_value if a.has_default_value() else NO_DEFAULT)
        for a in op._schema.arguments
    ]  # fmt: skip


def op_return_count(op) -> int:
    return len(op._schema.returns)


def default_overload(op):
    """``ns.name.default`` of any overload of the same op (``maybe_inplace`` -> functional)."""
    return op.overloadpacket.default


NO_DEFAULT = object()


# --------------------------------------------------------------------------------------------------
# Dynamo's graph-break reasons (torch._dynamo.utils.counters: a Counter keyed by the reason text)
# --------------------------------------------------------------------------------------------------


def clear_graph_break_reasons() -> None:
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()


def graph_break_reasons() -> dict[str, int]:
    """Graph breaks since the last clear: the first line of each reason -> how many times."""
    from torch._dynamo.utils import counters

    reasons: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        lines = [line.strip() for line in str(reason).splitlines() if line.strip()] or ["(no reason given)"]
        # Newer torch puts a headline first and the specifics on an "Explanation:" line.
        explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
        text = f"{lines[0]}: {explanation.removeprefix('Explanation:').strip()}" if explanation else lines[0]
        reasons[text[:300]] = reasons.get(text[:300], 0) + count
    return reasons


# --------------------------------------------------------------------------------------------------
# torch.compile's mode and options, as stock Inductor reads them (torch/__init__.py
# _TorchCompileInductorWrapper), and the torch.compile call a backend is called through
# --------------------------------------------------------------------------------------------------


def inductor_mode_options(mode: str) -> dict:
    """Inductor's settings for a torch.compile mode; RuntimeError, as stock raises it, for an
    unknown mode."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def inductor_option_problem(key: str, value: object) -> str | None:
    """None if ``key`` is an Inductor config key that takes ``value``, else why not (stock's
    words, ``_TorchCompileInductorWrapper.apply_options``). Keys are spelt with "-" or "_"."""
    name = key.replace("-", "_")
    current = inductor_config.get_config_copy()
    if name not in current:
        return f"{key} is not an Inductor config key"
    expected = inductor_config.get_type(name)
    if typing.get_origin(expected) is None and isinstance(expected, type) and not isinstance(value, expected):
        return f"Inductor option {key} takes {type(current[name]).__name__}, got {type(value).__name__}"
    return None


def calling_torch_compile(depth: int = 8) -> object | None:
    """The ``torch.compile(...)`` call whose wrapper (torch's ``_TorchCompileWrapper``: one per
    call, holding its mode and options) is calling the backend that calls this, or None (a
    backend called some other way). Torch calls the backend once per graph through it, so it
    is where graphs of one compile can find each other."""
    wrapper_type = getattr(torch, "_TorchCompileWrapper", None)
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back
        if frame is None or wrapper_type is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, wrapper_type):
            return owner
    return None


def compiling_frame_locals() -> dict:
    """The locals of the Python frame Dynamo is compiling (from inside a backend): there,
    ``L['self']`` of ``nn_module_stack`` is ``locals['self']``. Empty outside a Dynamo compile
    or where this torch keeps them elsewhere."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return dict(tx.output.root_tx.f_locals) if tx is not None else {}
    except Exception:  # noqa: BLE001 - only a check reads this; it then has less to go on
        return {}


def calling_modules(depth: int = 256) -> list[torch.nn.Module]:
    """The modules whose methods are running below this call (each frame's ``self``), where a
    graph Dynamo compiles can find the model it is part of: first the modules torch.compile
    wrapped (an ``OptimizedModule``'s original, outermost first), then the others, outermost
    first. Dynamo runs a frame it resumes inside a submodule under the compiled code of the
    frames that called it, so the compiled model is among them."""
    wrapper_type = getattr(getattr(torch._dynamo, "eval_frame", None), "OptimizedModule", ())
    frame, wrapped, plain, seen = sys._getframe(1), [], [], set()
    for _ in range(depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if wrapper_type and isinstance(owner, wrapper_type):
            owner, into = getattr(owner, "_orig_mod", None), wrapped
        else:
            into = plain
        if isinstance(owner, torch.nn.Module) and id(owner) not in seen:
            seen.add(id(owner))
            into.append(owner)
        frame = frame.f_back
    return wrapped[::-1] + plain[::-1]


from torch._dynamo.exc import ShortenTraceback as _ShortenTraceback  # noqa: E402


class ReachesCaller(_ShortenTraceback):
    """Base of our errors raised while a graph compiles (MissedSiteError, bad options), so that
    they reach the caller as themselves.

    Dynamo wraps what a backend raises in ``BackendCompilerFailed`` and Inductor wraps what a
    post-grad pass raises in ``InductorError``, except a ``ShortenTraceback``, which both
    re-raise as it is (torch/_dynamo/output_graph.py ``_call_user_compiler``,
    torch/_inductor/compile_fx.py around ``fx_codegen_and_compile``; so in torch 2.11-2.14)."""

    def __init__(self, *args):
        super().__init__(*args, first_useful_frame=None)


@contextlib.contextmanager
def reraise_ours():
    """Around ``compile_fx``: one of our errors raised inside it (a post-grad pass's
    MissedSiteError) leaves as itself. Inductor wraps it in ``InductorError`` when it compiles
    with the FX-graph cache off (compile_fx.py ``_compile_fx_inner``'s cache-bypass branch
    wraps every exception), keeping it as ``inner_exception``."""
    try:
        yield
    except Exception as error:
        inner = error
        while not isinstance(inner, ReachesCaller) and isinstance(getattr(inner, "inner_exception", None), Exception):
            inner = inner.inner_exception
        if inner is not error and isinstance(inner, ReachesCaller):
            raise inner.with_traceback(inner.__traceback__) from None
        raise
