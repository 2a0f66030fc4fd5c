"""patterns/decode_attention.py on HF's real attention code (SDPA over ``repeat_kv``), and near misses.

HF's decode step of each model, tiny widths, CPU (Inductor's CPU flash SDPA op): one
decode_attention site per attention layer, matched; the logits equal eager's within bf16
rounding. MiniMax and Qwen3.5's full attention repeat the cache. DeepSeek's expanded MLA cache
(every head, G = 1, q/k 192 wide and v 128) is not a site on CPU: Inductor decomposes an SDPA
whose q and v widths differ into its math there; on CUDA it is a cuDNN SDPA op, a site (the H200
decode bench reports it). Near misses must stay SDPA: a per-head mask, a causal single query, a
float64 attention (the kernel takes fp16 / bf16 / fp32); prefill (several queries) is not a site
at all. A mask made by DeepSeek's indexer (top-k, in miniature) fuses as the ``sparse`` variant.
"""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import get_adapter, make_decode_step
from fusion_compiler.patterns.decode_attention import FAMILY
from fusion_compiler.verify import relative_error

# model -> (layers built, attention layers among them, variant)
MODELS = {
    "minimax-m2.5": (1, ["model.layers.0.self_attn"], "repeat_kv"),
    "qwen3.5": (4, ["model.layers.3.self_attn"], "repeat_kv"),
}


@pytest.mark.parametrize("model_name", list(MODELS))
def test_hf_decode_attention_fuses_once_per_attention_layer(model_name):
    layers, attention_modules, variant = MODELS[model_name]
    adapter = get_adapter(model_name)
    model = adapter.build_hf(size="tiny", layers=layers, device="cpu", dtype=torch.bfloat16, seed=0)
    backend = fc.FusionBackend(fc.FusionConfig(expected=adapter.expected_sites(model, batch=2, context=16)))
    compiled = torch.compile(model, backend=backend)
    step = make_decode_step(model, batch=2, context=16, seed=3, max_cache_len=32)
    got, want = step.run(compiled), step.run(model)
    assert relative_error(got.float(), want.float()) < 2e-2
    report = backend.report
    assert report.per_module(FAMILY) == {m: 1 for m in attention_modules}, report.to_dict()["sites"]
    assert report.count(FAMILY, variant) == len(attention_modules)
    assert report.misses(FAMILY) == []
    assert report.missing_expected() == []


def _repeat_kv(x, groups):
    batch, heads, keys, dim = x.shape
    return x[:, :, None].expand(batch, heads, groups, keys, dim).reshape(batch, heads * groups, keys, dim)


class _Attention(torch.nn.Module):
    """HF's sdpa_attention_forward in miniature: repeat_kv, then SDPA with the given mask."""

    def __init__(self, **sdpa_kwargs):
        super().__init__()
        self.sdpa_kwargs = sdpa_kwargs

    def forward(self, q, k_cache, v_cache, mask):
        groups = q.shape[1] // k_cache.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, _repeat_kv(k_cache, groups), _repeat_kv(v_cache, groups), attn_mask=mask, **self.sdpa_kwargs
        )


def _inputs(queries=1, mask_heads=1, batch=2, heads=4, kv_heads=2, keys=24, dim=32):
    gen = torch.Generator().manual_seed(queries * 10 + mask_heads)
    q = torch.randn(batch, heads, queries, dim, generator=gen).bfloat16()
    k, v = (torch.randn(batch, kv_heads, keys, dim, generator=gen).bfloat16() for _ in range(2))
    lengths = torch.tensor([keys - 5, keys - 11])[:batch]
    mask = (torch.arange(keys)[None, None, None, :] < lengths[:, None, None, None]).expand(batch, mask_heads, queries, keys)
    return q, k, v, mask.contiguous()


def _compile(module, *inputs):
    backend = fc.FusionBackend(fc.FusionConfig())
    with torch.no_grad():
        out = torch.compile(module, backend=backend)(*inputs)
        want = module(*inputs)
    return backend.report, out, want


