"""One decode step, per decoder layer, six ways side by side (issue 7): HF's code and our
reference decode layers, at real widths with random weights.

Models: deepseek-v3.2, minimax-m2.5 and qwen3.5 on both sources (the default); qwen3-moe
(Qwen3-235B-A22B) and glm4-moe (GLM-4.5) on HF's code only (``--sources hf``; we have no
reference layer for them), built from a transformers config alone (``bench/hf_configs.py``,
``model_adapters.adapter_from_hf_config``): every layer of their stacks is an MoE layer.

    eager            the model as written
    eager_graph      the same step captured by hand in one CUDA graph
    inductor         stock torch.compile
    inductor_graph   stock torch.compile's step captured by hand in one CUDA graph
    reduce_overhead  stock torch.compile(mode="reduce-overhead") (Inductor's CUDA-graph trees)
    fusion_compiler  torch.compile with our backend: the pass, then one CUDA graph per step
                     (``cudagraph.py``; each call copies its inputs and replays)

Per layer = (2 layers) - (1 layer) of the same kind, for kernels (profiler kernel events; kernel
nodes read from the captured graph for the graph modes) and for µs (CUDA events around 20-call
loops, the median of 10; the graph modes replay their graph, the others launch as they would).
Each layer kind is its own pair: Qwen3.5's linear-attention layer is ([full, linear] - [full])
on HF's code, whose hybrid cache needs a full-attention layer, and ([linear, linear] -
[linear]) on ours. "Stock Inductor + CUDA graphs", the issue's baseline, is the faster of
inductor_graph and reduce_overhead in the same run.

Inputs. Ours: the reference step (``model_adapters/reference/<model>_decode_layer.py``
``make_step``): paged caches holding ``--context`` tokens per sequence, state slots, random
values. HF's: a ``StaticCache`` of
``--context`` slots, prefilled with 16 tokens; each call writes one more slot, and every mode
starts from the restored prefill. HF's attention reads, masked, every slot of a static cache each
step, and so do eager and stock Inductor: their attention bytes are those of the full context.
Ours does not: decode_attention loads no K / V row the mask rules out and does not visit the
tiles past the last position it keeps, so on these stacks it reads the 17 written rows, as it
would for a user whose static cache is longer than the text so far. What a full cache costs
ours is the kernel alone in ``bench/diagnostics/decode_attention_sparse.py`` (its ``all``
rows: nothing masked; ``topk``: DSA's 2048 of 4096). The floor counts the whole cache. Every
mode runs on the same input tensors (restored in place between modes, so graphs keep their
addresses) and is compared with eager's output (and, on ours, the caches and states it
wrote): ``vs_eager``.

How far from eager is right. On ours, eager also runs once more with every element of the
hidden input changed in its last bit (``last_bit_noise`` in the eager row): a compiled mode's
roundings differ about that much, and the models turn such differences into percent-level
output changes on their own: FP8 requantisation moves a code a whole step, a near-tied router
swaps an expert, and DeepSeek's DSA indexer keeps 2048 of 4097 near-tied scores, where one
swapped key moves the output by about 1% (random weights: the indexer does not track the
attention, so a boundary key can carry much of a head's weight). A ``vs_eager`` out_rel_err of
the order of ``last_bit_noise`` is agreement. Where the model selects (DeepSeek's indexers, a
``pinned_topk`` attribute), inductor and fusion_compiler are compiled once more with every
indexer pinned to eager's selection and compared again: ``vs_eager_pinned``, the check of the
arithmetic itself (``--no-pinned`` skips it: two more compiles per stack and batch).

Experts: HF's routed experts are stubbed to zeros by default (``--hf-experts zeros``: attention +
router + norms + shared expert alone), or computed by HF's own code (``compute``: its default
``grouped_mm`` experts). The reference layers' experts are plain torch in HF's two forms
(``--ref-experts grouped``: ``grouped_mm``, the default; ``compute``: ``batched_mm``, which gathers
every token's experts' weights) or stubbed (``zeros``). Computed experts are ordinary model code:
eager and stock Inductor run them as written, our backend fuses them (the moe_experts stage).
The reference layers' attention core is an opaque op too (``paged_kv.paged_decode_attention``: on CUDA a split-KV
Triton kernel reading the paged cache through the slot table, ``kernels/paged_decode_attention.py``;
on CPU the kv rows gathered once, then SDPA), as a serving engine's attention backend is.

Floors per layer: the layer's weight bytes read once (routed experts: the expected share of
experts a batch of uniformly routed tokens touches) over the same run's copy bandwidth, and the
layer's cache / state bytes read once.

    python bench/decode.py --out bench/results/decode_h200.json --png bench/results/decode_h200.png
    python bench/decode.py --models minimax-m2.5 --sources reference --batches 1 64 --out r.json
    python bench/decode.py --models qwen3-moe glm4-moe --sources hf --batches 1 --out h.json
    python bench/decode.py --smoke      # CPU, tiny: build, compile, compare and report; no timing
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import hf_configs  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler.cudagraph import kernel_nodes  # noqa: E402
from fusion_compiler.inspect import counting  # noqa: E402
from fusion_compiler.inspect.run import build_stack  # noqa: E402
from fusion_compiler.model_adapters import ModelAdapter, adapter_from_hf_config, base, get_adapter, make_decode_step  # noqa: E402
from fusion_compiler.model_adapters.reference import moe  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

SOURCES = ("reference", "hf")
MODES = ("eager", "eager_graph", "inductor", "inductor_graph", "reduce_overhead", "fusion_compiler")
SMOKE_MODES = ("eager", "inductor", "fusion_compiler")
GRAPH_MODES = ("eager_graph", "inductor_graph")  # captured here, by hand
MODELS = {"deepseek-v3.2": "deepseek_v32", "minimax-m2.5": "minimax_m2", "qwen3.5": "qwen35"}  # -> reference layer
HF_ONLY = tuple(hf_configs.CONFIGS)  # built from their config (hf_configs.py); no reference layer
HF_PREFILL = 16
DEFAULT_CONTEXT = 4096  # every reference config's RoPE table (max_position) must cover it
CALLS, REPEATS = 20, 10


# ------------------------------------------------------------------------------------------
# The stacks: (source, model, layer kind) -> the larger and the smaller stack
# ------------------------------------------------------------------------------------------


def layer_pairs(source: str, model: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    if model != "qwen3.5":  # every layer an MoE decoder layer (DeepSeek's dense first layers left out)
        return {"moe": (("moe", "moe"), ("moe",))}
    lin, full = "linear_attention", "full_attention"
    if source == "hf":
        return {lin: ((full, lin), (full,)), full: ((full, full), (full,))}
    return {lin: ((lin, lin), (lin,)), full: ((full, full), (full,))}


@dataclasses.dataclass
class Stack:
    """A built model and what the bench needs of it, whatever the source."""

    model: torch.nn.Module
    expected: dict
    weight_bytes: int  # routed experts excluded
    expert_bytes: int  # all routed experts' weights (0 when stubbed)
    experts: tuple[int, int] | None  # (num_experts, top_k) per MoE layer


def build_reference(model: str, kinds: tuple[str, ...], size: str, device: str, experts: str) -> Stack:
    layer = importlib.import_module(f"fusion_compiler.model_adapters.reference.{MODELS[model]}_decode_layer")
    cfg = layer.REAL if size == "real" else layer.TINY
    stack_kinds = list(kinds) if model == "qwen3.5" else len(kinds)
    built = layer.build(cfg, stack_kinds, experts=experts, device=device)
    routed = sum(moe.weight_bytes(m) for m in built.modules() if isinstance(m, moe.RoutedExperts))
    return Stack(built, layer.expected_sites(built), moe.weight_bytes(built) - routed, routed,
                 (cfg.moe.num_experts, cfg.moe.top_k))  # fmt: skip


def _hf_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, module) of every routed-experts module (HF's ``*Experts``)."""
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if type(child).__name__.endswith("Experts") and hasattr(child, "gate_up_proj"):
                found.append((parent, attr, child))
    return found


