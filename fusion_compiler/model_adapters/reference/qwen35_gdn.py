"""Qwen3.5 Gated DeltaNet (linear attention) decode as a serving engine runs it, in plain torch.

HF's ``Qwen3_5MoeGatedDeltaNet`` keeps one conv state and one recurrent state per batch row of
its cache. A serving engine (vLLM's ``QwenGatedDeltaNetAttention``, docs/MODELS.md) keeps them
in per-sequence **state slots** and addresses them with a state-slot tensor, one slot per
decoding sequence:

* ``conv_state``      [num_slots, conv_dim, W] in the activation dtype, W = K - 1 (vLLM; HF
  keeps W = K, the oldest column shifted out unread; ``GdnConfig.conv_state_width`` picks);
* ``recurrent_state`` [num_slots, Hv, Dk, Dv] fp32, HF's layout ``S[key, value]``.

One decode step of T sequences, one token each (``state_slots`` [T], distinct, all valid: a
plain ``index_put_`` wraps -1 to the last slot; the fused op skips vLLM's padding slot -1):

1. ``causal_conv1d_update``: window = [state | x] per channel, the state shifts left by one, a
   depthwise conv over the last K columns in fp32, SiLU in fp32, one rounding (vLLM's Triton
   kernel computes it so);
2. split into q [Hk, Dk], k [Hk, Dk], v [Hv, Dv]; value head h reads key head h // (Hv / Hk)
   (HF's ``repeat_interleave``);
3. the gated delta rule, one step, fp32 (vLLM's ``fused_recurrent_gated_delta_rule``):
   q, k L2-normalised (eps 1e-6 inside the sum), q scaled by Dk^-0.5,
   g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b);
   S = S * exp(g); S = S + k (x) (v - S^T k) * beta; o = S^T q;
4. the gated RMSNorm after the norm (``norm_before_gate``): rms(o) * w * silu(z), fp32, one
   rounding (vLLM's ``RMSNormGated``; HF's ``Qwen3_5MoeRMSNormGated`` rounds the normalised o
   and multiplies the weight in bf16 before the fp32 gate).

Rounding differences from HF (bf16): HF rounds the conv output to bf16 before the SiLU, beta to
bf16, and the gated norm twice more; here each of those stays fp32 to one final rounding. The
states agree to fp32 reordering plus what the bf16 roundings feed into them
(tests/model_adapters/reference/test_qwen35_gdn.py measures both).

Projections: HF 5.17 has four GEMMs, ``in_proj_qkv`` ([q | k | v], 2 * key_dim + value_dim),
``in_proj_z``, ``in_proj_b``, ``in_proj_a``; this module keeps them. vLLM merges them into
``in_proj_qkvz`` ([q | k | v | z] along the output dim) and ``in_proj_ba`` ([b | a]) and splits
the outputs: the same columns, so the core below reads the same tensors. Qwen3-Next instead
interleaves qkvz and ba per key-head group (``gqa_interleaved_layout``), which needs a
reordering of the projection's columns before the core; it is not modelled here.

Everything here is ordinary model code: nothing imports the compiler's ops.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

QK_L2NORM_EPS = 1e-6  # HF and fla hard-code it


@dataclasses.dataclass(frozen=True)
class GdnConfig:
    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    conv_state_width: int | None = None  # None: K - 1 (vLLM); K: HF's cache width

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"{self.num_value_heads} value heads do not share {self.num_key_heads} key heads evenly")
        if self.state_width < self.conv_kernel - 1:
            raise ValueError(f"conv_state_width {self.state_width} < conv_kernel - 1 = {self.conv_kernel - 1}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_width(self) -> int:
        return self.conv_kernel - 1 if self.conv_state_width is None else self.conv_state_width

    def conv_state_shape(self, num_slots: int) -> tuple[int, int, int]:
        return (num_slots, self.conv_dim, self.state_width)

    def recurrent_state_shape(self, num_slots: int) -> tuple[int, int, int, int]:
        return (num_slots, self.num_value_heads, self.key_head_dim, self.value_head_dim)


REAL = GdnConfig(hidden_size=4096, num_key_heads=16, num_value_heads=64, key_head_dim=128, value_head_dim=128)
# The adapter's tiny config (linear heads 2 / 4 of 64).
TINY = GdnConfig(hidden_size=256, num_key_heads=2, num_value_heads=4, key_head_dim=64, value_head_dim=64)


def causal_conv1d_update(x, conv_state, state_slots, weight):
    """x [T, C]; conv_state [slots, C, W] updated at ``state_slots``; weight [C, K]. Returns
    SiLU(conv) [T, C] in x's dtype (fp32 sums and SiLU, one rounding)."""
    window = torch.cat([conv_state[state_slots], x.unsqueeze(-1)], dim=-1)  # [T, C, W + 1]
    conv_state[state_slots] = window[:, :, 1:]
    taps = window[:, :, -weight.shape[-1] :]
    return F.silu((taps.float() * weight.float()).sum(-1)).to(x.dtype)


