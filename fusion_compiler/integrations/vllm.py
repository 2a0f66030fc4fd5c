"""fusion_compiler inside vLLM 0.33: our pass in vLLM's one slot for a third-party post-grad pass.

vLLM takes exactly one user pass: an `InductorPass` in
``CompilationConfig.inductor_compile_config["post_grad_custom_post_pass"]``. Its backend
(`VllmBackend.configure_post_pass`) adds it to `PostGradPassManager`, which runs it after
vLLM's own fusions and before vLLM lowers its IR ops, cleans up and defunctionalises. Three
ways to fill the slot:

- Python: ``CompilationConfig(use_inductor_graph_partition=True, inductor_compile_config=
  {"post_grad_custom_post_pass": VllmFusionPass(FusionConfig(...))})``.
- CLI: ``--compilation-config '{"use_inductor_graph_partition": true, "inductor_passes":
  {"post_grad_custom_post_pass": "fusion_compiler.vllm_pass"}}'``. vLLM resolves the string as
  ``__import__("fusion_compiler").__dict__["vllm_pass"]``, so the pass must be an attribute of
  the top-level package: the package sets it when vLLM is already loaded, and this module sets
  it on import. Its config comes from ``FUSION_COMPILER_VLLM_OPTIONS`` (FusionConfig fields as
  JSON), read once, at import.
- The ``vllm.general_plugins`` entry point `register`: with ``FUSION_COMPILER_VLLM=1`` every
  VllmConfig built afterwards gets `vllm_pass` in the slot (unless it already holds one of
  ours) and graph partition (`use_graph_partition`); unset or ``0``, it changes nothing.

Graph partition keeps vLLM's K/V cache update in the graph our pass sees (else a splitting op):
the K/V prologue (patterns/vllm_gqa_prologue.py) needs it, and without it reports each attention
layer as a miss saying so.

Never worse than stock: inside vLLM, a family replaces a site only where our op launches fewer
kernels on CUDA than Inductor emits for the same nodes (`never_worse`). vLLM lowers its
norms and RoPE to plain torch that Inductor fuses with their neighbours (q-norm, k-norm, RoPE
and the cos/sin gather in one kernel); our norm and RoPE ops would each launch one of their own.
So those sites stay with Inductor, and the report lists each with its reason (status
`LEFT`). With vLLM's K/V cache update absorbed (patterns/vllm_gqa_prologue.py), norms + RoPE +
the cache write are our one launch against Inductor's kernel plus vLLM's cache kernel: kept. A
family named in ``FusionConfig.families`` runs as asked, everywhere.

This module imports vLLM; the package itself imports it only when vLLM is already loaded.
"""

from __future__ import annotations

import dataclasses
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

from .. import _compat
from ..config import FusionConfig
from ..ops.launches import cuda_launches
from ..passes.fusion_pass import FusionPass, pass_uuid
from ..passes.report import GraphReport, MatchReport
from ..ops import gqa_prologue_vllm
from ..patterns import vllm_gdn, vllm_gqa_prologue, vllm_ir, vllm_rope
from ..patterns.registry import Family, Variant, source_text
from ..patterns.site import Site

log = logging.getLogger("fusion_compiler")

SLOT = "post_grad_custom_post_pass"
# vLLM's spellings, each run before the core family of its name.
VLLM_FAMILIES = (vllm_ir.FAMILY, vllm_rope.FAMILY, vllm_gqa_prologue.FAMILY)
# vLLM's GDN core + gated norm, rewritten by hand before the core gdn family (patterns/vllm_gdn.py).
GDN_CORE = "vllm::qwen_gdn_attention_core"
# Our ops that partition vLLM's graph wherever the vLLM op they replace does: their non-decode
# path calls it (ops/gdn_decode_vllm.py), so they must stay out of piecewise CUDA graphs as it does.
PARTITION_LIKE = {"fusion_compiler::gdn_decode_vllm": GDN_CORE}
ENABLE_ENV = "FUSION_COMPILER_VLLM"
OPTIONS_ENV = "FUSION_COMPILER_VLLM_OPTIONS"


# A Site status: a site a family matches, left to Inductor because Inductor emits no more
# kernels for it than our op launches.
LEFT = "left to Inductor"


@dataclasses.dataclass(frozen=True)
class InductorFuses:
    """A site Inductor lowers by itself: ``what`` in words, the kernels Inductor emits for its
    nodes on CUDA, and the op our replacement calls (its launches: ops/launches.py)."""

    what: str
    kernels: int
    op: str

    def reason(self) -> str | None:
        """Why the site stays with Inductor, or None where our op launches fewer kernels."""
        ours = cuda_launches(self.op)
        if ours < self.kernels:
            return None
        kernels = "one Inductor kernel" if self.kernels == 1 else f"{self.kernels} Inductor kernels"
        return (f"{LEFT}: {self.what} is {kernels}, fused with its neighbours' pointwise work; "
                f"ours would launch {ours} and fuse with nothing")  # fmt: skip