def config_adapter(model: str, size: str) -> ModelAdapter:
    """The adapter of one of ``HF_ONLY``, from its config file: real widths, or ``hf_configs.tiny``'s
    (an adapter built from a config has that config as both its "tiny" and its "real" one)."""
    config = hf_configs.CONFIGS[model]
    if size == "tiny":
        config = hf_configs.tiny(config)
    return adapter_from_hf_config(config)


def build_hf(model: str, kinds: tuple[str, ...], size: str, device: str, experts: str) -> Stack:
    if model in MODELS:
        adapter, stack_kinds = get_adapter(model), kinds
    else:
        adapter = config_adapter(model, size)
        # Such an adapter calls every layer a "decoder"; the bench's "moe" is one with a router.
        stack_kinds = tuple(adapter.layer_kinds(adapter.hf_config(size, len(kinds))))
    built = build_stack(adapter, size, stack_kinds, device, torch.bfloat16)
    if model not in MODELS and len(base.router_sites(built)) != len(kinds):
        raise ValueError(f"{model}: {len(kinds)} MoE layers asked for, the stack has "
                         f"{len(base.router_sites(built))} routers")  # fmt: skip
    modules = _hf_experts(built)
    routed = sum(moe.weight_bytes(m) for _, _, m in modules)
    if experts == "zeros":
        # The same call signature (hidden, top_k_index, top_k_weights): an opaque op returning
        # zeros keeps the router and the adds in every mode.
        for parent, attr, _ in modules:
            setattr(parent, attr, moe.ZeroExperts())
        routed = 0
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    text = built.config.get_text_config(decoder=True)
    shape = (int(getattr(text, "num_local_experts", 0) or getattr(text, "n_routed_experts", 0) or getattr(text, "num_experts", 0)),
             int(getattr(text, "num_experts_per_tok", 0)))  # fmt: skip
    weights = moe.weight_bytes(built) - routed if experts == "compute" else moe.weight_bytes(built)
    expected = adapter.expected_sites(built, batch=1, context=HF_PREFILL)
    return Stack(built, expected, weights, routed, shape if shape[0] else None)


