"""The match report: what fused where, what was expected, and why each miss missed."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Any

import torch

from ..fx.module_paths import layer_of, normalize_module_path
from ..patterns.site import Site
from ..stages import FOLD, of_kind, stage_module

@dataclasses.dataclass
class GraphReport:
    graph_index: int
    sites: list[Site] = dataclasses.field(default_factory=list)
    expected: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    modules_in_graph: set[str] = dataclasses.field(default_factory=set)
    # What each fold (stages.STAGES, kind "fold") reported for this graph, by stage name: e.g.
    # {"gqa_prologue_rope_gather": {"folded_rope_gathers": 2}}; the names are the stage module's RESULTS.
    stage_results: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # Where the graph was compiled when not by our own backend, e.g. "vllm 0.33.0, compile
    # range [1, 8]" (integrations/vllm.py); empty for our backend.
    pipeline: str = ""
    # The graph_index of the compiled graph this entry reports again, for another module it ran
    # for (backend.SharedFrameGraph: one graph compiled in layer 0's MoE block runs for every
    # layer's); None for a graph compiled.
    runs: int | None = None

    def run_for(self, own: str, other: str, graph_index: int) -> GraphReport:
        """This graph's sites, as it ran for module `other`: paths under `own` moved there."""
        def moved(path):
            return other + path[len(own):] if path and (path == own or path.startswith(own + ".")) else path

        return GraphReport(graph_index, [dataclasses.replace(s, module=moved(s.module)) for s in self.sites],
                           self.expected, {moved(m) for m in self.modules_in_graph}, pipeline=self.pipeline,
                           runs=self.graph_index)  # fmt: skip

    def matched(self, family: str | None = None) -> list[Site]:
        return [s for s in self.sites if s.status == "matched" and family in (None, s.family)]

    def missed(self, family: str | None = None) -> list[Site]:
        return [s for s in self.sites if s.status == "missed" and family in (None, s.family)]

    def missing_expected(self) -> list[tuple[str, str, int, int]]:
        """(family, module, expected, found) for expected modules this graph holds but did not fuse."""
        out = []
        for family, per_module in self.expected.items():
            found = Counter(s.module for s in self.matched(family))
            for module, count in per_module.items():
                if module in self.modules_in_graph and found[module] < count:
                    out.append((family, module, count, found[module]))
        return out


