"""Gated DeltaNet decode step (Qwen3.5 linear attention), from the projections' outputs to the
input of out_proj, one op (issue 6).

    fusion_compiler::gdn_decode(Tensor mixed_qkv, Tensor z, Tensor b, Tensor a, Tensor conv_weight,
        Tensor A_log, Tensor dt_bias, Tensor norm_weight, float eps, float qk_l2norm_eps,
        Tensor(a!) conv_state, Tensor(b!) recurrent_state, Tensor state_slots) -> Tensor out

Source of the semantics: transformers 5.17 ``Qwen3_5MoeGatedDeltaNet.forward``, cached decode
(``seq_len == 1``) with the torch fallbacks ``causal_conv1d_update``,
``torch_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True)`` and
``Qwen3_5MoeRMSNormGated``. ``gdn_decode_reference`` is the numerical truth; it follows HF
operation by operation, with HF's dtypes and rounding points.

Arguments; T sequences with one token each, Hk key heads of Dk, Hv value heads of Dv
(Hv a multiple of Hk), conv_dim = 2 * Hk * Dk + Hv * Dv, K conv taps:

    mixed_qkv        [T, conv_dim]      in_proj_qkv output, [q | k | v] (any row stride); its dtype
                                        is the activation dtype (conv_state's and the output's)
    z                [T, Hv * Dv]       in_proj_z output (gate)
    b, a             [T, Hv]            in_proj_b / in_proj_a outputs
    conv_weight      [conv_dim, K] or [conv_dim, 1, K]   depthwise conv1d weight, no bias
    A_log, dt_bias   [Hv]
    norm_weight      [Dv]               the gated RMSNorm's weight (plain ``w``, no Gemma offset)
    eps              the gated norm's eps (config.rms_norm_eps)
    qk_l2norm_eps    the l2norm eps of q and k (HF hard-codes 1e-6)
    conv_state       [num_slots, conv_dim, W], W >= K - 1, activation dtype, mutated. HF keeps
                     W = K (its cache is ``conv_kernel_size`` wide; the oldest column is shifted
                     out unread), vLLM W = K - 1: both work, the conv reads the last K - 1
                     columns and the state shifts left by one with the new column at W - 1.
    recurrent_state  [num_slots, Hv, Dk, Dv] fp32, mutated: HF's layout, S[key, value].
    state_slots      [T] int: the slot of each sequence in both states; -1 is padding (its
                     output row is zero, no state is read or written). Live slots are distinct.

Math per live row (HF's order; ``r_X`` = rounded to dtype X; act = mixed_qkv.dtype, cw =
conv_weight.dtype, bd = b.dtype):

    window  = r_cw([conv_state[slot], x])            [conv_dim, W + 1]; state <- window[:, 1:]
    qkv     = r_act(r_cw(silu(r_cw(sum_i window[:, W+1-K+i] * w[:, i]))))  (fp32 sums)
    q, k, v = split(qkv) -> [Hk, Dk], [Hk, Dk], [Hv, Dv]; q, k repeat_interleave'd to Hv
              (value head h uses key head h // (Hv / Hk))
    beta    = r_bd(sigmoid(b));  g = -exp(A_log.float()) * softplus(a.float() + dt_bias)
    q, k    = l2norm(q.float()), l2norm(k.float())    x * rsqrt(sum(x * x) + qk_l2norm_eps)
    q       = q / Dk ** 0.5
    S       = S * exp(g);  kv_mem = sum_k S * k;  delta = (v - kv_mem) * beta
    S       = S + k (x) delta;  o = r_act(sum_k S * q)                     (all fp32)
    out     = r_act(r_nw(norm_weight * r_act(o * rsqrt(mean(o^2) + eps))) * silu(z.float()))

where nw = promote(norm_weight.dtype, act): HF multiplies the weight in bf16 before the fp32
gate (vLLM does all of it in fp32; the difference is one bf16 rounding). Reductions here sum in
a different order than HF's, so fp32 states agree to a few ulp and outputs to bf16 tolerance
(tests/ops/test_gdn_decode.py measures both).

On CUDA the op runs ``kernels/gdn_decode.py`` (checked under the Triton interpreter and on the
H200). ``patterns/gdn.py`` emits it (lowering "triton"), ``gdn_decode_fla`` (the same contract on
fla-core's kernels, ``kernels/gdn_fla.py``; lowering "fla"), or ``gdn_decode_canonical``, the
same math as a functional graph (lowering "inductor").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._checks import require_dtype, require_shape, require_size_eq, require_slots_in_range
from .padding_slots import padded_scatter_rows

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)

_SCHEMA = (
    "(Tensor mixed_qkv, Tensor z, Tensor b, Tensor a, Tensor conv_weight, Tensor A_log, Tensor dt_bias, "
    "Tensor norm_weight, float eps, float qk_l2norm_eps, Tensor(a!) conv_state, Tensor(b!) recurrent_state, "
    "Tensor state_slots) -> Tensor"
)


@dataclass(frozen=True)
class GdnDims:
    """Sizes derived from the arguments' shapes."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    conv_dim: int
    kernel: int
    width: int

    @property
    def ratio(self) -> int:
        return self.value_heads // self.key_heads


