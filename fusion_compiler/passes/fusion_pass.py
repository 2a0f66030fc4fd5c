"""FusionPass: the one post-grad pass that runs every enabled family in a fixed order."""

from __future__ import annotations

import hashlib
import inspect
import logging

import torch

from .. import _compat
from ..config import GRAPH_PASSES, FusionConfig
from ..patterns import FAMILIES
from ..patterns.registry import Family, failed_match_reason, run_family, source_text
from ..patterns import registry as registry_module
from . import canonicalize as canonicalize_module
from . import decode_attention as decode_attention_module
from . import dsa_topk_mask as dsa_topk_mask_module
from . import horizontal as horizontal_module
from . import merge_projections as merge_projections_module
from . import rope_gather as rope_gather_module
from . import tp_variance as tp_variance_module
from ..module_paths import module_path
from .explain import chain
from .horizontal import merge_prologues
from .merge_projections import merge_projections
from .rope_gather import fold_rope_gathers
from .tp_variance import fold_tp_variances
from .report import GraphReport, MatchReport, Site, modules_in

log = logging.getLogger("fusion_compiler")


# config.GRAPH_PASSES by name: each rewrites the graph and returns its sites, matched or missed.
GRAPH_PASS_RUNS = {
    "dsa_topk_mask": dsa_topk_mask_module.fuse_dsa_topk_masks,
    "decode_attention": decode_attention_module.fuse_decode_attention,
}
assert tuple(GRAPH_PASS_RUNS) == GRAPH_PASSES, "one run per config.GRAPH_PASSES entry, in its order"


class MissedSiteError(RuntimeError):
    """strict=True and an expected site did not fuse."""


