"""Gated DeltaNet decode core (Qwen3.5's linear attention), from the projections' outputs to
out_proj's input -> ``gdn_decode`` (issue 6).

One site per GDN layer and decode step: the causal conv update with SiLU, the q/k/v split, q and
k L2-normalised and repeated to the value heads, ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``, the delta-rule update of the fp32 state and ``o = S^T q``, then the
gated RMSNorm ``rms(o) * w * silu(z)``. Both states are written: in place by the op
(``auto_functionalized``), or functionally by the canonical decomposition (lowering "inductor").

Three spellings, each as its code writes it:

* ``hf``: transformers 5.17 ``Qwen3_5MoeGatedDeltaNet``'s cached single-token decode with the
  torch fallbacks Inductor traces when fla and causal-conv1d are absent (``causal_conv1d_update``,
  ``torch_recurrent_gated_delta_rule``, ``Qwen3_5MoeRMSNormGated``): [B, 1, ...] activations,
  the cache's [B, conv_dim, K] conv state and [B, Hv, Dk, Dv] recurrent state written whole
  (``copy_``, functional ``aten.copy`` post-grad), batch row b in state slot b;
* ``hf_next``: transformers 5.17 ``Qwen3NextGatedDeltaNet``, the same core; its q/k/v/z/b/a come
  out of interleaved qkvz / ba projections (outside the site: ``mixed_qkv`` is their
  concatenation, z already [B, 1, heads, Dv]) and its output is restored to z's shape before
  the flatten, one reshape more than Qwen3.5;
* ``slots``: a serving engine (model_adapters/reference/qwen35_gdn.py, vLLM's kernels' math in
  torch): [T, ...] rows, one token per sequence, both states gathered and written back at a
  state-slot tensor (``index_put``), conv and norm in fp32 with one rounding each.

HF's multi-token paths do not reach this family: with seq_len > 1 HF runs the chunked rule and
``causal_conv1d_fn``, another graph; a multi-token recurrent loop (spec decode through the
single-step functions) does not fit the one-step pattern, and the guard declines any match
whose activations carry more than one token per sequence (the op decodes one).

The site's anchor is the delta rule's prediction error ``v - sum_k(S * k)``. ``explain`` says,
in model terms, where a candidate departs: q or k not L2-normalised, beta not ``sigmoid(b)``,
the gate applied before the norm.

Numerics: the op rounds where HF does (``ops/gdn_decode.py``); on the ``slots`` layout it adds
the bf16 roundings HF has and the fp32 reference does not (conv output, beta, normalised o), a
few bf16 ulps on the output (tests/patterns/test_gdn.py measures them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat
from ..ops import gdn_decode as gdn_ops
from ..fx.graph_walk import downstream as _downstream
from ..fx.graph_walk import is_silu as _is_silu
from ..fx.graph_walk import target as _target
from ..fx.graph_walk import upstream as _upstream
from .registry import Family, Reason, Variant

aten = torch.ops.aten
prims = torch.ops.prims

_EPS = 1.2345e-6  # the gated norm's eps, traced as a keyword argument
QK_L2NORM_EPS = 1e-6  # HF and fla hard-code it; a literal of the patterns (the re-trace pins it)

# ------------------------------------------------------------------------------------------
# Model-code spellings: HF transformers 5.17 (torch fallbacks)
# ------------------------------------------------------------------------------------------


def l2norm(x, eps: float = QK_L2NORM_EPS):
    """HF's ``l2norm`` (fla's form: eps inside the sum)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def hf_causal_conv1d_update(x, conv_state, weight):
    """HF's ``causal_conv1d_update`` fallback, functional: (SiLU(conv) [B, C, S], the new state)."""
    _, hidden, seq_len = x.shape
    state_len = conv_state.shape[-1]
    window = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    new_state = aten.copy.default(conv_state, window[:, :, -state_len:])
    out = F.conv1d(window, weight.unsqueeze(1), None, padding=0, groups=hidden)
    out = F.silu(out[:, :, -seq_len:])
    return out.to(x.dtype), new_state


