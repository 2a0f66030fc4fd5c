"""One CUDA graph per decode step and batch bucket, around a compiled graph.

The backend wraps each graph Inductor compiles for CUDA inputs in a :class:`StepGraphs`
(``FusionConfig(cudagraphs=True)``, the default). Each call picks a *bucket*, the smallest of
``FusionConfig.cudagraph_buckets`` that holds the step's batch, copies the batch inputs into that
bucket's static buffers and replays its graph: the whole step, every layer's kernels, in one
``cudaGraphLaunch``.

What is a batch input, and how rows are padded:

* The batch inputs are the graph inputs whose leading dim is a symbol of Dynamo's dynamic shapes
  (hidden states, positions, slot mappings, block tables...). Each call's batch size B is their
  leading size, which must be the same for all of them.
* Padding needs slot-indexed state, as serving engines keep it. Rows B..bucket-1 of the inputs
  named in ``FusionConfig.cudagraph_slot_inputs`` (``slots``, ``slot_mapping``, ``state_slots``,
  ...) are -1: our ops write no cache or state row for slot -1, so a padded row writes nothing,
  and every op of a decode step is row-wise, so a padded row (zeros elsewhere; its attention may
  be NaN) cannot leak into real rows. A graph with no slot inputs (HF's static cache) is captured
  per exact batch size instead: there, a padded row would write state. Its batch inputs are then
  read in place like the other inputs (address checked; one that moves is copied from then on):
  HF's cache is a batch input the step writes.
* Every other input (parameters, caches, tables) is used in place: the graph records its address.
  Parameters are trusted to stay put. When another tensor input's address changes between calls,
  the bucket recaptures (logged, counted). An input the step writes in place (a cache, a state, a
  write counter: ``InputPlan.mutated``, read off Dynamo's graph) is then read at its new address,
  so the write lands in the caller's tensor: HF's ``generate()`` makes a new ``StaticCache``
  each call. Any other input that moved (an activation made afresh each step: HF's input ids,
  positions and mask) is from then on copied into a static buffer of its own.
* Recapturing reuses the graphs' memory pool. The graph being replaced is dropped only after its
  successor is captured: a pool whose last graph is gone while the caller still holds that
  graph's outputs cannot take another capture (torch's allocator asserts ``use_count > 0``).

A bucket's first call runs the compiled graph uncaptured on its padded static buffers (the
warm-up: Triton compiles, Inductor autotunes, our kernels size their counters); the second
captures and replays. So each step runs exactly once. Batches above the largest bucket, calls
while another capture is in progress (a caller capturing this step into its own graph), and
graphs with no batch inputs whose shapes change, run uncaptured; so does every call after a
capture failed (logged as a warning, counted in :meth:`StepGraphs.report`; with ``strict`` the
failure raises :class:`CaptureError`). Outputs are views of the bucket's static outputs: valid
until the next call, as with ``torch.compile(mode="reduce-overhead")``. All buckets share one
memory pool.

Nothing in a captured step may sync the host; a graph break splits the step into several
compiled graphs, each wrapped on its own (``StepGraphs.report`` and ``inspect`` show the count).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import re
from collections.abc import Callable, Sequence

import torch

from ._compat import canonical_size

log = logging.getLogger("fusion_compiler")

# Dynamo names a placeholder after the argument it came from: L_slots_, L_state_slots_, ...
_PLACEHOLDER_NAME = re.compile(r"^l_(?P<name>.*?)_*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """What each flat input of a compiled graph is, read from Dynamo's placeholders."""

    batch: tuple[int, ...]  # tensor inputs with a symbolic leading dim
    slots: tuple[int, ...]  # the batch inputs padded with -1
    batch_sizes: tuple[int, ...]  # SymInt inputs that are a batch symbol: set to the bucket
    movable: tuple[int, ...]  # other tensor inputs, not parameters: their address is checked
    batch_outputs: tuple[int, ...]  # outputs with a batch-symbol leading dim: sliced to B
    mutated: tuple[int, ...] = ()  # tensor inputs the step writes in place (never copied)

    @property
    def pads(self) -> bool:
        return bool(self.slots)


