"""The fp32 paths of the kernels that fp32 models fuse into, against the same math in float64.

An fp32 model's sites fuse (mla_prologue's four roles, gdn_decode); the other kernel tests
compare each kernel with its op's reference, which computes in fp32 too. Here the truth is the
math written out in float64, so the fp32 kernel's own error is what is measured: under the
interpreter 3e-8 to 7e-8 of each output's largest value for the prologues, 2e-7 for the GDN
step (its delta-rule sums); the bound leaves 10x for the GPU's rsqrt and summation order. dsa_topk_mask and
decode_attention compare with float64 truths in their own tests (fp32 cases included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_fixtures import DEVICE, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import gdn_decode as gdn_kernel  # noqa: E402
from fusion_compiler.kernels import mla_kv_prologue as kv_kernel  # noqa: E402
from fusion_compiler.kernels import mla_q_prologue as q_kernel  # noqa: E402
from fusion_compiler.ops import mla_kv_prologue as kv_op  # noqa: E402
from fusion_compiler.ops import mla_q_prologue as q_op  # noqa: E402

TOLERANCE = 2e-6  # relative to each output's largest magnitude


def _assert_near(out: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.float32, what
    error = float((out.double().cpu() - truth).abs().max() / truth.abs().max())
    assert error < TOLERANCE, f"{what}: {error:.2e} from float64"


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _pairs(x, cos, sin):
    """GPT-J pairs rotated in place: (x0, x1), (x2, x3), ..."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def _halves(x, cos, sin, rot):
    """NeoX halves of the first rot dims; the rest as it is."""
    x1, x2 = x[..., : rot // 2], x[..., rot // 2 : rot]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]), dim=-1)


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * scale


def _run(kernel_fwd, op, args):
    outs = [torch.empty(shape, dtype=dtype, device=DEVICE) for shape, dtype in op.output_shapes(args)]
    kernel_fwd(args, *outs)
    return outs


def test_mla_kv_prologue_fp32_matches_float64():
    """q, kv and index_k roles (no FP8: an fp32 model's HF sites), one launch."""
    gen = torch.Generator().manual_seed(0)
    tokens, q_rank, kv_rank, rot, dim = 3, 192, 128, 32, 64
    q_c, kv_c, k_pe = _randn(gen, tokens, q_rank), _randn(gen, tokens, kv_rank), _randn(gen, tokens, rot)
    index_k = _randn(gen, tokens, dim, scale=2.0) + 0.5
    q_w, kv_w = _randn(gen, q_rank) + 1, _randn(gen, kv_rank) + 1
    ik_w, ik_b = _randn(gen, dim) + 1, _randn(gen, dim, scale=0.1)
    cos, sin = _randn(gen, tokens, rot // 2), _randn(gen, tokens, rot // 2)
    args = dict(zip(kv_op._ARG_NAMES, kv_op.mla_kv_prologue_reference.__defaults__))
    args.update(q_c=q_c, q_weight=q_w, q_eps=1e-6, kv_c=kv_c, k_pe=k_pe, kv_weight=kv_w, kv_eps=1e-5,
                return_kv=True, index_k=index_k, index_k_weight=ik_w, index_k_bias=ik_b, index_k_eps=1e-6,
                return_index_k=True, cos=cos, sin=sin)  # fmt: skip
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    q_out, _, kv_out, k_pe_out, index_k_out = _run(kv_kernel.mla_kv_prologue_fwd, kv_op, args)

    d = {k: v.double() for k, v in locals().items() if isinstance(v, torch.Tensor) and v.dtype == torch.float32}
    centred = d["index_k"] - d["index_k"].mean(-1, keepdim=True)
    normed_k = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * d["ik_w"] + d["ik_b"]
    _assert_near(q_out, _rms(d["q_c"], d["q_w"], 1e-6), "q_out")
    _assert_near(kv_out, _rms(d["kv_c"], d["kv_w"], 1e-5), "kv_out")
    _assert_near(k_pe_out, _pairs(d["k_pe"], d["cos"], d["sin"]), "k_pe_out")
    _assert_near(index_k_out, _halves(normed_k, d["cos"], d["sin"], rot), "index_k_out")


def test_mla_q_prologue_fp32_matches_float64():
    """q role (RoPE of q_pe after q_nope) and index_q role with head weights, no FP8."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads, rot, nope, index_heads, dim = 3, 4, 32, 48, 4, 64
    q_pe, q_other = _randn(gen, tokens, heads, rot), _randn(gen, tokens, heads, nope)
    index_q, weights = _randn(gen, tokens, index_heads, dim, scale=3.0), _randn(gen, tokens, index_heads)
    cos, sin = _randn(gen, tokens, rot // 2), _randn(gen, tokens, rot // 2)
    args = dict(zip(q_op._ARG_NAMES, q_op.mla_q_prologue_reference.__defaults__))
    args.update(q_pe=q_pe, q_other=q_other, index_q=index_q, index_weights=weights, index_weights_scale=0.125,
                cos=cos, sin=sin)  # fmt: skip
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    q_out, index_q_out, weights_out = _run(q_kernel.mla_q_prologue_fwd, q_op, args)

    angles = cos.double()[:, None], sin.double()[:, None]
    _assert_near(q_out, torch.cat([q_other.double(), _pairs(q_pe.double(), *angles)], dim=-1), "q_out")
    _assert_near(index_q_out, _halves(index_q.double(), *angles, rot), "index_q_out")
    _assert_near(weights_out, weights.double() * 0.125, "index_weights_out")


def _gdn_float64(x, z, b, a, conv_w, A_log, dt_bias, norm_w, eps, l2_eps, conv_state, state, key_heads, key_dim):
    """One decode step of every row (slot = row), HF's math in float64: (out, new conv, new state)."""
    tokens, value_heads, _, value_dim = state.shape
    kernel = conv_w.shape[-1]
    window = torch.cat([conv_state, x[..., None]], dim=-1)
    qkv = F.silu((window[..., -kernel:] * conv_w).sum(-1))
    q, k, v = qkv.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    ratio = value_heads // key_heads
    q = q.reshape(tokens, key_heads, key_dim).repeat_interleave(ratio, dim=1)
    k = k.reshape(tokens, key_heads, key_dim).repeat_interleave(ratio, dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + l2_eps) / key_dim**0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + l2_eps)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    state = state * g.exp()[..., None, None]
    delta = (v.reshape(tokens, value_heads, value_dim) - (state * k[..., None]).sum(-2)) * torch.sigmoid(b)[..., None]
    state = state + k[..., None] * delta[..., None, :]
    o = (state * q[..., None]).sum(-2)
    out = _rms(o, norm_w, eps) * F.silu(z.reshape(tokens, value_heads, value_dim))
    return out.reshape(tokens, -1), window[..., 1:], state


def test_gdn_decode_fp32_matches_float64():
    """Two sequences, 2 key heads shared by 4 value heads, HF's K-wide conv state."""
    gen = torch.Generator().manual_seed(2)
    tokens, key_heads, value_heads, key_dim, value_dim, kernel = 2, 2, 4, 16, 32, 4
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    inputs = [_randn(gen, tokens, conv_dim), _randn(gen, tokens, value_heads * value_dim),
              _randn(gen, tokens, value_heads), _randn(gen, tokens, value_heads), _randn(gen, conv_dim, kernel, scale=0.5),
              torch.rand(value_heads, generator=gen) * 2, _randn(gen, value_heads), _randn(gen, value_dim, scale=0.2) + 1]  # fmt: skip
    conv_state, state = _randn(gen, tokens, conv_dim, kernel), _randn(gen, tokens, value_heads, key_dim, value_dim, scale=0.2)
    truth = _gdn_float64(*[t.double() for t in inputs], 1e-6, 1e-6, conv_state.double(), state.double(),
                         key_heads, key_dim)  # fmt: skip
    args = [t.to(DEVICE) for t in inputs] + [1e-6, 1e-6, conv_state.to(DEVICE), state.to(DEVICE),
                                             torch.arange(tokens, device=DEVICE)]  # fmt: skip
    out = torch.empty(tokens, value_heads * value_dim, device=DEVICE)
    gdn_kernel.gdn_decode_fwd(*args, out)
    _assert_near(out, truth[0], "out")
    _assert_near(args[10], truth[1], "conv state")
    _assert_near(args[11], truth[2], "recurrent state")