def hf_recurrent_step(query, key, value, g, beta, initial_state):
    """HF's ``torch_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True)`` for one token:
    (core_attn_out [B, 1, Hv, Dv], final state). Its ``core_attn_out[:, :, 0] = ...`` is the
    select_scatter functionalisation makes of it."""
    initial_dtype = query.dtype
    query, key, value, beta, g = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    query, key = l2norm(query), l2norm(key)
    query = query / (query.shape[-1] ** 0.5)
    state = initial_state.to(value)
    core_attn_out = torch.zeros_like(value)
    q_t, k_t, v_t = query[:, :, 0], key[:, :, 0], value[:, :, 0]
    state = state * g[:, :, 0].exp()[..., None, None]
    beta_t = beta[:, :, 0].unsqueeze(-1)
    kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - kv_mem) * beta_t
    state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    core_attn_out = torch.select_scatter(core_attn_out, (state * q_t.unsqueeze(-1)).sum(dim=-2), 2, 0)
    return core_attn_out.transpose(1, 2).contiguous().to(initial_dtype), state


def hf_gated_norm(hidden_states, gate, weight, eps):
    """HF's ``Qwen3_5MoeRMSNormGated``: normalise in fp32, round, weight in the activation dtype,
    then the fp32 SiLU gate."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    hidden_states = weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    return hidden_states.to(input_dtype)


def _dims(mixed_qkv, recurrent_state):
    """(key heads, key_dim, value heads, value_dim), as the code derives them from its config."""
    value_heads, head_k_dim, head_v_dim = recurrent_state.shape[1:]
    value_dim = value_heads * head_v_dim
    key_dim = (mixed_qkv.shape[-1] - value_dim) // 2
    return key_dim // head_k_dim, key_dim, value_heads, value_dim


def hf_decode(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, eps):
    """``Qwen3_5MoeGatedDeltaNet.forward`` between the projections and out_proj, cached decode."""
    return _hf_decode(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, eps)


def hf_next_decode(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, eps):
    """``Qwen3NextGatedDeltaNet.forward``: the same core, its output restored to z's
    [B, T, heads, Dv] before the flatten (its q/k/v/z/b/a come out of the interleaved qkvz / ba
    projections, which stay outside the site: ``mixed_qkv`` is their concatenation)."""
    return _hf_decode(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, eps,
                      restore_head_shape=True)  # fmt: skip


def _hf_decode(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, eps,
               restore_head_shape=False):  # fmt: skip
    batch_size, seq_len, _ = mixed_qkv.shape
    head_k_dim, head_v_dim = recurrent_state.shape[2], recurrent_state.shape[3]
    key_heads, key_dim, value_heads, value_dim = _dims(mixed_qkv, recurrent_state)
    mixed_qkv = mixed_qkv.transpose(1, 2)
    z = z.reshape(batch_size, seq_len, -1, head_v_dim)
    mixed_qkv, new_conv_state = hf_causal_conv1d_update(mixed_qkv, conv_state, conv_weight.squeeze(1))
    mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [key_dim, key_dim, value_dim], dim=-1)
    query = query.reshape(batch_size, seq_len, -1, head_k_dim)
    key = key.reshape(batch_size, seq_len, -1, head_k_dim)
    value = value.reshape(batch_size, seq_len, -1, head_v_dim)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    if value_heads // key_heads > 1:
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    core_attn_out, new_state = hf_recurrent_step(query, key, value, g, beta, recurrent_state)
    core_attn_out = core_attn_out.reshape(-1, head_v_dim)
    z_shape = z.shape
    z = z.reshape(-1, head_v_dim)
    core_attn_out = hf_gated_norm(core_attn_out, z, norm_weight, eps)
    if restore_head_shape:
        core_attn_out = core_attn_out.reshape(z_shape)
    return core_attn_out.reshape(batch_size, seq_len, -1), new_conv_state, new_state


# ------------------------------------------------------------------------------------------
# Model-code spellings: a serving engine's state slots (fp32, one rounding per stage)
# ------------------------------------------------------------------------------------------


def slots_decode(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state,
                 state_slots, eps):  # fmt: skip
    """The decode core of model_adapters/reference/qwen35_gdn.py, its state writes functional."""
    key_heads, key_dim, value_heads, value_dim = _dims(mixed_qkv, recurrent_state)
    head_k_dim, head_v_dim = recurrent_state.shape[2], recurrent_state.shape[3]
    # causal conv update over the slots
    window = torch.cat([conv_state[state_slots], mixed_qkv.unsqueeze(-1)], dim=-1)
    new_conv_state = aten.index_put.default(conv_state, [state_slots], window[:, :, 1:])
    taps = window[:, :, -conv_weight.shape[-1] :]
    x = F.silu((taps.float() * conv_weight.float()).sum(-1)).to(mixed_qkv.dtype)
    q, k, v = x.split([key_dim, key_dim, value_dim], dim=-1)
    ratio = value_heads // key_heads
    q = q.view(-1, key_heads, head_k_dim).repeat_interleave(ratio, dim=1)
    k = k.view(-1, key_heads, head_k_dim).repeat_interleave(ratio, dim=1)
    v = v.view(-1, value_heads, head_v_dim)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    # one gated delta-rule step, fp32
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    state = recurrent_state[state_slots] * g.exp()[:, :, None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v.float() - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    new_recurrent_state = aten.index_put.default(recurrent_state, [state_slots], state)
    o = (state * q.unsqueeze(-1)).sum(-2).to(v.dtype)
    # gated RMSNorm, norm before gate, fp32
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    gate = z.view(-1, value_heads, head_v_dim)
    out = (h * norm_weight.float() * F.silu(gate.float())).to(o.dtype)
    return out.reshape(-1, value_dim), new_conv_state, new_recurrent_state


VARIANTS = (
    Variant("hf", hf_decode, {"layout": "hf"}),
    Variant("hf_next", hf_next_decode, {"layout": "hf"}),
    Variant("slots", slots_decode, {"layout": "slots"}),
)

# ------------------------------------------------------------------------------------------
# Example inputs (tiny, real structure: 2 key heads shared by 4 value heads, Dk != Dv)
# ------------------------------------------------------------------------------------------

# (activations, the A_log / dt_bias / gated-norm weight parameters): a bf16 model; a bf16 model
# whose GDN parameters stay fp32 (their ``.float()`` is then no cast, a different graph); fp32.
# An all-fp32 layer whose ``a`` is its own Linear still misses (reported): Inductor folds
# ``a + dt_bias`` into that GEMM as an addmm bias (tests/patterns/test_gdn.py).
DTYPE_COMBOS = ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32))
_B, _HK, _HV, _DK, _DV, _K, _SLOTS = 2, 2, 4, 8, 16, 4, 5
_CONV_DIM = 2 * _HK * _DK + _HV * _DV


def example_inputs(variant: Variant, combo) -> list:
    act, param = combo

    def r(*shape, dtype=act):
        return torch.randn(*shape, dtype=dtype)

    params = [r(_HV, dtype=param), r(_HV, dtype=param), r(_DV, dtype=param)]  # A_log, dt_bias, norm weight
    if variant.params["layout"] == "hf":
        lead = (_B, 1)
        return [r(*lead, _CONV_DIM), r(*lead, _HV * _DV), r(*lead, _HV), r(*lead, _HV), r(_CONV_DIM, 1, _K), *params,
                r(_B, _CONV_DIM, _K), r(_B, _HV, _DK, _DV, dtype=torch.float32), _EPS]  # fmt: skip
    return [r(_B, _CONV_DIM), r(_B, _HV * _DV), r(_B, _HV), r(_B, _HV), r(_CONV_DIM, _K), *params,
            r(_SLOTS, _CONV_DIM, _K - 1), r(_SLOTS, _HV, _DK, _DV, dtype=torch.float32), torch.tensor([3, 0]), _EPS]  # fmt: skip


SCALARS = {"eps": _EPS}

# ------------------------------------------------------------------------------------------
# Facts read from the matched nodes, and the guard
# ------------------------------------------------------------------------------------------


def facts_of(nodes: list[torch.fx.Node], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The gated norm's eps (torch 2.11 drops scalars from the re-traced match) and the q/k
    L2-norm eps (a literal of the pattern: the re-trace pins it to QK_L2NORM_EPS, which the
    replacement passes; the guard checks what the graph holds all the same)."""
    facts: dict[str, Any] = {"l2_eps": set()}
    for node in nodes:
        if node.op != "call_function" or node.target is not aten.rsqrt.default:
            continue
        add = node.args[0]
        if getattr(add, "target", None) is not aten.add.Tensor:
            continue
        reduced = add.args[0]
        if getattr(reduced, "target", None) is aten.mean.dim:
            facts["graph_eps"] = add.args[1]
        elif getattr(reduced, "target", None) is aten.sum.dim_IntList:
            facts["l2_eps"].add(add.args[1])
    return facts


