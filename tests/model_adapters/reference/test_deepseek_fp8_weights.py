"""The DeepSeek V3.2 reference with FP8 weights (``ReferenceConfig.fp8_weights``), tiny, on CPU.

- ``fp8_linear`` with block scales equals DeepSeek's FP8 GEMM contract written out per 128-block
  in float64; without them it is the bf16-weight formula, bit for bit.
- the FP8 experts' ``quantize_weight`` (HF's ``Fp8Quantize``), which ``build`` uses, round-trips
  through the reference's ``weight_dequant`` within e4m3's rounding, all-zero blocks scaled 1;
  ``build`` quantises the very weights the bf16 build draws.
- A 1-layer stack runs eagerly and under the fusion backend, and they agree (output, FP8 cache
  bytes); merge_projections leaves the block-dequantised weights alone and says why.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters.reference import deepseek_v32 as ref
from fusion_compiler.ops.moe_experts_fp8 import quantize_weight
from fusion_compiler.verify import relative_error
from model_adapters.reference import test_decode_layers as decode_layers  # its eager-vs-fused bar

FP8_WEIGHTS = ("fused_qkv_a_proj", "q_b_proj", "indexer.wq_b")  # every fp8_linear's weight


def _fp8_gemm_contract(xq, sx, wq, sw):
    """y[t, n] = sum_kb (sum_{k in kb} xq[t, k] * wq[n, k]) * sx[t, kb] * sw[n // 128, kb], float64."""
    n, k = wq.shape
    sw_rows = sw.double()[torch.arange(n) // 128]  # [N, K/128]
    y = torch.zeros(xq.shape[0], n, dtype=torch.float64)
    for kb in range(k // 128):
        cols = slice(128 * kb, 128 * (kb + 1))
        partial = xq[:, cols].double() @ wq[:, cols].double().t()
        y += partial * sx[:, kb, None].double() * sw_rows[None, :, kb]
    return y


@pytest.mark.parametrize("n, k", [(200, 384), (256, 128), (416, 256)])
@pytest.mark.parametrize("ue8m0", [True, False])
def test_fp8_linear_with_weight_scales_equals_the_block_contract(n, k, ue8m0):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(5, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen) * k**-0.5 * (1 + torch.rand(n, 1, generator=gen) * 8)  # blocks of unequal scale
    xq, sx = ref.act_quant(x, 128, ue8m0)
    wq, sw = quantize_weight(w)
    assert sw.shape == (-(-n // 128), k // 128)
    y, expected = ref.fp8_linear(xq, sx, wq, sw), _fp8_gemm_contract(xq, sx, wq, sw)
    assert y.dtype == torch.bfloat16 and y.shape == (5, n)
    # Measured 1.6e-3 to 1.7e-3: the output's bf16 rounding (at most 2^-8 relative per element);
    # the fp32 product before it is 1.9e-7 to 2.5e-7 from the float64 one.
    assert relative_error(y, expected) < 2**-8 + 1e-5
    x = (xq.float().unflatten(-1, (-1, 128)) * sx.unsqueeze(-1)).flatten(-2)
    assert relative_error(x @ ref.weight_dequant(wq, sw).t(), expected) < 1e-6


def test_fp8_linear_without_weight_scales_is_the_bf16_weight_formula_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    xq, sx = ref.act_quant(torch.randn(3, 256, generator=gen).bfloat16(), 128, True)
    w = (torch.randn(200, 256, generator=gen) * 256**-0.5).bfloat16()
    before = ((xq.float().unflatten(-1, (-1, 128)) * sx.unsqueeze(-1)).flatten(-2) @ w.float().t()).to(torch.bfloat16)
    assert torch.equal(ref.fp8_linear(xq, sx, w), before)
    bf16 = ref.build(dataclasses.replace(ref.TINY, num_layers=1))
    assert not [name for name in bf16.state_dict() if name.endswith("_scale_inv")]
    assert all(bf16.get_parameter(f"layers.0.self_attn.{w}").dtype == torch.bfloat16 for w in FP8_WEIGHTS)


def test_quantize_weight_round_trips_within_e4m3_rounding():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 320, generator=gen) * (1 + torch.rand(200, 1, generator=gen) * 8)
    w[:128, 128:256] = 0  # a whole block
    wq, sw = quantize_weight(w)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == (200, 320)
    assert sw.dtype == torch.float32 and sw.shape == (2, 3)  # ceil(200/128) x ceil(320/128)
    assert sw[0, 1] == 1 and not wq[:128, 128:256].float().any()
    blocks_amax = torch.stack([torch.stack([w[i : i + 128, j : j + 128].abs().amax() for j in (0, 128, 256)]) for i in (0, 128)])
    torch.testing.assert_close(sw, torch.where(blocks_amax > 0, blocks_amax / 448, 1.0), rtol=0, atol=0)
    deq = ref.weight_dequant(wq, sw)
    scale = sw.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :320]
    # e4m3: 3 mantissa bits (half an ulp 2^-4 relative), subnormal spacing 2^-9 of the scale.
    assert ((deq - w).abs() <= 2**-4 * w.abs() + 2**-10 * scale).all()
    assert relative_error(deq, w) < 4e-2  # measured 2.6e-2


def test_fp8_build_quantises_the_weights_the_bf16_build_draws():
    cfg = dataclasses.replace(ref.TINY, num_layers=1)
    bf16, fp8 = ref.build(cfg), ref.build(dataclasses.replace(cfg, fp8_weights=True))
    fp8_state = fp8.state_dict()
    for name, value in bf16.state_dict().items():
        if name.removeprefix("layers.0.self_attn.") in FP8_WEIGHTS:
            codes, scale = quantize_weight(value)
            assert torch.equal(fp8_state[name].view(torch.uint8), codes.view(torch.uint8)), name
            assert torch.equal(fp8_state[f"{name}_scale_inv"], scale), name
        else:
            assert torch.equal(fp8_state[name], value), name
    assert len(fp8_state) == len(bf16.state_dict()) + len(FP8_WEIGHTS)


def test_moe_decode_layer_build_honours_fp8_weights():
    """The attention + MoE layer (deepseek_v32_decode_layer.build) quantises the same weights."""
    from fusion_compiler.model_adapters.reference import deepseek_v32_decode_layer as layer

    cfg = dataclasses.replace(layer.TINY, attention=dataclasses.replace(layer.TINY.attention, fp8_weights=True))
    model, bf16 = layer.build(cfg, 1, experts="zeros"), layer.build(layer.TINY, 1, experts="zeros")
    attn = model.layers[0].self_attn
    for name in FP8_WEIGHTS:
        owner, leaf = (attn.indexer, "wq_b") if name.startswith("indexer.") else (attn, name)
        codes, scale = quantize_weight(bf16.get_parameter(f"layers.0.self_attn.{name}"))
        assert getattr(owner, leaf).dtype == torch.float8_e4m3fn, name
        assert torch.equal(getattr(owner, f"{leaf}_scale_inv"), scale), name
        assert torch.equal(getattr(owner, leaf).view(torch.uint8), codes.view(torch.uint8)), name


@pytest.fixture(scope="module")
def fp8_run():
    """A 1-layer FP8-weight stack, eager and under the fusion backend, with lone projections made
    the op on the CPU too (as FusionConfig.skinny_gemm does on CUDA), so each FP8 GEMM is a
    candidate merge_projections must decline; the merged_linear nodes it leaves are recorded."""
    from fusion_compiler.patterns import merge_projections as stage

    real, merged_weights = stage.merge_projections, []

    def cpu_too(graph, single_devices, declined=None):
        result = real(graph, single_devices + ("cpu",), declined)
        op = torch.ops.fusion_compiler.merged_linear.default
        merged_weights.extend(w.meta["val"].dtype for n in graph.nodes if n.target is op for w in n.args[1])
        return result

    model = ref.build(dataclasses.replace(ref.TINY, num_layers=1, fp8_weights=True))
    step = ref.make_step(model.cfg, tokens=2)
    eager_step, fused_step = step.clone(), step.clone()
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(stage, "merge_projections", cpu_too)
        eager = model(**eager_step.kwargs)
        fused = torch.compile(model, backend=backend)(**fused_step.kwargs)
    return dict(model=model, step=step, eager=eager, fused=fused, eager_step=eager_step, fused_step=fused_step,
                report=backend.report, merged_weights=merged_weights)  # fmt: skip


def test_fp8_weight_stack_runs_eagerly_and_compiled_and_they_agree(fp8_run):
    eager, eager_step, fused_step = fp8_run["eager"], fp8_run["eager_step"], fp8_run["fused_step"]
    assert eager.dtype == torch.bfloat16 and torch.isfinite(eager).all()
    caches = eager_step.caches()
    assert caches and all(c.dtype == torch.uint8 for c in caches)  # fp8_ds_mla latent rows, indexer rows
    for written, pristine in zip(caches, fp8_run["step"].caches()):
        assert not torch.equal(written, pristine)
    stock = decode_layers._stock_where_torch_drops_the_rounding(fp8_run["model"], fp8_run["step"])
    # Measured (torch 2.13): output 2.4e-3 from eager, every cache byte equal.
    decode_layers._assert_matches_eager(fp8_run["fused"], eager, fused_step.caches(), caches, stock)


def test_merge_projections_declines_block_dequantised_fp8_weights_and_says_why(fp8_run):
    report = fp8_run["report"]
    declined = [d for g in report.graphs for d in g.stage_results["merge_projections"]["declined_merges"]]
    fp8 = [d for d in declined if "FP8 that the model's code block-dequantises" in d["reason"]]
    assert len(fp8) == len(FP8_WEIGHTS), declined  # each a lone projection of its own activation here
    assert {d["module"] for d in fp8} == {"layers.0.self_attn", "layers.0.self_attn.indexer"}, fp8
    assert "which merged_linear does not read" in report.format()
    assert fp8_run["merged_weights"] and torch.float8_e4m3fn not in fp8_run["merged_weights"]
