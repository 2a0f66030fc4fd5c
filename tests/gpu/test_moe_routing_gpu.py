"""GPU tier: MoE routing at the three models' real widths and 1 / 16 / 64 tokens (1 and 16: the
router GEMM and the routing in one launch; 64: two launches), against float64.

DeepSeek V3.2: 256 experts, sigmoid + bias, 8 groups (top 4), top-8, renorm eps 1e-20, x2.5, fp32
logits; MiniMax-M2.5: 256 experts, sigmoid + bias, top-8, bf16 logits; Qwen3.5: 512 experts,
softmax top-10, bf16 logits and weights, with the shared-expert gate as one more GEMM column.

The reference never sees the kernel's logits: the router GEMM is done in float64 from the same
bf16 inputs, and routed in float64 (gpu_reference.route64). Hidden states are fresh random rows,
redrawn where the float64 routing is within rounding of a tie (the k-th and next score, or the
last kept and next group, closer than the kernel's logits may move), so every token's expert
set must equal the reference's. Logits are compared element-wise within their rounding, weights
against the float64 scores at the kernel's own ids, the gate to bf16 tolerance. Outputs start
poisoned (NaN, ids -1) with a guard row on each side that must stay so.

``moe_route`` from given logits (the pattern's logits form) is checked the same way, its
reference routing those very logits in float64.
"""

from __future__ import annotations

import pytest
import torch

from gpu.gpu_reference import (ROUTERS, TINY_ROUTERS, assert_routes, assert_rows_close, cases, decisive_hidden,
                               generator, logit_slack, route64, router_weights)  # fmt: skip
from kernel_fixtures import DEVICE, skip_unless_kernels_can_run

pytestmark = pytest.mark.gpu
skip_unless_kernels_can_run()

from fusion_compiler.kernels import moe_route as K  # noqa: E402
from fusion_compiler.ops.moe_route import _ARG_NAMES, _ROUTER_ARG_NAMES  # noqa: E402

TOKENS = (1, 16, 64)


def guarded(rows, cols, dtype, fill):
    buf = torch.full((rows + 2, cols), fill, dtype=dtype, device=DEVICE)
    return buf, buf[1:-1]


def assert_guards(buf, fill, what):
    for guard in (buf[0], buf[-1]):
        same = torch.isnan(guard) if fill != fill else guard == fill
        assert bool(same.all()), f"{what} written outside its rows"


def run_router(spec, x, w, bias, gate_w):
    """moe_router_fwd on poisoned, guarded outputs: (logits, weights, ids, gate)."""
    hidden, experts, routing, logits_dtype, _, has_gate = spec
    tokens, top_k = x.shape[0], routing[0]
    named = dict(zip(_ROUTER_ARG_NAMES, (x, w, bias, *routing, logits_dtype, gate_w)))
    bufs = [guarded(tokens, experts, logits_dtype, float("nan")), guarded(tokens, top_k, routing[-1], float("nan")),
            guarded(tokens, top_k, torch.int64, -1)]  # fmt: skip
    if has_gate:
        bufs.append(guarded(tokens, 1, torch.bfloat16, float("nan")))
    outs = [view for _, view in bufs]
    K.moe_router_fwd(named, x, w, *outs[:3], gate_weight=gate_w, gate=outs[3] if has_gate else None)
    for (buf, _), fill, what in zip(bufs, (float("nan"), float("nan"), -1, float("nan")), ("logits", "weights", "ids", "gate")):
        assert_guards(buf, fill, what)
    return outs + [None] * (4 - len(outs))


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("spec", cases(ROUTERS, TINY_ROUTERS))
def test_router_gemm_and_routing_match_float64(spec, tokens):
    gen = generator(1000 + tokens)
    w, bias, gate_w = router_weights(spec, gen)
    x, ref, logits64, slack = decisive_hidden(spec, w, bias, tokens, gen)
    logits, weights, ids, gate = run_router(spec, x, w, bias, gate_w)
    bad = (logits.double() - logits64).abs() > slack
    assert not bool(bad.any()), f"{int(bad.sum())} logits off their float64 value by more than rounding"
    assert_routes(weights, ids, ref, spec[2], f"{tokens} tokens")
    if gate_w is not None:
        want = torch.sigmoid(x.double() @ gate_w.double().t())
        assert_rows_close(gate, want, 2**-7, "shared-expert gate")
    # the one-token launch's partial sums are handed back unwritten for the next launch
    columns = spec[1] + (gate_w is not None)
    for key, partials in K._POLLED.items():
        if key[2] == columns:
            assert bool((partials.view(torch.int32) == -1).all()), "partial sums left written"


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("spec", cases(ROUTERS, TINY_ROUTERS))
def test_routing_from_logits_matches_float64(spec, tokens):
    """moe_route: the logits are the input, so the reference routes these very values; they are
    drawn decisive (redrawn rows) as above, then rounded to the logits dtype, which moves them
    by at most the slack the draw allowed for."""
    gen = generator(2000 + tokens)
    w, bias, _ = router_weights(spec, gen)
    x, _, _, _ = decisive_hidden(spec, w, bias, tokens, gen)
    _, experts, routing, logits_dtype, _, _ = spec
    logits = (x.double() @ w.double().t()).to(logits_dtype)
    ref = route64(logits.double(), bias, *routing[:7], torch.zeros_like(logits, dtype=torch.float64))
    assert bool(ref["decisive"].all()), "a tie in the rounded logits"  # measure-zero; seeds are fixed
    named = dict(zip(_ARG_NAMES, (logits, bias, *routing)))
    (wbuf, weights), (ibuf, ids) = guarded(tokens, routing[0], routing[-1], float("nan")), guarded(tokens, routing[0], torch.int64, -1)
    K.moe_route_fwd(named, weights, ids)
    assert_guards(wbuf, float("nan"), "weights")
    assert_guards(ibuf, -1, "ids")
    assert_routes(weights, ids, ref, routing, f"{tokens} tokens from logits")


def test_decisive_margin_rejects_a_near_tie():
    """The margin the tests rely on: two experts 1e-7 apart are not decisive, 1e-2 apart are."""
    slack = logit_slack(torch.tensor([[0.0, 0.0, 0.0]]), torch.full((1, 3), 1e-4), torch.bfloat16)
    for gap, decisive in ((1e-7, False), (1e-2, True)):
        logits = torch.tensor([[0.5, 0.5 - gap, -3.0]], dtype=torch.float64)
        ref = route64(logits, None, 1, 1, 1, 0, True, 0.0, 1.0, slack.double())
        assert bool(ref["decisive"][0]) == decisive, gap