def guard(values: Mapping[str, Any], variant: Variant) -> Reason:
    eps = values.get("eps")
    if not isinstance(eps, (int, float)):
        return f"the gated norm's eps is a tensor, not a Python number (got {eps}); the fused op takes it as a constant"
    l2_eps = values["l2_eps"]
    if len(l2_eps) != 1 or not all(isinstance(e, (int, float)) and e > 0 for e in l2_eps):
        return f"the q/k L2-norm eps are {sorted(map(str, l2_eps))}, not one positive number"
    mixed_qkv, conv_state, recurrent_state = values["mixed_qkv"], values["conv_state"], values["recurrent_state"]
    if variant.params["layout"] == "hf" and (mixed_qkv.dim() != 3 or mixed_qkv.shape[1] != 1):
        return (f"{mixed_qkv.shape[1] if mixed_qkv.dim() == 3 else '?'} tokens per sequence (mixed_qkv "
                f"{tuple(mixed_qkv.shape)}): the fused op decodes one token per sequence")  # fmt: skip
    if recurrent_state.dtype != torch.float32:
        return f"the recurrent state is {recurrent_state.dtype}; the fused op keeps it in fp32"
    if conv_state.dtype != mixed_qkv.dtype:
        return f"the conv state is {conv_state.dtype}, the activations {mixed_qkv.dtype}; the fused op keeps both alike"
    kernel = values["conv_weight"].shape[-1]
    if conv_state.shape[-1] < kernel - 1:
        return f"the conv state keeps {conv_state.shape[-1]} columns, fewer than kernel - 1 = {kernel - 1}"
    for name in ("mixed_qkv", "z", "b", "a", "conv_weight", "A_log", "dt_bias", "norm_weight"):
        if values[name].dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"{name} dtype {values[name].dtype} is not bf16/fp16/fp32"
    if variant.params["layout"] == "slots":
        slots = values["state_slots"]
        if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
            return f"the state slots {slots.dtype} {tuple(slots.shape)} are not a 1-D int tensor"
    elif not mixed_qkv.shape[0] == conv_state.shape[0] == recurrent_state.shape[0]:
        return (f"{mixed_qkv.shape[0]} sequences, but the conv / recurrent states hold {conv_state.shape[0]} / "
                f"{recurrent_state.shape[0]} rows: HF's cache row b is sequence b")  # fmt: skip
    return _op_reason(values)


