"""FusionConfig: what the compiler fuses, how it lowers each family, and how loudly it fails."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from types import MappingProxyType

from .stages import FAMILY, GRAPH_PASS, STAGES, of_kind

# Families in the order the pass runs them (stages.STAGES says why that order).
FAMILY_ORDER: tuple[str, ...] = tuple(stage.name for stage in of_kind(FAMILY))

# Rewrites keyed on the graph alone, outside the families' pattern registry, in the order they
# run after the families; each is a bool field of FusionConfig of the same name. Their sites are
# reported like a family's, and may be expected.
GRAPH_PASSES: tuple[str, ...] = tuple(stage.name for stage in of_kind(GRAPH_PASS))

LOWERINGS: tuple[str, ...] = ("triton", "inductor", "off")
"""triton: our hand-written kernel; inductor: a canonical decomposition Inductor
fuses itself; off: the family does not run (its sites are not reported either)."""

FAMILY_LOWERINGS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {stage.name: tuple(lowering for lowering, _ in stage.lowerings) for stage in of_kind(FAMILY) if stage.lowerings}
)
"""Lowerings only some families have, on top of LOWERINGS (stages.STAGES: gdn's "fla", the
site's op on fla-core's kernels)."""


DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_SLOT_INPUTS: tuple[str, ...] = ("slots", "slot_mapping", "state_slots", "state_indices")


def lowerings_of(family: str) -> tuple[str, ...]:
    return LOWERINGS + FAMILY_LOWERINGS.get(family, ())


def _frozen(mapping: Mapping | None) -> Mapping:
    return MappingProxyType(dict(mapping or {}))


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    """What `fusion_compiler` does to a graph.

    families: family name -> lowering ("triton" | "inductor" | "off"; "gdn" also "fla").
        Families left out take `default_lowering`.
    strict: raise `MissedSiteError` when an expected site (see `expected`) did not fuse. With no
        `expected`, `fusion_compiler.compile` of an HF model expects its model adapter's sites,
        and any other route every candidate site of each graph.
    verify: on the first call of each compiled graph, run the graph eagerly on cloned
        inputs and raise `VerificationError`, naming the fused sites, if outputs or
        mutated inputs differ beyond `verify_rtol` (relative norm error).
    expected: family -> {module path: sites per forward}, as a model adapter derives it
        from the model's module tree. Gives the report its expected-vs-found columns. A path
        that names no module of the compiled model is an error (`UnknownModuleError`).
    inductor_cache: let Inductor's FX-graph cache serve compiled graphs. Off by default:
        a cache hit skips our pass, so that compile would have no match report.
    horizontal_merge: fold a layer's independent prologue sites
        (patterns/mla_prologue_horizontal.py) into one launch each side of the q_b GEMM
        (DeepSeek V3.2: 2 kernels instead of 5).
    merge_projections: GEMMs left after the families that read the same activation (q / k / v,
        a shared expert's gate / up, ...) become one GEMM over the concatenated weights
        (patterns/merge_projections.py; the concatenation is made once, on the first call). A
        weight cast to a wider float before its GEMM (``x @ w.float().t()``) is read in its
        stored dtype and widened in the GEMM, with no wider copy written each call.
    skinny_gemm: on CUDA, a projection left alone (o_proj, out_proj, a shared expert's down, ...)
        becomes the same op with one weight, and every such GEMM of at most
        ``kernels/skinny_gemm.MAX_TOKENS`` rows runs our skinny GEMM kernel (one launch that
        streams the weight) instead of cuBLAS's split-K GEMM + reduce; larger M runs torch.mm.
    decode_attention: a single-query SDPA over HF's ``repeat_kv`` of a K/V cache reads the cache
        itself, once for all query heads of a K/V head (patterns/decode_attention.py).
    dsa_topk_mask: DeepSeek V3.2's DSA indexer scores, top-k and the scatter of its indices into
        the attention mask become one op (patterns/dsa_topk_mask.py: a score kernel and a radix
        select, no sort).
    moe_experts: a MoE layer's routed experts as HF writes them (``grouped_mm`` or
        ``batched_mm``), from the routing's (weights, ids) to the weighted combine, become one op
        (patterns/moe_experts.py): on CUDA, GEMV-style kernels up to 8 tokens, above them a
        grouped kernel that reads each touched expert once.
    cudagraphs: replay each graph compiled for CUDA inputs from one CUDA graph per batch
        bucket (cudagraph.py); no effect on CPU.
    cudagraph_buckets: the batch sizes captured; a batch runs in the smallest bucket that holds
        it (rows padded with slot -1), above the largest uncaptured.
    cudagraph_slot_inputs: names of the step's slot-mapping arguments, padded with -1.
    """

    families: Mapping[str, str] = dataclasses.field(default_factory=dict)
    default_lowering: str = "triton"
    strict: bool = False
    verify: bool = False
    verify_rtol: float = 2e-2
    expected: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    inductor_cache: bool = False
    horizontal_merge: bool = True
    merge_projections: bool = True
    skinny_gemm: bool = True
    decode_attention: bool = True
    dsa_topk_mask: bool = True
    moe_experts: bool = True
    cudagraphs: bool = True
    cudagraph_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    cudagraph_slot_inputs: tuple[str, ...] = DEFAULT_SLOT_INPUTS

    def __post_init__(self) -> None:
        unknown = sorted(set(self.families) - set(FAMILY_ORDER))
        if unknown:
            raise ValueError(f"unknown fusion families {unknown}; known: {list(FAMILY_ORDER)}")
        if self.default_lowering not in LOWERINGS:
            raise ValueError(f"default_lowering {self.default_lowering!r} is not one of {list(LOWERINGS)}")
        for family, lowering in self.families.items():
            if lowering not in lowerings_of(family):
                raise ValueError(
                    f"family {family!r}: lowering {lowering!r} is not one of {list(lowerings_of(family))}"
                )
        unknown_expected = sorted(set(self.expected) - set(FAMILY_ORDER) - set(GRAPH_PASSES))
        if unknown_expected:
            raise ValueError(f"expected sites given for unknown families {unknown_expected}")
        buckets = tuple(self.cudagraph_buckets)
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"cudagraph_buckets must be positive ints, got {self.cudagraph_buckets!r}")
        object.__setattr__(self, "cudagraph_buckets", tuple(sorted(set(buckets))))
        object.__setattr__(self, "cudagraph_slot_inputs", tuple(n.lower() for n in self.cudagraph_slot_inputs))
        if not (0 < self.verify_rtol < 1):
            raise ValueError(f"verify_rtol must be in (0, 1), got {self.verify_rtol}")
        object.__setattr__(self, "families", _frozen(self.families))
        object.__setattr__(
            self, "expected", _frozen({f: _frozen(s) for f, s in self.expected.items()})
        )

    def lowering(self, family: str) -> str:
        return self.families.get(family, self.default_lowering)

    def sites_off(self) -> frozenset[str]:
        """The families and graph passes this config turns off: they report no sites, so none
        can be expected of them."""
        return frozenset(s.name for s in STAGES if s.kind in (FAMILY, GRAPH_PASS) and not s.enabled(self))

    def __reduce__(self):
        # MappingProxyType neither pickles nor deep-copies, and vLLM does both to its inductor
        # config (our pass and this config inside it): a deep copy per backend, a pickle per
        # worker process.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["families"] = dict(self.families)
        fields["expected"] = {family: dict(sites) for family, sites in self.expected.items()}
        return (_config_from_fields, (fields,))

    def cache_key(self) -> str:
        """What of the config changes the compiled graph (expectations and verify do not)."""
        key = {f: self.lowering(f) for f in FAMILY_ORDER}
        for stage in STAGES:
            key.update({name: getattr(self, name) for name in (stage.flag, *stage.options) if name})
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _config_from_fields(fields: dict) -> FusionConfig:
    return FusionConfig(**fields)
