"""fusion_compiler::gdn_decode's reference against HF's own Qwen3.5 GatedDeltaNet decode
(transformers 5.17 ``Qwen3_5MoeGatedDeltaNet`` with its torch fallbacks ``causal_conv1d_update``,
``torch_recurrent_gated_delta_rule``, ``Qwen3_5MoeRMSNormGated``) on tiny dims.

The module runs its real cached decode path; hooks capture its projections' outputs (the op's
inputs) and out_proj's input (the op's output). The op's states live in slot buffers of their
own, seeded from HF's cache after a prefill and then left to evolve on their own for 8 steps.
Measured (torch 2.13 CPU): bf16: outputs, conv states and recurrent states bit-equal to HF's.
fp32: conv states bit-equal; outputs and recurrent states within ~3e-7 relative, because CPU
``F.conv1d`` accumulates its 4 taps with fused multiply-adds and the reference with separate
multiplies and adds (an ulp apart in q/k/v). The asserts allow 1e-2 (bf16) / 1e-5 (fp32) on
outputs and 1e-6 on recurrent states: the math is the contract, not the summation order.
"""

from __future__ import annotations

import pytest
import torch

from fusion_compiler.ops import gdn_decode as op
from fusion_compiler.verify import relative_error

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig  # noqa: E402

HIDDEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, KERNEL = 64, 2, 4, 16, 32, 4
CONV_DIM = 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM
QK_L2NORM_EPS = 1e-6  # hard-coded in HF's torch_recurrent_gated_delta_rule
# HF's layer runs on the CPU (its torch fallbacks, whatever else is installed); the op runs
# where the kernels do. On CUDA the recurrence's fp32 sums round differently from the CPU's,
# so the recurrent-state bound is looser there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RECURRENT_TOL = 1e-5 if DEVICE == "cuda" else 1e-6


def _hf_layer(dtype):
    cfg = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, vocab_size=32, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    torch.manual_seed(0)
    layer = hf.Qwen3_5MoeGatedDeltaNet(cfg, 0)
    with torch.no_grad():  # move the defaults (dt_bias 1, norm weight 1) off their special values
        layer.dt_bias.normal_(0.0, 1.0)
        layer.norm.weight.normal_(1.0, 0.2)
    return cfg, layer.to(dtype)


class _Capture:
    """The projections' outputs and out_proj's input of the layer's last call."""

    def __init__(self, layer):
        self.seen = {}
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            getattr(layer, name).register_forward_hook(self._save(name))
        layer.out_proj.register_forward_pre_hook(lambda _m, args: self.seen.__setitem__("out_proj", args[0]))

    def _save(self, name):
        return lambda _m, _args, out: self.seen.__setitem__(name, out)

    def rows(self, name):
        x = self.seen[name]
        return x.reshape(x.shape[0] * x.shape[1], -1)  # [B, 1, width] -> [B, width]