# ------------------------------------------------------------------------------------------
# A decode step whose inputs can be restored in place
# ------------------------------------------------------------------------------------------


class Step:
    """``call(fn)`` runs ``fn(**kwargs)``; ``restore()`` puts every input back, in place."""

    def __init__(self, source: str, model: str, stack: Stack, batch: int, context: int):
        if source == "hf":
            self.hf = make_decode_step(stack.model, batch=batch, context=HF_PREFILL, seed=0, max_cache_len=context)
            if self.hf.cache_kind != "static":  # a growing cache would recompile on every timed call
                raise ValueError(f"HF's StaticCache did not build for this model ({self.hf.cache_kind} cache)")
            self.kwargs = self.hf.kwargs
        else:
            layer = importlib.import_module(f"fusion_compiler.model_adapters.reference.{MODELS[model]}_decode_layer")
            self.hf = None
            self.kwargs = layer.make_step(stack.model, tokens=batch, context=context, seed=1).kwargs
            self._snapshot = {k: base._restore_(None, v) if isinstance(v, (torch.Tensor, list)) else v
                              for k, v in self.kwargs.items()}  # fmt: skip

    def restore(self) -> None:
        if self.hf is not None:
            self.hf.reset()
        else:
            for key, value in self._snapshot.items():
                base._restore_(self.kwargs[key], value)

    def call(self, fn: Callable) -> torch.Tensor:
        with torch.no_grad():
            return base._logits_of(fn(**self.kwargs))

    def last_bit_noise(self, fn: Callable, out: torch.Tensor) -> dict | None:
        """``fn``'s output with every element of the hidden input changed in its last bit (xor 1
        of its bits), against ``out``: eager's own spread, the yardstick of ``vs_eager``. Ours only
        (HF's step starts from token ids); the inputs are restored before and after."""
        hidden = self.kwargs.get("hidden") if self.hf is None else None
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.element_size() not in (2, 4):
            return None
        self.restore()
        hidden.view({2: torch.int16, 4: torch.int32}[hidden.element_size()]).bitwise_xor_(1)
        try:
            noisy = self.call(fn)
        finally:
            self.restore()
        return {"out_rel_err": relative_error(noisy.float(), out.float())}

    def state(self) -> list[torch.Tensor]:
        """The caches and states the step writes (ours; HF's cache is compared via the logits)."""
        if self.hf is not None:
            return []
        return [t for v in self.kwargs.values() if isinstance(v, list) for t in v]

    def state_bytes(self) -> int:
        if self.hf is not None:
            return sum(t.numel() * t.element_size() for layer in getattr(self.hf.cache, "layers", [])
                       for t in vars(layer).values() if isinstance(t, torch.Tensor) and t.dim() > 1)  # fmt: skip
        return sum(t.numel() * t.element_size() for t in self.state())


