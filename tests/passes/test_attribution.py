"""Every site is attributed to its layer when the decode step splits into several graphs.

HF's "eager" experts loop over the experts hit with ``nonzero``, which breaks the graph in every
MoE block: Dynamo then compiles each decoder layer's forward, the MoE block's and the experts'
as frames of their own, whose ``nn_module_stack`` paths start at that frame's ``self``
(``L['self'].gate``). The backend names them from the model (backend.qualify_module_paths), found
among the modules running (a plain ``torch.compile``) or given (``fusion_compiler.compile``).
A tiny two-layer MiniMax-M2 (CPU, fp32, eager experts; ~20 s per compile).
"""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import get_adapter, make_decode_step

LAYERS = (0, 1)


@pytest.fixture(scope="module")
def model():
    return get_adapter("minimax-m2.5").build_hf(size="tiny", layers=2, dtype=torch.bfloat16,
                                                experts_implementation="eager", num_local_experts=2)  # fmt: skip


@pytest.fixture(scope="module")
def compiled(model):
    """(expected sites, report, graphs compiled) of one decode step through torch.compile with
    our backend and no root given."""
    expected = get_adapter("minimax-m2.5").expected_sites(model)
    backend = fc.FusionBackend(fc.FusionConfig(expected=expected, cudagraphs=False))
    torch._dynamo.reset()
    make_decode_step(model).run(torch.compile(model, backend=backend))
    return expected, backend.report, backend.compiles


def _per_layer(per_module: dict) -> dict:
    return {i: sum(n for m, n in per_module.items() if m.startswith(f"model.layers.{i}.")) for i in LAYERS}


def test_every_site_is_attributed_to_its_layer(compiled):
    expected, report, compiles = compiled
    assert compiles > 4  # the step really is split
    outside = [(s.family, s.module) for s in report.sites if s.layer is None]
    assert outside == [("add_rms_norm", "model.norm")]  # the final norm, and nothing else
    qk_norms = {f"model.layers.{i}.self_attn.{n}": 1 for i in LAYERS for n in ("q_norm", "k_norm")}
    assert report.per_module("add_rms_norm") == {**expected["add_rms_norm"], **qk_norms}
    assert {i: report.per_layer("moe_routing").get(i, 0) for i in LAYERS} == _per_layer(expected["moe_routing"])
    assert report.per_module("moe_routing") == expected["moe_routing"]
    assert report.per_module("decode_attention") == {f"model.layers.{i}.self_attn": 1 for i in LAYERS}
    # With the step split, cos/sin arrive from the rotary embedding's own graph: the prologue
    # misses, once per layer, with its reason, at its layer's attention (add_rms_norm then fuses
    # its q/k norms one by one, beyond the expected sites: bench/NOTES.md section 20).
    misses = report.misses("gqa_prologue")
    assert sorted(m.module for m in misses) == sorted(expected["gqa_prologue"])
    assert all("cos/sin" in m.reason for m in misses)
    assert not report.unseen_expected()


def test_a_graph_compiled_in_one_layer_is_credited_to_each_layer_it_runs_for(compiled):
    """The MoE block's graph is compiled once, in layer 0, and runs for layer 1 too."""
    _, report, compiles = compiled
    reruns = [g for g in report.graphs if g.runs is not None]
    assert len(report.graphs) - len(reruns) == compiles
    assert {s.module for g in reruns for s in g.matched("moe_routing")} == {"model.layers.1.mlp.gate"}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)

    def forward(self, x):
        x = self.norm(x)
        torch._dynamo.graph_break()
        return self.proj(x) + x


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("given", [True, False], ids=["root-given", "root-found-on-the-stack"])
def test_module_paths_of_a_frame_resumed_in_a_layer_are_the_models(given):
    """No Inductor: a recording backend qualifies each graph's paths as FusionBackend does, with
    the model given (fc.compile, inspect) or found among the running modules (torch.compile)."""
    from fusion_compiler import _compat
    from fusion_compiler.backend import qualify_module_paths
    from fusion_compiler.fx.module_paths import module_path

    model, paths = _Stack(), []

    def backend(gm, example_inputs):
        qualify_module_paths(gm, [model] if given else _compat.calling_modules())
        paths.extend(module_path(n) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(torch.randn(2, 8))
    # Layer 0's block runs as a frame of its own (the break is inside it): "proj", not "layers.0.proj".
    assert "layers.0.proj" in paths and all(p and p.startswith("layers.") for p in paths), paths
