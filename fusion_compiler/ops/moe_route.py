"""MoE routing from router logits to (weights, expert ids), for the three scoring schemes.

    fusion_compiler::moe_route(Tensor logits, Tensor? bias, int top_k, int n_group, int topk_group,
                               int scoring, bool renormalize, float renorm_eps, float scale,
                               ScalarType weights_dtype) -> (Tensor weights, Tensor ids)

Semantics (``moe_route_reference`` is the numerical truth):

    s      = sigmoid(logits.float())  (scoring 0)   or  softmax(logits.float(), -1)  (scoring 1)
    choice = s + bias.float()         (bias [E], DeepSeek/MiniMax ``e_score_correction_bias``; fp32
                                       in checkpoints, bf16 when the model was cast as a whole)
    if n_group > 1:                   (DeepSeek V3 grouped routing; E % n_group == 0)
        group score = sum of the 2 largest ``choice`` in each group of E / n_group experts
        keep the ``topk_group`` best groups; every expert of the others gets choice = -inf
    ids    = the ``top_k`` largest ``choice``, in descending order          int64 [T, top_k]
    w      = s[ids]                   (the *unbiased* scores)
    if renormalize: w = w / (w.sum(-1) + renorm_eps)   (DeepSeek 1e-20, MiniMax and Qwen 0)
    w      = (w * scale).to(weights_dtype)             (DeepSeek routed_scaling_factor 2.5)

Ties: equal scores are ranked by the lower expert (or group) index first. ``torch.topk`` leaves
tie order unspecified, so where scores tie the chosen set can differ from eager's; tests compare
on tie-free inputs exactly and elsewhere compare weight sums and the combined expert output.
Ids are guaranteed equal to the reference's on exact ties and on scores further apart than a few
ulp (the kernels' exp/sigmoid may differ from torch's in the last bit); with NaN logits they are
unspecified, though valid and distinct. Experts are returned in descending score order (HF asks ``sorted=False``: any order is its
contract, and the experts' combine does not depend on it).
"""

from __future__ import annotations

import torch

from ._checks import require_dtype, require_shape

SCORING = {"sigmoid": 0, "softmax": 1}
GROUP_TOP = 2  # DeepSeek V3 scores a group by the sum of its 2 best experts

_SCHEMA = (
    "(Tensor logits, Tensor? bias, int top_k, int n_group, int topk_group, int scoring, "
    "bool renormalize, float renorm_eps, float scale, ScalarType weights_dtype) -> (Tensor weights, Tensor ids)"
)
_ARG_NAMES = ("logits", "bias", "top_k", "n_group", "topk_group", "scoring", "renormalize", "renorm_eps", "scale", "weights_dtype")


def _validate(logits, bias, top_k, n_group, topk_group, scoring, renormalize, renorm_eps, scale, weights_dtype) -> None:
    require_dtype(logits, (torch.float32, torch.bfloat16, torch.float16), "logits")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if bias is not None:
        require_dtype(bias, (torch.float32, torch.bfloat16, torch.float16), "bias")
        require_shape(bias, (experts,), "bias")
    if scoring not in SCORING.values():
        raise ValueError(f"scoring must be 0 (sigmoid) or 1 (softmax), got {scoring}")
    if n_group < 1 or (isinstance(experts, int) and experts % n_group):
        raise ValueError(f"n_group {n_group} must divide the {experts} experts")
    if n_group > 1:
        per_group = experts // n_group
        if per_group < GROUP_TOP:
            raise ValueError(f"groups of {per_group} experts cannot be scored by their top {GROUP_TOP}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group {topk_group} must be in [1, {n_group}]")
        available = topk_group * per_group
    else:
        available = experts
    if isinstance(available, int) and not 1 <= top_k <= available:
        raise ValueError(f"top_k {top_k} must be in [1, {available}] (the experts left after group masking)")
    if weights_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"weights_dtype {weights_dtype} not supported")
    if not (isinstance(renorm_eps, (int, float)) and not isinstance(renorm_eps, bool) and renorm_eps >= 0):
        raise ValueError(f"renorm_eps must be a float >= 0, got {renorm_eps}")


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def moe_route_reference(
    logits, bias=None, top_k=8, n_group=1, topk_group=1, scoring=0, renormalize=True, renorm_eps=0.0,
    scale=1.0, weights_dtype=torch.float32,
):  # fmt: skip
    _validate(logits, bias, top_k, n_group, topk_group, scoring, renormalize, renorm_eps, scale, weights_dtype)
    h = logits.float()
    s = torch.sigmoid(h) if scoring == 0 else torch.softmax(h, dim=-1)
    choice = s + bias.float() if bias is not None else s
    if n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        group_scores = torch.sort(grouped, dim=-1, descending=True).values[..., :GROUP_TOP].sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, _top(group_scores, topk_group), True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, experts)
    ids = _top(choice, top_k)
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + renorm_eps)
    return (w * scale).to(weights_dtype).contiguous(), ids.contiguous()


