"""DeepSeek V3.2 reference decode layers: whole decoder layers at real widths, in plain torch.

Each layer is ``deepseek_v32.DecoderLayer`` (residual add + input RMSNorm, FP8 ``act_quant``, MLA
with the DSA indexer over the paged latent and indexer caches) followed by the MoE half:

* residual add + post-attention RMSNorm (DeepSeek's: fp32 weight, one rounding);
* the MoE of ``moe.py``: HF's grouped ``noaux_tc`` router (fp32 router GEMM, sigmoid + bias,
  top-4 of 8 groups, top-8 of 256 experts, renormalised with ``+ 1e-20``, times 2.5), the
  routed experts (2048 wide), identical in every compile mode, and one dense shared expert
  (2048 wide) in bf16. (Real checkpoints run these GEMMs in FP8; what the fusions target is
  the attention's FP8 path, which is kept.)

Every layer is an MoE layer: the checkpoint's first three dense layers are left out, as in the
HF adapter (``first_k_dense_replace`` 0). ``build`` makes a ``deepseek_v32.ReferenceModel`` of such
layers with random weights; ``make_step`` is ``deepseek_v32.make_step`` for it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from . import deepseek_v32 as ref
from . import moe
from .paged_kv import ReferenceStep


@dataclasses.dataclass(frozen=True)
class Config:
    attention: ref.ReferenceConfig
    moe: moe.MoEConfig


REAL = Config(
    ref.REAL,
    moe.MoEConfig(hidden_size=7168, num_experts=256, top_k=8, intermediate_size=2048, shared_intermediate_size=2048,
                  n_group=8, topk_group=4, routed_scaling_factor=2.5),
)  # fmt: skip
# The HF adapter's tiny MoE: 16 experts in 4 groups, top-2 groups (with 1, Inductor rewrites the
# group mask and the routing graph is not the real one), top-4 experts, 128 wide.
TINY = dataclasses.replace(
    REAL, attention=ref.TINY,
    moe=dataclasses.replace(REAL.moe, hidden_size=256, num_experts=16, top_k=4, intermediate_size=128,
                            shared_intermediate_size=128, n_group=4, topk_group=2),
)  # fmt: skip


class DecoderLayer(ref.DecoderLayer):
    """The reference attention half, then residual add + post-attention norm and the MoE."""

    def __init__(self, cfg: Config, experts: str = "grouped"):
        super().__init__(cfg.attention)
        self.post_attention_layernorm = ref.RMSNorm(cfg.attention.hidden_size, cfg.attention.rms_norm_eps)
        self.mlp = moe.SparseMoeBlock(cfg.moe, moe.GroupedTopkRouter(cfg.moe), experts)

    def forward(self, hidden, residual, *attention_args):
        out, residual = super().forward(hidden, residual, *attention_args)
        residual = out + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


def build(cfg: Config, num_layers: int, *, experts: str = "grouped", device="cpu", dtype: torch.dtype = torch.bfloat16,
          seed: int = 0) -> ref.ReferenceModel:  # fmt: skip
    """``num_layers`` decoder layers with seeded random weights (``moe.build``). ``experts``:
    "compute" (the routed experts run) or "zeros" (stubbed, no expert weights). Activations are
    bf16 only: the reference's simulated FP8 GEMMs return bf16."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if dtype != torch.bfloat16:
        raise ValueError(f"the DeepSeek reference runs bf16 activations, got dtype {dtype}")
    attention = dataclasses.replace(cfg.attention, num_layers=num_layers)
    model = moe.build(lambda: ref.ReferenceModel(attention, lambda: DecoderLayer(cfg, experts)), device, dtype, seed)
    if attention.fp8_weights:  # the attention's FP8 GEMMs read e4m3 codes and block scales
        ref.quantize_fp8_weights_(model)
    return model


def make_step(model: ref.ReferenceModel, tokens: int = 2, context: int = 6, seed: int = 1) -> ReferenceStep:
    """``deepseek_v32.make_step`` for the model's layers, on its device."""
    return ref.make_step(model.cfg, tokens, context, device=model.cos_sin_cache.device, seed=seed)


def expected_sites(model: nn.Module) -> dict[str, dict[str, int]]:
    """Per layer: the four MLA prologue sites, the input, q_a and post-attention norms, the router."""
    return moe.expected_sites(model, ref.expected_sites(model))