def _op_args(layer, cap, pad_at, conv_state, recurrent_state, slots):
    """The op's arguments for the captured step, with a padding row inserted at ``pad_at``."""

    def padded(x):
        return torch.cat([x[:pad_at], torch.randn_like(x[:1]), x[pad_at:]]).to(DEVICE)

    return (
        padded(cap.rows("in_proj_qkv")), padded(cap.rows("in_proj_z")), padded(cap.rows("in_proj_b")),
        padded(cap.rows("in_proj_a")), layer.conv1d.weight.to(DEVICE), layer.A_log.to(DEVICE),
        layer.dt_bias.to(DEVICE), layer.norm.weight.to(DEVICE), layer.norm.variance_epsilon, QK_L2NORM_EPS,
        conv_state, recurrent_state, torch.cat([slots[:pad_at], torch.tensor([-1]), slots[pad_at:]]).to(DEVICE),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eight_decode_steps_match_hf_gated_deltanet(dtype):
    cfg, layer = _hf_layer(dtype)
    cap = _Capture(layer)
    batch, num_slots, pad_at = 3, 6, 1
    slots = torch.tensor([4, 0, 2])  # HF batch row i lives in slot slots[i]
    cache = DynamicCache(config=cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer(torch.randn(batch, 5, HIDDEN, generator=gen).to(dtype), cache_params=cache)  # prefill
    hf_conv, hf_rec = cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]
    assert hf_conv.shape == (batch, CONV_DIM, KERNEL) and hf_rec.dtype == torch.float32  # HF: width K, fp32 S

    conv_state = torch.randn(num_slots, CONV_DIM, KERNEL, generator=gen).to(dtype)
    recurrent_state = torch.randn(num_slots, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    conv_state[slots], recurrent_state[slots] = hf_conv, hf_rec
    conv_state, recurrent_state = conv_state.to(DEVICE), recurrent_state.to(DEVICE)
    others = torch.tensor([s for s in range(num_slots) if s not in slots.tolist()])
    conv_others, rec_others = conv_state[others].clone(), recurrent_state[others].clone()

    for step in range(8):
        with torch.no_grad():
            layer(torch.randn(batch, 1, HIDDEN, generator=gen).to(dtype), cache_params=cache)
            args = _op_args(layer, cap, pad_at, conv_state, recurrent_state, slots)
            out = torch.ops.fusion_compiler.gdn_decode(*args)
        expected = cap.rows("out_proj")
        live = [i for i in range(batch + 1) if i != pad_at]
        out, hf_conv, hf_rec = out.cpu(), cache.layers[0].conv_states[0], cache.layers[0].recurrent_states[0]
        assert out.dtype == dtype and out.shape == (batch + 1, VALUE_HEADS * VALUE_DIM)
        assert relative_error(out[live], expected) < (1e-2 if dtype == torch.bfloat16 else 1e-5), step
        assert torch.equal(out[pad_at], torch.zeros_like(out[pad_at])), "padding rows are zero"
        assert torch.equal(conv_state[slots].cpu(), hf_conv), step  # a shift: exact
        assert relative_error(recurrent_state[slots].cpu(), hf_rec) < RECURRENT_TOL, step
        assert torch.equal(conv_state[others], conv_others) and torch.equal(recurrent_state[others], rec_others)


def _random_args(tokens=3, num_slots=5, width=KERNEL, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return [
        rand(tokens, CONV_DIM), rand(tokens, VALUE_HEADS * VALUE_DIM), rand(tokens, VALUE_HEADS),
        rand(tokens, VALUE_HEADS), rand(CONV_DIM, KERNEL, scale=0.5), rand(VALUE_HEADS).abs(), rand(VALUE_HEADS),
        rand(VALUE_DIM, scale=0.1) + 1, 1e-6, 1e-6, rand(num_slots, CONV_DIM, width),
        torch.randn(num_slots, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen), torch.tensor([3, -1, 0])[:tokens],
    ]  # fmt: skip


def test_padding_rows_read_and_write_no_state():
    args = _random_args()
    args[-1] = torch.tensor([-1, -1, -1])
    conv, rec = args[10].clone(), args[11].clone()
    out = op.gdn_decode_reference(*args)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(args[10], conv) and torch.equal(args[11], rec)


def test_vllm_conv_width_k_minus_1_gives_the_same_step():
    """HF keeps K columns (the oldest unread), vLLM K - 1: same outputs, same shifted columns."""
    wide = _random_args(width=KERNEL)
    narrow = list(wide)
    narrow[10], narrow[11] = wide[10][..., 1:].clone(), wide[11].clone()
    out_wide, out_narrow = op.gdn_decode_reference(*wide), op.gdn_decode_reference(*narrow)
    assert torch.equal(out_wide, out_narrow)
    assert torch.equal(wide[10][..., 1:], narrow[10]) and torch.equal(wide[11], narrow[11])


def test_schema_fake_and_functionalization_pass_opcheck():
    torch.library.opcheck(torch.ops.fusion_compiler.gdn_decode.default, tuple(_random_args()))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda a: a.__setitem__(-1, torch.tensor([3, -1, 3])), "distinct"),
        (lambda a: a.__setitem__(-1, torch.tensor([5, -1, 0])), "out of range"),
        (lambda a: a.__setitem__(-1, torch.tensor([-2, -1, 0])), "out of range"),
        (lambda a: a.__setitem__(10, a[10][..., :2]), "width"),
        (lambda a: a.__setitem__(11, a[11].bfloat16()), "recurrent_state dtype"),
        (lambda a: a.__setitem__(0, a[0][:, 1:]), "conv_weight dim 0"),
        (lambda a: a.__setitem__(7, a[7][1:]), "norm_weight"),
    ],
)
def test_bad_arguments_raise(edit, message):
    args = _random_args()
    edit(args)
    with pytest.raises(ValueError, match=message):
        op.gdn_decode_reference(*args)


@pytest.mark.parametrize("slots", [[3, -1, 0], [-1, 0, 2], [-1, -1, -1], [4, 1, 2]])
def test_canonical_decomposition_equals_the_reference(slots):
    """Lowering "inductor": functional, padding rows clamped to a live row's slot (here [-1, 0, 2]
    clamps the padding row onto slot 0, which row 1 writes) without disturbing it."""
    args = _random_args()
    args[-1] = torch.tensor(slots)
    expected_conv, expected_rec = args[10].clone(), args[11].clone()
    expected = op.gdn_decode_reference(*args[:10], expected_conv, expected_rec, args[12])
    out, conv, rec = op.gdn_decode_canonical(**dict(zip(op.ARG_NAMES, args)))
    assert torch.equal(out, expected)
    assert torch.equal(conv, expected_conv) and torch.equal(rec, expected_rec)