@dataclasses.dataclass
class MatchReport:
    """All graphs one backend compiled. Counts are summed over graphs.

    ``step_graphs``: the CUDA-graph wrapper of each graph compiled for CUDA inputs, in compile
    order (the backend's ``cudagraph.StepGraphs``; read only through their ``report()`` dict),
    so the report says what ran captured and what did not."""

    graphs: list[GraphReport] = dataclasses.field(default_factory=list)
    step_graphs: list = dataclasses.field(default_factory=list)

    @property
    def sites(self) -> list[Site]:
        return [s for g in self.graphs for s in g.sites]

    def count(self, family: str | None = None, variant: str | None = None) -> int:
        return sum(
            1
            for s in self.sites
            if s.status == "matched" and family in (None, s.family) and variant in (None, s.variant)
        )

    def per_variant(self) -> dict[str, int]:
        return dict(Counter(s.variant for s in self.sites if s.status == "matched"))

    def per_layer(self, family: str) -> dict[int | None, int]:
        return dict(Counter(s.layer for s in self.sites if s.status == "matched" and s.family == family))

    def per_module(self, family: str) -> dict[str | None, int]:
        return dict(Counter(s.module for s in self.sites if s.status == "matched" and s.family == family))

    def misses(self, family: str | None = None) -> list[Site]:
        return [s for s in self.sites if s.status == "missed" and family in (None, s.family)]

    def expected_per_layer(self, family: str) -> dict[int | None, int]:
        out: dict[int | None, int] = defaultdict(int)
        modules = {}
        for g in self.graphs:
            modules.update(g.expected.get(family, {}))
        for module, count in modules.items():
            out[layer_of(module)] += count
        return dict(out)

    def missing_expected(self) -> list[tuple[str, str, int, int]]:
        return [m for g in self.graphs for m in g.missing_expected()]

    def unseen_expected(self) -> list[tuple[str, str, int]]:
        """(family, module, expected) for expected modules that no compiled graph ran: a module
        that ran outside the compiled graphs (a graph break), or a path that names no module."""
        seen = set().union(*(g.modules_in_graph for g in self.graphs)) if self.graphs else set()
        out = {}
        for g in self.graphs:
            for family, per_module in g.expected.items():
                for module, count in per_module.items():
                    if module not in seen:
                        out[(family, module)] = count
        return [(family, module, count) for (family, module), count in out.items()]

    def cuda_graphs(self) -> list[dict]:
        """Each step graph's own report: graphs captured, calls that ran uncaptured, any
        capture error (cudagraph.StepGraphs.report)."""
        return [g.report() for g in self.step_graphs]

    def summary(self) -> str:
        fams = sorted({s.family for s in self.sites})
        parts = []
        for family in fams:
            found = self.count(family)
            total = sum(1 for s in self.sites if s.family == family)
            parts.append(f"{family} {found}/{total} sites fused")
        missing = self.missing_expected()
        if missing:
            parts.append(f"{len(missing)} expected modules not fused")
        unseen = self.unseen_expected()
        if unseen:
            parts.append(f"{len(unseen)} expected modules in no compiled graph")
        return "; ".join(parts) or "no candidate sites"

    def stage_results(self) -> dict[str, dict[str, Any]]:
        """Each fold's results (stages.STAGES) summed over graphs, counts added and lists joined;
        a fold that did not run reports its empty results."""
        out = {}
        for stage in of_kind(FOLD):
            totals = dict(stage_module(stage).RESULTS)
            for g in self.graphs:
                for key, value in g.stage_results.get(stage.name, {}).items():
                    totals[key] = totals[key] + value
            out[stage.name] = totals
        return out

    def total(self, key: str) -> Any:
        """One fold result (a name in some fold's RESULTS), summed over graphs."""
        return next(results[key] for results in self.stage_results().values() if key in results)

    def fold_lines(self) -> list[str]:
        """The report's lines for the folds' results, in pipeline order."""
        return [line for stage, results in zip(of_kind(FOLD), self.stage_results().values())
                for line in stage_module(stage).describe(results)]

    # Named reads of the fold results callers use (inspect, tests).
    def merges(self) -> list[tuple[str, str, int]]:
        """(layer, op kind, sites folded) of every launch the horizontal merge built."""
        return [(m["layer"], m["kind"], m["sites"]) for m in self.total("merged_launches")]

    def folded_rope_gathers(self) -> int:
        return self.total("folded_rope_gathers")

    def merged_projections(self) -> list[int]:
        return self.total("merged_projections")

    def skinny_projections(self) -> int:
        return self.total("skinny_projections")

    def folded_tp_divisions(self) -> int:
        return self.total("folded_tp_divisions")

    def fused_tp_variances(self) -> int:
        return self.total("fused_tp_variances")

    def to_dict(self) -> dict:
        return {
            "graphs": sum(g.runs is None for g in self.graphs),  # compiled; not the runs for other modules
            "pipelines": [g.pipeline for g in self.graphs],
            **{key: value for results in self.stage_results().values() for key, value in results.items()},
            "matches": self.per_variant(),
            "sites": [dataclasses.asdict(s) | {"layer": s.layer} for s in self.sites],
            "missing_expected": [
                {"family": f, "module": m, "expected": e, "found": n} for f, m, e, n in self.missing_expected()
            ],
            "unseen_expected": [{"family": f, "module": m, "expected": e} for f, m, e in self.unseen_expected()],
            "cuda_graphs": self.cuda_graphs(),
        }

    def format(self) -> str:
        lines = [self.summary()]
        lines += [f"  {line}" for line in self.fold_lines()]
        for g in self.graphs:
            if g.pipeline:
                fused = ", ".join(f"{n} {v}" for v, n in Counter(s.variant for s in g.matched()).items()) or "nothing"
                lines.append(f"  graph {g.graph_index} inside {g.pipeline}: fused {fused}")
        for s in self.misses():
            lines.append(f"  miss {s.family} at {s.module or '?'} ({s.anchor}): {s.reason} [stopped at {s.stopped_at}]")
        for family, module, expected, found in self.missing_expected():
            lines.append(f"  expected {expected} {family} at {module}, fused {found}")
        for family, module, expected in self.unseen_expected():
            lines.append(f"  expected {expected} {family} at {module}: no compiled graph ran this module")
        lines += [f"  {_cuda_graph_line(r)}" for r in self.cuda_graphs()]
        return "\n".join(lines)


def _cuda_graph_line(report: dict) -> str:
    """One step graph's CUDA-graph figures in words (keys of cudagraph.StepGraphs.report)."""
    nodes_by_rows = report.get("kernel_nodes_by_rows", {})
    rows = ", ".join(f"{rows} rows: {nodes} kernel nodes" for rows, nodes in nodes_by_rows.items())
    line = (f"{report.get('name', 'graph')}: {report.get('graphs', 0)} CUDA graph(s) captured"
            f"{f' ({rows})' if rows else ''}; calls: {report.get('warmup_calls', 0)} warm-up, "
            f"{report.get('replays', 0)} replayed, {report.get('uncaptured_calls', 0)} uncaptured")
    if report.get("capture_error"):
        line += f"; capture failed: {report['capture_error']}"
    return line


def modules_in(graph: torch.fx.Graph) -> set[str]:
    """Every module path (and its parents) that some node of the graph came from."""
    seen: set[str] = set()
    for node in graph.nodes:
        for raw, _ in (node.meta.get("nn_module_stack") or {}).values():
            seen.add(normalize_module_path(raw))
    return seen

