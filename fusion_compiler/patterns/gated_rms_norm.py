"""Gated RMSNorm, norm before gate: ``rms(x) · w · silu(z)`` -> ``gated_rms_norm``.

The output norm of Qwen3.5's (and Qwen3-Next's) Gated DeltaNet layers, per value head. Decode
through plain HF code fuses it inside the gdn family's site (it runs first); this family takes
the norm where the GDN core is not ours to fuse:

- inside vLLM 0.33, whose GDN core is the opaque ``vllm::qwen_gdn_attention_core``, while
  ``self.norm(core_attn_out, z)`` runs after it as plain aten ops (``RMSNormGated.forward_static``
  under ``custom_ops=["none"]``, the default with Inductor);
- HF's multi-token (prefill) path, whose chunked delta rule the gdn family does not take, or any
  graph compiled with the gdn family off.

Variants, most specific first (one search each, keyed on the math, not on module names):

- `vllm`: ``RMSNormGated.forward_static(norm_before_gate=True, group_size=None)``: x, w and z in
  fp32, ``x·rsqrt(mean(x²) + eps)·w·silu(z)``, one cast. Exactly the op's semantics.
- `hf`: ``Qwen3_5MoeRMSNormGated``: normalise in fp32, cast back, ``w · x`` in the activation
  dtype, times ``silu(z.float())``, cast. The op applies the weight in fp32: one bf16 rounding
  apart (as for HF's plain norms, ops/rms_norm.py).

Not this family, and left to others: the gate applied before the norm, ``rms(x · silu(z))``
(Mamba2's default; the plain norm after the gate fuses as add_rms_norm), and grouped norms
(``group_size`` < width: the mean is over a reshaped [.., g, d] view, which no variant spells).
A sigmoid gate is a candidate site reported with its reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..ops import rms_norm as rms_norm_ops
from . import add_rms_norm
from ..fx.graph_walk import is_sigmoid, is_silu
from .registry import Family, Reason, Variant

aten = torch.ops.aten
prims = torch.ops.prims


def vllm(x, gate, weight, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float() * F.silu(gate.float())).to(x.dtype)


def hf(x, gate, weight, eps):
    return (add_rms_norm.hf(x, weight, eps) * F.silu(gate.float())).to(x.dtype)


VARIANTS = (Variant("gated_rms_norm.vllm", vllm), Variant("gated_rms_norm.hf", hf))

DTYPE_COMBOS = add_rms_norm.DTYPE_COMBOS
_EPS_EXAMPLE = add_rms_norm._EPS_EXAMPLE


def example_inputs(variant: Variant, combo: tuple[torch.dtype, ...]) -> list:
    act, weight_dtype = combo
    return [torch.randn(4, 64, dtype=act), torch.randn(4, 64, dtype=act), torch.randn(64, dtype=weight_dtype), _EPS_EXAMPLE]


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    reason = add_rms_norm.norm_reason(values)
    if reason:
        return reason
    x, gate = values["x"], values["gate"]
    if not isinstance(gate, torch.Tensor) or gate.shape != x.shape:
        shape = tuple(gate.shape) if isinstance(gate, torch.Tensor) else gate
        return f"gate {shape} is not x's shape {tuple(x.shape)} (a broadcast gate is not fused)"
    if gate.dtype not in rms_norm_ops.SUPPORTED_DTYPES:
        return f"gate dtype {gate.dtype} is not bf16/fp16/fp32"
    return None


def replacement(variant: Variant, lowering: str):
    if lowering == "triton":
        norm = torch.ops.fusion_compiler.gated_rms_norm
    elif lowering == "inductor":
        norm = rms_norm_ops.gated_rms_norm_reference
    else:
        raise ValueError(f"no replacement for lowering {lowering!r}")

    def replace(x, gate, weight, eps):
        return norm(x, gate, weight, eps, 0.0, x.dtype)

    return replace


# What may sit between the normalisation and the gate's product: the weight's product and casts.
_BETWEEN = (aten.mul.Tensor, prims.convert_element_type.default)
_GATE_DEPTH = 5


def _gate_product(anchor: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(the product, its gate operand): the first mul after the norm, through muls and casts,
    whose other operand is a SiLU or a sigmoid."""
    frontier = [anchor]
    for _ in range(_GATE_DEPTH):
        frontier = [u for n in frontier for u in n.users if u.target in _BETWEEN]
        for node in frontier:
            if node.target is aten.mul.Tensor:
                gate = next((a for a in node.args if is_silu(a) or is_sigmoid(a)), None)
                if gate is not None:
                    return node, gate
    return None


def is_site(node: torch.fx.Node) -> bool:
    """An RMSNorm whose output is multiplied by an activated gate."""
    return add_rms_norm.is_site(node) and _gate_product(node) is not None


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    _, gate = _gate_product(anchor)
    if not is_silu(gate):
        return gate, f"the gate is a sigmoid ({gate.name}), not a SiLU: the fused op gates with silu(z)"
    return add_rms_norm.explain(anchor)


FAMILY = Family(
    name="gated_rms_norm",
    variants=VARIANTS,
    dtype_combos=DTYPE_COMBOS,
    example_inputs=example_inputs,
    scalars={"eps": _EPS_EXAMPLE},
    guard=guard,
    facts_of=add_rms_norm.facts_of,
    replacement=replacement,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, add_rms_norm.__name__, rms_norm_ops.__name__),
)
