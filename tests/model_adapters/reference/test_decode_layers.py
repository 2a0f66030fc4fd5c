"""The reference decode layers (model_adapters/reference/: <model>_decode_layer.py, moe.py), tiny,
on CPU.

- Every model's 1- and 2-layer stacks (Qwen3.5: each layer kind alone, twice, and one of each)
  run eagerly, with the routed experts computed and stubbed: finite outputs, every cache and
  state written; the same seed builds the same weights.
- The routed-experts op equals a loop over tokens and experts in fp32 (bf16 tolerance); the
  stub returns zeros; each stays one opaque node per layer in the graph Inductor receives.
- Under the fusion backend (strict), a 1-layer stack of each model (Qwen3.5: one layer of each
  kind) fuses every expected site; outputs and caches match eager, and the compiled code calls
  the experts op once per layer, as eager does.
- REAL configs, built on the meta device: the weight bytes of one layer (the GPU run's sizing).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler as fc
from fusion_compiler._compat import JOINT_GRAPH_DROPS_ROUND_TRIPS
from fusion_compiler.model_adapters.reference import moe, paged_kv
from fusion_compiler.model_adapters.reference import deepseek_v32_decode_layer as deepseek
from fusion_compiler.model_adapters.reference import minimax_m2_decode_layer as minimax
from fusion_compiler.model_adapters.reference import qwen35_decode_layer as qwen
from fusion_compiler.verify import relative_error

LINEAR, FULL = qwen.LAYER_KINDS
MODELS = {"deepseek": deepseek, "minimax": minimax, "qwen": qwen}
ATTENTION_OP = torch.ops.fusion_compiler_ref.paged_decode_attention.default
ZEROS_OP = torch.ops.fusion_compiler_ref.routed_experts_zeros.default


def _build(name: str, layers, experts: str = "grouped", seed: int = 0):
    """layers: a layer count, or Qwen3.5's list of layer kinds."""
    return MODELS[name].build(MODELS[name].TINY, layers, experts=experts, seed=seed)


# ------------------------------------------------------------------------------------------
# Eager
# ------------------------------------------------------------------------------------------

STACKS = [("deepseek", 1), ("deepseek", 2), ("minimax", 1), ("minimax", 2), ("qwen", [LINEAR]), ("qwen", [FULL]),
          ("qwen", [LINEAR, LINEAR]), ("qwen", [FULL, FULL]), ("qwen", [LINEAR, FULL])]  # fmt: skip


@pytest.mark.parametrize("experts", moe.EXPERTS_MODES)
@pytest.mark.parametrize("name, layers", STACKS)
def test_stack_runs_eagerly_and_writes_every_cache(name, layers, experts):
    model = _build(name, layers, experts)
    step = MODELS[name].make_step(model, tokens=3)
    before = step.clone()
    with torch.no_grad():
        out = model(**step.kwargs)
    assert out.shape == (3, model.cfg.hidden_size) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert len(step.caches()) == 2 * len(model.layers)  # K and V, latent and index, or conv and recurrent
    for written, pristine in zip(step.caches(), before.caches()):
        assert not torch.equal(written, pristine)


def test_same_seed_same_weights_other_seed_other_weights():
    weights = [_build("qwen", [LINEAR, FULL], seed=s).state_dict() for s in (0, 0, 1)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    experts = "layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(weights[0][experts], weights[2][experts])


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="experts must be one of"):
        _build("minimax", 1, experts="none")
    with pytest.raises(ValueError, match="layer kind"):
        _build("qwen", ["mamba"])
    with pytest.raises(ValueError, match="num_layers"):
        _build("deepseek", 0)
    with pytest.raises(ValueError, match="bf16"):
        deepseek.build(deepseek.TINY, 1, dtype=torch.float32)


# ------------------------------------------------------------------------------------------
# The experts op
# ------------------------------------------------------------------------------------------


def _experts_loop(hidden, ids, weights, gate_up_proj, down_proj):
    """The routed experts, one token and one expert at a time, in fp32."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate, up = (gate_up_proj[e].float() @ hidden[t].float()).chunk(2)
            out[t] += weights[t, k].float() * (down_proj[e].float() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("form", [moe.grouped_mm_experts, moe.batched_mm_experts])
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])  # sigmoid routers' / softmax's
def test_routed_experts_equal_a_loop_over_tokens_and_experts(weights_dtype, form):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, experts, top_k, inter = 3, 64, 6, 2, 32
    hidden = torch.randn(tokens, hidden_size, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).to(weights_dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden_size, generator=gen) * hidden_size**-0.5).bfloat16()
    down = (torch.randn(experts, hidden_size, inter, generator=gen) * inter**-0.5).bfloat16()
    out = form(hidden, ids, weights, gate_up, down)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, _experts_loop(hidden, ids, weights, gate_up, down)) < 1e-2
    with pytest.raises(ValueError, match="both \\[T, top_k\\]"):
        form(hidden, ids, weights[:, :1], gate_up, down)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, paged_kv.FP8])
def test_paged_decode_attention_equals_the_repeated_fp32_attention(cache_dtype):
    """The opaque attention (each kv head's rows gathered once, G query heads as G queries of one
    SDPA) equals the fp32 attention over every query head's repeated rows; padded context
    positions (slot -1, masked) take no weight."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim, blocks, block_size, ctx = 3, 6, 2, 16, 8, 4, 10
    q = torch.randn(tokens, heads, head_dim, generator=gen).bfloat16()
    caches = [(torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen) * 4).to(cache_dtype) for _ in range(2)]
    slots = torch.randperm(blocks * block_size, generator=gen)[: tokens * ctx].view(tokens, ctx)
    valid = torch.arange(ctx) < torch.tensor([[ctx], [7], [1]])
    slots = torch.where(valid, slots, -1)
    args = (q, *caches, 0.5, 0.25, slots, valid, kv_heads)
    out = paged_kv.paged_decode_attention(*args)
    assert out.dtype == torch.float32 and out.shape == (tokens, heads, head_dim)
    assert relative_error(out, paged_kv.paged_decode_attention_reference(*args)) < (1e-2 if cache_dtype == torch.bfloat16 else 1e-5)