def _inductor_fuses(family: str, variant: Variant) -> InductorFuses | None:
    """What Inductor makes of a variant's nodes, where that is known to be few kernels: the
    norms, and RoPE without a cache write. A variant that absorbs what Inductor cannot fuse (a
    cache write, the GDN core, top-k, an FP8 quant, a GEMM) is not here: ours is fewer."""
    params = variant.params
    if params.get("fp8") or params.get("cache"):
        return None
    if family == "add_rms_norm":
        if params.get("residual"):
            return InductorFuses("an RMSNorm with its residual add", 1, "add_rms_norm")
        return InductorFuses("an RMSNorm", 1, "rms_norm")
    if family == "gated_rms_norm":
        return InductorFuses("a gated RMSNorm (norm, weight and silu gate)", 1, "gated_rms_norm")
    if family == "mla_prologue":
        op = "mla_kv_prologue" if params.get("site") in ("kv", "index_k") else "mla_q_prologue"
        return InductorFuses("RoPE with its cos/sin gather and no cache write", 1, op)
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class NeverWorse:
    """A family split by `never_worse`: ``kept`` (the variants that lower the launch count;
    None if none do) and, per variant left to Inductor, its reason."""

    kept: Family | None
    left: dict[str, str]


@functools.cache
def never_worse(family: Family) -> NeverWorse:
    """``family`` inside vLLM. Cached per Family object: the kept family is traced once."""
    left = {}
    for variant in family.variants:
        fuses = _inductor_fuses(family.name, variant)
        reason = fuses.reason() if fuses else None
        if reason:
            left[variant.name] = reason
    kept = tuple(v for v in family.variants if v.name not in left)
    if not left:
        return NeverWorse(family, {})
    return NeverWorse(dataclasses.replace(family, variants=kept) if kept else None, left)


class VllmMatchReport(MatchReport):
    """The match report of the vLLM route: also the sites left to Inductor, each with why."""

    def left(self, family: str | None = None) -> list[Site]:
        return [s for s in self.sites if s.status == LEFT and family in (None, s.family)]

    def summary(self) -> str:
        left = self.left()
        more = f"; {len(left)} sites left to Inductor (no more launches there than ours)" if left else ""
        return super().summary() + more

    def format(self) -> str:
        lines = [super().format()]
        lines += [f"  {s.reason} [{s.family} {s.variant} at {s.module or '?'} ({s.anchor})]" for s in self.left()]
        return "\n".join(lines)


class VllmFusionPass(FusionPass, InductorPass):
    """`FusionPass` as a vLLM `InductorPass`, matching vLLM's own spellings (patterns/vllm_ir.py,
    patterns/vllm_rope.py, patterns/vllm_gqa_prologue.py) before the core variants, and leaving
    to Inductor what it lowers in as few kernels (`never_worse`). Its report (``.report``, a
    `VllmMatchReport`) marks each graph with the vLLM version and compile range it was compiled
    for."""

    def __init__(self, config: FusionConfig | None = None, report: MatchReport | None = None):
        super().__init__(config, report if report is not None else VllmMatchReport())
        self._left_anchors: set[str] = set()  # anchors of the sites left in the graph being run

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._left_anchors = set()
        rewritten = vllm_ir.functionalize_maybe_inplace(graph)
        if rewritten:
            log.info("fusion_compiler: %d in-place vLLM IR norm call(s) made functional", rewritten)
        super().__call__(graph)
        self._report_kv_update_split()

    def _report_kv_update_split(self) -> None:
        """With vLLM's FX split at its K/V cache update no graph holds a K/V prologue site: each
        attention layer of the config is reported once as a miss, saying so."""
        from vllm.model_executor.layers.attention.attention import Attention

        update = gqa_prologue_vllm.KV_UPDATE
        if not splits_at(update) or any(s.anchor == update for s in self.report.sites):
            return
        for name in layers_of(Attention):
            self.report.graphs[-1].sites.append(
                Site("gqa_prologue", "missed", None, name, update, KV_SPLIT_REASON)
            )

    def families_for(self, name: str) -> tuple[Family, ...]:
        core = super().families_for(name)
        ours = tuple(f for f in VLLM_FAMILIES if f.name == name)
        return (*ours, *core)

    def _run(self, family: Family, lowering: str, graph: torch.fx.Graph, model_nodes: set) -> list[Site]:
        sites = []
        if family.name == vllm_gdn.FAMILY and lowering == "triton":
            sites = vllm_gdn.run(graph, model_nodes, split_layers=gdn_split_layers())
            if any(s.status == "matched" for s in sites):
                partition_like_replaced_ops()
        sites += self._never_worse_run(family, lowering, graph, model_nodes)
        # A node an earlier family (or spelling) left to Inductor as its site's anchor is no miss
        # of this one: the gated norm's rsqrt, say, is also a plain norm's anchor.
        sites = [s for s in sites if s.status != "missed" or s.anchor not in self._left_anchors]
        self._left_anchors.update(s.anchor for s in sites if s.status == LEFT)
        return sites

    def _never_worse_run(self, family: Family, lowering: str, graph: torch.fx.Graph, model_nodes: set) -> list[Site]:
        split = never_worse(family) if lowering == "triton" and family.name not in self.config.families else None
        if split is None or not split.left:
            return super()._run(family, lowering, graph, model_nodes)
        # What the whole family would take, found on a copy: the graph keeps the left sites' nodes.
        copy, copied = torch.fx.Graph(), {}
        copy.output(copy.graph_copy(graph, copied))
        _compat.graph_module_lazy(graph.owning_module, copy)  # the matcher needs the graph's module
        would = super()._run(family, lowering, copy, {copied[n] for n in model_nodes if n in copied})
        # The kept variants run on the graph only where they took a site on the copy (each
        # family traced is seconds of a compile).
        kept = split.kept and any(s.status == "matched" and s.variant not in split.left for s in would)
        took = {s.anchor: s for s in super()._run(split.kept, lowering, graph, model_nodes)} if kept else {}
        sites = []
        for site in would:
            real = took.get(site.anchor)
            if real is not None and real.status == "matched":
                sites.append(real)
            elif site.status == "matched" and site.variant in split.left:
                sites.append(dataclasses.replace(site, status=LEFT, reason=split.left[site.variant]))
            else:
                sites.append(real or site)
        return sites

    def _log(self, graph_report: GraphReport) -> None:
        super()._log(graph_report)
        for site in graph_report.sites:
            if site.status == LEFT:
                log.info("  %s at %s", site.reason, site.module)

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


