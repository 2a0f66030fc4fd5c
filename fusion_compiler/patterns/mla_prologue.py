"""DeepSeek V3.2 attention prologue: the MLA and DSA-indexer work around the GEMMs.

Four kinds of site per layer, each anchored on its RoPE (every RoPE in the graph is a
candidate, so an unfused one is reported):

* ``kv``: RMSNorm(kv_c) + interleaved RoPE(k_pe) [+ concat + paged latent-cache write, bf16
  or FP8 ``fp8_ds_mla``] -> ``mla_kv_prologue`` kv role;
* ``index_k``: LayerNorm(wk(x)) + NeoX RoPE on the first rot dims [+ FP8 quant + indexer
  cache write] -> ``mla_kv_prologue`` index_k role;
* ``q``: interleaved RoPE(q_pe) + concat with q_nope (HF) or the absorbed q (serving
  engines) -> ``mla_q_prologue`` q role;
* ``index_q``: NeoX RoPE on the first rot dims [+ FP8 quant + head-weight scaling]
  -> ``mla_q_prologue`` index_q role.

Each comes as HF transformers writes it (``*.hf``: no FP8, no latent cache) and as a serving
engine writes it from DeepSeek's inference code (model_adapters/reference/deepseek_v32.py).
The horizontal merge (patterns/mla_prologue_horizontal.py) then folds each layer's sites into one launch
before the q_b GEMM and one after it.

Inductor's pattern tracer turns ints, lists and dtypes into wildcards, so a NeoX RoPE
written with slices looks exactly like HF's interleaved one (the bug SGLang shipped): the
guard reads slice steps, split sizes, cast dtypes and quant groups from the matched nodes
(``facts_of``) and declines, with the reason, whatever does not fit.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat
from ..fx.graph_walk import is_pair_slice, val_shape
from ..fx.module_paths import module_path
from ..ops import mla_kv_prologue as kv_ops
from ..ops import mla_q_prologue as q_ops
from . import add_rms_norm, prologue_calls
from .prologue_calls import kv_prologue, q_prologue
from .spellings import FP8, act_quant, as_bytes, write_rows
from .registry import Family, Reason, Variant

aten = torch.ops.aten
prims = torch.ops.prims

_EPS = 1.2345e-6
_LN_EPS = 2.3456e-6
_HEAD_SCALE = 0.3456
_DIM_SCALE = 0.4567
LATENT_GROUP = kv_ops.LATENT_GROUP

# ------------------------------------------------------------------------------------------
# Model-code spellings (plain torch; each mirrors a real source, named after it)
# ------------------------------------------------------------------------------------------


def rope_pairs(x, cos, sin):
    """GPT-J pairs, vLLM ``forward_native`` / DeepSeek: in fp32, pairs stay in place."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def rope_pairs_hf(x, cos, sin):
    """HF ``apply_rotary_pos_emb_interleave``: in x's dtype, output de-interleaved."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_halves(x, cos, sin):
    """NeoX halves, vLLM ``forward_native``: in fp32."""
    x1, x2 = torch.chunk(x.float(), 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_halves_hf(x, cos, sin):
    """HF ``apply_rotary_pos_emb`` (``rotate_half``); cos/sin are ``cat(freqs, freqs)``."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ------------------------------------------------------------------------------------------
# Search functions, one per site and spelling
# ------------------------------------------------------------------------------------------


def kv_hf(compressed_kv, weight, cos, sin, eps):
    # The split belongs to the site: it is what connects the norm and the RoPE into one
    # pattern (Inductor finds a multi-output match's other outputs through shared nodes).
    kv_c, k_pe = torch.split(compressed_kv, [weight.shape[0], 2 * cos.shape[-1]], dim=-1)
    batch, seq = compressed_kv.shape[:2]
    k_pe = k_pe.view(batch, 1, seq, k_pe.shape[-1])
    return add_rms_norm.hf(kv_c, weight, eps), rope_pairs_hf(k_pe, cos, sin)


def _kv_cache(fp8: bool, ue8m0: bool):
    def kv_cache(kv_c, k_pe, weight, cos, sin, cache, slots, eps):
        kv = add_rms_norm.deepseek(kv_c, weight, eps)
        pe = rope_pairs(k_pe, cos, sin)
        if fp8:
            y, scale = act_quant(kv, LATENT_GROUP, ue8m0)
            rows = torch.cat([as_bytes(y), as_bytes(scale), as_bytes(pe)], dim=-1)
        else:
            rows = torch.cat([kv, pe], dim=-1)
        return write_rows(cache, slots, rows)

    return kv_cache


