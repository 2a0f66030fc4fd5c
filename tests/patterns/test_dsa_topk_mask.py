"""patterns/dsa_topk_mask.py on HF's DeepSeek V3.2 indexer, on its math in miniature, and near misses.

HF's decode step is tested in tests/patterns/test_mla_prologue.py (its strict 2-layer compile
expects one dsa_topk_mask site per indexer). The miniature repeats the indexer tail and the attention's scatter as HF writes them
(fp32 inputs, so no near ties): the compiled mask equals eager's bit for bit, with a bool mask,
an additive one and none, and with the batch-of-one matmuls spelled as Inductor's GPU graph
spells them (``mm`` between squeezes: HF's code at batch 1 on CUDA). Near misses stay unfused with their reason: the top-k values read
too, relu after the head reduction, keys reshaped instead of transposed; so does a site the
op's argument checks refuse (forced), with the op's words. A float64 indexer fuses on the fp32
values its ``.float()`` makes. A top-k whose indices are gathered (routing, sparse attention)
is no site.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusion_compiler as fc
from fusion_compiler.patterns.dsa_topk_mask import FAMILY

BATCH, HEADS, DIM, KEYS, TOPK = 2, 6, 16, 24, 5


def _batch_one_matmul(a, b):
    """``a @ b`` for one sequence and query, spelled as Inductor's joint-graph pass ``bmm_to_mm``
    leaves a batch-of-one ``bmm`` on the GPU (so the CPU sees the GPU's graph)."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    return torch.mm(a.reshape(1, m, k).squeeze(0), b.reshape(1, k, n).squeeze(0)).unsqueeze(0).reshape(1, 1, m, n)


def _indexer_tail(q, keys, weights, mask4, *, scale=DIM**-0.5, topk=TOPK, mask_kind="bool",
                  read_values=False, relu_late=False, reshape_keys=False, batch_one_mm=False):  # fmt: skip
    """HF's DeepseekV32Indexer scoring + DeepseekV32Attention's scatter, as HF writes them."""
    matmul = _batch_one_matmul if batch_one_mm else torch.matmul
    k_t = keys.reshape(keys.shape[0], keys.shape[2], keys.shape[1]) if reshape_keys else keys.transpose(-1, -2)
    scores = matmul(q.float(), k_t.float().unsqueeze(1)) * scale
    if not relu_late:
        scores = F.relu(scores)
    w = weights.float() * HEADS**-0.5
    index = matmul(w.unsqueeze(-2), scores).squeeze(-2)
    if relu_late:
        index = F.relu(index)
    if mask_kind == "bool":
        index = index.masked_fill(~mask4[:, 0], float("-inf"))
    elif mask_kind == "additive":
        index = index + mask4[:, 0]
    top = index.topk(topk, dim=-1)
    idx = top.indices.to(torch.int32)
    index_mask = idx.new_ones(index.shape, dtype=torch.bool).scatter(-1, idx.long(), False).unsqueeze(1)
    if mask_kind == "bool":
        out = mask4 & ~index_mask
    else:
        out = (mask4 if mask_kind == "additive" else torch.zeros_like(index).unsqueeze(1)).masked_fill(index_mask, -1e9)
    return (out, top.values) if read_values else out


def _inputs(mask_kind="bool", batch=BATCH):
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, 1, HEADS, DIM, generator=gen)
    keys = torch.randn(batch, KEYS, DIM, generator=gen)
    weights = torch.randn(batch, 1, HEADS, generator=gen).bfloat16()
    lengths = torch.tensor([KEYS - 3, 4])[:batch]  # the second row allows fewer keys than TOPK
    allowed = (torch.arange(KEYS)[None, None, None, :] < lengths[:, None, None, None])
    mask4 = allowed if mask_kind == "bool" else torch.where(allowed, 0.0, float("-inf"))
    return q, keys, weights, mask4


def _compile(**kwargs):
    mask_kind = kwargs.get("mask_kind", "bool")
    inputs = _inputs(mask_kind, batch=1 if kwargs.get("batch_one_mm") else BATCH)
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lambda *a: _indexer_tail(*a, **kwargs), backend=backend)(*inputs)
        want = _indexer_tail(*inputs, **kwargs)
    return backend.report, got, want


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_indexer_tail_mask_equals_eager(mask_kind):
    report, got, want = _compile(mask_kind=mask_kind)
    assert report.count(FAMILY) == 1 and report.misses(FAMILY) == [], report.to_dict()["sites"]
    variant = {"bool": "bool_mask", "additive": "additive_mask", "none": "no_mask"}[mask_kind]
    assert report.count(FAMILY, variant) == 1
    if mask_kind == "bool":
        assert torch.equal(got, want)
    else:
        # Positions HF's top-k took from the masked (-inf) ones are undefined; the rest agree.
        allowed = torch.isfinite(_inputs(mask_kind)[3]) if mask_kind == "additive" else torch.ones_like(got, dtype=torch.bool)
        assert torch.equal(got[allowed], want[allowed])


def test_batch_of_one_as_the_gpu_graph_spells_it():
    report, got, want = _compile(batch_one_mm=True)
    assert report.count(FAMILY, "bool_mask") == 1 and report.misses(FAMILY) == [], report.to_dict()["sites"]
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(read_values=True), "the top-k values are read"),
        (dict(relu_late=True), "the scores are not a GEMM over the heads"),
        (dict(reshape_keys=True), "not a [B, T, D] cache transposed"),
    ],
)
def test_near_misses_are_reported_with_their_reason(kwargs, reason):
    report, got, want = _compile(**kwargs)
    (miss,) = report.misses(FAMILY)
    assert reason in miss.reason, miss.reason
    # --explain's chain runs from the top-k to the node where matching stopped, marked.
    assert any(miss.stopped_at in line and "diverged here" in line for line in miss.chain), miss.chain
    torch.testing.assert_close(got, want)


def test_a_float64_indexer_fuses_on_its_fp32_casts():
    """In a float64 model HF's ``q.float()`` / ``k.float()`` round down to fp32: the op reads those
    fp32 tensors, as the model's own products do, and the mask equals eager's."""
    inputs = tuple(t.double() if t.is_floating_point() else t for t in _inputs())
    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(_indexer_tail, backend=backend)(*inputs)
        want = _indexer_tail(*inputs)
    assert backend.report.count(FAMILY, "bool_mask") == 1, [s.reason for s in backend.report.misses()]
    assert torch.equal(got, want)


def test_a_site_the_op_rejects_is_a_miss_with_the_ops_words(monkeypatch):
    """The op's argument checks run on the site's fake values before the rewrite: what they raise
    is the miss's reason, and the graph keeps HF's ops (no crash at compile)."""
    from fusion_compiler.ops import dsa_topk_mask as op

    def refuse(*args):
        raise ValueError("topk 5 is too small for this kernel (forced)")

    monkeypatch.setattr(op, "_validate", refuse)
    report, got, want = _compile()
    (miss,) = report.misses(FAMILY)
    assert miss.reason == "the fused op does not take this site: topk 5 is too small for this kernel (forced)"
    assert report.count(FAMILY) == 0
    assert torch.equal(got, want)


def test_gathered_top_k_indices_are_no_site():
    def route(scores, values):
        idx = scores.topk(3, dim=-1).indices
        return values.gather(-1, idx)

    backend = fc.FusionBackend(fc.FusionConfig())
    torch._dynamo.reset()
    scores, values = torch.randn(4, 16), torch.randn(4, 16)
    torch.compile(route, backend=backend)(scores, values)
    assert [s for s in backend.report.sites if s.family == FAMILY] == []
