"""GPU tier: the one-token router launch (GEMM + routing, its last program polling the partial
sums) at the three models' real widths, captured in a CUDA graph and replayed on fresh inputs.

Every replay is checked against float64 computed without the kernel: the router logits are the
float64 GEMM of the same bf16 hidden row and weight, compared element-wise within the logits
dtype's rounding; the routing is the float64 routing of those logits (gpu_reference.route64).
The hidden row is redrawn until that routing is decisive (no tie within the kernel's rounding),
so the expert set must be the reference's; the weights are those of the float64 scores at the
kernel's ids. The partial-sum buffer is left unwritten for the next launch."""

from __future__ import annotations

import pytest
import torch

from gpu.gpu_reference import ROUTERS, assert_routes, assert_rows_close, decisive_hidden, generator, router_weights
from fusion_compiler.kernels import moe_route as K
from fusion_compiler.ops.moe_route import _ROUTER_ARG_NAMES

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPLAYS = 100


def _replay_and_check(launch, replays, spec, inputs, outputs, gen):
    """``launch`` captured once, then replayed on fresh decisive hidden states (``inputs``' x
    refilled, ``outputs`` poisoned before each replay): logits against float64 within rounding,
    the routing against float64's, the shared-expert gate (if any) against sigmoid's."""
    x, w, bias, gate_w = inputs
    logits, weights, ids, gate = outputs
    routing = spec[2]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for step in range(replays):
        fresh, ref, logits64, slack = decisive_hidden(spec, w, bias, x.shape[0], gen)
        x.copy_(fresh)
        for out in (logits, weights) + ((gate,) if gate is not None else ()):
            out.fill_(float("nan"))
        ids.fill_(-1)
        graph.replay()
        bad = (logits.double() - logits64).abs() > slack
        assert not bool(bad.any()), f"replay {step}: {int(bad.sum())} logits off float64 by more than rounding"
        assert_routes(weights, ids, ref, routing, f"replay {step}")
        if gate is not None:
            assert_rows_close(gate, torch.sigmoid(x.double() @ gate_w.double().t()), 2**-7, f"replay {step}: gate")
    torch.cuda.synchronize()


@requires_cuda
@pytest.mark.parametrize("model", list(ROUTERS))
def test_one_token_router_replays_in_a_graph(model):
    spec = ROUTERS[model]
    hidden_size, experts, routing, logits_dtype, _, has_gate = spec
    gen = generator(0)
    w, bias, gate_w = router_weights(spec, gen)
    x = torch.zeros(1, hidden_size, device="cuda", dtype=torch.bfloat16)
    named = dict(zip(_ROUTER_ARG_NAMES, (x, w, bias, *routing, logits_dtype, gate_w)))
    top_k, weights_dtype = routing[0], routing[-1]
    logits = torch.empty(1, experts, device="cuda", dtype=logits_dtype)
    weights = torch.empty(1, top_k, device="cuda", dtype=weights_dtype)
    ids = torch.empty(1, top_k, device="cuda", dtype=torch.int64)
    gate = torch.empty(1, 1, device="cuda", dtype=torch.bfloat16) if has_gate else None

    def launch():
        K.moe_router_fwd(named, x, w, logits, weights, ids, gate_weight=gate_w, gate=gate)

    launch()  # uncaptured first: fills the partial-sum buffer with the unwritten bits
    _replay_and_check(launch, REPLAYS, spec, (x, w, bias, gate_w), (logits, weights, ids, gate), gen)
    buffers = [b for key, b in K._POLLED.items() if key[2] == experts + has_gate]
    assert buffers and all(bool((b.view(torch.int32) == -1).all()) for b in buffers), "partials left written"


@requires_cuda
def test_one_token_capture_needs_a_fused_call_first():
    """The one-token buffer is made on the first fused call (1-16 tokens) outside capture: a first
    call inside capture raises; after a 2-token call, capturing one token works (its routing
    checked against float64, as above)."""
    gen = generator(1)
    for hidden_size, experts in ((640, 136), (768, 136)):  # shapes no other test launched
        routing = (4, 1, 1, 0, True, 0.0, 1.0, torch.float32)
        spec = (hidden_size, experts, routing, torch.float32, False, False)
        w, _, _ = router_weights(spec, gen)
        x1, ref, logits64, slack = decisive_hidden(spec, w, None, 1, gen)
        named = dict(zip(_ROUTER_ARG_NAMES, (x1, w, None, *routing, torch.float32, None)))

        def outs(tokens):
            return (torch.full((tokens, experts), float("nan"), device="cuda"),
                    torch.full((tokens, 4), float("nan"), device="cuda"),
                    torch.full((tokens, 4), -1, dtype=torch.int64, device="cuda"))  # fmt: skip

        graph = torch.cuda.CUDAGraph()
        if hidden_size == 640:
            with pytest.raises(RuntimeError, match="first one-token call for this shape"):
                with torch.cuda.graph(graph):
                    K.moe_router_fwd(named, x1, w, *outs(1))
        else:
            x2 = torch.randn(2, hidden_size, device="cuda", dtype=torch.bfloat16)
            K.moe_router_fwd(named, x2, w, *outs(2))
            logits, weights, ids = outs(1)
            with torch.cuda.graph(graph):
                K.moe_router_fwd(named, x1, w, logits, weights, ids)
            graph.replay()
            assert not bool(((logits.double() - logits64).abs() > slack).any()), "logits"
            assert_routes(weights, ids, ref, routing, "captured one-token call")


@requires_cuda
@pytest.mark.parametrize("tokens", [64, 128])
@pytest.mark.parametrize("model", list(ROUTERS))
def test_several_token_tiles_route_in_one_launch_replayed(model, tokens):
    """The one launch over several token tiles (min(T, programs) <= MAX_ROUTERS routers waiting
    on the arrival counter; not shipped above one token, where two launches measured faster, but
    selectable by config): one kernel, captured and replayed on fresh decisive inputs, each
    replay's logits and routing against float64, and the counters back at zero."""
    from fusion_compiler.inspect.counting import count_cuda_kernels

    spec = ROUTERS[model]
    hidden_size, experts, routing, logits_dtype, _, has_gate = spec
    gen = generator(tokens)
    w, bias, gate_w = router_weights(spec, gen)
    x = torch.zeros(tokens, hidden_size, device="cuda", dtype=torch.bfloat16)
    named = dict(zip(_ROUTER_ARG_NAMES, (x, w, bias, *routing, logits_dtype, gate_w)))
    top_k, weights_dtype = routing[0], routing[-1]
    logits = torch.empty(tokens, experts, device="cuda", dtype=logits_dtype)
    weights = torch.empty(tokens, top_k, device="cuda", dtype=weights_dtype)
    ids = torch.empty(tokens, top_k, device="cuda", dtype=torch.int64)
    gate = torch.empty(tokens, 1, device="cuda", dtype=torch.bfloat16) if has_gate else None

    def launch():
        K.moe_router_fwd(named, x, w, logits, weights, ids, gate_weight=gate_w, gate=gate,
                         config=K.MoeRouteConfig(fused_gemm_max_tokens=tokens))

    launch()  # uncaptured first: makes the counters
    assert count_cuda_kernels(launch).count == 1
    _replay_and_check(launch, 20, spec, (x, w, bias, gate_w), (logits, weights, ids, gate), gen)
    assert all(c.tolist() == [0, 0] for c in K._COUNTERS.values()), "counters left non-zero"
