"""Residual add + RMSNorm: the first fusion family.

Variants are the ways real code writes RMSNorm:
- `hf`: HF transformers' LlamaRMSNorm family (DeepSeek V3.2, MiniMax-M2.5, Qwen3.5's gated
  norm): normalise in fp32, cast back, then `weight * x` (or `x * weight`).
- `torch`: `torch.nn.functional.rms_norm` / `nn.RMSNorm` as torch decomposes them:
  `x * rstd * weight` in fp32, then one cast.
- `gemma`: Qwen3.5's `x·(1 + w)` norm, in fp32, then one cast.

Each comes with and without the residual add; with it, the add and its sum belong to
the site (the fused op returns the sum for the next residual).

Until later families exist this family matches every RMSNorm, q/k norms and MLA
q_a/kv_a norms included; later families run before it and take their norms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import _compat
from ..fx.graph_walk import RESHAPES as _RESHAPES, is_silu, target, val_shape
from ..fx.module_paths import module_path
from ..ops import mla_kv_prologue as kv_ops
from ..ops import rms_norm as rms_norm_ops
from . import prologue_calls
from .prologue_calls import kv_prologue
from .registry import Family, Reason, Variant
from .spellings import FP8, act_quant

aten = torch.ops.aten

# A value no real model uses, so the tracer can tell eps apart from the other literals.
_EPS_EXAMPLE = 1.2345e-6


def _normalize(h32: torch.Tensor, eps: float) -> torch.Tensor:
    return h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)


def hf(x, weight, eps):
    return weight * _normalize(x.to(torch.float32), eps).to(x.dtype)


def hf_weight_last(x, weight, eps):
    return _normalize(x.to(torch.float32), eps).to(x.dtype) * weight


def torch_functional(x, weight, eps):
    return (_normalize(x.to(torch.float32), eps) * weight).to(x.dtype)


def deepseek(x, weight, eps):
    """DeepSeek's inference ``RMSNorm``: fp32 weight times the fp32 normalised x, one rounding."""
    return (weight * _normalize(x.to(torch.float32), eps)).to(x.dtype)


def gemma(x, weight, eps):
    return (_normalize(x.to(torch.float32), eps) * (1.0 + weight.float())).to(x.dtype)


def _with_residual(norm):
    def search(x, residual, weight, eps):
        total = x + residual
        return norm(total, weight, eps), total

    search.__name__ = f"add_{norm.__name__}"
    return search


# Most specific first: `torch`'s weight argument would also match Gemma's `(1 + w)` node.
_NORMS = {
    "gemma": (gemma, 1.0),
    "hf": (hf, 0.0),
    "hf_weight_last": (hf_weight_last, 0.0),
    "torch": (torch_functional, 0.0),
    "deepseek": (deepseek, 0.0),
}


def _with_fp8_quant(norm, ue8m0: bool):
    """The norm feeding an FP8 GEMM: DeepSeek's act_quant (group 128) of its output."""

    def search(x, weight, eps):
        return act_quant(norm(x, weight, eps), FP8_GROUP, ue8m0)

    search.__name__ = f"{norm.__name__}_fp8{'_ue8m0' if ue8m0 else ''}"
    return search


FP8_GROUP = 128

# Most specific first: a norm followed by an FP8 quant is one site, and where both could
# match, the residual add belongs to the site.
VARIANTS = tuple(
    Variant(f"rms_norm_fp8{'_ue8m0' if ue8m0 else ''}.{name}", _with_fp8_quant(fn, ue8m0),
            {"weight_offset": offset, "residual": False, "fp8": True, "ue8m0": ue8m0})
    for ue8m0 in (True, False)
    for name, (fn, offset) in _NORMS.items()
    if name in ("deepseek", "torch")
) + tuple(
    Variant(f"add_rms_norm.{name}", _with_residual(fn), {"weight_offset": offset, "residual": True, "fp8": False})
    for name, (fn, offset) in _NORMS.items()
) + tuple(
    Variant(f"rms_norm.{name}", fn, {"weight_offset": offset, "residual": False, "fp8": False})
    for name, (fn, offset) in _NORMS.items()
)  # fmt: skip

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DTYPE_COMBOS = tuple((act, w) for act in _ACT_DTYPES for w in (act, torch.float32))


def example_inputs(variant: Variant, combo: tuple[torch.dtype, ...]) -> list:
    act, weight_dtype = combo
    x = torch.randn(4, 256, dtype=act)
    weight = torch.randn(256, dtype=weight_dtype)
    if variant.params["residual"]:
        return [x, torch.randn(4, 256, dtype=act), weight, _EPS_EXAMPLE]
    return [x, weight, _EPS_EXAMPLE]


