"""GPU tier: the one-token router launch (GEMM + routing, its last program polling the partial
sums) at the three models' real widths, captured in a CUDA graph and replayed on fresh inputs:
every replay's routing equals the reference routed from the kernel's own logits, the logits match
F.linear, and the partial-sum buffer is left unwritten for the next launch."""

from __future__ import annotations

import pytest
import torch

from fusion_compiler.kernels import moe_route as K
from fusion_compiler.ops.moe_route import _ROUTER_ARG_NAMES, moe_route_reference

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MODELS = {
    # name: (hidden, experts, routing args after bias (top_k .. weights_dtype), logits dtype, bias, gate)
    "deepseek-v3.2": (7168, 256, (8, 8, 4, 0, True, 1e-20, 2.5, torch.float32), torch.float32, True, False),
    "minimax-m2.5": (3072, 256, (8, 1, 1, 0, True, 0.0, 1.0, torch.float32), torch.bfloat16, True, False),
    "qwen3.5": (4096, 512, (10, 1, 1, 1, True, 0.0, 1.0, torch.bfloat16), torch.bfloat16, False, True),
}
REPLAYS = 200


@requires_cuda
@pytest.mark.parametrize("model", list(MODELS))
def test_one_token_router_replays_in_a_graph(model):
    hidden_size, experts, routing, logits_dtype, has_bias, has_gate = MODELS[model]
    torch.manual_seed(0)
    x = torch.randn(1, hidden_size, device="cuda", dtype=torch.bfloat16)
    w = 0.02 * torch.randn(experts, hidden_size, device="cuda", dtype=torch.bfloat16)
    bias = 0.1 * torch.rand(experts, device="cuda") if has_bias else None
    gate_w = 0.02 * torch.randn(1, hidden_size, device="cuda", dtype=torch.bfloat16) if has_gate else None
    named = dict(zip(_ROUTER_ARG_NAMES, (x, w, bias, *routing, logits_dtype, gate_w)))
    top_k, weights_dtype = routing[0], routing[-1]
    logits = torch.empty(1, experts, device="cuda", dtype=logits_dtype)
    weights = torch.empty(1, top_k, device="cuda", dtype=weights_dtype)
    ids = torch.empty(1, top_k, device="cuda", dtype=torch.int64)
    gate = torch.empty(1, 1, device="cuda", dtype=torch.bfloat16) if has_gate else None

    def launch():
        K.moe_router_fwd(named, x, w, logits, weights, ids, gate_weight=gate_w, gate=gate)

    launch()  # uncaptured first: fills the partial-sum buffer with the unwritten bits
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for step in range(REPLAYS):
        x.copy_(torch.randn_like(x))
        for out in (logits, weights) + ((gate,) if has_gate else ()):
            out.fill_(float("nan"))
        ids.fill_(-1)
        graph.replay()
        ref_w, ref_ids = moe_route_reference(logits.clone(), bias, *routing)
        assert torch.equal(ids, ref_ids), f"replay {step}: ids {ids.tolist()} vs {ref_ids.tolist()}"
        rtol = 1e-6 if weights_dtype == torch.float32 else 2**-7  # exp may differ in the last fp32 ulp
        torch.testing.assert_close(weights.float(), ref_w.float(), rtol=rtol, atol=1e-30, msg=f"replay {step}")
        expected = torch.nn.functional.linear(x.float(), w.float())
        assert (logits.float() - expected).abs().max() <= 1e-2 * expected.abs().max(), f"replay {step}: logits"
        if has_gate:
            torch.testing.assert_close(gate.float(), torch.sigmoid(x.float() @ gate_w.float().T), rtol=1e-2, atol=1e-3)
    torch.cuda.synchronize()
    buffers = [b for key, b in K._POLLED.items() if key[2] == experts + has_gate]
    assert buffers and all(bool((b.view(torch.int32) == -1).all()) for b in buffers), "partials left written"


@requires_cuda
def test_one_token_capture_needs_a_fused_call_first():
    """The one-token buffer is made on the first fused call (1-16 tokens) outside capture: a first
    call inside capture raises; after a 2-token call, capturing one token works."""
    for hidden_size, experts in ((640, 136), (768, 136)):  # shapes no other test launched
        x1 = torch.randn(1, hidden_size, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, hidden_size, device="cuda", dtype=torch.bfloat16)
        named = dict(zip(_ROUTER_ARG_NAMES, (x1, w, None, 4, 1, 1, 0, True, 0.0, 1.0, torch.float32, torch.float32, None)))

        def outs(tokens):
            return (torch.empty(tokens, experts, device="cuda"), torch.empty(tokens, 4, device="cuda"),
                    torch.empty(tokens, 4, dtype=torch.int64, device="cuda"))  # fmt: skip

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
            ref_w, ref_ids = moe_route_reference(logits.clone(), None, 4, 1, 1, 0, True, 0.0, 1.0, torch.float32)
            assert torch.equal(ids, ref_ids)