@torch.library.custom_op("fusion_compiler::moe_route", mutates_args=(), schema=_SCHEMA)
def _op(*args):
    return moe_route_reference(*args)


@_op.register_fake
def _fake(*args):
    _validate(*args)
    logits, top_k, weights_dtype = args[0], args[2], args[9]
    return logits.new_empty((logits.shape[0], top_k), dtype=weights_dtype), logits.new_empty(
        (logits.shape[0], top_k), dtype=torch.int64
    )


@_op.register_kernel("cuda")
def _cuda(*args):
    from fusion_compiler.kernels.moe_route import moe_route_fwd

    _validate(*args)
    named = dict(zip(_ARG_NAMES, args))
    logits, top_k = named["logits"], named["top_k"]
    weights = torch.empty((logits.shape[0], top_k), dtype=named["weights_dtype"], device=logits.device)
    ids = torch.empty((logits.shape[0], top_k), dtype=torch.int64, device=logits.device)
    moe_route_fwd(named, weights, ids)
    return weights, ids


def moe_route(logits, bias=None, *, top_k, n_group=1, topk_group=1, scoring="sigmoid", renormalize=True,
              renorm_eps=0.0, scale=1.0, weights_dtype=torch.float32):  # fmt: skip
    """Keyword front end of ``torch.ops.fusion_compiler.moe_route``."""
    return torch.ops.fusion_compiler.moe_route(
        logits, bias, top_k, n_group, topk_group, SCORING[scoring], renormalize, float(renorm_eps), float(scale), weights_dtype
    )


# ---------------------------------------------------------------------------------------------
# Router GEMM + routing
# ---------------------------------------------------------------------------------------------
#
#   fusion_compiler::moe_router(Tensor hidden, Tensor router_weight, <moe_route's routing args>,
#                               ScalarType logits_dtype) -> (Tensor weights, Tensor ids, Tensor logits)
#
#   logits = F.linear(hidden.to(logits_dtype), router_weight.to(logits_dtype))   [T, E]
#   weights, ids = moe_route(logits, ...)
#
# DeepSeek's router is an fp32 GEMM of bf16 operands (``F.linear(x.float(), w.float())``),
# MiniMax's and Qwen's a bf16 GEMM. On CUDA our own GEMM reads the bf16 weight as it is (no fp32
# copy) with fp32 accumulation, then the routing kernel: two launches (a one-launch form for
# few tokens exists, off until measured: kernels/moe_route.py, FUSED_GEMM_MAX_TOKENS). Each
# operand's dtype must widen exactly to logits_dtype (or be it). Summation order differs from
# cuBLAS's, so logits agree to rounding, and ids wherever scores are not within that rounding
# of a tie.

#
# Qwen3.5's shared-expert gate, ``sigmoid(F.linear(hidden, gate_weight))`` with a [1, H] weight
# (``shared_expert_gate``), reads the same hidden states: with ``gate_weight`` the op computes it
# as one more row of the router GEMM and returns it as ``gate`` [T, 1] in hidden's dtype
# (otherwise ``gate`` is [T, 0]).

_ROUTER_SCHEMA = (
    "(Tensor hidden, Tensor router_weight, Tensor? bias, int top_k, int n_group, int topk_group, int scoring, "
    "bool renormalize, float renorm_eps, float scale, ScalarType weights_dtype, ScalarType logits_dtype, "
    "Tensor? gate_weight=None) -> (Tensor weights, Tensor ids, Tensor logits, Tensor gate)"
)
_ROUTER_ARG_NAMES = ("hidden", "router_weight") + _ARG_NAMES[1:] + ("logits_dtype", "gate_weight")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def router_args(args) -> dict:
    """moe_router's positional arguments by name (gate_weight defaults to None)."""
    named = dict(zip(_ROUTER_ARG_NAMES, args))
    named.setdefault("gate_weight", None)
    return named


def _routing_args(named: dict) -> tuple:
    return tuple(named[n] for n in _ARG_NAMES[1:])


def widening_reason(name: str, dtype: torch.dtype, logits_dtype: torch.dtype) -> str | None:
    """Why a router-GEMM operand cannot feed ``logits_dtype`` logits (None when it can): it must
    be a float of that dtype or a narrower one (an exact widening)."""
    if dtype not in _FLOATS:
        return f"{name} is {dtype}, not fp32/bf16/fp16"
    if dtype != logits_dtype and dtype.itemsize >= logits_dtype.itemsize:
        return f"{name} ({dtype}) does not widen exactly to the {logits_dtype} logits"
    return None


