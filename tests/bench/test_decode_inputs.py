"""The inputs bench/decode.py builds at real widths, checked without building a real model:
every index of a reference step stays inside what it indexes at the bench's context, the DeepSeek
reference's byte-packed cache writes lower in stock Inductor as torch 2.11 lowers them on the
GPU, its random caches hold what a layer writes (unit-scale values, not random FP8 bytes), and
its indexers can be pinned to a given selection (decode.py's ``vs_eager_pinned``)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import pytest
import torch

from fusion_compiler.model_adapters.reference import paged_kv
from fusion_compiler.model_adapters.reference import deepseek_v32 as ds
from fusion_compiler.patterns import spellings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import decode  # noqa: E402

FP8 = torch.float8_e4m3fn


def _layer(model: str):
    return importlib.import_module(f"fusion_compiler.model_adapters.reference.{decode.MODELS[model]}_decode_layer")


@pytest.mark.parametrize("model", list(decode.MODELS))
@pytest.mark.parametrize("size", ["REAL", "TINY"])
def test_step_indices_stay_in_range(model, size):
    """At the bench's context (REAL) or the smoke's (TINY): the new token's position is a row of
    the RoPE table (MiniMax / Qwen3.5's 4096-row table ended at position 4096: a device-side
    assert on the H200), its slot a cache row, every block id a block of the pool."""
    cfg = getattr(_layer(model), size).attention
    context = decode.DEFAULT_CONTEXT if size == "REAL" else 32
    for tokens in (1, 64):
        num_blocks, t = paged_kv.random_block_table(tokens, context, cfg.block_size, torch.Generator().manual_seed(0),
                                                    cfg.max_position)  # fmt: skip
        assert int(t["positions"].max()) < cfg.max_position
        assert int(t["block_table"].max()) < num_blocks and int(t["slots"].max()) < num_blocks * cfg.block_size
        assert int(t["seq_lens"].max()) <= t["block_table"].shape[1] * cfg.block_size


def test_a_position_past_the_rope_table_is_refused():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="RoPE table"):
        paged_kv.random_block_table(1, 4096, 16, gen, max_position=4096)
    with pytest.raises(ValueError, match="RoPE table"):
        ds.make_step(ds.TINY, tokens=1, context=ds.TINY.max_position)
    layer = _layer("minimax-m2.5")
    model = layer.build(layer.TINY, 1, experts="zeros")
    assert model.cos_sin_cache.shape[0] == layer.TINY.attention.max_position
    with pytest.raises(ValueError, match="RoPE table"):
        layer.make_step(model, tokens=1, context=layer.TINY.attention.max_position)


@pytest.mark.parametrize("as_bytes", [ds.as_bytes, spellings.as_bytes], ids=["reference", "pattern"])
def test_as_bytes_is_the_uint8_view(as_bytes):
    special = torch.tensor([[float("nan"), float("-inf"), -0.0, 1e-40, -3.5e38]])
    for t in (torch.randn(3, 1), torch.randn(2, 4), special, torch.randn(2, 64).bfloat16(), special.bfloat16(),
              torch.randn(3, 128).to(FP8), torch.randn(5, 4).half()):  # fmt: skip
        assert torch.equal(as_bytes(t), t.view(torch.uint8)), t.dtype


def _writes(as_bytes):
    """The reference's two cache writes (fp8_ds_mla latent row, indexer row), ue8m0 scales."""

    def writes(kv, k_pe, k, latent_cache, index_cache, slots):
        kv_fp8, kv_scale = ds.act_quant(kv, 128, True)
        rows = torch.cat([as_bytes(kv_fp8), as_bytes(kv_scale), as_bytes(k_pe)], dim=-1)
        latent_cache.view(-1, latent_cache.shape[-1]).index_put_((slots,), rows)
        k_fp8, k_scale = ds.act_quant(k, k.shape[-1], True)
        index_cache.view(-1, index_cache.shape[-1]).index_put_((slots,), torch.cat([as_bytes(k_fp8), as_bytes(k_scale)], dim=-1))

    return writes


class _Lowered(Exception):
    pass