def _skip_hints(monkeypatch) -> list:
    """The ``sparse_mask`` argument of every decode_attention node the stage writes."""
    from fusion_compiler.patterns import decode_attention as stage

    real, hints = stage.fuse_decode_attention, []

    def recorded(graph):
        sites = real(graph)
        op = torch.ops.fusion_compiler.decode_attention.default
        hints.extend(bool(n.args[5]) if len(n.args) > 5 else False for n in graph.nodes if n.target is op)
        return sites

    monkeypatch.setattr(stage, "fuse_decode_attention", recorded)
    return hints


def test_a_one_row_mask_fuses_and_equals_sdpa(monkeypatch):
    """A length mask (a static cache's unwritten tail): the variant is not ".sparse" (that names
    DSA's top-k), but the op is told to skip the rows the mask rules out."""
    hints = _skip_hints(monkeypatch)
    report, out, want = _compile(_Attention(), *_inputs())
    assert report.count(FAMILY, "repeat_kv") == 1
    assert hints == [True]
    assert relative_error(out.float(), want.float()) < 1e-2


def test_no_mask_no_skip(monkeypatch):
    hints = _skip_hints(monkeypatch)
    report, out, want = _compile(_Attention(), *_inputs()[:3], None)
    assert report.count(FAMILY, "repeat_kv") == 1 and hints == [False]
    assert relative_error(out.float(), want.float()) < 1e-2


@pytest.mark.parametrize(
    ("module", "inputs", "reason"),
    [
        (_Attention(), _inputs(mask_heads=4), "per head or per query"),
        (_Attention(is_causal=True), _inputs()[:3] + (None,), "is_causal"),
        # The op's own argument checks, before the rewrite: a dtype its kernel cannot take.
        (_Attention(), tuple(t.double() if t.is_floating_point() else t for t in _inputs()),
         "the fused op does not take this site: q dtype torch.float64 not supported"),
    ],
    ids=["per_head_mask", "causal_single_query", "float64"],
)
def test_near_misses_stay_sdpa_with_a_reason(module, inputs, reason):
    report, out, want = _compile(module, *inputs)
    assert report.count(FAMILY) == 0
    (miss,) = report.misses(FAMILY)
    assert reason in miss.reason
    assert relative_error(out.float(), want.float()) < 1e-2


class _TopKAttention(torch.nn.Module):
    """DeepSeek V3.2's sparse attention in miniature: HF's indexer tail and scatter (top-k of
    the indexer's scores, as ``DeepseekV32Indexer`` and ``DeepseekV32Attention`` write them) make
    the bool mask, then SDPA over a repeated cache (q and v one width, so the CPU keeps SDPA)."""

    def forward(self, q, k_cache, v_cache, mask, index_q, index_keys, index_weights, top_k: int = 6):
        scores = torch.relu(torch.matmul(index_q.float(), index_keys.float().transpose(-1, -2).unsqueeze(1)) * 0.25)
        index = torch.matmul((index_weights.float() * 0.5).unsqueeze(-2), scores).squeeze(-2)
        index = index.masked_fill(~mask[:, 0], float("-inf"))
        top = index.topk(top_k, dim=-1).indices.to(torch.int32)
        index_mask = top.new_ones(index.shape, dtype=torch.bool).scatter(-1, top.long(), False).unsqueeze(1)
        return _Attention()(q, k_cache, v_cache, mask & ~index_mask)


def test_a_top_k_mask_fuses_as_sparse_and_equals_sdpa():
    """The mask is dsa_topk_mask's: the variant says sparse (and, as for any mask, the kernel
    loads only the kept rows)."""
    q, k, v, mask = _inputs()
    gen = torch.Generator().manual_seed(5)
    # 8 indexer heads with positive weights: no key's score is a relu-zero tie at the k-th.
    index_inputs = (torch.randn(2, 1, 8, 16, generator=gen), torch.randn(2, 24, 16, generator=gen),
                    torch.rand(2, 1, 8, generator=gen) + 0.1)  # fmt: skip
    report, out, want = _compile(_TopKAttention(), q, k, v, mask, *index_inputs)
    assert report.count("dsa_topk_mask") == 1
    assert report.count(FAMILY, "repeat_kv.sparse") == 1
    assert relative_error(out.float(), want.float()) < 1e-2


def test_prefill_is_not_a_site():
    report, _, _ = _compile(_Attention(), *_inputs(queries=3))
    assert [s for s in report.sites if s.family == FAMILY] == []