# ------------------------------------------------------------------------------------------
# Modes
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
    fn: Callable
    backend: fc.FusionBackend | None = None


def compile_modes(modes, model: torch.nn.Module, expected: dict) -> dict[str, Compiled]:
    """Each mode's callable; a graph mode shares its base's (one compile for inductor and its
    hand-captured graph)."""
    eager, stock = Compiled(model), None
    compiled = {}
    for mode in modes:
        if mode in ("eager", "eager_graph"):
            compiled[mode] = eager
        elif mode in ("inductor", "inductor_graph"):
            stock = stock or Compiled(torch.compile(model))
            compiled[mode] = stock
        elif mode == "reduce_overhead":
            compiled[mode] = Compiled(torch.compile(model, mode="reduce-overhead"))
        else:
            # Not strict: a miss is a result here (the report goes into the JSON), not an abort.
            backend = fc.FusionBackend(fc.FusionConfig(expected=expected))
            compiled[mode] = Compiled(torch.compile(model, backend=backend), backend)
    return compiled


def capture(step: Step, fn: Callable) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn``'s step captured in one CUDA graph (warmed up on a side stream first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step.call(fn)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept: its kernel nodes are counted
    with torch.cuda.graph(graph):
        out = step.call(fn)
    graph.instantiate()
    return graph, out