def l2norm(x, eps: float = QK_L2NORM_EPS):
    """fla's l2norm: x / sqrt(sum(x^2) + eps), as a product with rsqrt."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule_step(q, k, v, g, beta, recurrent_state, state_slots):
    """One recurrent step per sequence, fp32: q, k [T, Hv, Dk] (already per value head), v [T,
    Hv, Dv], g and beta [T, Hv]; updates ``recurrent_state`` [slots, Hv, Dk, Dv] at the slots and
    returns o [T, Hv, Dv] in v's dtype."""
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    state = recurrent_state[state_slots] * g.exp()[:, :, None, None]
    kv_mem = (state * k.unsqueeze(-1)).sum(-2)
    delta = (v.float() - kv_mem) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    recurrent_state[state_slots] = state
    return (state * q.unsqueeze(-1)).sum(-2).to(v.dtype)


def gated_rms_norm(x, gate, weight, eps: float):
    """vLLM's ``RMSNormGated`` (norm before gate), fp32: rms(x) * w * silu(gate), one rounding."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float() * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One GDN layer's decode step: x [T, hidden] (one token per sequence) -> [T, hidden]."""

    def __init__(self, cfg: GdnConfig):
        super().__init__()
        self.cfg = cfg
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, cfg.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, cfg.num_value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(cfg.conv_dim, cfg.conv_kernel) * cfg.conv_kernel**-0.5)
        self.A_log = nn.Parameter(torch.empty(cfg.num_value_heads).uniform_(0.01, 16).log())
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.norm_weight = nn.Parameter(torch.ones(cfg.value_head_dim))
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x, conv_state, recurrent_state, state_slots):
        core = self.core(self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x),
                         conv_state, recurrent_state, state_slots)  # fmt: skip
        return self.out_proj(core)

    def core(self, mixed_qkv, z, b, a, conv_state, recurrent_state, state_slots):
        """The projections' outputs -> out_proj's input [T, value_dim]; updates both states at
        ``state_slots``: the region the gdn fusion replaces."""
        cfg = self.cfg
        mixed_qkv = causal_conv1d_update(mixed_qkv, conv_state, state_slots, self.conv_weight)
        q, k, v = mixed_qkv.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        ratio = cfg.num_value_heads // cfg.num_key_heads
        q = q.view(-1, cfg.num_key_heads, cfg.key_head_dim).repeat_interleave(ratio, dim=1)
        k = k.view(-1, cfg.num_key_heads, cfg.key_head_dim).repeat_interleave(ratio, dim=1)
        v = v.view(-1, cfg.num_value_heads, cfg.value_head_dim)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = b.float().sigmoid()
        o = gated_delta_rule_step(q, k, v, g, beta, recurrent_state, state_slots)
        z = z.view(-1, cfg.num_value_heads, cfg.value_head_dim)
        return gated_rms_norm(o, z, self.norm_weight, cfg.rms_norm_eps).reshape(-1, cfg.value_dim)

    def new_states(self, num_slots: int, dtype: torch.dtype | None = None, device=None):
        """Zeroed (conv_state, recurrent_state) for ``num_slots`` sequences."""
        dtype = dtype or self.in_proj_qkv.weight.dtype
        device = device or self.in_proj_qkv.weight.device
        return (torch.zeros(self.cfg.conv_state_shape(num_slots), dtype=dtype, device=device),
                torch.zeros(self.cfg.recurrent_state_shape(num_slots), dtype=torch.float32, device=device))  # fmt: skip


def from_hf(hf_gdn: nn.Module, cfg: GdnConfig) -> GatedDeltaNet:
    """Our GDN layer with the weights of HF's Qwen3_5MoeGatedDeltaNet: the four projections,
    conv1d.weight [C, 1, K] as [C, K], A_log, dt_bias, the gated norm's weight, out_proj. HF's
    conv has no bias (the real model has none)."""
    if hf_gdn.conv1d.bias is not None:
        raise ValueError("HF GDN conv1d has a bias; the reference has none")
    ours = GatedDeltaNet(cfg).to(hf_gdn.in_proj_qkv.weight.dtype)
    with torch.no_grad():
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            getattr(ours, name).weight.copy_(getattr(hf_gdn, name).weight)
        ours.conv_weight.copy_(hf_gdn.conv1d.weight.squeeze(1))
        ours.A_log.copy_(hf_gdn.A_log)
        ours.dt_bias.copy_(hf_gdn.dt_bias)
        ours.norm_weight.copy_(hf_gdn.norm.weight)
    return ours.to(hf_gdn.in_proj_qkv.weight.device)


def config_of(hf_text_config, **overrides) -> GdnConfig:
    """The GDN reference config of an HF Qwen3_5MoeTextConfig."""
    c = hf_text_config
    return GdnConfig(
        hidden_size=c.hidden_size, num_key_heads=c.linear_num_key_heads, num_value_heads=c.linear_num_value_heads,
        key_head_dim=c.linear_key_head_dim, value_head_dim=c.linear_value_head_dim,
        conv_kernel=c.linear_conv_kernel_dim, rms_norm_eps=c.rms_norm_eps, **overrides,
    )  # fmt: skip