def _validate_router(*args) -> dict:
    named = router_args(args)
    hidden, router_weight, logits_dtype = named["hidden"], named["router_weight"], named["logits_dtype"]
    if hidden.dim() != 2 or router_weight.dim() != 2 or hidden.shape[1] != router_weight.shape[1]:
        raise ValueError(
            f"hidden [tokens, H] and router_weight [experts, H] expected, got {tuple(hidden.shape)} "
            f"and {tuple(router_weight.shape)}"
        )
    if logits_dtype not in _FLOATS:
        raise ValueError(f"logits_dtype {logits_dtype} not supported")
    for name, t in (("hidden", hidden), ("router_weight", router_weight)):
        reason = widening_reason(name, t.dtype, logits_dtype)
        if reason:
            raise ValueError(reason)
    gate_weight = named["gate_weight"]
    if gate_weight is not None:
        require_shape(gate_weight, (1, hidden.shape[1]), "gate_weight")
        if gate_weight.dtype != hidden.dtype:
            raise ValueError(f"gate_weight is {gate_weight.dtype}, hidden {hidden.dtype}: F.linear needs one dtype")
    logits = hidden.new_empty((hidden.shape[0], router_weight.shape[0]), dtype=logits_dtype, device="meta")
    _validate(logits, *_routing_args(named))
    return named


def router_logits(hidden: torch.Tensor, router_weight: torch.Tensor, logits_dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.linear(hidden.to(logits_dtype), router_weight.to(logits_dtype))


def moe_router_reference(*args):
    named = _validate_router(*args)
    hidden, gate_weight = named["hidden"], named["gate_weight"]
    logits = router_logits(hidden, named["router_weight"], named["logits_dtype"])
    weights, ids = moe_route_reference(logits, *_routing_args(named))
    if gate_weight is None:
        gate = hidden.new_empty((hidden.shape[0], 0))
    else:
        gate = torch.sigmoid(torch.nn.functional.linear(hidden, gate_weight))
    return weights, ids, logits, gate


@torch.library.custom_op("fusion_compiler::moe_router", mutates_args=(), schema=_ROUTER_SCHEMA)
def _router_op(*args):
    return moe_router_reference(*args)


@_router_op.register_fake
def _router_fake(*args):
    named = _validate_router(*args)
    hidden, experts, top_k = named["hidden"], named["router_weight"].shape[0], named["top_k"]
    tokens = hidden.shape[0]
    return (
        hidden.new_empty((tokens, top_k), dtype=named["weights_dtype"]),
        hidden.new_empty((tokens, top_k), dtype=torch.int64),
        hidden.new_empty((tokens, experts), dtype=named["logits_dtype"]),
        hidden.new_empty((tokens, 0 if named["gate_weight"] is None else 1)),
    )


@_router_op.register_kernel("cuda")
def _router_cuda(*args):
    from fusion_compiler.kernels.moe_route import moe_router_fwd

    named = _validate_router(*args)
    hidden, router_weight, gate_weight = named["hidden"], named["router_weight"], named["gate_weight"]
    tokens, experts, top_k = hidden.shape[0], router_weight.shape[0], named["top_k"]
    weights = torch.empty((tokens, top_k), dtype=named["weights_dtype"], device=hidden.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=hidden.device)
    logits = torch.empty((tokens, experts), dtype=named["logits_dtype"], device=hidden.device)
    gate = torch.empty((tokens, 0 if gate_weight is None else 1), dtype=hidden.dtype, device=hidden.device)
    unit = [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (hidden, router_weight, gate_weight)]
    # The kernel takes the gate output only with its weight; the empty [T, 0] one is the op's shape.
    moe_router_fwd(named, unit[0], unit[1], logits, weights, ids, gate_weight=unit[2],
                   gate=None if gate_weight is None else gate)
    return weights, ids, logits, gate


def moe_router(hidden, router_weight, bias=None, *, top_k, n_group=1, topk_group=1, scoring="sigmoid",
               renormalize=True, renorm_eps=0.0, scale=1.0, weights_dtype=torch.float32, logits_dtype=None,
               gate_weight=None):  # fmt: skip
    """Keyword front end of ``torch.ops.fusion_compiler.moe_router`` (logits_dtype: the router
    weight's dtype when not given)."""
    return torch.ops.fusion_compiler.moe_router(
        hidden, router_weight, bias, top_k, n_group, topk_group, SCORING[scoring], renormalize, float(renorm_eps),
        float(scale), weights_dtype, logits_dtype or router_weight.dtype, gate_weight,
    )
