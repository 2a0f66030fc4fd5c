"""What the GQA prologue pattern tests share: a small paged-cache prologue's inputs, compiling it
beside eager, the one-miss assertion, and HF static caches against eager's."""

from __future__ import annotations

import torch

import fusion_compiler as fc
from fusion_compiler.verify import relative_error

FAMILY = "gqa_prologue"


def prologue_inputs(full_weights: bool, table_width: int = 16):
    """(args, caches, slots) of a 3-token prologue: 4 q / 2 kv heads of 16, paged bf16 caches."""
    t, hq, hkv, d = 3, 4, 2, 16
    q, k = torch.randn(t, hq * d, dtype=torch.bfloat16), torch.randn(t, hkv * d, dtype=torch.bfloat16)
    v = torch.randn(t, hkv * d, dtype=torch.bfloat16)
    qw = torch.randn(hq * d if full_weights else d, dtype=torch.bfloat16)
    kw = torch.randn(hkv * d if full_weights else d, dtype=torch.bfloat16)
    table = torch.randn(32, table_width)
    caches = [torch.randn(4, 4, hkv, d, dtype=torch.bfloat16) for _ in range(2)]
    return (q, k, v, qw, kw, table, torch.tensor([3, 1, 30])), caches, torch.tensor([0, 9, 5])


def compile_beside_eager(module, args, caches, slots, families: dict):
    """Run ``module`` eagerly and compiled (other families as ``families`` says), check they
    agree, and return the compiled run's match report."""
    eager_caches = [c.clone() for c in caches]
    backend = fc.FusionBackend(fc.FusionConfig(families=families))
    with torch.no_grad():
        expected = module(*args, *eager_caches, slots)
        actual = torch.compile(module, backend=backend)(*args, *caches, slots)
    assert relative_error(actual, expected) < 1e-2 and relative_error(caches[0], eager_caches[0]) < 1e-2
    return backend.report


def assert_missed(report, *words):
    """Nothing fused, and the one gqa_prologue miss gives a reason containing ``words``."""
    assert report.per_variant() == {}, report.format()
    [miss] = report.misses(FAMILY)
    assert all(w in miss.reason for w in words), miss.reason


def assert_hf_caches(eager_step, fused_cache, attention_layers):
    """HF's static caches after one decode step: the new position's K / V rows close to eager's
    (bf16 tolerance), every other cache byte unchanged."""
    position = eager_step.context
    for i in attention_layers:
        eager_layer, fused_layer = eager_step.cache.layers[i], fused_cache.layers[i]
        for want, got in ((eager_layer.keys, fused_layer.keys), (eager_layer.values, fused_layer.values)):
            others = torch.ones(want.shape[2], dtype=torch.bool)
            others[position] = False
            assert torch.equal(got[:, :, others], want[:, :, others])
            assert relative_error(got[:, :, position], want[:, :, position]) < 1e-2


def paged_decode(ref, ours, cfg, x: torch.Tensor, k_scale=1.0, v_scale=1.0):
    """Decode x [L, hidden] through a reference ``Attention`` one token at a time, the
    sequence's blocks scattered in the paged caches. Returns (outputs [L, hidden], k_cache)."""
    from fusion_compiler.model_adapters.reference import paged_kv

    length = x.shape[0]
    blocks = -(-length // cfg.block_size)
    block_table = torch.randperm(blocks + 3)[:blocks].view(1, blocks)
    k_cache = torch.randn(blocks + 3, cfg.block_size, cfg.num_kv_heads, cfg.head_dim).to(cfg.cache_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(cfg.cache_dtype)
    table = ref.rope_cos_sin_cache(cfg)
    rows = []
    with torch.no_grad():
        for p in range(length):
            slots, valid = paged_kv.context_of(block_table, torch.tensor([p + 1]), cfg.block_size)
            args = (table, torch.tensor([p]), slots[:, -1], k_cache, v_cache, k_scale, v_scale, slots, valid)
            rows.append(ours(x[p : p + 1], *args))
    return torch.cat(rows), k_cache


def assert_prologue_writes_only_its_slots(ref):
    """A reference prologue writes K and V at its tokens' slots and nowhere else."""
    cfg = ref.TINY
    torch.manual_seed(0)
    ours = ref.Attention(cfg).to(torch.bfloat16)
    k_cache = torch.randn(6, cfg.block_size, cfg.num_kv_heads, cfg.head_dim).bfloat16()
    v_cache = torch.randn_like(k_cache)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    x = torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16)
    slots = torch.tensor([5, 2 * cfg.block_size + 7, 4 * cfg.block_size])
    with torch.no_grad():
        ours.prologue(x, ref.rope_cos_sin_cache(cfg), torch.tensor([3, 0, 40]), slots, k_cache, v_cache, 1.0, 1.0)
    written = torch.zeros(6 * cfg.block_size, dtype=torch.bool)
    written[slots] = True
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):
        flat, flat_before = cache.view(-1, *cache.shape[2:]), before.view(-1, *cache.shape[2:])
        assert torch.equal(flat[~written], flat_before[~written])
        assert not torch.equal(flat[written], flat_before[written])