def _op_reason(values: Mapping[str, Any]) -> Reason:
    """The op's own argument checks (ops/gdn_decode.py) on the arguments the replacement would pass."""
    mixed_qkv = values["mixed_qkv"]
    tokens = mixed_qkv.numel() // mixed_qkv.shape[-1]
    slots = values.get("state_slots")
    if slots is None:
        slots = torch.empty(tokens, dtype=torch.int64, device="meta")
    args = [values[n].reshape(tokens, -1) for n in ("mixed_qkv", "z", "b", "a")]
    args += [values[n] for n in ("conv_weight", "A_log", "dt_bias", "norm_weight")]
    args += [values["eps"], next(iter(values["l2_eps"])), values["conv_state"], values["recurrent_state"], slots]
    try:
        gdn_ops._validate(*args)
    except ValueError as err:
        return f"the fused op does not take this site's shapes: {err}"
    return None


# ------------------------------------------------------------------------------------------
# Replacements
# ------------------------------------------------------------------------------------------


_OPS = {"triton": "gdn_decode", "fla": "gdn_decode_fla"}


def _call(lowering: str, **kwargs):
    """(out, new conv_state, new recurrent_state): the op of the lowering (our kernel, or fla's
    kernels) through ``auto_functionalized``, or the canonical functional decomposition
    (lowering "inductor")."""
    if lowering == "inductor":
        return gdn_ops.gdn_decode_canonical(**kwargs)
    return _compat.auto_functionalized(getattr(torch.ops.fusion_compiler, _OPS[lowering]).default, **kwargs)


