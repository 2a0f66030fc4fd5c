"""The routing kernel on each routing variant's flags (patterns/moe_routing.py) against float64.

CPU tier: ``moe_route_fwd`` under TRITON_INTERPRET=1 (tests/conftest.py). The reference here is
the HF routers' math in float64, written out, not ``moe_route_reference``: ids equal on tie-free
logits, weights within fp32 rounding (or one bf16 ulp for bf16 weights).
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import moe_route as K  # noqa: E402
from fusion_compiler.ops.moe_route import _ARG_NAMES  # noqa: E402


def _float64_routing(logits, bias, top_k, n_group, topk_group, scoring, renormalize, renorm_eps, scale):
    x = logits.double()
    scores = x.sigmoid() if scoring == 0 else x.softmax(-1)
    choice = scores + bias.double() if bias is not None else scores
    tokens, experts = choice.shape
    if n_group > 1:
        grouped = choice.view(tokens, n_group, -1)
        keep = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        mask = torch.zeros(tokens, n_group, dtype=torch.bool).scatter(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(tokens, experts)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + renorm_eps)
    return weights * scale, ids


# (HF router and option, experts, top_k, n_group, topk_group, scoring, bias, renormalize, eps, scale,
#  logits dtype, weights dtype)
CASES = {
    "deepseek_v3 norm_topk_prob=False": (256, 8, 8, 4, 0, True, False, 0.0, 2.5, torch.float32, torch.float32),
    "glm-4.5 n_group=1": (160, 8, 1, 1, 0, True, True, 1e-20, 2.5, torch.float32, torch.float32),
    "topk_group=1 of 4": (64, 6, 4, 1, 0, True, True, 1e-20, 2.5, torch.float32, torch.float32),
    "topk_group=1 of 8 norm_topk_prob=False": (256, 8, 8, 1, 0, True, False, 0.0, 1.0, torch.float32, torch.float32),
    "n_group=1 norm_topk_prob=False scale 1": (64, 6, 1, 1, 0, True, False, 0.0, 1.0, torch.float32, torch.float32),
    "qwen3_moe norm_topk_prob=False": (128, 8, 1, 1, 1, False, False, 0.0, 1.0, torch.bfloat16, torch.bfloat16),
    "mixtral fp32 weights": (8, 2, 1, 1, 1, False, True, 0.0, 1.0, torch.bfloat16, torch.float32),
    "ernie4_5_moe softmax + bias": (64, 6, 1, 1, 1, True, True, 0.0, 1.0, torch.float32, torch.float32),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_routes_each_variant_like_float64(case):
    experts, top_k, n_group, topk_group, scoring, has_bias, renormalize, eps, scale, logits_dtype, wdt = CASES[case]
    gen = torch.Generator().manual_seed(experts + top_k)
    # Distinct multiples of 8 / E in [-4, 4) (exact in bf16): no ties, in scores or group sums.
    logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(3)]).float()
    logits = ((logits - experts // 2) * (8.0 / experts)).to(logits_dtype)
    bias = torch.rand(experts, generator=gen) * 0.1 if has_bias else None
    args = (logits.to(DEVICE), None if bias is None else bias.to(DEVICE), top_k, n_group, topk_group, scoring,
            renormalize, eps, scale, wdt)  # fmt: skip
    # Poisoned outputs: a slot the kernel leaves unwritten fails the comparison.
    weights = torch.full((3, top_k), float("nan"), dtype=wdt, device=DEVICE)
    ids = torch.full((3, top_k), -1, dtype=torch.int64, device=DEVICE)
    K.moe_route_fwd(dict(zip(_ARG_NAMES, args)), weights, ids)
    w64, ids64 = _float64_routing(logits, bias, top_k, n_group, topk_group, scoring, renormalize, eps, scale)
    assert torch.equal(ids.cpu(), ids64), case
    rtol = 1e-5 if wdt == torch.float32 else 2 ** -8
    torch.testing.assert_close(weights.cpu().double(), w64, rtol=rtol, atol=0.0)
