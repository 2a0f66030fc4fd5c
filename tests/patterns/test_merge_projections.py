"""patterns/merge_projections.py: GEMMs of one activation become one GEMM, on HF's real code
(counts per model asserted) and on near misses that must stay apart."""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.verify import relative_error
from hf_fixtures import default_decode_run

# Per layer, in graph order. DeepSeek V3.2: q_a / kv_a / indexer wk / indexer weights_proj of
# the normed hidden state, q_b / the indexer's wq_b of the normed q latent, the shared expert's
# gate / up; Qwen3.5: GDN's
# in_proj_qkv / z / b / a or the full-attention q / k / v, then the shared expert's gate / up
# (its router and gate are inside the routing op); MiniMax-M2.5: q / k / v.
EXPECTED = {
    "deepseek-v3.2": [4, 2, 2] * 2,
    "minimax-m2.5": [3] * 2,
    "qwen3.5": [4, 2] * 3 + [3, 2],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hf_projections_merge_per_layer_and_match_eager(name):
    run = default_decode_run(name)
    assert run.report.merged_projections() == EXPECTED[name]
    assert relative_error(run.fused, run.eager) < 2e-2
    # The first call moved the weights into merged buffers; the parameters still hold their
    # values, and the next call neither recompiles nor changes the result.
    assert run.compiles == 1
    torch.testing.assert_close(run.again, run.fused)
    assert relative_error(run.eager_step.fresh().run(run.model), run.eager) < 1e-6


class _NearMisses(torch.nn.Module):
    """q / k / v of x merge; a projection of another activation, one with a bias (addmm), and
    one of a different dtype stay as they are."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(64, n, bias=False) for n in (64, 16, 16))
        self.other = torch.nn.Linear(64, 32, bias=False)
        self.biased = torch.nn.Linear(64, 32)
        self.wide = torch.nn.Linear(64, 8, bias=False).double()

    def forward(self, x, y):
        parts = (self.q(x), self.k(x), self.v(x), self.other(y), self.biased(x), self.wide(x.double()).float())
        return torch.cat(parts, dim=-1)


def test_near_misses_stay_apart():
    torch.manual_seed(0)
    model = _NearMisses().eval()
    x, y = torch.randn(3, 64), torch.randn(3, 64)
    torch._dynamo.reset()
    backend = fc.FusionBackend(fc.FusionConfig())
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x, y)
        expected = model(x, y)
    assert backend.report.merged_projections() == [3]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_off_leaves_every_gemm():
    torch.manual_seed(0)
    model = _NearMisses().eval()
    torch._dynamo.reset()
    backend = fc.FusionBackend(fc.FusionConfig(merge_projections=False))
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(3, 64), torch.randn(3, 64))
    assert backend.report.merged_projections() == []


def _projections(x, y, wq, wk, wo, wd, wh):
    """q / k of x (a group); a lone projection of y; an fp64 one of an exactly widened weight (a
    projection: the op reads the fp32 weight); a bf16 one of a narrowed weight (rounded: not a
    weight the op could read, so not a projection)."""
    return x @ wq.t(), x @ wk.t(), y @ wo.t(), x.double() @ wd.double().t(), x.bfloat16() @ wh.bfloat16().t()


def _traced_projections():
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(4)
    args = (torch.randn(2, 32, generator=gen), torch.randn(1, 48, generator=gen), torch.randn(16, 32, generator=gen),
            torch.randn(8, 32, generator=gen), torch.randn(32, 48, generator=gen), torch.randn(8, 32, generator=gen),
            torch.randn(4, 32, generator=gen))  # fmt: skip
    return make_fx(_projections, tracing_mode="fake")(*args), args


@pytest.mark.parametrize("single_devices, singles", [((), 0), (("cpu",), 2), (("cuda",), 0)])
def test_lone_projections_become_the_op_only_on_the_named_devices(single_devices, singles):
    """FusionConfig.skinny_gemm passes ("cuda",): a lone projection there becomes merged_linear
    with one weight (the skinny GEMM path), an exactly widened weight read in its own dtype;
    elsewhere nothing changes, nor does a GEMM whose second operand is a narrowed weight."""
    from fusion_compiler.patterns.merge_projections import merge_projections

    gm, args = _traced_projections()
    merged, lone = merge_projections(gm.graph, single_devices)
    gm.graph.eliminate_dead_code()  # as the fusion pass does after its passes
    gm.recompile()
    assert (merged, lone) == ([2], singles)
    ops = [n for n in gm.graph.nodes if n.target is torch.ops.fusion_compiler.merged_linear.default]
    assert sorted(len(n.args[1]) for n in ops) == sorted([2] + [1] * singles)
    weight_dtypes = sorted(str(w.meta["val"].dtype) for n in ops for w in n.args[1])
    assert weight_dtypes == sorted(["torch.float32"] * (2 + singles)), weight_dtypes  # fp32 wd, not its fp64 copy
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(casts) == (3 if singles else 4)  # x.double(), x.bfloat16(), wh.bfloat16() (+ wd.double())
    for out, ref in zip(gm(*args), _projections(*args), strict=True):
        torch.testing.assert_close(out, ref)


def test_a_group_the_op_cannot_take_stays_and_says_why():
    """merged_linear reads float GEMMs: two integer projections of one activation keep their
    own mm nodes, and the group comes back with the op's rule it breaks."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusion_compiler.patterns.merge_projections import merge_projections

    def int_projections(x, wa, wb):
        return x @ wa.t(), x @ wb.t()

    args = (torch.randint(0, 5, (2, 32)), torch.randint(0, 5, (16, 32)), torch.randint(0, 5, (8, 32)))
    gm = make_fx(int_projections, tracing_mode="fake")(*args)
    declined = []
    assert merge_projections(gm.graph, ("cpu",), declined) == ([], 0)
    ((first, reason),) = declined
    assert first.target is torch.ops.aten.mm.default
    assert reason == "the activation x_1 is torch.int64 (2, 32), not a 2-D float tensor", reason
    assert len([n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]) == 2


def test_a_declined_group_is_in_the_report():
    """The pass hands the group's reason to the match report: never left apart silently."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import fusion_compiler as fc

    def int_projections(x, wa, wb):
        return x @ wa.t(), x @ wb.t()

    args = (torch.randint(0, 5, (2, 32)), torch.randint(0, 5, (16, 32)), torch.randint(0, 5, (8, 32)))
    gm = make_fx(int_projections, tracing_mode="fake")(*args)
    off = fc.FusionConfig(default_lowering="off", dsa_topk_mask=False, decode_attention=False)
    fusion_pass = fc.FusionPass(off)
    fusion_pass(gm.graph)
    (declined,) = fusion_pass.report.graphs[0].stage_results["merge_projections"]["declined_merges"]
    anchor, reason = declined["anchor"], declined["reason"]
    assert "not a 2-D float tensor" in reason
    assert f"({anchor}) left unmerged: the activation" in fusion_pass.report.format()
    assert fusion_pass.report.to_dict()["declined_merges"][0]["reason"] == reason
