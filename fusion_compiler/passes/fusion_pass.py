"""FusionPass: the one post-grad pass that runs every enabled family in a fixed order."""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from .. import _compat
from ..config import FusionConfig
from ..fx import canonicalize as canonicalize_module
from ..fx.explain import chain
from ..fx.module_paths import module_path
from ..patterns import FAMILIES
from ..patterns.failed_match import op_name
from ..patterns.registry import Family, failed_match_reason, is_binding_artefact, run_family
from ..stages import FAMILY, GRAPH_PASS, STAGES, stage_module
from .report import GraphReport, MatchReport, Site, modules_in

log = logging.getLogger("fusion_compiler")


class MissedSiteError(_compat.ReachesCaller):
    """strict=True and an expected site did not fuse (with no expected sites given, any
    candidate site). A RuntimeError; raised through torch.compile as itself."""


class UnknownModuleError(_compat.ReachesCaller, ValueError):
    """An `expected` module path names no module of the compiled model."""


class FusionPass(_compat.CustomGraphPass):
    """Canonicalise, then run each enabled stage of the pipeline (`stages.STAGES`, in its
    order: the families, their folds, the graph passes), then clean up.

    Every call appends a `GraphReport` to `self.report`. `uuid()` covers every source file of
    the package, the kernel versions and the config, so Inductor's caches stay correct.
    """

    def __init__(self, config: FusionConfig | None = None, report: MatchReport | None = None):
        self.config = config or FusionConfig()
        self.report = report if report is not None else MatchReport()

    def __call__(self, graph: torch.fx.Graph) -> None:
        # A family or graph pass turned off has no sites, so none can be expected of it.
        off = self.config.sites_off()
        graph_report = GraphReport(
            graph_index=len(self.report.graphs),
            expected={family: dict(sites) for family, sites in self.config.expected.items() if family not in off},
            modules_in_graph=modules_in(graph),
            pipeline=self.pipeline(),
        )
        canonicalize_module.canonicalize(graph)
        # A dead node still counts as a user, and the matcher refuses a pattern node with users
        # outside the pattern: HF's ``core_attn_out[:, :, i] = o`` functionalises to a
        # select_scatter and leaves a dead select of the zeros behind.
        graph.eliminate_dead_code()
        # Sites are the model's nodes: a replacement's own nodes (the "inductor" lowering's
        # canonical norms, say) are never candidates for a later family.
        model_nodes = set(graph.nodes)
        for stage in STAGES:
            if not stage.enabled(self.config):
                continue
            if stage.kind == FAMILY:
                for family in self.families_for(stage.name):
                    graph_report.sites.extend(self._run(family, self.config.lowering(stage.name), graph, model_nodes))
            elif stage.kind == GRAPH_PASS:
                graph_report.sites.extend(stage_module(stage).run(graph, self.config))
            else:
                graph_report.stage_results[stage.name] = stage_module(stage).run(graph, self.config)
        graph_report.sites = _without_other_prologues(graph_report.sites, graph_report.expected)
        # Replacements can land before the nodes they read; sort before anything lints.
        _compat.stable_topological_sort(graph)
        graph.eliminate_dead_code()
        graph.lint()
        self.report.graphs.append(graph_report)
        self._log(graph_report)
        if self.config.strict:
            failure = strict_failure(graph_report, every_candidate=not self.config.expected)
            if failure:
                raise MissedSiteError(failure)

    def families_for(self, name: str) -> tuple[Family, ...]:
        """The Family objects run under one name (an integration adds its host's spellings)."""
        return (FAMILIES[name],)

    def pipeline(self) -> str:
        """Where this graph is being compiled, for the report; empty for our own backend."""
        return ""

    def _run(self, family: Family, lowering: str, graph: torch.fx.Graph, model_nodes: set) -> list[Site]:
        anchors = [(n, module_path(n)) for n in graph.nodes if n in model_nodes and family.is_site(n)]
        recorder = run_family(family, lowering, graph)
        if recorder.accepted:  # a replacement can land before a node it reads: sort for the next family
            _compat.stable_topological_sort(graph)
        sites = []
        for anchor, module in anchors:
            if getattr(anchor, "_erased", False):
                variant = recorder.accepted.get(anchor, "?")
                sites.append(Site(family.name, "matched", variant, module, anchor.name))
                continue
            sites.append(self._miss(family, lowering, anchor, module, recorder.declined.get(anchor)))
        return sites

    @staticmethod
    def _miss(family: Family, lowering: str, anchor, module, declined) -> Site:
        # The matcher binding q's and k's paths to one node is its own wrong try, not the model's
        # code: left out beside any other reason; alone, the family's explain speaks if it can.
        kept = [d for d in declined or () if not is_binding_artefact(d[1])]
        if declined and not kept:
            kept = [] if family.explain(anchor) is not None else declined
        declined = kept
        if declined:
            # A declined site matched in structure (its guard said no): the anchor stands for it,
            # and the guard's words are the reason; a variant traced for several dtypes declines
            # once per trace, so say each reason once.
            stopped = anchor
            reason = "; ".join(dict.fromkeys(f"{variant}: {why}" for variant, why in declined))
        else:
            where = family.explain(anchor) or failed_match_reason(family, lowering, anchor)
            stopped = where[0] if where else anchor
            reason = where[1] if where else (
                f"the model's code here is a {family.name} site (the {op_name(anchor.target)} at {anchor.name}) in "
                "a spelling none of the family's variants takes, at a step no check of the family names (--explain "
                "lists the nodes from the anchor)")  # fmt: skip
        return Site(family.name, "missed", None, module, anchor.name, reason, stopped.name, chain(anchor, stopped))

    def _log(self, graph_report: GraphReport) -> None:
        one = MatchReport([graph_report])
        where = f" ({graph_report.pipeline})" if graph_report.pipeline else ""
        log.info("graph %d%s: %s", graph_report.graph_index, where, one.summary())
        for line in one.fold_lines():
            log.info("  %s", line)
        for site in graph_report.missed():
            log.info("  miss %s at %s: %s", site.family, site.module, site.reason)
        for family, module, expected, found in graph_report.missing_expected():
            log.warning("expected %d %s at %s, fused %d", expected, family, module, found)

    def uuid(self) -> str:
        return pass_uuid(self.config)


