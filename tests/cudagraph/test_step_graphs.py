"""cudagraph.py's bookkeeping on CPU: which inputs are batch / slot / in-place inputs, the
bucket a batch runs in, padding with slot -1 (and re-padding after a larger batch), outputs
sliced back, moved inputs copied from then on, and the kernel-node count of a CUDA-graph dump.
Capture itself needs CUDA: a stand-in graph replays the compiled callable on the bucket's
static buffers (tests/gpu/test_cudagraph_gpu.py captures for real)."""

from __future__ import annotations

import pytest
import torch

from fusion_compiler import cudagraph
from fusion_compiler.config import DEFAULT_BUCKETS, DEFAULT_SLOT_INPUTS, FusionConfig


class Step(torch.nn.Module):
    """A decode step's shape: per-token inputs, a slot-indexed cache written in place (slot -1
    writes nothing a real slot reads)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden, slots, positions, cache):
        out = self.proj(hidden) + positions[:, None]
        # slot -1 writes the cache's last row, a scratch row no real slot uses
        cache.index_put_((torch.where(slots >= 0, slots, cache.shape[0] - 1),), out)
        return out, cache[:-1].sum()


def _trace(tokens: int = 3):
    """Dynamo's graph of Step with a dynamic batch, and its example inputs."""
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    step = Step()
    args = (torch.randn(tokens, 8), torch.arange(tokens), torch.arange(tokens).float(), torch.zeros(16, 8))
    for t in args[:3]:
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    torch.compile(step, backend=backend)(*args)
    return seen["gm"], seen["inputs"]


@pytest.fixture(scope="module")
def traced():
    return _trace()