def index_k_hf(k, weight, bias, cos, sin, ln_eps):
    k = F.layer_norm(k, (k.shape[-1],), weight, bias, ln_eps).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [cos.shape[-1], k.shape[-1] - cos.shape[-1]], dim=-1)
    return torch.cat([rope_halves_hf(k_rot, cos, sin), k_pass], dim=-1).squeeze(2)


def _index_k_cache(ue8m0: bool):
    def index_k_cache(k, weight, bias, cos, sin, cache, slots, ln_eps):
        k = F.layer_norm(k, (k.shape[-1],), weight, bias, ln_eps)
        k_pe, k_nope = torch.split(k, [2 * cos.shape[-1], k.shape[-1] - 2 * cos.shape[-1]], dim=-1)
        k = torch.cat([rope_halves(k_pe, cos, sin), k_nope], dim=-1)
        y, scale = act_quant(k, k.shape[-1], ue8m0)
        return write_rows(cache, slots, torch.cat([as_bytes(y), as_bytes(scale)], dim=-1))

    return index_k_cache


def q_hf(q_pass, q_rot, cos, sin):
    return torch.cat((q_pass, rope_pairs_hf(q_rot, cos, sin)), dim=-1)


def q_absorbed(q_other, q_pe, cos, sin):
    return torch.cat([q_other, rope_pairs(q_pe, cos, sin)], dim=-1)


def index_q_hf(q, cos, sin):
    q_rot, q_pass = torch.split(q, [cos.shape[-1], q.shape[-1] - cos.shape[-1]], dim=-1)
    return torch.cat([rope_halves_hf(q_rot, cos, sin), q_pass], dim=-1)


def _index_q_fp8(ue8m0: bool):
    def index_q_fp8(q, cos, sin, weights, head_scale, dim_scale):
        q_pe, q_nope = torch.split(q, [2 * cos.shape[-1], q.shape[-1] - 2 * cos.shape[-1]], dim=-1)
        q = torch.cat([rope_halves(q_pe, cos, sin), q_nope], dim=-1)
        y, scale = act_quant(q, q.shape[-1], ue8m0)
        w = weights.float() * head_scale
        return y, w * scale.squeeze(-1) * dim_scale

    return index_q_fp8


def _variant(name, search, *, rope, rotated, cache=None, fp8=False, ue8m0=False):
    return Variant(name, search, {
        "site": name.split(".")[0], "rope": rope, "rotated": rotated, "cache": cache, "fp8": fp8, "ue8m0": ue8m0,
    })  # fmt: skip


# Order: the cache-writing spellings first (they contain more of the site).
VARIANTS = (
    _variant("kv.cache_fp8_ue8m0", _kv_cache(True, True), rope="pairs", rotated="k_pe", cache="fp8", fp8=True, ue8m0=True),
    _variant("kv.cache_fp8", _kv_cache(True, False), rope="pairs", rotated="k_pe", cache="fp8", fp8=True),
    _variant("kv.cache_bf16", _kv_cache(False, False), rope="pairs", rotated="k_pe", cache="bf16"),
    _variant("kv.hf", kv_hf, rope="pairs_hf", rotated="compressed_kv"),
    _variant("index_k.cache_fp8_ue8m0", _index_k_cache(True), rope="halves", rotated="k", cache="fp8", fp8=True, ue8m0=True),
    _variant("index_k.cache_fp8", _index_k_cache(False), rope="halves", rotated="k", cache="fp8", fp8=True),
    _variant("index_k.hf", index_k_hf, rope="halves_hf", rotated="k"),
    _variant("q.absorbed", q_absorbed, rope="pairs", rotated="q_pe"),
    _variant("q.hf", q_hf, rope="pairs_hf", rotated="q_rot"),
    _variant("index_q.fp8_ue8m0", _index_q_fp8(True), rope="halves", rotated="q", fp8=True, ue8m0=True),
    _variant("index_q.fp8", _index_q_fp8(False), rope="halves", rotated="q", fp8=True),
    _variant("index_q.hf", index_q_hf, rope="halves_hf", rotated="q"),
)

# ------------------------------------------------------------------------------------------
# Example inputs (tiny, real structure: kv_rank a multiple of the 128 quant group)
# ------------------------------------------------------------------------------------------