def pass_uuid(config: FusionConfig, root: Path | None = None) -> str:
    """Every source file of the package (under ``root``, default this package), the kernel
    versions and what of the config changes the graph: whatever decides the rewritten graph is
    in one of them, so no compile cache (Inductor's FX-graph cache, vLLM's) serves a graph our
    pass would now rewrite differently."""
    from .. import kernels

    digest = hashlib.sha256()
    digest.update(config.cache_key().encode())
    digest.update(source_digest(Path(root) if root is not None else PACKAGE_ROOT).encode())
    for name, version in sorted(kernels.KERNEL_VERSIONS.items()):
        digest.update(f"{name}:{version}\n".encode())
    return digest.hexdigest()


PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def source_digest(root: Path) -> str:
    """sha256 over every ``*.py`` under ``root`` (its path relative to root, then its bytes), in
    path order. Read once per process and root."""
    digest = hashlib.sha256()
    for path in sorted(Path(root).rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def strict_failure(graph_report: GraphReport, every_candidate: bool) -> str | None:
    """Strict mode's message for a graph, or None: each expected site that did not fuse, or
    with ``every_candidate`` (no expected sites given) each candidate site that did not."""
    if every_candidate:
        misses = graph_report.missed()
        if not misses:
            return None
        lines = [f"strict mode: {len(misses)} candidate site(s) did not fuse (no expected sites were given, "
                 "so every candidate site is expected):"]
        lines += [f"  {s.family} at {s.module or '?'} ({s.anchor}): {s.reason} (stopped at {s.stopped_at})"
                  for s in misses]
        return "\n".join(lines)
    missing = graph_report.missing_expected()
    return _format_missing(graph_report, missing) if missing else None


def _format_missing(graph_report: GraphReport, missing) -> str:
    lines = [f"strict mode: {len(missing)} expected site(s) did not fuse:"]
    by_module = {s.module: s for s in graph_report.missed()}
    for family, module, expected, found in missing:
        miss = by_module.get(module)
        why = f" — {miss.reason} (stopped at {miss.stopped_at})" if miss else " — no candidate node found there"
        lines.append(f"  {family} at {module}: expected {expected}, fused {found}{why}")
    return "\n".join(lines)


# Both prologue families anchor on RoPE nodes, so each sees the other's attentions as candidates.
# Where the expectations say which family an attention is (model_adapters.base.attention_families:
# MLA's latent K/V or per-head K/V with q/k norms), the other family's candidates there are not
# sites of it: never reported as its misses. Without expectations, an attention whose K rows are
# written roped per head to a cache (a gqa_prologue site, fused or not) is GQA's: mla_prologue
# anchors on any rotation and would report its q and k RoPE as misses in its own variants' terms.
PROLOGUE_FAMILIES = ("gqa_prologue", "mla_prologue")


def _without_other_prologues(sites: list[Site], expected: dict) -> list[Site]:
    owner = {s.module: s.family for s in sites if s.family == "gqa_prologue" and s.module}
    owner.update({module: family for family in PROLOGUE_FAMILIES for module in expected.get(family, {})})
    return [s for s in sites
            if not (s.status == "missed" and s.family in PROLOGUE_FAMILIES and owner.get(s.module, s.family) != s.family)]