def test_zero_experts_return_zeros_and_hold_no_weights():
    model = _build("minimax", 1, experts="zeros")
    block = model.layers[0].mlp
    assert list(block.experts.parameters()) == []
    x = torch.randn(3, minimax.TINY.moe.hidden_size).bfloat16()
    with torch.no_grad():
        out = block(x)  # MiniMax has no shared expert: the block is the routed experts alone
    assert out.dtype == x.dtype and torch.equal(out, torch.zeros_like(x))


def test_stubbed_experts_stay_one_opaque_node_per_layer():
    """The graph Inductor lowers (Dynamo's, after AOT with Inductor's decompositions) calls the
    zeros stub and the attention op once per layer and has no expert GEMM of its own."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _build("minimax", 2, "zeros")
    step = minimax.make_step(model)
    backend = aot_autograd(fw_compiler=capture, decompositions=select_decomp_table())
    with torch.no_grad():
        torch.compile(model, backend=backend)(**step.kwargs)
    [graph] = graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is ZEROS_OP]
    assert len(calls) == 2
    attention = [n for n in graph.graph.nodes if n.target is ATTENTION_OP]
    assert len(attention) == 2
    gemms = (torch.ops.aten.bmm.default, torch.ops.aten._grouped_mm.default)
    assert not [n for n in graph.graph.nodes if n.target in gemms]


# ------------------------------------------------------------------------------------------
# Fusion
# ------------------------------------------------------------------------------------------

FUSED_STACKS = {"deepseek": 1, "minimax": 1, "qwen": [LINEAR, FULL]}


def _stock_where_torch_drops_the_rounding(model, step):
    """Torch 2.11's joint graph folds ``x.to(bf16).to(float32)`` (`_compat.JOINT_GRAPH_DROPS_ROUND_TRIPS`):
    the bf16 rounding DeepSeek applies before its FP8 quantisation is gone from the graph stock
    Inductor and our pass compile, so neither can write eager's FP8 bytes (measured, 1-layer
    DeepSeek on 2.11: stock 1.4e-2 from eager and 112 + 23 cache bytes off, ours 1.3e-2 and 5 + 0;
    with 2.13's rule patched in, ours 2.3e-3 and bytes equal). There, stock Inductor's (output,
    caches) on the same step are the bar, as in the numerics gate; None where torch keeps it."""
    if not JOINT_GRAPH_DROPS_ROUND_TRIPS or not any(c.dtype == torch.uint8 for c in step.caches()):
        return None
    stock_step = step.clone()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="inductor")(**stock_step.kwargs)
    return out, stock_step.caches()


def _assert_matches_eager(fused, eager, fused_caches, eager_caches, stock=None):
    """Output within 1e-2 of eager's, FP8 (uint8) caches eager's bytes, others within 1e-2. With
    ``stock`` (above): output within max(1.5 x stock's error, 1e-2), FP8 caches no more bytes off
    eager's than stock's."""
    bound = 1e-2 if stock is None else max(1.5 * relative_error(stock[0], eager), 1e-2)
    assert relative_error(fused, eager) < bound
    stock_caches = eager_caches if stock is None else stock[1]
    for fused_cache, eager_cache, stock_cache in zip(fused_caches, eager_caches, stock_caches):
        if eager_cache.dtype == torch.uint8:  # DeepSeek's FP8 latent and indexer rows: the same bytes
            assert (fused_cache != eager_cache).sum() <= (stock_cache != eager_cache).sum()
        else:
            assert relative_error(fused_cache, eager_cache) < 1e-2


@pytest.fixture(scope="module", params=sorted(FUSED_STACKS))
def fused_run(request):
    from torch._inductor.utils import run_and_get_code

    name = request.param
    model = _build(name, FUSED_STACKS[name])
    expected = MODELS[name].expected_sites(model)
    step = MODELS[name].make_step(model, tokens=2)
    eager_step, fused_step = step.clone(), step.clone()
    backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(**eager_step.kwargs)
        compiled = torch.compile(model, backend=backend)
        fused, code = run_and_get_code(lambda: compiled(**fused_step.kwargs))
    return dict(model=model, expected=expected, report=backend.report, eager=eager, fused=fused, code="\n".join(code),
                eager_caches=eager_step.caches(), fused_caches=fused_step.caches(),
                stock=_stock_where_torch_drops_the_rounding(model, step))  # fmt: skip


def test_every_expected_site_fuses(fused_run):
    report, expected = fused_run["report"], fused_run["expected"]
    assert report.misses() == [] and report.missing_expected() == [], report.format()
    layers = len(fused_run["model"].layers)
    assert len(expected["moe_routing"]) == layers and len(expected["add_rms_norm"]) >= 2 * layers
    for family, modules in expected.items():
        assert report.per_module(family) == modules, (family, report.format())


def test_compiled_step_matches_eager(fused_run):
    # Measured: outputs 2.7e-3 (DeepSeek), 3.6e-3 (MiniMax), 5.1e-3 (Qwen3.5); caches <= 1.6e-3.
    _assert_matches_eager(fused_run["fused"], fused_run["eager"], fused_run["fused_caches"], fused_run["eager_caches"],
                          fused_run["stock"])  # fmt: skip


def test_compiled_code_calls_the_experts_op_once_per_layer(fused_run):
    """The plain-torch grouped_mm experts became our moe_experts op, one call per layer, and no
    grouped GEMM of the original chain is left."""
    calls = fused_run["code"].count("torch.ops.fusion_compiler.moe_experts.default(")
    assert calls == len(fused_run["model"].layers)
    assert "_grouped_mm" not in fused_run["code"]


def test_deepseek_fp8_linears_read_their_bf16_weights(monkeypatch):
    """DeepSeek's simulated FP8 GEMMs (``dequantised x @ w.float().t()``): per layer the fused
    q_a / kv_a projection and the q latent's two (q_b, the indexer's wq_b: one activation, one
    merged GEMM) become merged_linear reading the bf16 weights, with no fp32 copy of them (a lone
    one only where FusionConfig.skinny_gemm reaches, CUDA: made CPU here to see it). (Two layers
    give 2x the same count; their output is 1.2e-2 from eager with or without this pass.)"""
    from fusion_compiler.patterns import merge_projections as stage

    real, widened = stage.merge_projections, []

    def cpu_too(graph, single_devices, declined=None):
        result = real(graph, single_devices + ("cpu",), declined)
        for node in graph.nodes:
            if node.target is torch.ops.fusion_compiler.merged_linear.default:
                x, weights = node.args
                widened.extend(tuple(w.meta["val"].shape) for w in weights if w.meta["val"].dtype != x.meta["val"].dtype)
        return result

    monkeypatch.setattr(stage, "merge_projections", cpu_too)
    model = _build("deepseek", 1)
    step = deepseek.make_step(model, tokens=2)
    eager_step, fused_step = step.clone(), step.clone()
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(**eager_step.kwargs)
        fused = torch.compile(model, backend=fc.FusionBackend(fc.FusionConfig()))(**fused_step.kwargs)
    attn = model.layers[0].self_attn
    per_layer = sorted(tuple(w.shape) for w in (attn.fused_qkv_a_proj, attn.q_b_proj, attn.indexer.wq_b))
    assert sorted(widened) == per_layer, widened
    assert all(c.dtype == torch.uint8 for c in step.caches())  # FP8 rows, byte for byte
    _assert_matches_eager(fused, eager, fused_step.caches(), eager_step.caches(),
                          _stock_where_torch_drops_the_rounding(model, step))


# ------------------------------------------------------------------------------------------
# Real widths
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, layers, layer_bytes, experts_bytes",
    [
        ("deepseek", 1, 23_042_524_672, 256 * 3 * 2048 * 7168 * 2),  # 21.46 GiB, experts 21.0
        ("minimax", 1, 7_337_438_208, 256 * 3 * 1536 * 3072 * 2),  # 6.83 GiB, experts 6.75
        ("qwen", [LINEAR], 13_150_315_008, 512 * 3 * 1024 * 4096 * 2),  # 12.25 GiB, experts 12.0
        ("qwen", [FULL], 13_124_002_816, 512 * 3 * 1024 * 4096 * 2),  # 12.22 GiB, experts 12.0
    ],
)
def test_real_layer_weight_bytes(name, layers, layer_bytes, experts_bytes):
    module = MODELS[name]
    layer = module.build(module.REAL, layers, device="meta").layers[0]
    assert moe.weight_bytes(layer) == layer_bytes
    assert moe.weight_bytes(layer.mlp.experts) == experts_bytes
    stub = module.build(module.REAL, layers, experts="zeros", device="meta").layers[0]
    assert moe.weight_bytes(stub) == layer_bytes - experts_bytes
    # What batched_mm_experts copies per decoded token: top_k experts' three matrices, bf16.
    assert module.REAL.moe.gathered_bytes(1) == experts_bytes // layer.mlp.gate.weight.shape[0] * module.REAL.moe.top_k