# bf16 models, and fp32 ones: where the activations are fp32, ``.float()`` and HF's norm upcasts
# are no casts, another graph (the kernels take fp32 too).
DTYPE_COMBOS = ((torch.bfloat16,), (torch.float32,))
_T, _H, _ROT, _R, _D = 2, 2, 16, 128, 32


def example_inputs(variant: Variant, combo) -> list | None:
    (act,) = combo
    hf = variant.params["rope"].endswith("_hf")
    if variant.params["site"] == "kv" and variant.params["cache"] == "fp8" and act != torch.bfloat16:
        return None  # fp8_ds_mla stores k_pe as bf16: a bf16 model's layout only

    def r(*shape, dtype=act):
        return torch.randn(*shape, dtype=dtype)

    site = variant.params["site"]
    if site == "kv":
        if hf:  # HF: kv_c [B, S, R]; k_pe, cos, sin viewed [B, 1, S, *]
            return [r(1, _T, _R + _ROT), r(_R), r(1, 1, _T, _ROT // 2), r(1, 1, _T, _ROT // 2), _EPS]
        row = kv_ops.latent_cache_width(_R, _ROT, torch.uint8 if variant.params["cache"] == "fp8" else act)
        cache = torch.zeros(3, 4, row, dtype=torch.uint8 if variant.params["cache"] == "fp8" else act)
        cos = torch.randn(_T, _ROT // 2)
        return [r(_T, _R), r(_T, _ROT), torch.randn(_R), cos, cos.clone(), cache, torch.arange(_T), _EPS]
    if site == "index_k":
        if hf:  # cos/sin: cat(freqs, freqs) [B, S, 1, rot]
            return [r(1, _T, _D), r(_D), r(_D), r(1, _T, 1, _ROT), r(1, _T, 1, _ROT), _LN_EPS]
        cache = torch.zeros(3, 4, _D + 4, dtype=torch.uint8)
        cos = torch.randn(_T, _ROT // 2)
        return [r(_T, _D), r(_D), r(_D), cos, cos.clone(), cache, torch.arange(_T), _LN_EPS]
    if site == "q":
        if hf:  # [B, H, S, *]
            return [r(1, _H, _T, _D), r(1, _H, _T, _ROT), r(1, 1, _T, _ROT // 2), r(1, 1, _T, _ROT // 2)]
        return [r(_T, _H, _R), r(_T, _H, _ROT), torch.randn(_T, 1, _ROT // 2), torch.randn(_T, 1, _ROT // 2)]
    if site == "index_q":
        if hf:
            return [r(1, _T, _H, _D), r(1, _T, 1, _ROT), r(1, _T, 1, _ROT)]
        return [r(_T, _H, _D), torch.randn(_T, 1, _ROT // 2), torch.randn(_T, 1, _ROT // 2), r(_T, _H), _HEAD_SCALE, _DIM_SCALE]
    raise AssertionError(site)


SCALARS = {"eps": _EPS, "ln_eps": _LN_EPS, "head_scale": _HEAD_SCALE, "dim_scale": _DIM_SCALE}

# ------------------------------------------------------------------------------------------
# Facts read from the matched nodes, and the guard
# ------------------------------------------------------------------------------------------


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """What the wildcards hid: eps values, slice steps, split sizes, cast dtypes, quant groups."""
    facts: dict[str, Any] = {
        "slice_steps": set(), "split_sizes": [], "chunk_widths": set(), "casts": set(), "quant_groups": set(),
    }  # fmt: skip
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target is aten.rsqrt.default and node.args[0].target is aten.add.Tensor:
            add = node.args[0]
            var, eps = add.args
            layer_norm = isinstance(var, torch.fx.Node) and var.target is operator.getitem
            facts["ln_eps" if layer_norm else "eps"] = eps
        elif node.target is aten.slice.Tensor:
            step = node.args[4] if len(node.args) > 4 else 1
            facts["slice_steps"].add(step)
        elif node.target is aten.split_with_sizes.default:
            facts["split_sizes"].append(list(node.args[1]))
        elif node.target is aten.split.Tensor:  # torch.chunk: equal pieces of this width
            facts["chunk_widths"].add((node.args[1], _val(node.args[0]).shape[-1]))
        elif node.target is prims.convert_element_type.default:
            facts["casts"].add(node.args[1])
        elif node.target is aten.amax.default:
            facts["quant_groups"].add(_val(node.args[0]).shape[-1])
    facts.update(_index_weight_scales(nodes, inputs.get("weights")))
    facts.update(angle_facts(inputs))
    facts["upcast_inputs"] = {name for name, node in inputs.items() if _is_upcast(node)}
    return facts


def _index_weight_scales(nodes: list[torch.fx.Node], weights) -> dict[str, Any]:
    """The indexer's head and dim scales as the graph's literals (``w = weights.float() *
    head_scale``, then ``w * scale * dim_scale``): torch 2.11 hands the check a re-traced match
    whose scalars are literals, not kwargs, so the replacement takes them from here."""
    if not isinstance(weights, torch.fx.Node):
        return {}
    literal = [n for n in nodes if n.op == "call_function" and n.target in (aten.mul.Tensor, aten.mul.Scalar)
               and isinstance(n.args[1], (int, float))]  # fmt: skip
    casts = (prims.convert_element_type.default, aten._to_copy.default)  # (.float(), in post-grad and aten graphs)
    head = next((n for n in literal if n.args[0] is weights
                 or (getattr(n.args[0], "target", None) in casts and n.args[0].args[0] is weights)), None)  # fmt: skip
    if head is None:
        return {}
    found = {"head_scale": head.args[1]}
    for n in literal:  # (w * scale) * dim_scale: a mul of a mul of the head-scaled weights
        inner = n.args[0]
        if getattr(inner, "target", None) in (aten.mul.Tensor, aten.mul.Scalar) and head in inner.args:
            found["dim_scale"] = n.args[1]
    return found


def _is_upcast(node) -> bool:
    """A cast of a bf16 / fp16 value to fp32 (``.float()``)."""
    if getattr(node, "target", None) is not prims.convert_element_type.default:
        return False
    source = _val(node.args[0])
    return source is not None and source.dtype in (torch.bfloat16, torch.float16) and node.args[1] == torch.float32


_ELEMENTWISE = (
    aten.cos.default, aten.sin.default, aten.mul.Tensor, aten.mul.Scalar, prims.convert_element_type.default,
    aten.unsqueeze.default, aten.reshape.default, aten.view.default, aten.clone.default,
)  # fmt: skip


def _is_repeat_twice(node) -> bool:
    """expand(unsqueeze(x, -2), [..., 2, n]): x twice along a new second-to-last dim."""
    if getattr(node, "target", None) is not aten.expand.default:
        return False
    source, sizes = node.args[0], node.args[1]
    if getattr(source, "target", None) is not aten.unsqueeze.default or len(sizes) < 2 or sizes[-2] != 2:
        return False
    return source.args[1] in (-2, len(sizes) - 2)


def _angles_source(node) -> str | None:
    """Where HF's NeoX cos/sin come from: "duplicated" for ``f(cat([freqs, freqs]))`` (the fused
    op reads only the first half, so it must be the same as the second), "input" when they are
    an input of this graph (the rotary embedding ran in another graph), else None. Walks back
    through elementwise ops."""
    for _ in range(8):
        if not isinstance(node, torch.fx.Node):
            return None
        if node.op == "placeholder":
            return "input"
        if node.target is aten.cat.default:
            parts = node.args[0]
            return "duplicated" if len(parts) == 2 and parts[0] is parts[1] else None
        if node.target is aten.clone.default and _is_repeat_twice(node.args[0]):
            return "duplicated"  # how Inductor's decompositions write cat([x, x], -1)
        if node.target not in _ELEMENTWISE:
            return None
        node = node.args[0]
    return None


def angle_facts(inputs: Mapping[str, Any]) -> dict[str, bool]:
    sources = [_angles_source(inputs.get(name)) for name in ("cos", "sin")]
    return {"angles_duplicated": all(s == "duplicated" for s in sources),
            "angles_from_input": any(s == "input" for s in sources)}  # fmt: skip


def angles_reason(values: Mapping[str, Any]) -> Reason:
    """Why HF's cos/sin cannot feed the fused NeoX RoPE, or None."""
    if values["angles_duplicated"]:
        return None
    if values.get("angles_from_input"):
        return ("cos/sin come into this graph from outside (the rotary embedding ran before a graph break), so "
                "nothing shows their two halves are equal; the fused NeoX RoPE reads one angle per pair")
    return "cos/sin are not built as cat(freqs, freqs); the fused NeoX RoPE reads one angle per pair"


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    p = variant.params
    # First: in a model of another dtype every other fact can look wrong (casts where none were).
    for name, t in values.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in kv_ops.ACT_DTYPES:
            return f"{name} is {t.dtype}; the fused prologue's kernels take bf16, fp16 or fp32"
    for name in ("eps", "ln_eps", "head_scale", "dim_scale"):
        if name in values and not isinstance(values[name], (int, float)):
            return f"{name} is a tensor, not a Python number (got {values[name]}); the fused op takes it as a constant"
    if p["rotated"] in values["upcast_inputs"]:
        # An fp32 model's spelling fitting a bf16 model's graph past its .float() (the bf16
        # spelling, casts included, is the site; torch 2.11 folds some of those casts away).
        return f"{p['rotated']} is a .float() of a narrower value: the fused op would read the upcast copy"
    reason = _rope_layout_reason(values, p["rope"])
    if reason:
        return reason
    cos, sin = values["cos"], values["sin"]
    reason = angles_reason(values) if p["rope"] == "halves_hf" else None
    if reason:
        return reason
    if not isinstance(cos, torch.Tensor) or cos.shape != sin.shape:
        return "cos and sin differ in shape"
    rot = cos.shape[-1] if p["rope"] == "halves_hf" else 2 * cos.shape[-1]
    x = values[p["rotated"]]
    if p["rotated"] == "compressed_kv":
        if values["split_sizes"] != [[values["weight"].shape[0], rot]]:
            return f"compressed_kv splits {values['split_sizes']}, not [kv_rank {values['weight'].shape[0]} | rope {rot}]"
    elif p["site"] in ("kv", "q") and x.shape[-1] != rot:
        return f"RoPE covers {rot} dims but the rotated tensor has {x.shape[-1]}"
    if p["site"] in ("index_k", "index_q"):
        sizes = [s for s in values["split_sizes"] if len(s) == 2]
        if not sizes or list(sizes[0]) != [rot, x.shape[-1] - rot]:
            return f"the indexer splits {sizes[0] if sizes else '?'}, not [rope {rot} | rest] (NeoX RoPE on the first dims)"
    if p["cache"] is not None:
        reason = _cache_reason(values, p)
        if reason:
            return reason
    if p["fp8"] and FP8 not in values["casts"]:
        return f"the quant casts to {sorted(map(str, values['casts']))}, not float8_e4m3fn"
    if p["site"] == "kv" and p["cache"] == "fp8" and values["quant_groups"] != {LATENT_GROUP}:
        return f"latent quant groups {sorted(values['quant_groups'])}, the fp8_ds_mla layout needs {LATENT_GROUP}"
    return None


def _rope_layout_reason(values, rope: str) -> Reason:
    steps = values["slice_steps"] - {None}
    if rope.startswith("pairs"):
        if steps != {2}:
            return f"RoPE layout is NeoX halves (slice steps {sorted(steps)}), the pattern is interleaved GPT-J pairs"
    elif rope == "halves_hf":
        if steps - {1}:
            return f"RoPE layout is interleaved pairs (slice steps {sorted(steps)}), the pattern is NeoX halves"
    elif steps:
        return f"RoPE slices with steps {sorted(steps)}; the NeoX pattern splits in halves"
    else:
        uneven = [(piece, width) for piece, width in values["chunk_widths"] if 2 * piece != width]
        if uneven:
            return f"the RoPE input of width {uneven[0][1]} is cut in pieces of {uneven[0][0]}, not halves"
    return None


def _cache_reason(values, p) -> Reason:
    cache, slots = values["cache"], values["slots"]
    if not cache.is_contiguous():
        return f"the cache is not contiguous (strides {cache.stride()}); the fused write needs a row-major cache"
    if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
        return f"slots {slots.dtype} {tuple(slots.shape)} are not a 1-D int tensor"
    want = torch.uint8 if p["cache"] == "fp8" else values["kv_c"].dtype
    if cache.dtype != want:
        return f"cache dtype {cache.dtype}, expected {want}"
    return None


# ------------------------------------------------------------------------------------------
# Replacements
# ------------------------------------------------------------------------------------------


def _tokens(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.reshape(-1, width)


def _half(t: torch.Tensor) -> torch.Tensor:
    """HF's NeoX cos/sin are cat(freqs, freqs): the per-pair angles are the first half."""
    return t[..., : t.shape[-1] // 2]


def replacement(variant: Variant, lowering: str):
    if lowering not in ("triton", "inductor"):
        raise ValueError(f"no replacement for lowering {lowering!r}")
    # "inductor": the ops' semantics as plain functional torch (ops/*: *_canonical, *_reference),
    # one canonical form whatever spelling matched; Inductor fuses it on its own.
    p = dict(variant.params, lowering=lowering)
    return _REPLACEMENTS[variant.name.rsplit("_ue8m0", 1)[0]](p)


def _replace_kv_hf(p):
    def replace(compressed_kv, weight, cos, sin, eps):
        rank, rot = weight.shape[0], 2 * cos.shape[-1]
        batch, seq = compressed_kv.shape[:2]
        flat = _tokens(compressed_kv, rank + rot)
        out = kv_prologue(
            p["lowering"],
            kv_c=flat[:, :rank], k_pe=flat[:, rank:], kv_weight=weight, kv_eps=eps,
            cos=_tokens(cos, rot // 2), sin=_tokens(sin, rot // 2), deinterleave_rope=True,
        )  # fmt: skip
        return out[2].view(batch, seq, rank), out[3].view(batch, 1, seq, rot)

    return replace


def _replace_kv_cache(p):
    def replace(kv_c, k_pe, weight, cos, sin, cache, slots, eps):
        out = kv_prologue(
            p["lowering"],
            kv_c=kv_c, k_pe=k_pe, kv_weight=weight, kv_eps=eps, cos=cos, sin=sin, slots=slots,
            latent_cache=cache, cache_ue8m0=p["ue8m0"], return_kv=False,
            round_before_quant=not _compat.JOINT_GRAPH_DROPS_ROUND_TRIPS,
        )  # fmt: skip
        return out[5]

    return replace


def _replace_index_k_hf(p):
    def replace(k, weight, bias, cos, sin, ln_eps):
        half = cos.shape[-1] // 2
        out = kv_prologue(
            p["lowering"],
            index_k=_tokens(k, k.shape[-1]), index_k_weight=weight, index_k_bias=bias, index_k_eps=ln_eps,
            cos=_tokens(_half(cos), half), sin=_tokens(_half(sin), half),
        )  # fmt: skip
        return out[4].view(k.shape)

    return replace


def _replace_index_k_cache(p):
    def replace(k, weight, bias, cos, sin, cache, slots, ln_eps):
        out = kv_prologue(
            p["lowering"],
            index_k=k, index_k_weight=weight, index_k_bias=bias, index_k_eps=ln_eps, cos=cos, sin=sin,
            slots=slots, index_cache=cache, cache_ue8m0=p["ue8m0"], return_index_k=False,
        )  # fmt: skip
        return out[6]

    return replace


def _replace_q_hf(p):
    def replace(q_pass, q_rot, cos, sin):
        batch, heads, seq, rot = q_rot.shape
        as_tokens = functools.partial(_heads_last, batch=batch, seq=seq, heads=heads)
        out = q_prologue(
            p["lowering"],
            q_pe=as_tokens(q_rot), q_other=as_tokens(q_pass), deinterleave_rope=True,
            cos=_tokens(cos, rot // 2), sin=_tokens(sin, rot // 2),
        )  # fmt: skip
        return out[0].view(batch, seq, heads, -1).transpose(1, 2)

    return replace


def _heads_last(t, batch, seq, heads):
    """[B, H, S, D] -> [B*S, H, D] (a view for HF's transposed q_b output)."""
    return t.transpose(1, 2).reshape(batch * seq, heads, t.shape[-1])


def _replace_q_absorbed(p):
    def replace(q_other, q_pe, cos, sin):
        half = q_pe.shape[-1] // 2
        out = q_prologue(p["lowering"], q_pe=q_pe, q_other=q_other, cos=_tokens(cos, half), sin=_tokens(sin, half))
        return out[0]

    return replace


def _replace_index_q_hf(p):
    def replace(q, cos, sin):
        half = cos.shape[-1] // 2
        heads, dim = q.shape[-2], q.shape[-1]
        out = q_prologue(p["lowering"], index_q=q.reshape(-1, heads, dim), cos=_tokens(_half(cos), half), sin=_tokens(_half(sin), half))
        return out[1].view(q.shape)

    return replace


def _replace_index_q_fp8(p):
    def replace(q, cos, sin, weights, head_scale, dim_scale):
        half = cos.shape[-1]
        out = q_prologue(
            p["lowering"],
            index_q=q, index_weights=weights, index_weights_scale=head_scale * dim_scale, index_q_fp8=True,
            ue8m0=p["ue8m0"], cos=_tokens(cos, half), sin=_tokens(sin, half),
        )  # fmt: skip
        return out[1], out[2]

    return replace


_REPLACEMENTS = {
    "kv.hf": _replace_kv_hf,
    "kv.cache_fp8": _replace_kv_cache,
    "kv.cache_bf16": _replace_kv_cache,
    "index_k.hf": _replace_index_k_hf,
    "index_k.cache_fp8": _replace_index_k_cache,
    "q.hf": _replace_q_hf,
    "q.absorbed": _replace_q_absorbed,
    "index_q.hf": _replace_index_q_hf,
    "index_q.fp8": _replace_index_q_fp8,
}

# ------------------------------------------------------------------------------------------
# Sites: every RoPE is one
# ------------------------------------------------------------------------------------------

_VIEWS = (prims.convert_element_type.default, aten.clone.default)


def _strip(node):
    while isinstance(node, torch.fx.Node) and node.target in _VIEWS:
        node = node.args[0]
    return node


def _sliced_from(node) -> torch.fx.Node | None:
    """The tensor `node` is a last-dim slice or split piece of (through casts)."""
    node = _strip(node)
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target is aten.slice.Tensor:
        return _strip(node.args[0])
    if node.target is operator.getitem and getattr(node.args[0], "target", None) in (
        aten.split_with_sizes.default,
        aten.split.Tensor,
    ):
        return _strip(node.args[0].args[0])
    return None


def _mul_operands(node):
    if not (isinstance(node, torch.fx.Node) and node.target is aten.mul.Tensor):
        return None
    return node.args


def _is_rotate_half(node) -> bool:
    return getattr(node, "target", None) is aten.cat.default and any(
        getattr(x, "target", None) is aten.neg.default for x in node.args[0]
    )


def is_complex_rope(node: torch.fx.Node) -> bool:
    """RoPE in complex numbers: ``view_as_real(view_as_complex(x) * freqs_cis)`` (HF's
    DeepSeek-V2), a reported miss."""
    if getattr(node, "target", None) is not aten.view_as_real.default:
        return False
    product = node.args[0]
    return getattr(product, "target", None) is aten.mul.Tensor and any(
        getattr(x, "target", None) is aten.view_as_complex.default for x in product.args
    )


_PROJECTIONS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
_HEAD_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.permute.default,
               aten.transpose.int, *_VIEWS)  # fmt: skip


def projected_heads(node) -> bool:
    """``node`` is a projection's output viewed as heads (through views, transposes and casts),
    whole: no slice or split piece of it (MLA ropes a slice, its decoupled RoPE dims)."""
    for _ in range(8):
        if not isinstance(node, torch.fx.Node) or node.target in (aten.slice.Tensor, operator.getitem):
            return False
        if node.target in _PROJECTIONS:
            return True
        if node.target not in _HEAD_VIEWS:
            return False
        node = node.args[0]
    return False


def complex_rope_of_heads(node: torch.fx.Node) -> bool:
    """A complex-number RoPE turning whole heads of a per-head projection (Llama-4's
    ``apply_rotary_emb``: a GQA attention's), not MLA's decoupled RoPE slice (DeepSeek-V2)."""
    if not is_complex_rope(node):
        return False
    rotated = next(x for x in node.args[0].args if getattr(x, "target", None) is aten.view_as_complex.default)
    return projected_heads(rotated.args[0])


def _static_cache_write_beside(node: torch.fx.Node) -> bool:
    """Whether ``node``'s attention module writes HF's static cache where gqa_prologue has a site."""
    from . import gqa_prologue  # it imports this module

    module = module_path(node)
    return bool(module) and any(n.target is aten.index_put.default and module_path(n) == module
                                and gqa_prologue.is_site(n) for n in node.graph.nodes)  # fmt: skip


def is_site(node: torch.fx.Node) -> bool:
    """A RoPE rotation: ``a*cos - b*sin`` with a, b slices of one tensor (pairs, or halves
    written out), or HF's ``x*cos + rotate_half(x)*sin``; or one in complex numbers, unless it
    turns whole heads of an attention with a gqa_prologue site (Llama-4's: that family's miss)."""
    if is_complex_rope(node):
        return not (complex_rope_of_heads(node) and _static_cache_write_beside(node))
    if node.op != "call_function" or node.target not in (aten.sub.Tensor, aten.add.Tensor):
        return False
    left, right = (_mul_operands(a) for a in node.args)
    if not left or not right:
        return False
    if node.target is aten.sub.Tensor:
        sources = {_sliced_from(a) for a in left} & {_sliced_from(b) for b in right}
        return bool(sources - {None})
    return any(_is_rotate_half(x) for x in (*left, *right))


def _in_indexer(node: torch.fx.Node) -> bool:
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    return bool(paths) and "indexer" in str(paths[-1]).rsplit(".", 1)[-1].lower()


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """A RoPE whose rotated tensor is also used outside the rotation cannot fuse (the op
    returns the rotated values only); an indexer that ropes interleaved pairs has no variant
    (DeepSeek V3.2's indexer ropes NeoX halves); other departures get Inductor's FailedMatch
    text."""
    if is_complex_rope(anchor):
        return anchor, ("RoPE is written in complex numbers (view_as_real(view_as_complex(x) * freqs_cis), as "
                        "DeepSeek-V2's HF code writes it): the fused MLA prologue takes RoPE as real cos / sin "
                        "products (DeepSeek-V3's spelling)")
    if _in_indexer(anchor):
        pairs = [_strip(x) for mul in anchor.args for x in (_mul_operands(mul) or ())]
        pairs = [p for p in pairs if is_pair_slice(p)]
        if pairs:
            return pairs[0], (
                "the indexer ropes interleaved (GPT-J) pairs; the indexer prologue's kernels rotate NeoX "
                "halves, as DeepSeek V3.2's indexer does, and have no pairs layout"
            )
    heads = _rotated_heads(anchor)
    appended = _cache_appended_by_cat(anchor) if heads is not None else None
    if appended is not None:
        width = (val_shape(heads) or (None,))[-1]
        return appended, (f"this RoPE turns whole {width}-wide heads of a per-head projection, a GQA attention's, not "
                          "MLA's RoPE slice beside a compressed latent; the attention appends k and v to its cache by "
                          "torch.cat (a dynamic cache, as MiniMax's own MiniMaxCache does), and the fused GQA "
                          "prologue's site is a write into HF's static cache (index_copy_), which it has none of")  # fmt: skip
    for mul in anchor.args:
        for operand in mul.args:
            source = _sliced_from(operand)
            if source is None:
                continue
            outside = [u for u in source.users if u.target not in (aten.slice.Tensor, operator.getitem, *_VIEWS)]
            outside = [u for u in outside if getattr(u, "target", None) not in (aten.split_with_sizes.default, aten.split.Tensor)]
            if outside:
                return source, (
                    f"the RoPE input {source.name} is also used by {', '.join(u.name for u in outside)}, "
                    "outside the rotation"
                )
    return None


def _rotated_heads(anchor: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor a real RoPE ``anchor`` turns, where that is whole heads of a per-head
    projection (both halves or all pairs of the head: a GQA attention's RoPE); else None."""
    sources = {_sliced_from(x.args[0] if getattr(x, "target", None) is aten.neg.default else x)
               for mul in anchor.args for operand in (_mul_operands(mul) or ())
               for x in (operand.args[0] if _is_rotate_half(operand) else [operand])}  # fmt: skip
    sources.discard(None)
    if len(sources) != 1:
        return None
    (heads,) = sources
    return heads if projected_heads(heads) else None


def _cache_appended_by_cat(anchor: torch.fx.Node) -> torch.fx.Node | None:
    """The ``cat((past, new), dim=-2)`` of a dynamic cache in ``anchor``'s attention module (the
    past a graph input), where the module has no index_put (no static-cache write)."""
    module = module_path(anchor)
    if not module:
        return None
    nodes = [n for n in anchor.graph.nodes if n.op == "call_function" and module_path(n) == module]
    if any(n.target is aten.index_put.default for n in nodes):
        return None
    return next((n for n in nodes if n.target is aten.cat.default and len(n.args) > 1 and n.args[1] in (-2, 2)
                 and getattr(n.args[0][0], "op", None) == "placeholder"), None)  # fmt: skip


FAMILY = Family(
    name="mla_prologue",
    variants=VARIANTS,
    dtype_combos=DTYPE_COMBOS,
    example_inputs=example_inputs,
    scalars=SCALARS,
    guard=guard,
    replacement=replacement,
    facts_of=facts_of,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, prologue_calls.__name__, kv_ops.__name__, q_ops.__name__),
)