def _core(lowering, mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state,
          state_slots, eps):  # fmt: skip
    tokens = mixed_qkv.numel() // mixed_qkv.shape[-1]
    return _call(
        lowering, mixed_qkv=mixed_qkv.reshape(tokens, -1), z=z.reshape(tokens, -1), b=b.reshape(tokens, -1),
        a=a.reshape(tokens, -1), conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight,
        eps=eps, qk_l2norm_eps=QK_L2NORM_EPS, conv_state=conv_state, recurrent_state=recurrent_state,
        state_slots=state_slots,
    )  # fmt: skip


def replacement(variant: Variant, lowering: str):
    if lowering != "inductor" and lowering not in _OPS:
        raise ValueError(f"no replacement for lowering {lowering!r}")
    if variant.params["layout"] == "hf":

        def replace_hf(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state, eps):
            # HF's cache: batch row b is state slot b.
            slots = torch.arange(mixed_qkv.shape[0], device=mixed_qkv.device)
            out, conv_new, rec_new = _core(lowering, mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight,
                                           conv_state, recurrent_state, slots, eps)  # fmt: skip
            return out.view(mixed_qkv.shape[0], 1, -1), conv_new, rec_new

        return replace_hf

    def replace_slots(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state, recurrent_state,
                      state_slots, eps):  # fmt: skip
        return tuple(_core(lowering, mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, conv_state,
                           recurrent_state, state_slots, eps))  # fmt: skip

    return replace_slots


# ------------------------------------------------------------------------------------------
# Sites: every delta-rule prediction error v - sum_k(S * k)
# ------------------------------------------------------------------------------------------


def _name(node) -> str:
    return node.name if isinstance(node, torch.fx.Node) else repr(node)


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _state_read(node) -> torch.fx.Node | None:
    """kv_mem = sum(S * k[..., None], dim=-2): the mul of a 4-D state and a column, or None."""
    if _target(node) is not aten.sum.dim_IntList or len(node.args) < 2:
        return None
    dims, mul = node.args[1], node.args[0]
    value = _val(mul)
    if not isinstance(dims, (list, tuple)) or list(dims) != [-2] or _target(mul) is not aten.mul.Tensor:
        return None
    return mul if isinstance(value, torch.Tensor) and value.dim() == 4 else None


def is_site(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is aten.sub.Tensor
        and len(node.args) == 2
        and _state_read(node.args[1]) is not None
    )


# Ops that move, cast or reshape a value without computing on it (explain walks through them).
_PLUMBING = (
    prims.convert_element_type.default, aten.clone.default, aten.permute.default, aten.reshape.default,
    aten.view.default, aten.select.int, aten.unsqueeze.default, aten.expand.default, aten.squeeze.dim,
    aten.slice.Tensor, aten.index.Tensor, aten.mul.Tensor, aten.div.Tensor,
)  # fmt: skip


def _source(node, depth: int = 12):
    """The first node upstream of `node` that is not plumbing (a mul/div by a constant counts as
    plumbing: q's Dk^-0.5 scale)."""
    for _ in range(depth):
        if not isinstance(node, torch.fx.Node) or node.target not in _PLUMBING:
            return node
        if node.target in (aten.mul.Tensor, aten.div.Tensor) and isinstance(node.args[1], torch.fx.Node):
            return node
        node = node.args[0]
    return node


def _is_l2norm(node) -> bool:
    """x * rsqrt(sum(x * x, -1) + eps)."""
    if _target(node) is not aten.mul.Tensor:
        return False
    rsqrt = node.args[1]
    if _target(rsqrt) is not aten.rsqrt.default:
        return False
    add = rsqrt.args[0]
    summed = add.args[0] if _target(add) is aten.add.Tensor else add
    return _target(summed) is aten.sum.dim_IntList


