"""The MoE half of the reference decode layers (DeepSeek V3.2, MiniMax-M2.5, Qwen3.5), in plain
torch, and what the three ``<model>_decode_layer`` modules share to build and seed them.

A decode layer is benchmarked eagerly, under stock ``torch.compile`` and under our fusion
backend; the comparison must show what fusion changes and nothing else. So:

* **Routers** are written as HF transformers 5.17 writes them (``DeepseekV32TopkRouter``,
  ``MiniMaxM2TopKRouter``, ``Qwen3_5MoeTopKRouter``), the code the ``moe_routing`` patterns
  were traced from: DeepSeek's grouped sigmoid + bias (``noaux_tc``: fp32 router GEMM, groups
  scored by their two best experts, renormalised with ``+ 1e-20``, times
  ``routed_scaling_factor``), MiniMax's sigmoid + bias, Qwen's softmax, each top-k renormalised.
  They return (weights, ids) and not HF's logits, which the MoE blocks drop anyway.
* **The routed experts** are plain torch in HF's two graph-friendly forms (``grouped_mm_experts``,
  ``batched_mm_experts``): stock Inductor runs exactly that code, and our backend meets it as
  ordinary model code (the ``moe_experts`` stage). ``batched_mm`` copies ``tokens * top_k``
  experts' weights every step (``gathered_bytes``). ``experts="zeros"`` swaps in
  ``fusion_compiler_ref::routed_experts_zeros``, which returns zeros (see ``ZeroExperts``).
* **The shared expert** is a dense SwiGLU MLP of ``nn.Linear`` layers (DeepSeek: one,
  ``moe_intermediate_size`` wide; Qwen3.5: ``shared_expert_intermediate_size``, scaled by
  ``sigmoid(x . w_gate)``; MiniMax has none), compiled like the rest of the layer.
* **MoEDecoderLayer** is the pre-norm layer around any attention, carrying (hidden, residual) as
  vLLM does; ``build`` allocates a model in place on its device and seeds its weights.

Nothing here imports the compiler's ops: the patterns meet ordinary model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# grouped: HF's ``grouped_mm`` experts (pairs sorted by expert, one grouped GEMM per
# projection); compute: HF's ``batched_mm`` experts (every pair's expert weights gathered, then
# bmm); zeros: the experts stubbed out (identical in every mode). The first two are plain torch:
# stock Inductor runs them as written, and our backend's moe_experts stage fuses them.
EXPERTS_MODES = ("compute", "grouped", "zeros")

# Random-init scales: norm weights (and Gemma offsets, biases) move 0.1 away from their init, so
# a missing multiply shows; matrices are N(0, 1/fan_in), so activations keep their size.
_NORM_WEIGHT_STD = 0.1


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen3.5: sigmoid(x . w_gate) scales the shared expert
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def gathered_bytes(self, tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of expert weights ``batched_mm_experts`` gathers (copies) in one step of ``tokens``."""
        return tokens * self.top_k * 3 * self.intermediate_size * self.hidden_size * dtype.itemsize


# ------------------------------------------------------------------------------------------
# Routers, as HF transformers 5.17 writes them
# ------------------------------------------------------------------------------------------


class GroupedTopkRouter(nn.Module):
    """HF's ``DeepseekV32TopkRouter`` (``noaux_tc``, ``norm_topk_prob`` true)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.num_experts = cfg.num_experts
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.num_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, hidden_states):
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.sigmoid()
        scores_for_choice = scores + self.e_score_correction_bias
        group_scores = (
            scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
            .topk(2, dim=-1)[0]
            .sum(dim=-1)
        )
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1)
            .expand(-1, self.num_group, self.num_experts // self.num_group)
            .reshape(-1, self.num_experts)
        )
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
        topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return topk_weights, topk_indices


class SigmoidTopkRouter(nn.Module):
    """HF's ``MiniMaxM2TopKRouter``; the correction bias, which HF keeps in the MoE block and
    passes in, is this module's buffer."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, hidden_states):
        router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)
        routing_weights = nn.functional.sigmoid(router_logits.float())
        scores_for_choice = routing_weights + self.e_score_correction_bias
        _, top_k_index = torch.topk(scores_for_choice, self.top_k, dim=-1, sorted=False)
        top_k_weights = routing_weights.gather(1, top_k_index)
        top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
        return top_k_weights, top_k_index