def plan_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence, slot_names: Sequence[str]) -> InputPlan:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    leading = {
        i: canonical_size(v.shape[0])
        for i, v in enumerate(values)
        if isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(v.shape[0], torch.SymInt)
    }

    def is_slot_input(i: int) -> bool:
        match = _PLACEHOLDER_NAME.match(placeholders[i].name)
        return bool(match and match.group("name").lower() in slot_names)

    # The batch is the slot inputs' leading dim where there are any (their symbol, or another
    # input's symbol of the same example size: Dynamo need not have unified them). A paged
    # cache's block count is dynamic too when it grows with the batch, but no batch row: taken
    # for one, its size never equalled the batch and every call ran uncaptured.
    slot_sizes = {leading[i] for i in leading if is_slot_input(i)}

    def in_batch(size) -> bool:
        if not slot_sizes:
            return size is not None
        return size is not None and any(size[0] == s[0] or (size[1] is not None and size[1] == s[1]) for s in slot_sizes)

    batch, slots, sizes, movable = [], [], [], []
    for i, value in enumerate(values):
        if isinstance(value, torch.SymInt):
            if in_batch(canonical_size(value)):
                sizes.append(i)
        elif isinstance(value, torch.Tensor):
            if in_batch(leading.get(i)):
                batch.append(i)
                if is_slot_input(i):
                    slots.append(i)
            elif i < len(example_inputs) and not isinstance(example_inputs[i], torch.nn.Parameter):
                movable.append(i)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat_outputs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    batch_outputs = []
    for j, out in enumerate(flat_outputs):
        value = out.meta.get("example_value", out.meta.get("val")) if isinstance(out, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(value.shape[0], torch.SymInt):
            if in_batch(canonical_size(value.shape[0])):
                batch_outputs.append(j)
    mutated = tuple(i for i, node in enumerate(placeholders) if _written_in_place(node))
    return InputPlan(tuple(batch), tuple(slots), tuple(sizes), tuple(movable), tuple(batch_outputs), mutated)


# Ops whose result may share the input's memory (Dynamo's graph is torch-level: methods,
# functions and operator.getitem): a write through one of them writes the input.
_ALIASING = frozenset({
    "getitem", "__getitem__", "view", "view_as", "reshape", "reshape_as", "select", "narrow", "slice",
    "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze", "t", "flatten", "unflatten",
    "as_strided", "split", "chunk", "unbind", "contiguous", "to", "type_as", "detach", "diagonal",
    "movedim", "swapaxes", "swapdims", "T", "mT", "data", "real", "imag", "view_as_real", "view_as_complex",
})  # fmt: skip


# Python's in-place operators (``x &= m`` is operator.iand); operator.and_ / or_ are not in place.
_IN_PLACE_OPERATORS = frozenset(
    {"iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "ilshift", "irshift", "iand", "ior", "ixor"}
)


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", "")


def _writes(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether ``node`` writes ``value`` in place: a method or function named ``*_`` taking it
    first (``index_copy_``, ``add_``, ``copy_``), a ``setitem`` into it or an in-place Python
    operator (``&=``, not ``&``), or an op whose schema marks that argument written."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return False
    if isinstance(node.target, torch._ops.OpOverload):
        written = [a.alias_info is not None and a.alias_info.is_write for a in node.target._schema.arguments]
        return any(w and i < len(node.args) and node.args[i] is value for i, w in enumerate(written))
    name = _target_name(node)
    if node.args[0] is not value:
        return False
    if getattr(node.target, "__module__", None) == "_operator":  # operator.and_ is `&`: not in place
        return name == "setitem" or name in _IN_PLACE_OPERATORS
    return name.endswith("_") and not name.startswith("_") and name != "requires_grad_"


def _written_in_place(placeholder: torch.fx.Node) -> bool:
    """The step writes this input, directly or through a view of it."""
    frontier, seen = [placeholder], {placeholder}
    while frontier:
        value = frontier.pop()
        for user in value.users:
            if _writes(user, value):
                return True
            if user not in seen and user.op in ("call_method", "call_function") and user.args and user.args[0] is value \
                    and _target_name(user) in _ALIASING:  # fmt: skip
                seen.add(user)
                frontier.append(user)
    return False


_CU_GRAPH_NODE_TYPE_KERNEL = 0
_CU_GRAPH_NODE_TYPE_GRAPH = 4  # a child graph: its kernels count too


def kernel_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """Kernel nodes of a captured graph (made with ``keep_graph=True``), read from the graph
    itself through the CUDA driver (``cuGraphGetNodes`` / ``cuGraphNodeGetType``); None where the
    driver library or the raw graph is not available."""
    try:
        handle = graph.raw_cuda_graph()
        driver = ctypes.CDLL("libcuda.so.1")
    except (AttributeError, RuntimeError, OSError) as error:
        log.debug("cannot read the CUDA graph's nodes: %s", error)
        return None
    return _count_kernels(driver, ctypes.c_void_p(handle))


def _count_kernels(driver, graph: ctypes.c_void_p) -> int | None:
    count = ctypes.c_size_t(0)
    if driver.cuGraphGetNodes(graph, None, ctypes.byref(count)) != 0:
        return None
    nodes = (ctypes.c_void_p * count.value)()
    if count.value and driver.cuGraphGetNodes(graph, nodes, ctypes.byref(count)) != 0:
        return None
    kernels, kind = 0, ctypes.c_int(0)
    for node in nodes:
        if driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0:
            return None
        if kind.value == _CU_GRAPH_NODE_TYPE_KERNEL:
            kernels += 1
        elif kind.value == _CU_GRAPH_NODE_TYPE_GRAPH:
            child = ctypes.c_void_p(0)
            if driver.cuGraphChildGraphNodeGetGraph(ctypes.c_void_p(node), ctypes.byref(child)) != 0:
                return None
            inner = _count_kernels(driver, child)
            if inner is None:
                return None
            kernels += inner
    return kernels


def _distinct_elements(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast dims (stride 0 taken to size 1): the elements it holds."""
    return t.as_strided([1 if st == 0 else n for n, st in zip(t.shape, t.stride())], t.stride(), t.storage_offset())


def _static_copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, what the graph reads) for an input copied in every call. A broadcast input (HF's
    attention mask can be an ``expand``) keeps its strides: the buffer holds its distinct
    elements, laid out as the source lays them, so the copy-in is a memcpy rather than a copy
    kernel outside the graph, and the graph reads the buffer expanded to the strides it was
    compiled for."""
    buffer = torch.empty_like(_distinct_elements(t))
    view = buffer.expand(t.shape)
    if view.stride() != t.stride():  # a layout empty_like does not keep: copy it whole
        buffer = view = torch.empty_like(t)
    return buffer, view


# A written input followed this often is moving on every call, not once per generate().
_FOLLOWS_BEFORE_WARNING = 3


class CaptureError(RuntimeError):
    """strict=True and a step could not be captured in a CUDA graph (it would run uncaptured)."""


@dataclasses.dataclass
class _Bucket:
    rows: int
    args: list  # the static inputs the graph reads (None for an in-place input: the call's own)
    addresses: dict[int, int]  # in-place input -> data_ptr the graph reads
    copied: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # input -> its static buffer
    dirty_rows: int = 0  # rows of the static batch buffers that may hold a real row
    graph: torch.cuda.CUDAGraph | None = None
    outputs: object = None
    kernel_nodes: int | None = None


class StepGraphs:
    """A compiled graph (flat inputs -> outputs) replayed from one CUDA graph per bucket."""

    def __init__(self, compiled: Callable, plan: InputPlan, buckets: Sequence[int], name: str = "graph",
                 strict: bool = False):  # fmt: skip
        self.compiled = compiled
        self.plan = plan
        self.buckets = tuple(sorted(set(buckets)))
        self.name = name
        self.strict = strict
        self.pool = None
        self._buckets: dict[tuple, _Bucket] = {}
        self._retired: list[torch.cuda.CUDAGraph] = []  # replaced graphs, kept until a successor is captured
        self.copied: set[int] = set()  # non-batch inputs known to move: copied into static buffers
        self._follows: dict[int, int] = {}  # written input -> times followed to a new address
        self.capture_error: str | None = None
        self.warmup_calls = 0
        self.uncaptured_calls = 0
        self.captures = 0
        self.recaptures = 0
        self.replays = 0
        self.last_rows: int | None = None  # the bucket of the last replay

    # -- what a call needs ------------------------------------------------------------------
    def _batch(self, args: Sequence) -> int | None:
        sizes = {args[i].shape[0] for i in self.plan.batch}
        return sizes.pop() if len(sizes) == 1 else None

    def _key(self, args: Sequence, rows: int) -> tuple:
        batch = set(self.plan.batch) | set(self.plan.batch_sizes)
        shapes = tuple(
            (tuple(a.shape[1:]) if i in batch else tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor)
            else (a if i not in batch else None)
            for i, a in enumerate(args)
        )  # fmt: skip
        return (rows, shapes)

    def _rows(self, batch: int | None) -> int | None:
        if not self.plan.batch:
            return 0
        if batch is None:
            return None
        if not self.plan.pads:
            return batch if batch <= self.buckets[-1] else None
        return next((b for b in self.buckets if b >= batch), None)

    # -- the call ---------------------------------------------------------------------------
    def __call__(self, *args):
        args = list(args)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # be part of the caller's graph
            return self.compiled(*args)
        batch = self._batch(args) if self.plan.batch else 0
        rows = self._rows(batch)
        if rows is None or self.capture_error:
            self.uncaptured_calls += 1
            return self.compiled(*args)
        key = self._key(args, rows)
        bucket = self._buckets.get(key)
        if bucket is None:  # warm-up: run once on new static buffers, uncaptured
            bucket = self._buckets[key] = self._new_bucket(args, rows)
            self.warmup_calls += 1
            return self._slice(self.compiled(*self._load(bucket, args, batch)), batch, rows)
        moved = [i for i, at in bucket.addresses.items() if args[i].data_ptr() != at]
        if moved:
            self._follow(bucket, args, moved)
        inputs = self._load(bucket, args, batch)
        if bucket.graph is None and not self._capture(bucket, inputs):
            self.uncaptured_calls += 1
            return self._slice(self.compiled(*inputs), batch, rows)
        bucket.graph.replay()
        self.replays += 1
        self.last_rows = rows
        return self._slice(bucket.outputs, batch, rows)

    def _in_place(self) -> tuple[int, ...]:
        """Inputs the graph reads where they are (their address checked): without padding
        (buckets of the exact batch), the batch inputs too. HF's StaticCache is [B, heads, S, D],
        a batch input written by the step: copied into a static buffer, the step wrote the copy
        and the caller's cache never saw the token (and DeepSeek's 21 GB cache at batch 64 was
        copied every call: 10 ms a layer on the H200)."""
        return self.plan.movable + (() if self.plan.pads else self.plan.batch)

    def _new_bucket(self, args: list, rows: int) -> _Bucket:
        static = list(args)
        if self.plan.pads:
            for i in self.plan.batch:
                a = args[i]
                static[i] = torch.empty((rows, *a.shape[1:]), dtype=a.dtype, device=a.device)
                static[i].fill_(-1 if i in self.plan.slots else 0)
        copied = {}
        for i in self.copied & set(self._in_place()):
            copied[i], static[i] = _static_copy(args[i])
        addresses = {i: args[i].data_ptr() for i in self._in_place() if i not in copied}
        for i in addresses:
            # Read from each call's own arguments, never held here: a cache the caller drops is
            # freed, and the next one (HF's generate() makes one a call) usually gets its address,
            # so the graph replays with no recapture.
            static[i] = None
        for i in self.plan.batch_sizes:
            static[i] = rows
        return _Bucket(rows, static, addresses, copied)

    def _follow(self, bucket: _Bucket, args: list, moved: list[int]) -> None:
        """Inputs moved since the bucket's graph was made: one the step writes is read at its new
        address (its writes must land in the caller's tensor); any other is copied from now on.
        Either way the graph is captured again on this call."""
        followed = [i for i in moved if i in self.plan.mutated]
        copied = [i for i in moved if i not in self.plan.mutated]
        for i in followed:
            bucket.addresses[i] = args[i].data_ptr()
            self._follows[i] = self._follows.get(i, 0) + 1
            if self._follows[i] == _FOLLOWS_BEFORE_WARNING:
                log.warning("%s: input %d, which the step writes in place, has moved %d times: every such call "
                            "captures the step again (pass a tensor that stays put)", self.name, i, self._follows[i])
        for i in copied:
            bucket.copied[i], bucket.args[i] = _static_copy(args[i])
            del bucket.addresses[i]
        self.copied.update(copied)
        log.info("%s: %d-row step: inputs %s moved since its graph was made (written in place, followed: %s; "
                 "copied from now on: %s); capturing again", self.name, bucket.rows, moved, followed, copied)  # fmt: skip
        if bucket.graph is not None:
            self._retired.append(bucket.graph)
            self.recaptures += 1
        bucket.graph, bucket.outputs, bucket.kernel_nodes = None, None, None

    def _load(self, bucket: _Bucket, args: list, batch: int) -> list:
        """Copy the real rows (and the copied inputs) in; re-pad rows a larger batch left behind.
        Returns the graph's inputs: the static buffers, and the in-place inputs of this call."""
        for i in self.plan.batch if self.plan.pads else ():
            buffer = bucket.args[i]
            buffer[:batch].copy_(args[i])
            if bucket.dirty_rows > batch:
                buffer[batch : bucket.dirty_rows].fill_(-1 if i in self.plan.slots else 0)
        for i, buffer in bucket.copied.items():
            buffer.copy_(_distinct_elements(args[i]))
        bucket.dirty_rows = batch
        return [args[i] if i in bucket.addresses else a for i, a in enumerate(bucket.args)]

    def _capture(self, bucket: _Bucket, inputs: list) -> bool:
        """Capture the bucket's step (nothing runs); False, logged and reported, if the step
        cannot be captured (a host sync, a CPU op): this graph then runs uncaptured, or with
        ``strict`` raises :class:`CaptureError`."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept: its nodes are counted
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self.compiled(*inputs)
        except RuntimeError as error:  # torch raises the CUDA capture errors as RuntimeError
            self.capture_error = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            torch.cuda.synchronize()
            if self.strict:
                raise CaptureError(f"{self.name}: the {bucket.rows}-row step cannot be captured in a CUDA graph "
                                   f"(strict mode): {self.capture_error}") from error  # fmt: skip
            log.warning("%s cannot be captured in a CUDA graph; it runs uncaptured from now on: %s",
                        self.name, self.capture_error)
            return False
        graph.instantiate()
        bucket.graph, bucket.outputs = graph, outputs
        bucket.kernel_nodes = kernel_nodes(graph)
        self.captures += 1
        self._retired.clear()  # the new graph holds the pool now
        log.info("%s: captured the %d-row step: %s kernel nodes", self.name, bucket.rows, bucket.kernel_nodes)
        return True

    def _slice(self, outputs, batch: int, rows: int):
        if batch == rows or not self.plan.batch_outputs:
            return outputs
        sliced = list(outputs)
        for j in self.plan.batch_outputs:
            sliced[j] = sliced[j][:batch]
        return type(outputs)(sliced) if isinstance(outputs, tuple) else sliced

    # -- what happened ----------------------------------------------------------------------
    def report(self) -> dict:
        """Graphs captured (now and in all), per bucket the kernel nodes read from the captured
        graph, calls by how they ran (warm-up, replayed, uncaptured), recaptures and why a
        capture failed."""
        captured = [b for b in self._buckets.values() if b.graph is not None]
        return {
            "name": self.name,
            "graphs": len(captured),
            "captures": self.captures,
            "kernel_nodes_by_rows": {b.rows: b.kernel_nodes for b in sorted(captured, key=lambda b: b.rows)},
            "padded_with_slots": self.plan.pads,
            "warmup_calls": self.warmup_calls,
            "replays": self.replays,
            "uncaptured_calls": self.uncaptured_calls,
            "recaptures": self.recaptures,
            "last_rows": self.last_rows,
            "written_inputs": list(self.plan.mutated),
            "copied_inputs": sorted(self.copied),
            "capture_error": self.capture_error,
        }