def _validate(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps, conv_state,
              recurrent_state, state_slots) -> GdnDims:  # fmt: skip
    for name, t in (("mixed_qkv", mixed_qkv), ("z", z), ("b", b), ("a", a), ("conv_weight", conv_weight),
                    ("A_log", A_log), ("dt_bias", dt_bias), ("norm_weight", norm_weight)):  # fmt: skip
        require_dtype(t, _FLOATS, name)
    require_dtype(state_slots, _INTS, "state_slots")
    require_dtype(recurrent_state, (torch.float32,), "recurrent_state")
    if conv_state.dtype != mixed_qkv.dtype:
        raise ValueError(f"conv_state dtype {conv_state.dtype} must be mixed_qkv's {mixed_qkv.dtype}")
    if mixed_qkv.dim() != 2 or conv_state.dim() != 3 or recurrent_state.dim() != 4:
        raise ValueError(
            f"expected mixed_qkv [T, conv_dim], conv_state [slots, conv_dim, W], recurrent_state "
            f"[slots, Hv, Dk, Dv]; got {tuple(mixed_qkv.shape)}, {tuple(conv_state.shape)}, "
            f"{tuple(recurrent_state.shape)}"
        )
    tokens, conv_dim = mixed_qkv.shape
    num_slots, value_heads, key_dim, value_dim = recurrent_state.shape
    if conv_weight.dim() == 3:
        require_size_eq(conv_weight.shape[1], 1, "conv_weight [conv_dim, 1, K] dim 1")
    elif conv_weight.dim() != 2:
        raise ValueError(f"conv_weight must be [conv_dim, K] or [conv_dim, 1, K], got {tuple(conv_weight.shape)}")
    kernel, width = conv_weight.shape[-1], conv_state.shape[-1]
    require_size_eq(conv_weight.shape[0], conv_dim, "conv_weight dim 0 (conv_dim)")
    require_shape(conv_state, (num_slots, conv_dim, None), "conv_state")
    if not (kernel >= 1 and width >= max(kernel - 1, 1)):
        raise ValueError(f"conv_state width {width} must be >= kernel - 1 = {kernel - 1} (and >= 1)")
    key_width = conv_dim - value_heads * value_dim
    if key_width <= 0 or key_width % (2 * key_dim):
        raise ValueError(
            f"conv_dim {conv_dim} is not 2 * key_heads * {key_dim} + {value_heads} * {value_dim} (from recurrent_state)"
        )
    key_heads = key_width // (2 * key_dim)
    if value_heads % key_heads:
        raise ValueError(f"{value_heads} value heads do not share {key_heads} key heads evenly")
    require_shape(z, (tokens, value_heads * value_dim), "z")
    require_shape(b, (tokens, value_heads), "b")
    require_shape(a, (tokens, value_heads), "a")
    require_shape(A_log, (value_heads,), "A_log")
    require_shape(dt_bias, (value_heads,), "dt_bias")
    require_shape(norm_weight, (value_dim,), "norm_weight")
    require_shape(state_slots, (tokens,), "state_slots")
    if not (eps > 0 and qk_l2norm_eps > 0):
        raise ValueError(f"eps and qk_l2norm_eps must be > 0, got {eps}, {qk_l2norm_eps}")
    return GdnDims(key_heads, key_dim, value_heads, value_dim, conv_dim, kernel, width)


def _live_slots(state_slots, num_slots):
    """Rows with a slot, and their slots (reference path: reads the slot values on the host)."""
    require_slots_in_range(state_slots, num_slots)
    live = (state_slots >= 0).nonzero().squeeze(1)
    slots = state_slots[live].long()
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"live state_slots must be distinct, got {state_slots.tolist()}")
    return live, slots


