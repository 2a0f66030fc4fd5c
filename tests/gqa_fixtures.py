"""What the GQA prologue pattern tests share: a small paged-cache prologue's inputs, compiling it
beside eager, and the one-miss assertion."""

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