class FusionPass(_compat.CustomGraphPass):
    """Canonicalise, then run each enabled family (order: `config.FAMILY_ORDER`), then clean up.

    Every call appends a `GraphReport` to `self.report`. `uuid()` covers pattern
    sources, kernel versions and the config, so Inductor's caches stay correct.
    """

    def __init__(self, config: FusionConfig | None = None, report: MatchReport | None = None):
        self.config = config or FusionConfig()
        self.report = report if report is not None else MatchReport()

    def __call__(self, graph: torch.fx.Graph) -> None:
        graph_report = GraphReport(
            graph_index=len(self.report.graphs),
            expected={family: dict(sites) for family, sites in self.config.expected.items()
                      if family not in self.config.disabled_graph_passes()},
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
        for family_name in self.config.enabled_families():
            for family in self.families_for(family_name):
                graph_report.sites.extend(self._run(family, self.config.lowering(family_name), graph, model_nodes))
        if self.config.horizontal_merge and self.config.lowering("mla_prologue") == "triton":
            graph_report.merged.extend(merge_prologues(graph))
        if self.config.lowering("gqa_prologue") == "triton":
            graph_report.folded_rope_gathers = fold_rope_gathers(graph, torch.ops.fusion_compiler.gqa_prologue.default)
            graph_report.folded_tp_divisions, graph_report.fused_tp_variances = fold_tp_variances(
                graph, torch.ops.fusion_compiler.gqa_prologue.default, torch.ops.fusion_compiler.gqa_prologue_variance.default
            )
        for name in GRAPH_PASSES:
            if getattr(self.config, name):
                graph_report.sites.extend(GRAPH_PASS_RUNS[name](graph))
        if self.config.merge_projections:
            graph_report.merged_projections, graph_report.skinny_projections = merge_projections(
                graph, ("cuda",) if self.config.skinny_gemm else ()
            )
        # Replacements can land before the nodes they read; sort before anything lints.
        _compat.stable_topological_sort(graph)
        graph.eliminate_dead_code()
        graph.lint()
        self.report.graphs.append(graph_report)
        self._log(graph_report)
        missing = graph_report.missing_expected()
        if missing and self.config.strict:
            raise MissedSiteError(_format_missing(graph_report, missing))

    def families_for(self, name: str) -> tuple[Family, ...]:
        """The Family objects run under one name (an integration adds its host's spellings)."""
        return (FAMILIES[name],)

    def pipeline(self) -> str:
        """Where this graph is being compiled, for the report; empty for our own backend."""
        return ""

    def _run(self, family: Family, lowering: str, graph: torch.fx.Graph, model_nodes: set) -> list[Site]:
        anchors = [(n, module_path(n)) for n in graph.nodes if n in model_nodes and family.is_site(n)]
        recorder = run_family(family, lowering, graph)
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
        if declined:
            # A declined site matched in structure (its guard said no): the anchor stands for it,
            # and the guard's words are the reason; a variant traced for several dtypes declines
            # once per trace, so say each reason once.
            stopped = anchor
            reason = "; ".join(dict.fromkeys(f"{variant}: {why}" for variant, why in declined))
        else:
            where = family.explain(anchor) or failed_match_reason(family, lowering, anchor)
            stopped = where[0] if where else anchor
            reason = where[1] if where else "no variant matched"
        return Site(family.name, "missed", None, module, anchor.name, reason, stopped.name, chain(anchor, stopped))

    def _log(self, graph_report: GraphReport) -> None:
        one = MatchReport([graph_report])
        where = f" ({graph_report.pipeline})" if graph_report.pipeline else ""
        log.info("fusion_compiler graph %d%s: %s", graph_report.graph_index, where, one.summary())
        for layer, kind, members in graph_report.merged:
            log.info("  merged %d %s-prologue sites of %s into one launch", members, kind, layer)
        if graph_report.merged_projections:
            log.info("  merged projections of one activation into one GEMM: groups of %s", graph_report.merged_projections)
        if graph_report.skinny_projections:
            log.info("  %d lone projection(s) on the skinny GEMM path at small M", graph_report.skinny_projections)
        if graph_report.folded_rope_gathers:
            log.info("  folded the RoPE table gather into %d gqa prologue(s)", graph_report.folded_rope_gathers)
        if graph_report.folded_tp_divisions:
            log.info("  folded the all-reduced variance division into %d gqa prologue(s), fused %d local-mean pair(s)",
                     graph_report.folded_tp_divisions, graph_report.fused_tp_variances)
        for site in graph_report.missed():
            log.info("  miss %s at %s: %s", site.family, site.module, site.reason)
        for family, module, expected, found in graph_report.missing_expected():
            log.warning("fusion_compiler: expected %d %s at %s, fused %d", expected, family, module, found)

    def uuid(self) -> str:
        return pass_uuid(self.config)


def pass_uuid(config: FusionConfig) -> str:
    digest = hashlib.sha256()
    digest.update(config.cache_key().encode())
    # What decides the rewritten graph besides the families' own sources: the matching contract
    # (registry: distinct inputs, scalar facts) and the rewrites outside the families.
    graph_pass_modules = [inspect.getmodule(run) for run in GRAPH_PASS_RUNS.values()]
    for module in (registry_module, canonicalize_module, horizontal_module, merge_projections_module, rope_gather_module,
                   tp_variance_module, *graph_pass_modules):  # fmt: skip
        digest.update(inspect.getsource(module).encode())
    from .. import kernels

    # The graph passes outside the families (a family's kernel version is hashed below).
    for name in (*GRAPH_PASSES, "merge_projections"):
        if getattr(config, name):
            digest.update(f"{name}:{kernels.KERNEL_VERSIONS.get(name, '')}".encode())
    for name in config.enabled_families():
        family = FAMILIES[name]
        digest.update(source_text(family).encode())
        for version in family_kernel_versions(family):
            digest.update(version.encode())
    return digest.hexdigest()


def family_kernel_versions(family: Family) -> list[str]:
    from .. import kernels

    return [f"{family.name}:{kernels.KERNEL_VERSIONS.get(family.name, 'none')}"]


def _format_missing(graph_report: GraphReport, missing) -> str:
    lines = [f"strict mode: {len(missing)} expected site(s) did not fuse:"]
    by_module = {s.module: s for s in graph_report.missed()}
    for family, module, expected, found in missing:
        miss = by_module.get(module)
        why = f" — {miss.reason} (stopped at {miss.stopped_at})" if miss else " — no candidate node found there"
        lines.append(f"  {family} at {module}: expected {expected}, fused {found}{why}")
    return "\n".join(lines)
