"""The declarative pattern contract.

A `Family` is a set of `Variant`s (plain torch search functions, one per way real code
writes the same math), one guard shared by all variants, and a replacement per lowering.
The registry turns a family into Inductor `register_replacement` entries: every variant
is traced once per dtype combination the family declares, and every match goes through
`guard` before it is replaced, then through its replacement traced on the site's own values: a
fused op that cannot take the site (its argument checks raise) declines it there, before
Inductor lowers anything. A declined match is recorded with its reason; it never disappears
silently, and it never ends the compile.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import _compat
from ..fx.canonicalize import canonicalize
from . import failed_match

log = logging.getLogger("fusion_compiler")

Reason = str | None


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """One way real code writes the family's math.

    search: a functional, plain-torch function of the site's inputs (tensors first,
        then the scalars named in `Family.scalars`); traced into the pattern.
    params: fixed facts of the variant the replacement needs (e.g. weight_offset=1.0
        for Gemma's x·(1+w)).
    """

    name: str
    search: Callable[..., Any]
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """A fusion family: what to find, how to check it, what to put in its place.

    is_site: true for exactly one node of every candidate site (the anchor); sites
        that no variant replaced are reported as misses.
    explain: for an anchor that did not match, the node where matching stopped and why.
    example_inputs: (variant, dtype combination) -> inputs to trace the variant with,
        or None when that combination does not apply to the variant.
    guard: (match kwargs as values, variant) -> reason to decline, or None to accept.
    facts_of: (matched nodes, match inputs by name) -> facts the guard and replacement need that the pattern itself
        cannot pin down: scalar arguments (eps; torch 2.11 drops scalars from a re-traced
        match's kwargs), and the ints, lists and dtypes Inductor's pattern tracer turns into
        wildcards (slice steps that tell interleaved RoPE from NeoX, split sizes, the dtype
        a quant casts to). Read from the matched graph nodes.
    replacement: (variant, lowering) -> replacement function with the search's signature.
    distinct_inputs: pairs of search inputs that must bind different graph nodes. Inductor's
        multi-output matcher can bind two structurally identical sub-patterns (q's and k's
        paths, two state writes) to the same nodes; such a match is declined with a reason.
    """

    name: str
    variants: tuple[Variant, ...]
    dtype_combos: tuple[tuple[torch.dtype, ...], ...]
    example_inputs: Callable[[Variant, tuple[torch.dtype, ...]], list | None]
    scalars: Mapping[str, float]
    guard: Callable[[Mapping[str, Any], Variant], Reason]
    replacement: Callable[[Variant, str], Callable[..., Any]]
    facts_of: Callable[[list[torch.fx.Node], Mapping[str, Any]], dict[str, Any]]
    is_site: Callable[[torch.fx.Node], bool]
    explain: Callable[[torch.fx.Node], tuple[torch.fx.Node, str]]
    source_modules: tuple[str, ...] = ()
    distinct_inputs: tuple[tuple[str, str], ...] = ()


class MatchRecorder:
    """Collects, per anchor node, which variant fused it or why variants declined it."""

    def __init__(self, family: Family):
        self.family = family
        self.accepted: dict[torch.fx.Node, str] = {}
        self.declined: dict[torch.fx.Node, list[tuple[str, str]]] = {}

    def anchor_of(self, match: _compat.Match) -> torch.fx.Node | None:
        # A multi-output match can list a node once per output that reaches it.
        anchors = list(dict.fromkeys(n for n in match.nodes if self.family.is_site(n)))
        return anchors[0] if len(anchors) == 1 else None


_active: list[MatchRecorder] = []


def _match_values(family: Family, match: _compat.Match) -> dict[str, Any]:
    """Match kwargs with nodes replaced by their fake values; scalars stay as they are.

    torch 2.11 hands the check the re-traced match, whose scalars are literals, not kwargs: a
    family scalar missing there takes the graph's own constant, ``facts["graph_<name>"]``,
    where ``facts_of`` reads one (the re-traced pattern matched that literal already)."""
    out: dict[str, Any] = family.facts_of(match.nodes, match.kwargs)
    for name, value in match.kwargs.items():
        if isinstance(value, torch.fx.Node):
            out[name] = _compat.fake_value(value) if "val" in value.meta else value
        else:
            out[name] = value
    for name in family.scalars:
        if name not in match.kwargs and f"graph_{name}" in out:
            out[name] = out[f"graph_{name}"]
    return out


_SAME_NODE_SUFFIX = ": one path matched as both"


def _same_node_reason(family: Family, match: _compat.Match) -> Reason:
    for a, b in family.distinct_inputs:
        node = match.kwargs.get(a)
        if isinstance(node, torch.fx.Node) and node is match.kwargs.get(b):
            return f"{a} and {b} bound to the same node {node.name}{_SAME_NODE_SUFFIX}"
    return None


def is_binding_artefact(reason: str) -> bool:
    """A decline for the matcher's own wrong binding (q's and k's paths matched to one node),
    which says nothing about the model's code: the report leaves it out beside any other reason."""
    return reason.endswith(_SAME_NODE_SUFFIX)


_CYCLE_PREFIX = "bound another site's node:"


def _cycle_reason(match: _compat.Match) -> Reason:
    """A match whose input is computed from its own nodes: the fused op would need its own
    output. Multi-output patterns bind each output's sub-pattern on its own, and with dynamic
    shapes a later layer's q / k path can fit an earlier layer's anchor (found on a 2-layer
    decode stack: a cycle at topological sort)."""
    inputs = {n for n in match.kwargs.values() if isinstance(n, torch.fx.Node)}
    seen = set(match.nodes)
    frontier = [u for n in match.nodes for u in n.users if u not in seen]
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        if node in inputs:
            return f"{_CYCLE_PREFIX} input {node.name} is computed from the match's own nodes"
        seen.add(node)
        frontier.extend(u for u in node.users if u not in seen)
    return None


def _checked(family: Family, variant: Variant, replace: Callable[..., Any]) -> Callable[[_compat.Match], bool]:
    def check(match: _compat.Match) -> bool:
        recorder = _active[-1] if _active else None
        try:
            values = _match_values(family, match)
            # A node left in `values` is an input the guard cannot reason about statically
            # (e.g. eps computed by a tensor op): the guard sees it and declines with a reason.
            reason = _same_node_reason(family, match) or _cycle_reason(match) or family.guard(values, variant)
        except Exception as err:  # noqa: BLE001 - never crash on a model; the reason names the error
            reason = _bug_reason(family, variant, "guard", err)
        if reason is None:
            reason = _lowering_reason(family, variant, replace, match, values)
        anchor = recorder.anchor_of(match) if recorder else None
        if reason is not None:
            if recorder is not None and anchor is not None:
                recorder.declined.setdefault(anchor, []).append((variant.name, reason))
            return False
        if recorder is not None and anchor is not None:
            recorder.accepted[anchor] = variant.name
        return True

    return check


def _lowering_reason(family: Family, variant: Variant, replace, match: _compat.Match, values: Mapping[str, Any]) -> Reason:
    """Why the replacement cannot take this site, or None: it is traced here with the site's own
    fake values, as Inductor traces it right after this check accepts (inside the check's fake
    mode, with the same arguments, so Inductor's trace is a copy of this one: ``_SITE_TRACES``).
    A fused op's argument checks (its fake function) raise ValueError on what its kernel cannot
    take (a width, a dtype, a layout); that would otherwise end the whole compile. Anything else
    raised is a bug of ours: the site is declined saying what raised, and the log has the
    traceback."""
    args = [_fresh(match.kwargs[name] if name in match.kwargs else values.get(name))
            for name in inspect.signature(variant.search).parameters]  # fmt: skip
    try:
        _trace(replace, args, **_compat.REPLACEMENT_TRACE_KWARGS)
    except ValueError as err:
        return f"the fused op does not take this site: {err}"
    except Exception as err:  # noqa: BLE001 - never crash on a model; the reason names the error
        return _bug_reason(family, variant, "replacement", err)
    return None


def _bug_reason(family: Family, variant: Variant, part: str, err: Exception) -> str:
    """The reason for a site declined because our own code raised on it (logged with the traceback)."""
    log.warning("%s's %s (%s) raised on a site", family.name, part, variant.name, exc_info=True)
    return f"fusion_compiler's {family.name} {part} raised {type(err).__name__} on this site (a bug; please report it): {err}"


def _fresh(value):
    """A match input as Inductor's check hands it to the replacement: a node's fake value as a
    new tensor of the same size, strides, dtype and device (``torch.empty_strided`` in the check's
    fake mode); anything else as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, torch.fx.Node):
        value = _compat.fake_value(value)
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
    return value


def _trace(fn, args, **kwargs) -> torch.fx.GraphModule:
    """A pattern trace in the form of the graphs it meets: post-grad rewrites, then our
    canonical spellings (the pass canonicalises the real graph the same way). Inside
    ``run_family`` a repeat of an earlier trace (same function, same argument metadata) is a
    copy of it (``_SITE_TRACES``)."""
    cache = _SITE_TRACES[-1] if _SITE_TRACES else None
    key = _trace_key(fn, args, kwargs) if cache is not None else None
    if key is not None and key in cache:
        return _copy_module(cache[key])
    gm = _compat.trace_like_post_grad(fn, args, **kwargs)
    if canonicalize(gm.graph):
        gm.recompile()
    if key is not None:
        cache[key] = gm
        return _copy_module(gm)  # Inductor writes the site's metadata into the graph it gets
    return gm


# Per-match traces of one run_family call, by (function, argument metadata). Inductor re-traces
# the search with each structural match's own shapes and traces the replacement for it (~10 ms
# each on CPU): once per layer, so a model of N layers would trace the same graphs N times (a
# 2-layer DeepSeek V3.2 step traces 36, of which 17 are distinct; bench/NOTES.md, "Compile
# time"). One run is one graph and one fake mode, so a copy is what a fresh trace would give. The
# check's own trace of a replacement (_lowering_reason) makes Inductor's trace right after it one
# of these copies.
_SITE_TRACES: list[dict] = []


class _Uncacheable(Exception):
    pass


def _trace_key(fn, args, kwargs) -> tuple | None:
    def size(d):
        # A symbolic size by its expression: one run is one shape env, where equal expressions
        # are equal sizes.
        return d if type(d) is int else ("sym", d.node.expr)

    def meta(value):
        if isinstance(value, torch.Tensor):
            shape, stride = tuple(map(size, value.shape)), tuple(map(size, value.stride()))
            return ("tensor", shape, stride, value.dtype, value.device.type, value.requires_grad)
        if isinstance(value, torch.SymInt):
            return ("symint", size(value))
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(meta(v) for v in value))
        if value is None or type(value) in (bool, int, float, str, torch.dtype):
            return (type(value), value)
        raise _Uncacheable

    try:
        key = (fn, meta(list(args)), tuple(sorted(kwargs.items())))  # kwargs: get_decomp_fn and the like
        hash(key)
        return key
    except (_Uncacheable, TypeError):  # TypeError: an unhashable kwarg
        return None


def _copy_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A fresh GraphModule over a copy of gm's graph (node metadata dicts copied, values shared)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return _compat.graph_module_lazy(gm, graph)


# The variant each registered pattern was traced from, by the pattern's id (patterns live as long
# as their matcher: the process).
_VARIANT_OF: dict[int, str] = {}

# Seconds spent tracing each (family, lowering)'s variants: once per process, then cached.
TRACE_SECONDS: dict[tuple[str, str], float] = {}


def trace_seconds_total() -> float:
    """All pattern tracing so far in this process (a compile's share: the difference across it)."""
    return sum(TRACE_SECONDS.values())


@functools.lru_cache(maxsize=None)
def matcher_for(family: Family, lowering: str) -> _compat.PatternMatcherPass:
    """Trace every variant of `family` once per process and lowering."""
    started = time.perf_counter()
    matcher = _compat.PatternMatcherPass(pass_name=f"fusion_compiler.{family.name}")
    for variant in family.variants:
        replace = family.replacement(variant, lowering)
        for combo in family.dtype_combos:
            inputs = family.example_inputs(variant, combo)
            if inputs is None:
                continue
            pattern = _compat.register_replacement(
                variant.search,
                replace,
                inputs,
                _trace,
                matcher,
                extra_check=_checked(family, variant, replace),
                scalar_workaround=dict(family.scalars),
                skip_duplicates=True,
            )
            if pattern:  # False: a duplicate of a pattern registered already (another dtype's trace)
                _VARIANT_OF[id(pattern)] = variant.name
    TRACE_SECONDS[(family.name, lowering)] = time.perf_counter() - started
    return matcher


def run_family(family: Family, lowering: str, graph: torch.fx.Graph) -> MatchRecorder:
    recorder = MatchRecorder(family)
    matcher = matcher_for(family, lowering)
    _active.append(recorder)
    _SITE_TRACES.append({})
    try:
        replaced = matcher.apply(graph)
        # An anchor declined because a sub-pattern bound a later site's nodes gets another pass
        # once that site is replaced (its nodes gone, the right binding is the one left).
        while replaced and _rebound(recorder, graph):
            replaced = matcher.apply(graph)
    finally:
        _active.pop()
        _SITE_TRACES.pop()
    return recorder


def _rebound(recorder: MatchRecorder, graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Anchors still in the graph, not accepted, declined only for binding another site's nodes."""
    live = set(graph.nodes)
    return [
        anchor for anchor, reasons in recorder.declined.items()
        if anchor in live and anchor not in recorder.accepted
        and any(reason.startswith(_CYCLE_PREFIX) for _, reason in reasons)
    ]  # fmt: skip


def failed_match_reason(family: Family, lowering: str, anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """Why no variant matched near `anchor`, in one sentence, and the node where it stopped.

    Tries every registered variant at the anchor and at the nodes downstream of it (where a
    pattern's output can sit). A structural match anywhere there, which Inductor's exact re-trace
    then refused, is the answer; else, of the failures near the anchor, the one of the variant
    that got furthest (the most pattern nodes bound before it stopped): the spelling the model's
    code is closest to, said as what the model has at the node where it left that spelling
    against what the pattern expects there (``failed_match.sentence``). (The structural match is
    looked for first: DeepSeek's router output sits past the anchor's first users, and the first
    failure there named another variant's mismatch while the real cause was the re-trace.)
    """
    matcher = matcher_for(family, lowering)
    frontier, seen = [anchor], {anchor}
    closest, closest_progress = None, -1
    for depth in range(_OUTPUT_SEARCH_DEPTH):
        for node in frontier:
            for pattern in _compat.patterns_rooted_at(matcher, node):
                result, progress = _compat.match_with_progress(pattern, node)
                if _compat.is_match(result):
                    # Inductor refuses a structural match before any guard of ours runs when its
                    # re-trace of the search with the site's real shapes and literals differs, or
                    # when the match spans an in-place op.
                    return node, (
                        f"{_VARIANT_OF.get(id(pattern), 'a variant')} matches at {node.name} in structure, but Inductor "
                        "did not take it: its re-trace with this site's shapes differs (a literal such as a reshape's "
                        "or split's sizes is not the traced spelling's), or the match spans an in-place op"
                    )
                if depth < _FAILURE_SEARCH_DEPTH and progress > closest_progress:
                    stopped, words = failed_match.sentence(result, node)
                    # The node the failure names is where the graph left the pattern, when it is one.
                    stopped = stopped if stopped.graph is node.graph else node
                    closest, closest_progress = (stopped, f"closest variant {_VARIANT_OF.get(id(pattern), '?')}: {words}"), progress
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
    return _dtype_reason(family, anchor) or closest


def _dtype_reason(family: Family, anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """A site no variant matches whose values nearby are of a float dtype the family was never
    traced for (a float64 model): that dtype is the reason, not the first spelling difference
    it causes (its casts to fp32 are where a bf16 or fp32 model has none)."""
    covered = {d for combo in family.dtype_combos for d in combo}
    for node in _upstream_nodes(anchor, _DTYPE_SEARCH_DEPTH):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_floating_point() and val.dtype not in covered:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in covered))
            return node, (f"{node.name} is {str(val.dtype).removeprefix('torch.')}: {family.name}'s patterns and "
                          f"kernels are for {names} models")  # fmt: skip
    return None


def _upstream_nodes(anchor: torch.fx.Node, depth: int) -> list[torch.fx.Node]:
    """The anchor and the nodes within ``depth`` inputs above it, nearest first."""
    nodes = {anchor: None}
    frontier = [anchor]
    for _ in range(depth):
        frontier = list(dict.fromkeys(m for n in frontier for m in n.all_input_nodes if m not in nodes))
        nodes.update(dict.fromkeys(frontier))
    return list(nodes)


# A failed match names where the graph left the pattern only near the anchor; further on, only a
# full structural match says anything (a site's output can sit tens of nodes past its anchor).
_FAILURE_SEARCH_DEPTH = 5
_OUTPUT_SEARCH_DEPTH = 48
_DTYPE_SEARCH_DEPTH = 8  # a site's inputs sit within a few ops above its anchor


def source_text(family: Family) -> str:
    parts = []
    for module_name in family.source_modules:
        module = __import__(module_name, fromlist=["_"])
        parts.append(inspect.getsource(module))
    return "\n".join(parts)