def _names(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def test_plan_finds_batch_slot_and_in_place_inputs(traced):
    gm, inputs = traced
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    names = _names(gm)
    batch = {names[i] for i in plan.batch}
    assert batch == {n for n in names if n.startswith(("l_hidden", "l_slots", "l_positions"))}
    assert [names[i] for i in plan.slots] == [n for n in names if n.startswith("l_slots")]
    assert [names[i] for i in plan.movable] == [n for n in names if n.startswith("l_cache")]  # params excluded
    assert plan.batch_sizes and all(isinstance(inputs[i], (int, torch.SymInt)) for i in plan.batch_sizes)
    assert plan.batch_outputs == (0,)  # out is per token, the cache sum is not


def test_a_cache_with_its_own_dynamic_size_is_no_batch_input():
    """A paged cache whose block count grows with the batch is dynamic too, under its own symbol:
    it is read in place (address checked), not taken for a batch row (as one, its size never
    equalled the batch and every call ran uncaptured: the reference layers at batch 64)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    args = (torch.randn(3, 8), torch.arange(3), torch.arange(3).float(), torch.zeros(16, 8))
    for t in args:
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    torch.compile(Step(), backend=backend)(*args)
    plan = cudagraph.plan_inputs(seen["gm"], seen["inputs"], DEFAULT_SLOT_INPUTS)
    names = _names(seen["gm"])
    assert {names[i] for i in plan.batch} == {n for n in names if n.startswith(("l_hidden", "l_slots", "l_positions"))}
    assert [names[i] for i in plan.movable] == [n for n in names if n.startswith("l_cache")]
    assert all(seen["inputs"][i] == 3 for i in plan.batch_sizes)


class _StandInGraph:
    def __init__(self, fn, args):
        self.fn, self.args, self.replays = fn, args, 0

    def replay(self):
        self.replays += 1
        self.outputs[:] = list(self.fn(*self.args))


def _stand_in_capture(self, bucket):
    graph = _StandInGraph(self.compiled, bucket.args)
    graph.outputs = list(self.compiled(*bucket.args))
    bucket.graph, bucket.outputs, bucket.kernel_nodes = graph, graph.outputs, 3
    return True


def test_buckets_pad_with_slot_minus_one_and_slice_outputs(traced, monkeypatch):
    gm, inputs = traced
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    calls = []

    def compiled(*args):
        calls.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        return gm.forward(*args)

    monkeypatch.setattr(cudagraph.StepGraphs, "_capture", _stand_in_capture)
    graphs = cudagraph.StepGraphs(compiled, plan, DEFAULT_BUCKETS)
    names = _names(gm)
    slot_i = plan.slots[0]
    cache_i = names.index(next(n for n in names if n.startswith("l_cache")))
    size_i = plan.batch_sizes[0]

    def call(tokens, seed):
        gen = torch.Generator().manual_seed(seed)
        args = list(inputs)
        for i in plan.batch:
            shape = (tokens, *inputs[i].shape[1:])
            args[i] = torch.randn(shape, generator=gen).to(inputs[i].dtype)
        args[slot_i] = torch.randperm(15, generator=gen)[:tokens]
        for i in plan.batch_sizes:
            args[i] = tokens
        expected_cache = inputs[cache_i].clone()
        expected = gm.forward(*[expected_cache if i == cache_i else a for i, a in enumerate(args)])
        got = graphs(*args)
        assert got[0].shape[0] == tokens
        torch.testing.assert_close(got[0], expected[0])
        torch.testing.assert_close(inputs[cache_i][:-1], expected_cache[:-1])  # in place; padded rows wrote nothing
        return calls[-1]

    seen = call(6, 0)  # warm-up of bucket 8: uncaptured, on the padded static buffers
    assert seen[size_i] == 8 and seen[slot_i].tolist()[6:] == [-1, -1]
    call(5, 1)  # bucket 8 again: captured, then replayed
    seen = call(3, 2)  # bucket 4
    assert seen[slot_i].tolist()[3:] == [-1]
    call(7, 3)
    seen = call(5, 4)  # back in bucket 8: rows 5..6 held row data from the 7-row call
    assert seen[slot_i].tolist()[5:] == [-1, -1, -1]
    assert all((seen[i][5:] == 0).all() for i in plan.batch if i != slot_i)
    call(4, 5)  # bucket 4's second call: captured
    report = graphs.report()
    assert report["graphs"] == 2 and report["kernel_nodes_by_rows"] == {4: 3, 8: 3}
    assert report["uncaptured_calls"] == 0 and report["recaptures"] == 0 and report["padded_with_slots"]
    # Replays: bucket 8's 2nd, 3rd and 4th calls and bucket 4's 2nd (a first call is a warm-up).
    assert report["replays"] == 4 and report["last_rows"] == 4


def test_an_input_that_moves_is_copied_from_then_on(traced, monkeypatch):
    gm, inputs = traced
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    monkeypatch.setattr(cudagraph.StepGraphs, "_capture", _stand_in_capture)
    graphs = cudagraph.StepGraphs(gm.forward, plan, (4,))
    names = _names(gm)
    cache_i = names.index(next(n for n in names if n.startswith("l_cache")))
    args = list(inputs)
    graphs(*args)
    graphs(*args)
    args[cache_i] = inputs[cache_i].clone()  # a new cache tensor: the graph's address is stale
    graphs(*args)
    assert graphs.report()["recaptures"] == 1 and graphs.report()["copied_inputs"] == [cache_i]


def test_batches_above_the_largest_bucket_run_uncaptured(traced, monkeypatch):
    gm, inputs = traced
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    monkeypatch.setattr(cudagraph.StepGraphs, "_capture", _stand_in_capture)
    graphs = cudagraph.StepGraphs(gm.forward, plan, (1, 2))
    out = graphs(*inputs)  # 3 tokens
    assert out[0].shape[0] == 3 and graphs.report() == {**graphs.report(), "graphs": 0, "uncaptured_calls": 1}


def test_config_checks_buckets():
    assert FusionConfig(cudagraph_buckets=(8, 1, 8)).cudagraph_buckets == (1, 8)
    with pytest.raises(ValueError, match="cudagraph_buckets"):
        FusionConfig(cudagraph_buckets=(0,))


class HFStyleStep(torch.nn.Module):
    """HF's StaticCache shape: the cache has the batch as its leading dim and the step writes its
    token at a position (no slot inputs: buckets of the exact batch)."""

    def forward(self, hidden, position, cache):
        cache.index_copy_(1, position, hidden[:, None, :])
        return cache.sum(dim=1)


def test_without_slots_batch_inputs_are_written_in_place_not_copied(monkeypatch):
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(HFStyleStep(), backend=backend)
    for batch in (2, 3):  # the second compile has a symbolic batch
        compiled(torch.randn(batch, 4), torch.tensor([0]), torch.zeros(batch, 6, 4))
    gm, inputs = seen["gm"], seen["inputs"]
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    assert not plan.pads and len(plan.batch) == 2  # hidden and the cache
    monkeypatch.setattr(cudagraph.StepGraphs, "_capture", _stand_in_capture)
    graphs = cudagraph.StepGraphs(gm.forward, plan, DEFAULT_BUCKETS)
    cache_i = next(i for i in plan.batch if inputs[i].dim() == 3)
    hidden_i = next(i for i in plan.batch if i != cache_i)
    position_i = next(i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor) and a.dtype == torch.int64)
    cache, hidden = torch.zeros(3, 6, 4), torch.randn(3, 4)
    args = list(inputs)
    args[cache_i], args[hidden_i] = cache, hidden
    for step in range(3):  # warm-up, capture + replay, replay: each writes its own position
        args[position_i] = torch.tensor([step])
        hidden.copy_(torch.randn(3, 4))
        graphs(*args)
        torch.testing.assert_close(cache[:, step], hidden)  # the caller's cache holds the token
    assert cache_i not in graphs.report()["copied_inputs"]