def _out_dtype(variant: Variant, x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # HF multiplies the bf16-cast activation by the weight, so an fp32 weight promotes
    # the output to fp32; the other variants cast once, at the end, to x's dtype.
    if variant.name.endswith((".hf", ".hf_weight_last")):
        return torch.promote_types(x.dtype, weight.dtype)
    return x.dtype


def norm_reason(values: Mapping[str, Any]) -> Reason:
    """Why the norm itself (eps, x, weight) cannot be fused; shared with the gated norm."""
    eps = values["eps"]
    if not isinstance(eps, (float, int)) or isinstance(eps, bool):
        # Also what happens when Dynamo unspecialises a float attribute after a recompile
        # (automatic dynamic): eps arrives as a 0-d tensor input.
        return f"eps is a tensor, not a Python number (got {eps}); the fused op takes eps as a constant"
    if not eps > 0:
        return f"eps={eps} is not positive"
    x, weight = values["x"], values["weight"]
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "x or weight has no tensor metadata"
    if x.dtype not in _ACT_DTYPES:
        return f"activation dtype {x.dtype} is not one of bf16/fp16/fp32"
    if values.get("x_is_upcast"):
        # Fusing from here would skip the site's own roundings to bf16; the variant traced
        # for the real activation dtype takes the whole site instead.
        return "x is an fp32 upcast of a bf16/fp16 tensor (the fp32 trace of this variant matched past the cast)"
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return f"weight shape {tuple(weight.shape)} is not [{x.shape[-1]}] (the normalised dim)"
    return None


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    reason = norm_reason(values)
    if reason:
        return reason
    x = values["x"]
    if variant.params["fp8"]:
        if FP8 not in values["casts"]:
            return f"the quant casts to {sorted(map(str, values['casts']))}, not float8_e4m3fn"
        if values["quant_groups"] != {FP8_GROUP} or x.shape[-1] % FP8_GROUP:
            return f"quant groups {sorted(values['quant_groups'])} over width {x.shape[-1]}; the fused quant does {FP8_GROUP}"
    if variant.params["residual"]:
        residual = values["residual"]
        if residual.shape != x.shape or residual.dtype != x.dtype:
            return (
                f"residual {tuple(residual.shape)} {residual.dtype} does not equal "
                f"x {tuple(x.shape)} {x.dtype} (broadcasting or promoting adds are not fused)"
            )
    return None


def replacement(variant: Variant, lowering: str):
    offset = variant.params["weight_offset"]
    if lowering == "triton":
        norm, add_norm = torch.ops.fusion_compiler.rms_norm, torch.ops.fusion_compiler.add_rms_norm
    elif lowering == "inductor":
        norm, add_norm = rms_norm_ops.rms_norm_reference, rms_norm_ops.add_rms_norm_reference
    else:
        raise ValueError(f"no replacement for lowering {lowering!r}")

    if variant.params["fp8"]:
        return _fp8_replacement(variant, lowering)

    if variant.params["residual"]:

        def replace_add_norm(x, residual, weight, eps):
            out, total = add_norm(x, residual, weight, eps, offset, _out_dtype(variant, x, weight))
            return out, total

        return replace_add_norm

    def replace_norm(x, weight, eps):
        return norm(x, weight, eps, offset, _out_dtype(variant, x, weight))

    return replace_norm


def _fp8_replacement(variant: Variant, lowering: str):
    ue8m0 = variant.params["ue8m0"]

    def replace_norm_fp8(x, weight, eps):
        # The q role of mla_kv_prologue is exactly RMSNorm + FP8 group quant; using it lets the
        # horizontal merge fold this norm into its layer's prologue launch. Lowering
        # "inductor" takes the op's canonical decomposition instead.
        width = x.shape[-1]
        kwargs = {"q_c": x.reshape(-1, width), "q_weight": weight, "q_eps": eps,
                  "q_quant_group": FP8_GROUP, "q_ue8m0": ue8m0,
                  "round_before_quant": not _compat.JOINT_GRAPH_DROPS_ROUND_TRIPS}  # fmt: skip
        out = kv_prologue(lowering, **kwargs)
        return out[0].view(x.shape), out[1].view(*x.shape[:-1], width // FP8_GROUP)

    return replace_norm_fp8


def _is_upcast(node) -> bool:
    """x is ``x16.to(float32)``: a variant traced for fp32 activations has matched past the
    upcast of a bf16/fp16 site (its own ``.to(float32)`` is a no-op)."""
    if not (isinstance(node, torch.fx.Node) and node.target is torch.ops.prims.convert_element_type.default):
        return False
    source = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return node.args[1] == torch.float32 and source is not None and source.dtype in (torch.bfloat16, torch.float16)


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """eps: the addend beside the mean under the site's rsqrt (a number, or a node); for the
    FP8 variants, the dtypes cast to and the quant group widths (wildcards in the pattern)."""
    facts: dict[str, Any] = {"casts": set(), "quant_groups": set(), "x_is_upcast": _is_upcast(inputs.get("x"))}
    for node in nodes:
        if is_site(node) and node.args[0].target is aten.add.Tensor:
            add = node.args[0]
            facts["eps"] = next(a for a in add.args if not (isinstance(a, torch.fx.Node) and a.target is aten.mean.dim))
        elif node.target is torch.ops.prims.convert_element_type.default:
            facts["casts"].add(node.args[1])
        elif node.target is aten.amax.default:
            facts["quant_groups"].add(node.args[0].meta["val"].shape[-1])
    return facts


def is_site(node: torch.fx.Node) -> bool:
    """An RMSNorm candidate: rsqrt of (mean of something [+ eps])."""
    if node.op != "call_function" or node.target is not aten.rsqrt.default:
        return False
    arg = node.args[0]
    if isinstance(arg, torch.fx.Node) and arg.target in (aten.add.Tensor, aten.add.Scalar):
        arg = next((a for a in arg.args if isinstance(a, torch.fx.Node) and a.target is aten.mean.dim), arg)
    return isinstance(arg, torch.fx.Node) and arg.target is aten.mean.dim


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """Say where an RMSNorm candidate departs from every variant, in model terms."""
    arg = anchor.args[0]
    if arg.target is aten.mean.dim:
        return arg, "rsqrt(mean(x²)) has no + eps"
    mean = next(a for a in arg.args if isinstance(a, torch.fx.Node) and a.target is aten.mean.dim)
    eps = [a for a in arg.args if a is not mean]
    if eps and isinstance(eps[0], torch.fx.Node):
        return arg, f"eps is a tensor ({eps[0].name}), not a Python number"
    dims = list(mean.args[1]) if len(mean.args) > 1 else []
    if dims != [-1]:
        return mean, f"the mean reduces dims {dims}, not the last dim"
    square = mean.args[0]
    if not (square.target is aten.pow.Tensor_Scalar and square.args[1] == 2):
        return mean, f"the mean is over {square.target}, not x**2"
    upcast = square.args[0]
    reason = _not_x_itself(upcast)
    if reason:
        return upcast, reason
    scaled = [u for u in anchor.users if u.target is aten.mul.Tensor and upcast in u.args]
    core = {upcast, square, mean, arg, anchor, *scaled}
    for node in (upcast, square, mean, arg, anchor):
        outside = [u for u in node.users if u not in core]
        if outside:
            return _escapes(node, outside)
    # Past the normalisation, the norm's own module tells its last node from its intermediates.
    module = module_path(anchor)
    if module:
        inside = [n for n in anchor.graph.nodes if module_path(n) == module]
        members = set(inside)
        leaving = [n for n in inside if any(u not in members for u in n.users)]
        for node in leaving[:-1]:
            return _escapes(node, [u for u in node.users if u not in members])
    return None


def _not_x_itself(squared: torch.fx.Node) -> Reason:
    """What a norm squares where it is not x (or x upcast), in model terms: x less its mean
    (Cohere's LayerNorm), or x times an activated gate (Mamba2's gated norm, gate first), also
    seen through the [.., groups, width / groups] view of a grouped norm (Zamba2's
    ``Zamba2RMSNormGated``, NemotronH's Mamba mixer norm: one group views x as [.., 1, width])."""
    groups = None
    while squared.target in _RESHAPES and isinstance(squared.args[0], torch.fx.Node):
        groups = (val_shape(squared) or (None, None))[-2] if groups is None else groups
        squared = squared.args[0]
    if squared.target is aten.sub.Tensor and target(squared.args[1]) is aten.mean.dim:
        if squared.args[1].args[0] is squared.args[0]:
            return "the norm subtracts the mean of x before normalising (a LayerNorm, not an RMSNorm)"
    if squared.target is aten.mul.Tensor and any(is_silu(a) for a in squared.args):
        grouped = f", in {groups} groups" if isinstance(groups, int) and groups > 1 else ""
        return (f"the norm normalises x · silu(gate){grouped}, the gate applied before the norm (Mamba2's gated "
                "RMSNorm), where the fused norms take x and gated_rms_norm gates after the norm")  # fmt: skip
    return None


def _escapes(node: torch.fx.Node, outside: list[torch.fx.Node]) -> tuple[torch.fx.Node, str]:
    return node, (
        f"{node.name} is also used by {', '.join(u.name for u in outside)}, "
        "a value the fused op does not return"
    )


FAMILY = Family(
    name="add_rms_norm",
    variants=VARIANTS,
    dtype_combos=DTYPE_COMBOS,
    example_inputs=example_inputs,
    scalars={"eps": _EPS_EXAMPLE},
    guard=guard,
    facts_of=facts_of,
    replacement=replacement,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, rms_norm_ops.__name__, kv_ops.__name__, prologue_calls.__name__),
)
