"""The routed experts of a MoE layer, from the routing's outputs to the weighted combine.

    fusion_compiler::moe_experts(Tensor hidden, Tensor top_k_ids, Tensor top_k_weights,
                                 Tensor gate_up_proj, Tensor down_proj) -> Tensor

Semantics (``moe_experts_reference`` is the numerical truth), HF transformers 5.17's gated
experts (``gate_up_proj`` [E, 2I, H]: gate rows then up rows; ``down_proj`` [E, H, I]):

    for each pair (t, k) with 0 <= e = ids[t, k] < E       (any other id is padding: HF's
                                                            expert-parallel sentinel >= E, or -1)
        gate = W_gate[e] @ x_t,  up = W_up[e] @ x_t         rounded to hidden's dtype
        act  = silu(gate) * up                              silu in fp32, rounded; product rounded
        y    = W_down[e] @ act                              rounded to hidden's dtype
    out[t] = sum_k float(w[t, k]) * float(y_(t,k))          fp32, rounded to hidden's dtype once

A token whose pairs are all padding gets zeros. The rounding points are those of HF's
``grouped_mm`` / ``batched_mm`` experts, where every GEMM returns the activation dtype; HF forms
``y * w`` in ``w``'s dtype (bf16 for Qwen3.5's softmax routing) before an fp32 sum, the op in
fp32: the two differ by one bf16 rounding of each product.

On CUDA (``_cuda``) two kernel paths, chosen by the number of tokens:

* up to ``SMALL_BATCH_MAX_TOKENS``: kernels/moe_experts.py, two GEMV-style launches that read
  each pair's expert once (no sort);
* above: kernels/moe_experts_grouped.py, the pairs grouped by expert on the device and each
  touched expert's weights read once for all its tokens: four launches (a sorted plan,
  gate/up, down, a combine; the two-launch scan mode is selectable by config, not shipped).

Neither syncs the host; a CUDA graph captures both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import require_dtype, require_last_dim_contiguous, require_same_device, require_shape

_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_IDS = (torch.int64, torch.int32)

# The small-batch kernels up to this many tokens, the grouped kernels above. H200, each path
# timed at every token count (results/moe_experts_h200_b5696dd.json, µs small / grouped): at 8
# tokens the small-batch kernels are faster for all three models (DeepSeek 1166 / 1197, MiniMax
# 381 / 387, Qwen3.5 449 / 485), at 16 the grouped ones for two (2045 / 2169, 696 / 716; Qwen3.5
# 856 / 842); 9-15 not measured.
SMALL_BATCH_MAX_TOKENS = 8

_SCHEMA = "(Tensor hidden, Tensor top_k_ids, Tensor top_k_weights, Tensor gate_up_proj, Tensor down_proj) -> Tensor"


def validate(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj) -> None:
    """The op's argument checks (reference, fake and CUDA paths): ValueError naming the value."""
    require_dtype(hidden, _FLOATS, "hidden")
    require_dtype(top_k_ids, _IDS, "top_k_ids")
    require_dtype(top_k_weights, _FLOATS, "top_k_weights")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, H], got shape {tuple(hidden.shape)}")
    tokens, size = hidden.shape
    if top_k_ids.dim() != 2:
        raise ValueError(f"top_k_ids must be [tokens, top_k], got shape {tuple(top_k_ids.shape)}")
    require_shape(top_k_ids, (tokens, None), "top_k_ids")
    require_shape(top_k_weights, tuple(top_k_ids.shape), "top_k_weights")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"gate_up_proj [E, 2I, H] and down_proj [E, H, I] expected, got {tuple(gate_up_proj.shape)} "
            f"and {tuple(down_proj.shape)}"
        )
    experts, double, _ = gate_up_proj.shape
    if isinstance(double, int) and double % 2:
        raise ValueError(f"gate_up_proj's {double} rows are not gate and up halves")
    require_shape(gate_up_proj, (None, None, size), "gate_up_proj")
    require_shape(down_proj, (experts, size, double // 2), "down_proj")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.dtype != hidden.dtype:
            raise ValueError(f"{name} is {t.dtype} and hidden {hidden.dtype}: the experts take one dtype")
        require_last_dim_contiguous(t, name)
    require_same_device({"top_k_ids": top_k_ids, "top_k_weights": top_k_weights, "gate_up_proj": gate_up_proj,
                         "down_proj": down_proj}, hidden)  # fmt: skip


def moe_experts_reference(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj) -> torch.Tensor:
    """The op's semantics in plain torch, one expert at a time (any device; float64 for truth)."""
    validate(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj)
    tokens, top_k = top_k_ids.shape
    experts, inter = gate_up_proj.shape[0], down_proj.shape[2]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    total = torch.zeros(tokens, hidden.shape[1], dtype=acc, device=hidden.device)
    flat_ids = top_k_ids.reshape(-1).long()
    flat_w = top_k_weights.reshape(-1).to(acc)
    rows = torch.arange(tokens * top_k, device=hidden.device)
    for e in torch.unique(flat_ids[(flat_ids >= 0) & (flat_ids < experts)]).tolist():
        pairs = rows[flat_ids == e]
        x = hidden[pairs // top_k]
        gate, up = F.linear(x, gate_up_proj[e]).split(inter, dim=-1)
        act = (F.silu(gate.to(acc)).to(hidden.dtype).to(acc) * up.to(acc)).to(hidden.dtype)
        y = F.linear(act, down_proj[e]).to(acc)
        total.index_add_(0, pairs // top_k, y * flat_w[pairs, None])
    return total.to(hidden.dtype)


@torch.library.custom_op("fusion_compiler::moe_experts", mutates_args=(), schema=_SCHEMA)
def _op(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj):
    return moe_experts_reference(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj)


@_op.register_fake
def _fake(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj):
    validate(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj)
    return torch.empty_like(hidden)


@_op.register_kernel("cuda")
def _cuda(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj):
    validate(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj)
    if hidden.shape[0] <= SMALL_BATCH_MAX_TOKENS:
        from fusion_compiler.kernels.moe_experts import small_batch_experts

        return small_batch_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj)
    from fusion_compiler.kernels.moe_experts_grouped import grouped_experts

    return grouped_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj)


def moe_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj) -> torch.Tensor:
    """Front end of ``torch.ops.fusion_compiler.moe_experts``."""
    return torch.ops.fusion_compiler.moe_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj)