def _column_operand(mul):
    """The [.., D, 1] operand of a state-times-column product (k in kv_mem, q in o)."""
    for arg in mul.args:
        value = _val(arg)
        if isinstance(value, torch.Tensor) and value.dim() == 4 and value.shape[-1] == 1:
            return arg
    return None


def explain(anchor: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """Where a delta-rule candidate departs from the fused math, in model terms; None leaves it
    to Inductor's FailedMatch text."""
    chained = _chained_steps(anchor)
    if chained is not None:
        return chained
    k = _column_operand(_state_read(anchor.args[1]))
    if k is not None and not _is_l2norm(_source(k)):
        return k, f"k is not L2-normalised before the delta rule (k comes from {_name(_source(k))})"
    beta_mul = next((u for u in anchor.users if _target(u) is aten.mul.Tensor), None)
    beta = next((a for a in beta_mul.args if a is not anchor), None) if beta_mul is not None else None
    if beta is not None and _target(_source(beta)) is not aten.sigmoid.default:
        beta = _source(beta)
        return beta_mul, f"beta is {_name(beta)} ({_target(beta)}), not sigmoid(b)"
    # o = sum(S_new * q[..., None]): the state update's other reader.
    o_mul = _downstream(anchor, lambda n: _state_read_of(n) is not None, 6)
    if o_mul is not None:
        q = _column_operand(o_mul)
        if q is not None and not _is_l2norm(_source(q)):
            return q, f"q is not L2-normalised before the delta rule (q comes from {_name(_source(q))})"
        norm = _downstream(o_mul, lambda n: _target(n) is aten.rsqrt.default and _target(_upstream(n, lambda m: _target(m) is aten.mean.dim, 3)) is aten.mean.dim, 14)  # fmt: skip
        if norm is not None:
            gated_first = _upstream(norm, lambda n: _target(n) is aten.mul.Tensor and any(_is_silu(a) for a in n.args), 8)
            if gated_first is not None:
                return gated_first, "the SiLU gate multiplies o before the RMSNorm (rms(o * silu(z))); the fused op normalises first"
    return None


def _chained_steps(anchor) -> tuple[torch.fx.Node, str] | None:
    """Several tokens of one sequence in one graph: a delta-rule step whose state comes out of
    another step, or whose new state feeds another (an unrolled multi-token recurrence)."""
    read = _state_read(anchor.args[1])
    state = next((a for a in read.args if a is not _column_operand(read)), None)
    previous = _upstream(state, lambda n: n is not state and is_site(n), 8) if state is not None else None
    following = _downstream(anchor, lambda n: n is not anchor and is_site(n), 12)
    other = previous or following
    if other is None:
        return None
    steps = sum(1 for n in anchor.graph.nodes if is_site(n) and _chained(n, anchor))
    return other, (f"the recurrent state passes through {steps} delta-rule steps in one graph: {steps} tokens per "
                   "sequence; the fused op decodes one token per sequence")  # fmt: skip


def _chained(node, anchor) -> bool:
    """node and anchor are steps of one recurrence (one reaches the other downstream)."""
    if node is anchor:
        return True
    return bool(_downstream(node, lambda n: n is anchor, 24) or _downstream(anchor, lambda n: n is node, 24))


def _state_read_of(node):
    """node is the mul of o = sum(S_new * q[..., None], -2) (a state-times-column product read by a sum)."""
    if _target(node) is not aten.mul.Tensor or _column_operand(node) is None:
        return None
    return next((u for u in node.users if _state_read(u) is node), None)


FAMILY = Family(
    name="gdn",
    variants=VARIANTS,
    dtype_combos=DTYPE_COMBOS,
    example_inputs=example_inputs,
    scalars=SCALARS,
    guard=guard,
    replacement=replacement,
    facts_of=facts_of,
    is_site=is_site,
    explain=explain,
    source_modules=(__name__, gdn_ops.__name__),
    distinct_inputs=(("conv_state", "recurrent_state"),),
)