def time_us(run: Callable[[], object]) -> float:
    """Median µs per call over ``REPEATS`` loops of ``CALLS`` calls (CUDA events)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples)


def prepare(mode: str, compiled: Compiled, step: Step) -> tuple[Callable[[], object], torch.Tensor, torch.cuda.CUDAGraph | None]:
    """The call a mode is timed by (a replay for the hand-captured modes), warmed up, with the
    output of one run from the restored inputs and the hand-captured graph, if any."""
    step.restore()
    if mode in GRAPH_MODES:
        graph, out = capture(step, compiled.fn)
        step.restore()
        graph.replay()
        return graph.replay, out, graph
    # Three calls from the same inputs: the compile / warm-up, the capture (our step graphs,
    # reduce-overhead's recording), then the output compared: a replay where there is one.
    for _ in range(2):
        step.call(compiled.fn)
        step.restore()
    return (lambda: step.call(compiled.fn)), step.call(compiled.fn), None


def measure(mode: str, compiled: Compiled, step: Step, timing: bool) -> tuple[dict, torch.Tensor, list]:
    """One mode on one step: its output and written state (from the restored inputs), kernels,
    graph nodes and µs."""
    row: dict = {}
    replays_before = [g.replays for g in compiled.backend.step_graphs] if compiled.backend is not None else []
    run, out, graph = prepare(mode, compiled, step)
    if graph is not None:
        row["graph_kernel_nodes"] = kernel_nodes(graph)
    if out.is_cuda:
        torch.cuda.synchronize()
    out = out.detach().clone()
    state = [t.detach().clone() for t in step.state()]
    if timing:
        step.restore()
        row["kernels"] = counting.count_cuda_kernels(run).count
        step.restore()
        row["us"] = time_us(run)
    if compiled.backend is not None:
        report = compiled.backend.report
        row["matches"] = report.summary()
        row["missing_expected"] = report.to_dict().get("missing_expected", [])
        row["fused"] = fused_counts(report, compiled.backend.config.expected)
        # Why each miss missed, so a result with a miss explains itself.
        row["misses"] = [{"family": m.family, "module": m.module, "reason": m.reason, "stopped_at": m.stopped_at}
                         for m in report.misses()]  # fmt: skip
        graphs = [g.report() for g in compiled.backend.step_graphs]
        row["step_graphs"] = graphs
        # The graphs this batch replayed (an earlier batch's static-shape graph is not one).
        before = replays_before + [0] * (len(graphs) - len(replays_before))
        used = [g for g, n in zip(graphs, before, strict=True) if g["replays"] > n]
        nodes = [g["kernel_nodes_by_rows"].get(g["last_rows"]) for g in used]
        row["graph_kernel_nodes"] = sum(nodes) if nodes and None not in nodes else None
        row["step_graphs_replayed"] = len(used)
    return row, out, state


def fused_counts(report, expected: Mapping) -> dict[str, list[int]]:
    """Family -> [expected sites fused, expected sites]; a site fused again (another batch's
    graph) counts once."""
    out = {}
    for family, modules in expected.items():
        if modules:
            found = report.per_module(family)
            out[family] = [sum(min(found.get(m, 0), n) for m, n in modules.items()), sum(modules.values())]
    return out


PINNED_MODES = ("inductor", "fusion_compiler")


def pinned_vs_eager(modes, model: torch.nn.Module, step: Step, eager_out, eager_state) -> dict[str, dict]:
    """``vs_eager`` of stock Inductor and ours with every DSA indexer's top-k pinned to eager's
    (``Indexer.pinned_topk``): each compiled afresh (the pinned graph is another graph; a fresh
    backend keeps the timed one's report clean), one call from the restored inputs. Empty for a
    model without indexers."""
    indexers = [m for m in model.modules() if hasattr(m, "pinned_topk")]
    if not indexers:
        return {}
    selections: dict = {}
    hooks = [m.register_forward_hook(lambda mod, _args, out: selections.__setitem__(mod, out.clone())) for m in indexers]
    try:
        step.restore()
        step.call(model)
    finally:
        for hook in hooks:
            hook.remove()
    results = {}
    try:
        for m in indexers:
            m.pinned_topk = selections[m]
        for mode in (m for m in PINNED_MODES if m in modes):
            backend = fc.FusionBackend(fc.FusionConfig()) if mode == "fusion_compiler" else "inductor"
            step.restore()
            try:
                out = step.call(torch.compile(model, backend=backend))
                results[mode] = compare(out, step.state(), eager_out, eager_state)
            except Exception as error:  # noqa: BLE001 - a check that fails is a result
                results[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
    finally:
        for m in indexers:
            m.pinned_topk = None
        step.restore()
    return results


def compare(out, state, eager_out, eager_state) -> dict:
    """Output vs eager's; written caches / states: relative error of the float ones, the share of
    differing bytes of the byte-coded ones (FP8 caches: a rounding step is a changed byte)."""
    result = {"out_rel_err": relative_error(out.float(), eager_out.float())}
    floats = [(a, b) for a, b in zip(state, eager_state, strict=True) if a.is_floating_point()]
    coded = [(a, b) for a, b in zip(state, eager_state, strict=True) if not a.is_floating_point()]
    if floats:
        result["state_rel_err"] = max(relative_error(a.float(), b.float()) for a, b in floats)
    if coded:
        result["state_bytes_differ"] = sum(int((a != b).sum()) for a, b in coded) / sum(a.numel() for a, _ in coded)
    return result


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------


def run_case(source: str, model: str, kind: str, batches: list[int], args, bandwidth: float | None, progress) -> list[dict]:
    """Both stacks of one (source, model, layer kind), every batch and mode; per-layer rows."""
    modes = SMOKE_MODES if args.smoke else tuple(m for m in MODES if m in args.modes)
    big_kinds, small_kinds = layer_pairs(source, model)[kind]
    per_stack: dict[str, dict[int, dict]] = {}
    for label, kinds in (("two", big_kinds), ("one", small_kinds)):
        torch._dynamo.reset()
        build = build_hf if source == "hf" else build_reference
        experts = args.hf_experts if source == "hf" else args.ref_experts
        stack = build(model, kinds, "tiny" if args.smoke else "real", args.device, experts)
        compiled = compile_modes(modes, stack.model, stack.expected)
        per_stack[label] = {}
        for batch in batches:
            progress(f"{source} {model} {kind}: {len(kinds)} layer(s), batch {batch}")
            try:
                step = Step(source, model, stack, batch, args.context)
            except Exception as error:  # noqa: BLE001 - e.g. out of memory: the batch is a result
                message = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
                print(f"  {source} {model} {kind} {len(kinds)}L batch {batch}: no step: {message}", flush=True)
                per_stack[label][batch] = {"modes": {m: {"error": f"no step: {message}"} for m in modes}, "state_bytes": 0,
                                           "weight_bytes": stack.weight_bytes, "expert_bytes": stack.expert_bytes,
                                           "experts": stack.experts}  # fmt: skip
                continue
            results, eager = {}, None
            for mode in modes:
                started = time.perf_counter()
                try:
                    row, out, state = measure(mode, compiled[mode], step, timing=not args.smoke)
                    if mode == "eager":
                        eager = (out, state)
                        noise = step.last_bit_noise(compiled[mode].fn, out)
                        if noise is not None:
                            row["last_bit_noise"] = noise
                    elif eager is not None:
                        row["vs_eager"] = compare(out, state, *eager)
                except Exception as error:  # noqa: BLE001 - a mode that fails is a result
                    row = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}
                    print(f"  {source} {model} {kind} {len(kinds)}L batch {batch} {mode}: {row['error']}", flush=True)
                    if args.smoke:
                        traceback.print_exc()
                row["seconds"] = time.perf_counter() - started
                results[mode] = row
                if not args.smoke:  # raw per-stack numbers in the log: a run cut short mid-case keeps them
                    raw = {key: row[key] for key in ("us", "kernels", "graph_kernel_nodes", "vs_eager", "last_bit_noise", "seconds") if key in row}
                    print(f"  {source} {model} {kind} {len(kinds)}L batch {batch} {mode}: {raw}", flush=True)
            if source == "reference" and eager is not None and not args.no_pinned:
                for mode, result in pinned_vs_eager(modes, stack.model, step, *eager).items():
                    results[mode]["vs_eager_pinned"] = result
                    print(f"  {source} {model} {kind} {len(kinds)}L batch {batch} {mode}: vs_eager_pinned {result}", flush=True)
            per_stack[label][batch] = {"modes": results, "state_bytes": step.state_bytes(), "weight_bytes": stack.weight_bytes,
                                       "expert_bytes": stack.expert_bytes, "experts": stack.experts}  # fmt: skip
            del step
        del stack, compiled
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return [per_layer_row(source, model, kind, batch, per_stack, args, bandwidth) for batch in batches]


def per_layer_row(source, model, kind, batch, per_stack, args, bandwidth) -> dict:
    two, one = per_stack["two"][batch], per_stack["one"][batch]
    row = {"source": source, "model": model, "kind": kind, "batch": batch, "context": args.context,
           "experts": args.hf_experts if source == "hf" else args.ref_experts, "stacks": {"two": two, "one": one}}  # fmt: skip
    layer = {}
    for mode in two["modes"]:
        a, b = two["modes"][mode], one["modes"][mode]
        layer[mode] = {key: a[key] - b[key] for key in ("us", "kernels", "graph_kernel_nodes")
                       if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float))}  # fmt: skip
    row["per_layer"] = layer
    weights = two["weight_bytes"] - one["weight_bytes"]
    experts = two["expert_bytes"] - one["expert_bytes"]
    if experts and two["experts"]:
        num, top_k = two["experts"]
        experts *= 1 - (1 - top_k / num) ** batch  # the expected share a batch of uniform tokens reads
    row["floor"] = {"weight_bytes": weights + experts, "state_bytes": two["state_bytes"] - one["state_bytes"]}
    if bandwidth:
        row["floor"]["weight_us"] = row["floor"]["weight_bytes"] / bandwidth / 1e3
        row["floor"]["state_us"] = row["floor"]["state_bytes"] / bandwidth / 1e3
        ours = layer.get("fusion_compiler", {}).get("us")
        if ours:
            row["floor"]["ours_pct_of_weight_floor"] = 100 * row["floor"]["weight_us"] / ours
            row["floor"]["ours_pct_of_floor"] = 100 * (row["floor"]["weight_us"] + row["floor"]["state_us"]) / ours
    stock_graph = [layer.get(m, {}).get("us") for m in ("inductor_graph", "reduce_overhead")]
    stock_graph = [us for us in stock_graph if us]
    ours = layer.get("fusion_compiler", {}).get("us")
    if stock_graph and ours:
        row["stock_inductor_graph_us"] = min(stock_graph)
        row["speedup_vs_stock_inductor_graph"] = min(stock_graph) / ours
    if layer.get("inductor", {}).get("kernels") and layer.get("fusion_compiler", {}).get("kernels") is not None:
        row["kernels_ours_over_inductor"] = layer["fusion_compiler"]["kernels"] / layer["inductor"]["kernels"]
    return row


def summary_line(row: dict) -> str:
    parts = [f"{row['source']:>9} {row['model']:<13} {row['kind']:<16} B={row['batch']:<3}"]
    for mode, values in row["per_layer"].items():
        us = f"{values['us']:.1f}us" if "us" in values else "-"
        parts.append(f"{mode} {us} {values.get('kernels', '-')}k/{values.get('graph_kernel_nodes', '-')}n")
    if "speedup_vs_stock_inductor_graph" in row:
        parts.append(f"x{row['speedup_vs_stock_inductor_graph']:.2f} vs stock+graph")
    if "ours_pct_of_weight_floor" in row.get("floor", {}):
        # Both: HF's caches can weigh as much as the weights (DeepSeek's expanded K/V at batch 64).
        parts.append(f"{row['floor']['ours_pct_of_weight_floor']:.0f}% of weight floor, "
                     f"{row['floor']['ours_pct_of_floor']:.0f}% of weights + state")  # fmt: skip
    fused = row["stacks"]["two"]["modes"].get("fusion_compiler", {}).get("fused")
    if fused:
        parts.append("fused " + " ".join(f"{family} {n}/{total}" for family, (n, total) in fused.items()))
    errors = sorted({mode for stack in row["stacks"].values() for mode, result in stack["modes"].items() if "error" in result})
    if errors:
        parts.append(f"errors: {' '.join(errors)}")
    return " | ".join(parts)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [r for r in rows if r["per_layer"].get("fusion_compiler", {}).get("us")]
    if not groups:
        return
    modes = [m for m in MODES if any(m in r["per_layer"] and "us" in r["per_layer"][m] for r in groups)]
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups)), 4.6))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        values = [r["per_layer"].get(mode, {}).get("us", 0) for r in groups]
        ax.bar([i + (j - (len(modes) - 1) / 2) * width for i in range(len(groups))], values, width, label=mode)
    labels = [f"{r['model']}\n{r['source']} {r['kind'].replace('_attention', '')}\nbatch {r['batch']}" for r in groups]
    ax.set_xticks(range(len(groups)), labels, fontsize=7)
    ax.set_ylabel("µs per decoder layer (2 layers - 1 layer)")
    ax.set_yscale("log")
    ax.set_title(f"one decode step per layer, context {groups[0]['context']}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def select_cases(sources: list[str] | None, models: list[str], kinds: list[str] | None) -> list[tuple[str, str, str]]:
    """(source, model, layer kind) of every case; ``sources`` None: each model's own (HF's only
    for ``HF_ONLY``)."""
    return [(source, model, kind) for source in sources or SOURCES for model in models
            if source == "hf" or model in MODELS
            for kind in layer_pairs(source, model) if kinds is None or kind in kinds]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path (required unless --smoke)")
    parser.add_argument("--png", help="chart of µs per layer")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=[*MODELS, *HF_ONLY],
                        help=f"default: {' '.join(MODELS)}; {' and '.join(HF_ONLY)} have HF's code only (--sources hf)")
    parser.add_argument("--sources", nargs="*", default=None, choices=SOURCES,
                        help="default: every source each model has")
    parser.add_argument("--kinds", nargs="*", default=None, help="layer kinds to measure (default: all of each model)")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--hf-experts", default="zeros", choices=("compute", "zeros"), help="HF's own experts code, or zeros")
    parser.add_argument("--ref-experts", default="grouped", choices=moe.EXPERTS_MODES,
                        help="grouped: HF's grouped_mm form; compute: HF's batched_mm form (weights gathered per pair)")
    parser.add_argument("--no-pinned", action="store_true", help="skip vs_eager_pinned (DeepSeek's selection pinned)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny widths, context 32: correctness and reports only")
    args = parser.parse_args(argv)
    refused = [model for model in args.models if model in HF_ONLY] if "reference" in (args.sources or ()) else []
    if refused:
        parser.error(f"--sources reference: no reference layer for {' or '.join(refused)} "
                     "(HF's code only: pass --sources hf)")  # fmt: skip
    if args.smoke:
        args.device, args.context = "cpu", 32
    elif not args.out:
        parser.error("--out is required unless --smoke")
    else:
        args.device = "cuda"
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    bandwidth = None if args.smoke else common.copy_bandwidth_gbs()
    cases = select_cases(args.sources, args.models, args.kinds)
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(cases) * 2 * len(args.batches), desc="decode bench", file=sys.stdout)
    except ImportError:
        bar = None

    def progress(message: str) -> None:
        if bar is not None:
            bar.set_postfix_str(message)
            bar.update(1)
        else:
            print(message, flush=True)

    facts = {"device": "cpu (smoke)", "torch": torch.__version__} if args.smoke else common.device_facts()
    rows = []
    for source, model, kind in cases:
        for row in run_case(source, model, kind, args.batches, args, bandwidth, progress):
            rows.append(row)
            print(summary_line(row), flush=True)
        if args.out:  # after every case: a run cut short keeps what it measured
            common.write_json(args.out, {"device": facts, "copy_bandwidth_gbs": bandwidth, "context": args.context,
                                         "method": __doc__, "rows": rows})  # fmt: skip
    if bar is not None:
        bar.close()
    if args.png:
        plot(rows, args.png)
    return rows


if __name__ == "__main__":
    main()
