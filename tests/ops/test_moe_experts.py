"""``fusion_compiler::moe_experts`` (ops/moe_experts.py): the reference against a per-pair loop
in float64, padding ids, the fake, and the argument checks that turn a site into a miss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.ops import moe_experts as M


def _inputs(tokens=4, top_k=3, experts=6, hidden=24, inter=10, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, dtype=dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=gen, dtype=dtype)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, dtype=dtype) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen, dtype=dtype) * inter**-0.5
    return x, ids, w, gate_up, down


def _loop(x, ids, w, gate_up, down):
    out = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if 0 <= e < gate_up.shape[0]:
                gate, up = (gate_up[e] @ x[t]).chunk(2)
                out[t] += w[t, k] * (down[e] @ (F.silu(gate) * up))
    return out


def test_reference_equals_a_loop_over_pairs_with_padding():
    x, ids, w, gate_up, down = _inputs()
    ids[0, 1], ids[2, 0] = -1, gate_up.shape[0]  # padding: -1 and HF's sentinel >= E
    ids[3] = -1  # a token with only padding gets zeros
    out = M.moe_experts(x, ids, w, gate_up, down)
    assert torch.allclose(out, _loop(x, ids, w, gate_up, down), rtol=1e-12, atol=1e-12)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_int32_ids_and_bf16_inputs_round_like_hf():
    x, ids, w, gate_up, down = _inputs(dtype=torch.float32)
    bf = [t.bfloat16() for t in (x, gate_up, down)]
    out = M.moe_experts(bf[0], ids.int(), w, bf[1], bf[2])
    assert out.dtype == torch.bfloat16
    exact = _loop(*(t.double() for t in (bf[0], ids, w, bf[1], bf[2])))
    assert (out.double() - exact).norm() / exact.norm() < 1e-2


def test_fake_gives_hidden_shaped_output():
    x, ids, w, gate_up, down = _inputs()
    with torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, ids, w, gate_up, down)]
        out = torch.ops.fusion_compiler.moe_experts(*fake)
    assert out.shape == x.shape and out.dtype == x.dtype


@pytest.mark.parametrize("change, message", [
    (lambda a: (a[0], a[1].float(), *a[2:]), "top_k_ids dtype"),
    (lambda a: (a[0], a[1], a[2][:, :1], *a[3:]), "top_k_weights dim 1"),
    (lambda a: (*a[:3], a[3].float(), a[4]), "one dtype"),
    (lambda a: (*a[:3], a[3][:, :-1], a[4]), "gate and up halves"),
    (lambda a: (*a[:4], a[4][:, :, :-1]), "down_proj dim 2"),
    (lambda a: (*a[:3], a[3].transpose(1, 2).contiguous().transpose(1, 2), a[4]), "unit stride"),
    (lambda a: (a[0][None], *a[1:]), "hidden must be"),
], ids=["float-ids", "weights-shape", "weight-dtype", "odd-gate-up", "down-shape", "column-major", "3d-hidden"])  # fmt: skip
def test_checks_name_what_the_op_does_not_take(change, message):
    args = _inputs()
    with pytest.raises(ValueError, match=message):
        M.moe_experts(*change(args))