class SoftmaxTopkRouter(nn.Module):
    """HF's ``Qwen3_5MoeTopKRouter``."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, hidden_states):
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        router_top_value = router_top_value.to(router_logits.dtype)
        return router_top_value, router_indices


ROUTERS = (GroupedTopkRouter, SigmoidTopkRouter, SoftmaxTopkRouter)


# ------------------------------------------------------------------------------------------
# Routed experts: plain torch in HF's two graph-friendly forms
# ------------------------------------------------------------------------------------------


def _check_routing(hidden: torch.Tensor, top_k_ids: torch.Tensor, top_k_weights: torch.Tensor) -> None:
    if hidden.dim() != 2 or top_k_ids.shape != top_k_weights.shape or top_k_ids.shape[:1] != hidden.shape[:1]:
        raise ValueError(
            f"routed experts: hidden {tuple(hidden.shape)} must be [T, H] and ids {tuple(top_k_ids.shape)} / "
            f"weights {tuple(top_k_weights.shape)} both [T, top_k]"
        )


def grouped_mm_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj) -> torch.Tensor:
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k], the way HF's
    ``grouped_mm`` experts compute it: the (token, k) pairs sorted by expert, per-expert offsets
    counted on the device (no host sync), one grouped GEMM per projection over the weights'
    transposed views, the outputs scaled by the routing weights, put back in pair order and
    summed over k. hidden [T, H]; ids / weights [T, k]; gate_up_proj [E, 2I, H] (gate rows,
    then up rows); down_proj [E, H, I]."""
    _check_routing(hidden, top_k_ids, top_k_weights)
    from transformers.integrations.moe import _grouped_mm  # torch's grouped GEMM, or HF's op for it

    tokens, top_k = top_k_ids.shape
    experts = gate_up_proj.shape[0]
    sorted_ids, order = torch.sort(top_k_ids.reshape(-1))
    counted = sorted_ids.float() if hidden.device.type == "cpu" else sorted_ids.int()  # histc's input types
    offsets = torch.cumsum(torch.histc(counted, bins=experts, min=0, max=experts - 1), dim=0, dtype=torch.int32)
    gate, up = _grouped_mm(hidden[order // top_k], gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
    out = _grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return out[inverse].view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def batched_mm_experts(hidden, top_k_ids, top_k_weights, gate_up_proj, down_proj) -> torch.Tensor:
    """The same sum the way HF's ``batched_mm`` experts compute it: each token repeated k times,
    every pair's expert weights gathered (``W[ids]``, a copy of ``tokens * top_k`` experts) and
    one ``bmm`` per projection, scaled by the routing weights and summed over k."""
    _check_routing(hidden, top_k_ids, top_k_weights)
    tokens, top_k = top_k_ids.shape
    ids = top_k_ids.reshape(-1).clamp(0, gate_up_proj.shape[0] - 1)
    x = hidden.repeat_interleave(top_k, dim=0)
    gate, up = torch.bmm(gate_up_proj[ids], x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    out = torch.bmm(down_proj[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
    return (out * top_k_weights.reshape(-1, 1)).view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


# The stub's zeros must still consume the router's outputs. Zeros made in model code
# (`torch.zeros_like(x)`, `x * 0`) leave the router with no user: the compiled modes would drop it
# as dead code while eager runs it, and Inductor could fold the zeros into the add that follows.
# Returned by an opaque op that takes (hidden, ids, weights), the zeros keep the router, the
# shared expert and the adds in every mode, exactly as with the real experts; only the experts'
# own kernels are gone (one memset is left).
@torch.library.custom_op("fusion_compiler_ref::routed_experts_zeros", mutates_args=())
def routed_experts_zeros(hidden: torch.Tensor, top_k_ids: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Zeros like ``hidden``: the routed experts stubbed out (inputs as ``grouped_mm_experts``)."""
    _check_routing(hidden, top_k_ids, top_k_weights)
    return torch.zeros_like(hidden)


@routed_experts_zeros.register_fake
def _(hidden, top_k_ids, top_k_weights):
    _check_routing(hidden, top_k_ids, top_k_weights)
    return torch.empty_like(hidden)


class RoutedExperts(nn.Module):
    """All experts' weights as 3-D tensors (HF's ``*Experts`` layout), run as HF's ``grouped_mm``
    experts (``grouped``) or its ``batched_mm`` ones."""

    def __init__(self, cfg: MoEConfig, grouped: bool = True):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size))
        self.grouped = grouped

    def forward(self, hidden, top_k_ids, top_k_weights):
        run = grouped_mm_experts if self.grouped else batched_mm_experts
        return run(hidden, top_k_ids, top_k_weights, self.gate_up_proj, self.down_proj)


class ZeroExperts(nn.Module):
    """The routed experts stubbed to zeros, with no expert weights (attention + router + norms +
    shared expert, measured alone)."""

    def forward(self, hidden, top_k_ids, top_k_weights):
        return torch.ops.fusion_compiler_ref.routed_experts_zeros(hidden, top_k_ids, top_k_weights)


# ------------------------------------------------------------------------------------------
# MoE block and decoder layer
# ------------------------------------------------------------------------------------------


class SharedExpert(nn.Module):
    """HF's dense ``*MLP``: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Router -> routed experts, plus the shared expert where the model has one (Qwen3.5's
    scaled by ``sigmoid(shared_expert_gate(x))``, as HF's ``Qwen3_5MoeSparseMoeBlock``).
    x [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: MoEConfig, router: nn.Module, experts: str = "grouped"):
        super().__init__()
        if experts not in EXPERTS_MODES:
            raise ValueError(f"experts must be one of {EXPERTS_MODES}, got {experts!r}")
        self.gate = router
        self.experts = ZeroExperts() if experts == "zeros" else RoutedExperts(cfg, grouped=experts == "grouped")
        self.shared_expert = None
        self.shared_expert_gate = None
        if cfg.shared_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_intermediate_size)
        if cfg.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, hidden_states):
        top_k_weights, top_k_ids = self.gate(hidden_states)
        out = self.experts(hidden_states, top_k_ids, top_k_weights)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(hidden_states)
        if self.shared_expert_gate is not None:
            shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out + shared


class MoEDecoderLayer(nn.Module):
    """A pre-norm decoder layer as vLLM runs it, carrying ``(hidden, residual)`` from layer to
    layer: residual add + input norm, the attention (``attention_name`` is HF's attribute for
    it: ``self_attn``, or ``linear_attn`` for Gated DeltaNet), residual add + post-attention
    norm, MoE. ``attention(x, *attention_args)`` -> [T, hidden]."""

    def __init__(self, input_layernorm: nn.Module, attention: nn.Module, post_attention_layernorm: nn.Module,
                 mlp: nn.Module, attention_name: str = "self_attn"):  # fmt: skip
        super().__init__()
        self.input_layernorm = input_layernorm
        self.attention_name = attention_name
        self.add_module(attention_name, attention)
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(self, hidden, residual, *attention_args):
        residual = hidden + residual
        out = getattr(self, self.attention_name)(self.input_layernorm(residual), *attention_args)
        residual = out + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


def expected_sites(model: nn.Module, attention_sites: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``attention_sites`` (family -> {module path: sites per step}) plus what every MoE decoder
    layer fuses once per step: its input and post-attention norms, each with the residual add
    before it (add_rms_norm), its router (moe_routing) and its routed experts (moe_experts, where
    they are computed, not stubbed)."""
    sites = {family: dict(modules) for family, modules in attention_sites.items()}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("input_layernorm", "post_attention_layernorm"):
            sites.setdefault("add_rms_norm", {})[name] = 1
        elif isinstance(module, ROUTERS):
            sites.setdefault("moe_routing", {})[name] = 1
        elif isinstance(module, RoutedExperts):
            sites.setdefault("moe_experts", {})[name] = 1
    return sites


# ------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------


def build(construct: Callable[[], nn.Module], device, dtype: torch.dtype, seed: int) -> nn.Module:
    """``construct()``'s model in ``eval()``, its tensors allocated directly on ``device`` in
    ``dtype`` (what the model code pins to fp32 stays fp32: DeepSeek's norm weights, the routers'
    correction biases, RoPE tables), with seeded random weights (``randomize_``).

    Allocating in place matters at real widths (DeepSeek's experts are 21 GiB per layer):
    nothing is built in fp32 or on the CPU first. On the "meta" device only shapes exist (for
    sizing: ``weight_bytes``). The same seed on the same device gives the same weights."""
    device = torch.device(device)
    forked = []  # the CPU's RNG is always forked; a GPU's only when named
    if device.type == "cuda":
        forked = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=forked), device, _default_dtype(dtype):
        torch.manual_seed(seed)
        model = construct()
        if device.type != "meta":
            randomize_(model)
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def randomize_(model: nn.Module) -> None:
    """Random weights from the current RNG, in place: matrices (and stacks of them) N(0, 1/fan_in),
    fan_in their last dim; 1-D tensors initialised to ones (norm weights, dt_bias) 1 + N(0, 0.1^2),
    to zeros (Gemma norm offsets, biases, the routers' correction biases) N(0, 0.1^2); any other
    1-D tensor keeps its own random init (GDN's A_log). Non-persistent buffers (RoPE tables) are
    left alone."""
    for t in _weights(model):
        if t.dim() >= 2:
            t.normal_(0.0, t.shape[-1] ** -0.5)
        elif bool((t == 1).all()):
            t.normal_(1.0, _NORM_WEIGHT_STD)
        elif bool((t == 0).all()):
            t.normal_(0.0, _NORM_WEIGHT_STD)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """Floating parameters and persistent buffers, in module order."""
    out = []
    for mod in model.modules():
        buffers = [b for n, b in mod.named_buffers(recurse=False) if n not in mod._non_persistent_buffers_set]
        out += [t for t in [*mod.parameters(recurse=False), *buffers] if t.is_floating_point()]
    return out


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and persistent buffers (what a checkpoint would hold)."""
    return sum(t.numel() * t.element_size() for t in _weights(module))