def test_cache_writes_lower_in_stock_inductor_as_on_the_gpu(monkeypatch):
    """Stock Inductor 2.11 on the GPU could not compile the reference ("self.stride(-1) must be 1
    to view Float as Byte ... got 0"): a float -> uint8 view lowers to an eager fallback that gets
    its input as it stands (2.13 first makes it contiguous), and on the GPU the indexer's [T, 1]
    ue8m0 scale, used twice, stays an unrealised pointwise (the CPU realises reused pointwise
    holding log2 / exp2), whose squeezed view reaches the fallback with a last-dim stride of 0.
    Emulated here: that lowering and that heuristic; lowering only (codegen is cut short)."""
    from torch._inductor import config, graph, ir, lowering

    aten = torch.ops.aten
    original = lowering.lowerings.get(aten.view.dtype)
    if original is None or not hasattr(ir.StorageBox, "should_realize_on_reuse"):
        pytest.skip("this torch's Inductor internals differ from the emulated ones")

    def view_dtype(x, dtype):
        if x.get_dtype().itemsize != dtype.itemsize:
            return lowering.fallback_handler(aten.view.dtype)(x, dtype)
        return original(x, dtype)

    def should_realize_on_reuse(self, users, *, graph_reuse=True):
        if users > 1 and isinstance(self.data, (ir.Pointwise, ir.Reduction)):
            return self.has_large_inner_fn() or (graph_reuse and self.num_reads() > config.realize_reads_threshold)
        return False

    def compile_to_module(self):
        raise _Lowered

    monkeypatch.setitem(lowering.lowerings, aten.view.dtype, view_dtype)
    monkeypatch.setattr(ir.StorageBox, "should_realize_on_reuse", should_realize_on_reuse)
    monkeypatch.setattr(graph.GraphLowering, "compile_to_module", compile_to_module)

    def lower(as_bytes) -> str:
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(0)
        args = (torch.randn(1, 512, generator=gen).bfloat16(), torch.randn(1, 64, generator=gen).bfloat16(),
                torch.randn(1, 128, generator=gen).bfloat16(), torch.zeros(2, 4, 656, dtype=torch.uint8),
                torch.zeros(2, 4, 132, dtype=torch.uint8), torch.tensor([5]))  # fmt: skip
        try:
            torch.compile(_writes(as_bytes), fullgraph=True)(*args)
        except Exception as error:  # noqa: BLE001 - the lowering's outcome is the result
            chain, cause = [], error
            while cause is not None:
                chain.append(cause)
                cause = cause.__cause__ or cause.__context__
            if any(isinstance(e, _Lowered) for e in chain):
                return "lowered"
            return str(error)
        return "ran"  # not reached: codegen is cut short

    with config.patch(force_disable_caches=True):  # lower for real: no cached graph
        plain = lower(lambda t: t.view(torch.uint8))
        ours = lower(ds.as_bytes)
    if "stride(-1) must be 1" not in plain:
        pytest.skip(f"the emulation no longer reproduces the 2.11 failure ({plain.splitlines()[0][:120]})")
    assert ours == "lowered", ours


def test_deepseek_step_caches_hold_written_rows():
    """Each cache row decodes to unit-scale values with power-of-two (ue8m0) scales, as the kv_a
    norm and the indexer's LayerNorm leave them; random FP8 bytes decoded to values up to 448 x
    their scale, a one-hot attention that a last-bit difference flipped."""
    cfg = ds.TINY
    step = ds.make_step(cfg, tokens=2, context=30)
    rank, rot, dim = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim
    groups = rank // 128
    for latent, index in zip(step.kwargs["latent_caches"], step.kwargs["index_caches"], strict=True):
        rows = latent.view(-1, latent.shape[-1])
        scale = rows[:, rank : rank + 4 * groups].contiguous().view(torch.float32)
        kv = rows[:, :rank].contiguous().view(FP8).float().unflatten(-1, (groups, 128)) * scale.unsqueeze(-1)
        k_pe = rows[:, rank + 4 * groups :].contiguous().view(torch.bfloat16).float()
        irows = index.view(-1, index.shape[-1])
        iscale = irows[:, dim:].contiguous().view(torch.float32)
        k = irows[:, :dim].contiguous().view(FP8).float() * iscale
        for name, values in (("kv", kv), ("k_pe", k_pe), ("index k", k)):
            rms = float(values.pow(2).mean().sqrt())
            assert 0.8 < rms < 1.25, (name, rms)
        for s in (scale, iscale):
            assert bool((torch.exp2(torch.log2(s).round()) == s).all()) and float(s.max()) < 0.1


def test_pinned_topk_replaces_the_indexer_selection():
    """decode.py's vs_eager_pinned: an indexer pinned to its own selection gives eager's step
    bit for bit (cache writes included); pinned elsewhere, another output; unpinned, the graph's."""
    cfg = dataclasses.replace(ds.TINY, num_layers=1)
    model = ds.build(cfg)
    step = ds.make_step(cfg, tokens=2, context=30)
    indexer = model.layers[0].self_attn.indexer
    assert indexer.pinned_topk is None
    seen = []
    hook = indexer.register_forward_hook(lambda _m, _a, out: seen.append(out.clone()))

    def run(pinned):
        indexer.pinned_topk = pinned
        s = step.clone()
        with torch.no_grad():
            return model(**s.kwargs), s.caches()

    try:
        free, free_caches = run(None)
        same, same_caches = run(seen[0])
        other, _ = run(torch.arange(cfg.index_topk).expand_as(seen[0]).contiguous())
    finally:
        indexer.pinned_topk = None
        hook.remove()
    assert torch.equal(same, free) and all(torch.equal(a, b) for a, b in zip(same_caches, free_caches, strict=True))
    assert not torch.equal(other, free)