def _compilation():
    """The CompilationConfig of the vLLM config being compiled."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().compilation_config


def splits_at(op: str) -> bool:
    """Whether vLLM splits its FX graph at ``op`` before Inductor, so no graph of ours holds the
    op beside its neighbours (with ``use_inductor_graph_partition`` it partitions after our pass)."""
    compilation = _compilation()
    return not compilation.use_inductor_graph_partition and op in (compilation.splitting_ops or ())


def layers_of(cls) -> list[str]:
    """The names of the config's layers of class ``cls`` (vLLM's static forward context)."""
    return [name for name, layer in _compilation().static_forward_context.items() if isinstance(layer, cls)]


def gdn_split_layers() -> tuple[str, ...]:
    """The model's GDN layers when vLLM splits its FX graph at their core, so no graph of ours
    holds the core and its gated norm together (they fuse with ``use_inductor_graph_partition``)."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    return tuple(layers_of(QwenGatedDeltaNetAttention)) if splits_at(GDN_CORE) else ()


def partition_like_replaced_ops() -> None:
    """Make `PARTITION_LIKE`'s ops Inductor partition points wherever the op each replaces is
    one. With ``use_inductor_graph_partition`` vLLM hands Inductor its splitting ops for the
    compile (`inductor_partition_rule_context`), which partitions after our pass, at codegen;
    the list is vLLM's to restore afterwards."""
    ops = list(torch._inductor.config.custom_should_partition_ops or ())
    ours = [op for op, theirs in PARTITION_LIKE.items() if theirs in ops and op not in ops]
    if ours:
        torch._inductor.config.custom_should_partition_ops = ops + ours


KV_SPLIT_REASON = (
    "vllm::unified_kv_cache_update is a splitting op (vLLM splits its graph there unless "
    "use_inductor_graph_partition is set), so no graph holds the K/V prologue: set "
    "use_inductor_graph_partition=True, or leave the update out of splitting_ops"
)


def use_graph_partition(compilation) -> None:
    """Turn ``use_inductor_graph_partition`` on where the user left it unset (vLLM's -O levels
    leave a set value alone). vLLM then partitions at codegen, after our pass, instead of splitting
    its FX graph before it: one graph holds the K/V cache update beside the q/k norms and RoPE (and
    the GDN core beside its gated norm). The CUDA-graph mode stays as configured; piecewise graphs
    become Inductor's partitions, split at attention, with the cache update captured inside them.
    At -O2 vLLM also turns on its MLA RoPE + cache fusion (``fuse_rope_kvcache_cat_mla``)."""
    if compilation.use_inductor_graph_partition is None:
        compilation.use_inductor_graph_partition = True
        log.info("fusion_compiler: use_inductor_graph_partition=True (the K/V prologue needs vLLM's cache update in "
                 "the graph); CUDA-graph mode unchanged, piecewise graphs are Inductor's partitions")  # fmt: skip
    elif not compilation.use_inductor_graph_partition:
        log.info("fusion_compiler: use_inductor_graph_partition=False as configured: %s", KV_SPLIT_REASON)


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
    """Fill the pass slot of every VllmConfig built from now on in this process, and turn graph
    partition on where the user left it unset (`use_graph_partition`). It happens at
    the config's construction because vLLM hashes the config (the pass's uuid included) into its
    compile-cache key before its backend reads the slot."""
    from vllm.config import VllmConfig

    post_init = VllmConfig.__post_init__
    if getattr(post_init, "_fills_fusion_compiler_slot", False):
        return

    @functools.wraps(post_init)
    def __post_init__(self) -> None:
        fill_slot(self.compilation_config.inductor_compile_config)
        use_graph_partition(self.compilation_config)
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