def _l2norm(x, eps):
    """HF's ``l2norm`` (FLA's form: eps inside the sum, not the mean)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _step(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps, conv_rows, state_rows,
          dims: GdnDims):  # fmt: skip
    """One decode step of n rows whose states were gathered already: conv_rows [n, conv_dim, W],
    state_rows [n, Hv, Dk, Dv] fp32. Returns (out [n, Hv * Dv], new conv rows, new state rows)."""
    hk, dk, hv, dv, kernel = dims.key_heads, dims.key_dim, dims.value_heads, dims.value_dim, dims.kernel
    act, n = mixed_qkv.dtype, mixed_qkv.shape[0]

    # causal_conv1d_update: the window is cast to the weight's dtype, conv1d accumulates in fp32
    # and rounds once, SiLU in the weight's dtype, then back to the activation dtype.
    w = conv_weight.reshape(dims.conv_dim, kernel)
    window = torch.cat([conv_rows, mixed_qkv.unsqueeze(-1)], dim=-1).to(w.dtype)
    conv = (window[..., -kernel:].float() * w.float()).sum(-1).to(w.dtype)
    qkv = F.silu(conv).to(act)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)

    beta = b.sigmoid()  # rounded to b's dtype, as in HF
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    q = q.repeat_interleave(dims.ratio, dim=1)
    k = k.repeat_interleave(dims.ratio, dim=1)

    # torch_recurrent_gated_delta_rule, one step, state [Hv, Dk, Dv].
    q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    q, k = _l2norm(q, qk_l2norm_eps), _l2norm(k, qk_l2norm_eps)
    q = q / (dk**0.5)
    state = state_rows * g.exp()[..., None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (state * q.unsqueeze(-1)).sum(dim=-2).to(act)

    # Qwen3_5MoeRMSNormGated: norm in fp32, rounded, weight applied in the promoted dtype, gate in fp32.
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = norm_weight * h.to(act)
    h = h * F.silu(z.reshape(n, hv, dv).float())
    return h.to(act).reshape(n, hv * dv), window[..., 1:], state


def gdn_decode_reference(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps,
                         conv_state, recurrent_state, state_slots):  # fmt: skip
    """Plain torch, any device; updates both states in place and returns out [T, Hv * Dv]."""
    dims = _validate(mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps, conv_state,
                     recurrent_state, state_slots)  # fmt: skip
    out = mixed_qkv.new_zeros(mixed_qkv.shape[0], dims.value_heads * dims.value_dim)
    live, slots = _live_slots(state_slots, conv_state.shape[0])
    if live.numel() == 0:
        return out
    rows, conv_rows, state_rows = _step(
        mixed_qkv[live], z[live], b[live], a[live], conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps,
        conv_state[slots], recurrent_state[slots], dims,
    )  # fmt: skip
    conv_state[slots] = conv_rows.to(conv_state.dtype)
    recurrent_state[slots] = state_rows
    out[live] = rows
    return out


ARG_NAMES = ("mixed_qkv", "z", "b", "a", "conv_weight", "A_log", "dt_bias", "norm_weight", "eps", "qk_l2norm_eps",
             "conv_state", "recurrent_state", "state_slots")  # fmt: skip


def gdn_decode_canonical(**kwargs):
    """The same math as a functional graph Inductor fuses (lowering "inductor"): returns (out,
    new conv_state, new recurrent_state), as ``auto_functionalized`` does. Every row is computed
    on the state at its slot clamped to >= 0; a padding row (-1) outputs zeros and writes the
    first live row's slot with that row's own new value (ops/padding_slots.py)."""
    args = [kwargs[name] for name in ARG_NAMES]
    dims = _validate(*args)
    mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps = args[:10]
    conv_state, recurrent_state, state_slots = args[10:]
    live = state_slots >= 0
    safe = state_slots.clamp(min=0).long()
    conv_old, state_old = conv_state[safe], recurrent_state[safe]
    out, conv_new, state_new = _step(
        mixed_qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, eps, qk_l2norm_eps, conv_old, state_old, dims
    )

    def write(state, new):
        index, rows = padded_scatter_rows(state_slots, new.to(state.dtype), lambda t: state[t.long()])
        return torch.ops.aten.index_put.default(state, [index.long()], rows)

    out = torch.where(live[:, None], out, torch.zeros_like(out))
    return out, write(conv_state, conv_new), write(recurrent_state, state_new)


@torch.library.custom_op(
    "fusion_compiler::gdn_decode", mutates_args=("conv_state", "recurrent_state"), schema=_SCHEMA
)
def _op(*args):
    return gdn_decode_reference(*args)


@_op.register_fake
def _fake(*args):
    dims = _validate(*args)
    mixed_qkv = args[0]
    return mixed_qkv.new_empty((mixed_qkv.shape[0], dims.value_heads * dims.value_dim))


@_op.register_kernel("cuda")
def _cuda(*args):
    from fusion_compiler.kernels.gdn_decode import gdn_decode_fwd

    dims = _validate(*args)
    mixed_qkv = args[0]
    out = torch.empty((mixed_qkv.shape[0], dims.value_heads * dims.value_dim), dtype=mixed_qkv.dtype,
                      device=mixed_qkv.device)  # fmt: skip
    gdn_decode_fwd(*args, out)
    return out


@torch.library.custom_op(
    "fusion_compiler::gdn_decode_fla", mutates_args=("conv_state", "recurrent_state"), schema=_SCHEMA
)
def _fla_op(*args):
    """gdn_decode's contract on fla-core's kernels (the gdn family's lowering "fla",
    ``kernels/gdn_fla.py``). Like every op here, its CPU body is the reference."""
    return gdn_decode_reference(*args)


_fla_op.register_fake(_fake)


@_fla_op.register_kernel("cuda")
def _fla_cuda(*args):
    from fusion_compiler.kernels.gdn_fla import gdn_decode_fla_fwd

    dims = _validate(*args)
    return gdn_decode_fla_fwd(*args, key_heads=dims.key_heads)
