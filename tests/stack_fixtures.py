"""A three-layer stack of HF-style RMSNorms around linears: six add_rms_norm sites, compiled in
a second or two. `Stack(broken_layer=i)` gives layer i's input norm a tensor eps, which the
pattern declines (a miss with a reason); `wrong_add_rms_norm()` makes the fused op wrong."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from fusion_compiler.ops import rms_norm as rms_norm_ops

BF16 = torch.bfloat16


class Norm(nn.Module):
    def __init__(self, eps=1e-6, tensor_eps=False):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(32))
        self.eps = torch.tensor(eps) if tensor_eps else eps

    def forward(self, x):
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, tensor_eps=False):
        super().__init__()
        self.input_layernorm = Norm(tensor_eps=tensor_eps)
        self.mlp = nn.Linear(32, 32)
        self.post_attention_layernorm = Norm()

    def forward(self, x):
        h = x + self.mlp(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class Stack(nn.Module):
    def __init__(self, broken_layer=None):
        super().__init__()
        self.layers = nn.ModuleList(Layer(tensor_eps=(i == broken_layer)) for i in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


EXPECTED = {
    "add_rms_norm": {f"layers.{i}.{name}": 1 for i in range(3) for name in ("input_layernorm", "post_attention_layernorm")}
}


@contextlib.contextmanager
def wrong_add_rms_norm():
    """The fused add_rms_norm's CPU kernel scales its output by 1.5 meanwhile: verify must say so."""
    custom_op = rms_norm_ops._add_rms_norm_op

    def wrong(x, residual, weight, eps, weight_offset, out_dtype):
        out, total = rms_norm_ops.add_rms_norm_reference(x, residual, weight, eps, weight_offset, out_dtype)
        return out * 1.5, total

    def honest(x, residual, weight, eps, weight_offset, out_dtype):
        # Through the module's name at call time, as the op's own CPU impl does: a test that
        # monkeypatches the reference later (tests/inspect/test_gate.py) still reaches the op.
        return rms_norm_ops.add_rms_norm_reference(x, residual, weight, eps, weight_offset, out_dtype)

    custom_op.register_kernel("cpu")(wrong)
    try:
        yield
    finally:
        custom_op.register_kernel("cpu")(honest)
