"""cudagraph.py's bookkeeping on CPU: which inputs are batch / slot / in-place inputs, the
bucket a batch runs in, padding with slot -1 (and re-padding after a larger batch), outputs
sliced back, moved inputs followed (written ones) or copied (the rest), failed captures counted,
and the kernel-node count of a CUDA-graph dump.
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


def _stand_in_capture(self, bucket, inputs):
    graph = _StandInGraph(self.compiled, inputs)
    graph.outputs = list(self.compiled(*inputs))
    bucket.graph, bucket.outputs, bucket.kernel_nodes = graph, graph.outputs, 3
    self.captures += 1
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


def test_a_written_input_that_moves_is_followed_and_recaptured(traced, monkeypatch):
    """HF's generate() makes a new cache each call. The graph must then write the *new* cache:
    a copy of it would take the write and the caller's cache would never see the token."""
    gm, inputs = traced
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    names = _names(gm)
    cache_i = names.index(next(n for n in names if n.startswith("l_cache")))
    assert plan.mutated == (cache_i,)
    monkeypatch.setattr(cudagraph.StepGraphs, "_capture", _stand_in_capture)
    graphs = cudagraph.StepGraphs(gm.forward, plan, (4,))
    args = list(inputs)
    graphs(*args)  # warm-up
    graphs(*args)  # captured
    fresh = torch.zeros_like(inputs[cache_i])
    args[cache_i] = fresh
    out = graphs(*args)
    report = graphs.report()
    assert report["recaptures"] == 1 and report["copied_inputs"] == [] and report["captures"] == 2
    slots = args[plan.slots[0]]
    torch.testing.assert_close(fresh[slots], out[0])  # the write landed in the caller's new cache


def test_buckets_hold_no_reference_to_in_place_inputs(traced, monkeypatch):
    """A cache the caller drops must be freed, so that the next one (HF's generate() makes a new
    one each call) can take its address and the graph replays without a recapture."""
    import gc
    import weakref

    gm, inputs = traced
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    names = _names(gm)
    cache_i = names.index(next(n for n in names if n.startswith("l_cache")))
    graphs = cudagraph.StepGraphs(gm.forward, plan, (4,))
    args = list(inputs)
    args[cache_i] = torch.zeros_like(inputs[cache_i])
    graphs(*args)  # warm-up: the bucket is made (no capture on CPU needed)
    dropped = weakref.ref(args[cache_i])
    args[cache_i] = None
    gc.collect()
    assert dropped() is None


def test_a_read_only_input_that_moves_is_copied_from_then_on(monkeypatch):
    """HF's input ids, positions and mask are new tensors every step: copied into static buffers,
    replayed with no further capture."""
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"], seen["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(HFStyleStep(), backend=backend)(torch.randn(2, 4), torch.tensor([0]), torch.zeros(2, 6, 4))
    gm, inputs = seen["gm"], seen["inputs"]
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)
    cache_i = next(i for i, a in enumerate(inputs) if a.dim() == 3)
    hidden_i = next(i for i, a in enumerate(inputs) if a.dim() == 2)
    position_i = next(i for i, a in enumerate(inputs) if a.dtype == torch.int64)
    assert plan.mutated == (cache_i,)
    monkeypatch.setattr(cudagraph.StepGraphs, "_capture", _stand_in_capture)
    graphs = cudagraph.StepGraphs(gm.forward, plan, (4,))
    cache = torch.zeros(2, 6, 4)
    for step in range(5):
        hidden, args = torch.randn(2, 4), [None] * 3
        args[cache_i], args[hidden_i], args[position_i] = cache, hidden, torch.tensor([step])
        graphs(*args)  # Dynamo's placeholder order
        torch.testing.assert_close(cache[:, step], hidden)
    report = graphs.report()
    assert sorted(report["copied_inputs"]) == sorted([hidden_i, position_i])
    # Moved before the first capture: copied from the capture on, so one capture serves every step.
    assert report["captures"] == 1 and report["recaptures"] == 0 and report["uncaptured_calls"] == 0
    assert report["warmup_calls"] == 1 and report["replays"] == 4


class WritesThroughViews(torch.nn.Module):
    def forward(self, x, state, counter, table, mask, flags):
        state[:, 1:] = x[:, None]  # setitem into the input
        counter.add_(1)
        view = table.view(-1)
        keep = mask & (x > 0)  # operator.and_: a new tensor (DeepSeek V3.2's mask & ~index_mask)
        flags |= x > 1  # operator.ior: in place
        return (view * 2).sum() + state.sum() + counter + keep.sum() + flags.sum()


def test_inputs_written_in_place_are_read_off_the_graph():
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    args = (torch.randn(2), torch.zeros(2, 3), torch.zeros(()), torch.ones(2, 2), torch.ones(2, dtype=torch.bool),
            torch.zeros(2, dtype=torch.bool))  # fmt: skip
    torch.compile(WritesThroughViews(), backend=backend)(*args)
    gm = seen["gm"]
    plan = cudagraph.plan_inputs(gm, [None] * len(args), DEFAULT_SLOT_INPUTS)
    names = _names(gm)
    written = sorted(n for n in names if n.startswith(("l_state", "l_counter", "l_flags")))
    assert sorted(names[i] for i in plan.mutated) == written


def test_a_failed_capture_is_counted_and_strict_raises(traced, monkeypatch):
    gm, inputs = traced
    plan = cudagraph.plan_inputs(gm, inputs, DEFAULT_SLOT_INPUTS)

    class FailingGraph:
        def __init__(self, pool=None, **_):
            pass

        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda **_: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: FailingGraph())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    graphs = cudagraph.StepGraphs(gm.forward, plan, (4,))
    for _ in range(3):
        graphs(*inputs)
    report = graphs.report()
    assert report["uncaptured_calls"] == 2 and report["warmup_calls"] == 1 and report["captures"] == 0
    assert "operation not permitted" in report["capture_error"]
    strict = cudagraph.StepGraphs(gm.forward, plan, (4,), strict=True)
    strict(*inputs)
    with pytest.raises(cudagraph.CaptureError, match="cannot be captured"):
        strict(*inputs)


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


def test_a_broadcast_input_is_copied_as_its_distinct_elements():
    """HF's attention mask can be an expand: its static copy keeps the strides the graph was
    compiled for, and the copy-in moves only the distinct elements (a memcpy on CUDA, not a
    copy kernel launched outside the graph)."""
    source = torch.randn(1, 1, 3, 5).expand(4, 1, 3, 5)
    buffer, view = cudagraph._static_copy(source)
    assert view.stride() == source.stride() and buffer.shape == (1, 1, 3, 5)
    buffer.copy_(cudagraph._distinct_elements(source))
    assert torch.equal(view, source)
    dense = torch.randn(6, 4).t()  # a transposed input keeps its layout too
    buffer, view = cudagraph._static_copy(dense)
    buffer.copy_(cudagraph._distinct_elements(dense))
    assert view.stride() == dense.stride() and torch.equal(view, dense)
