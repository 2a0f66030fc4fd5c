"""The pipeline: every stage `FusionPass` runs, in the order it runs them, in one table.

One row per stage: its name, its kind, its gate (what of `FusionConfig` turns it on), the module
that runs it, and the kernel modules whose ``KERNEL_VERSION``s it runs. Everything else is
derived from this table: ``config.FAMILY_ORDER`` and ``GRAPH_PASSES``, ``patterns.FAMILIES``,
``kernels._KERNEL_MODULES``, the report's per-stage results, and the order of the pass.

This module imports nothing but the standard library: ``config.py`` and ``kernels/`` read it,
and kernels import no graph code. A stage's module is named by its path under
``fusion_compiler`` and imported only when the pass runs it (`stage_module`).

Kinds, and what a stage's module provides:

- ``family``: ``FAMILY``, a ``patterns.registry.Family`` (search variants, guards, replacement).
  On unless ``FusionConfig.families[name]`` is ``"off"``. It reports a site per candidate.
- ``graph_pass``: ``run(graph, config) -> list[Site]``, a rewrite written by hand, keyed on the
  graph, that reports its sites like a family (they may be expected). On while the bool
  ``FusionConfig`` field of its name is set.
- ``fold``: ``run(graph, config) -> dict``, a rewrite of what earlier stages left (a merge of
  launches, a gather or division folded into an op). It reports counts, not sites: ``RESULTS``
  (each result's name and its empty value, ``0`` or ``[]``) and ``describe(results)`` (the
  report's lines for them, summed over graphs). On while its flag is set and, for a family's
  fold, while that family lowers to the kernels the fold knows (``needs``).

Adding a family is one row here plus its own files (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import dataclasses
import importlib

FAMILY = "family"
GRAPH_PASS = "graph_pass"
FOLD = "fold"


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    kind: str  # FAMILY | GRAPH_PASS | FOLD
    module: str  # under fusion_compiler, e.g. "patterns.gdn"
    kernels: tuple[str, ...] = ()  # modules of kernels/ whose KERNEL_VERSIONs the stage runs
    flag: str | None = None  # a bool field of FusionConfig that must be set
    needs: tuple[str, str] | None = None  # (family, lowering) the stage works on (a family's fold)
    options: tuple[str, ...] = ()  # other FusionConfig fields the stage reads (they key the cache)
    lowerings: tuple[tuple[str, tuple[str, ...]], ...] = ()  # a family's own lowerings, with their kernels

    def enabled(self, config) -> bool:
        if self.kind == FAMILY:
            return config.lowering(self.name) != "off"
        on = self.flag is None or bool(getattr(config, self.flag))
        return on and (self.needs is None or config.lowering(self.needs[0]) == self.needs[1])

    @property
    def gate(self) -> str:
        """What turns the stage on, in FusionConfig's terms (its fields, its ``lowering()``)."""
        if self.kind == FAMILY:
            return f'lowering("{self.name}") != "off"'
        parts = [self.flag] if self.flag else []
        if self.needs:
            parts.append(f'lowering("{self.needs[0]}") == "{self.needs[1]}"')
        return " and ".join(parts)


STAGES: tuple[Stage, ...] = (
    # Families. Bigger fusions go before "add_rms_norm": they take their norms, and the norm
    # family gets what is left. "gqa_prologue" goes before "mla_prologue": both anchor on RoPE,
    # and a GQA site's RoPEs are not MLA candidates. "gdn" takes the Qwen3.5 gated norm
    # (rms(o) * w * silu(z)) that ends each GDN site; "gated_rms_norm" takes that norm where no
    # GDN site does (vLLM's opaque GDN core, HF's prefill).
    Stage("gqa_prologue", FAMILY, "patterns.gqa_prologue", ("gqa_prologue",)),
    Stage("mla_prologue", FAMILY, "patterns.mla_prologue", ("mla_kv_prologue", "mla_q_prologue")),
    Stage("moe_routing", FAMILY, "patterns.moe_routing", ("moe_route",)),
    # "fla": the site's op on fla-core's kernels (kernels/gdn_fla.py; needs `pip install fla-core`).
    Stage("gdn", FAMILY, "patterns.gdn", ("gdn_decode",), lowerings=(("fla", ("gdn_fla",)),)),
    Stage("gated_rms_norm", FAMILY, "patterns.gated_rms_norm", ("rms_norm",)),  # the same kernel, gated
    Stage("add_rms_norm", FAMILY, "patterns.add_rms_norm", ("rms_norm",)),
    # The prologue families' folds, on the ops their Triton lowering leaves.
    Stage("mla_prologue_horizontal", FOLD, "patterns.mla_prologue_horizontal", ("mla_kv_prologue", "mla_q_prologue"),
          flag="horizontal_merge", needs=("mla_prologue", "triton")),
    Stage("gqa_prologue_rope_gather", FOLD, "patterns.gqa_prologue_rope_gather", ("gqa_prologue",), needs=("gqa_prologue", "triton")),
    Stage("gqa_prologue_tp_variance", FOLD, "patterns.gqa_prologue_tp_variance", ("gqa_prologue",), needs=("gqa_prologue", "triton")),
    # Rewrites keyed on the graph alone, outside the families' pattern registry.
    Stage("dsa_topk_mask", GRAPH_PASS, "patterns.dsa_topk_mask", ("dsa_topk_mask",), flag="dsa_topk_mask"),
    Stage("decode_attention", GRAPH_PASS, "patterns.decode_attention", ("decode_attention",), flag="decode_attention"),
    # After moe_routing: the experts take the routing op's (weights, ids).
    Stage("moe_experts", GRAPH_PASS, "patterns.moe_experts", ("moe_experts", "moe_experts_grouped"), flag="moe_experts"),
    # Last: GEMMs that no family took. skinny_gemm: a lone projection's small-M path.
    Stage("merge_projections", FOLD, "patterns.merge_projections", ("skinny_gemm",),
          flag="merge_projections", options=("skinny_gemm",)),
)  # fmt: skip


def of_kind(kind: str) -> tuple[Stage, ...]:
    return tuple(stage for stage in STAGES if stage.kind == kind)


def stage_module(stage: Stage):
    """The module that runs ``stage`` (imported on first use)."""
    return importlib.import_module(f"fusion_compiler.{stage.module}")


def table() -> str:
    """The stage table as markdown (docs/ARCHITECTURE.md pastes it)."""
    lines = ["| # | stage | kind | gate (FusionConfig) | runs | kernels |", "|---|---|---|---|---|---|"]
    for i, stage in enumerate(STAGES, 1):
        runs = "FAMILY" if stage.kind == FAMILY else "run"
        kernels = ", ".join(stage.kernels) + "".join(
            f"; {lowering}: {', '.join(mods)}" for lowering, mods in stage.lowerings
        )
        lines.append(f"| {i} | {stage.name} | {stage.kind} | `{stage.gate}` | "
                     f"`{stage.module.replace('.', '/')}.py` `{runs}` | {kernels} |")
    return "\n".join(lines)


assert len({s.name for s in STAGES}) == len(STAGES), "stage names are unique"
