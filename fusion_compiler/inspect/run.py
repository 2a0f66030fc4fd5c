"""`inspect`: one decode step of a model, eager / stock Inductor / fusion_compiler, per layer.

Per layer kernels, for each layer kind k = K(stack) − K(stack less one layer of kind k).
Where dropping that layer would leave a stack without one of the kinds (Qwen3.5's only
full-attention layer: HF cannot run a cache of linear-attention layers alone), the pair is
K(stack plus one layer of kind k) − K(stack) instead. Matches and misses come from the
fusion_compiler compile of the inspected stack, attributed to layers via `nn_module_stack`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
import time
from collections import Counter
from collections.abc import Callable

import torch

from .. import _compat
from ..backend import FusionBackend
from ..config import FusionConfig
from ..model_adapters import ModelAdapter, attention_families, make_decode_step
from ..patterns.registry import trace_seconds_total
from ..verify import relative_error
from . import counting, gate

MODES = ("eager", "inductor", "fusion_compiler")
FAMILY = "add_rms_norm"  # the first column; the adapter may expect sites of more families


@dataclasses.dataclass
class ModeResult:
    kernels: counting.KernelCount
    graphs: int
    logits: torch.Tensor
    report: object | None = None
    graph_breaks: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count


def _counting_backend(inner: Callable) -> tuple[Callable, list[int], list[float]]:
    """``inner`` counting its graphs and timing itself (seconds summed over graphs)."""
    graphs, seconds = [0], [0.0]

    def backend(gm, example_inputs):
        graphs[0] += 1
        started = time.perf_counter()
        try:
            return inner(gm, example_inputs)
        finally:
            seconds[0] += time.perf_counter() - started

    return backend, graphs, seconds


def _fusion_config(expected: dict | None) -> FusionConfig:
    # Kernels per layer come from uncaptured runs (the profiler, the wrapper code): no CUDA graphs.
    return FusionConfig(expected=expected or {FAMILY: {}}, cudagraphs=False)


def _fusion_backend(expected: dict | None, model) -> FusionBackend:
    return FusionBackend(_fusion_config(expected), root=model)


def _stock_inductor(gm, example_inputs):
    # Inductor's FX-graph cache off, as our backend runs it (a cache hit would skip our pass):
    # the two compile times compare the same work.
    with _compat.inductor_patches(None, use_caches=False):
        return _compat.compile_fx(gm, example_inputs)


def run_mode(model, step, mode: str, device: str, expected: dict | None) -> ModeResult:
    torch._dynamo.reset()
    _compat.clear_graph_break_reasons()
    report = None
    if mode == "eager":
        fn, graphs = model, [0]
    elif mode == "inductor":
        backend, graphs, _ = _counting_backend(_stock_inductor)
        fn = torch.compile(model, backend=backend)
    else:
        fusion = _fusion_backend(expected, model)
        backend, graphs, _ = _counting_backend(fusion)
        fn = torch.compile(model, backend=backend)
        report = fusion.report
    # step.run() restores the cache before a repeated run; restore first, outside the
    # counted region, so the count holds the decode step alone.
    if device == "cuda":
        logits = step.run(fn)  # compile + warm up
        step.run(fn)
        step.reset()
        kernels = counting.count_cuda_kernels(lambda: step.run(fn))
    elif mode == "eager":
        logits = step.run(fn)
        step.reset()
        kernels = counting.count_cpu_eager(lambda: step.run(fn))
    else:
        kernels, logits = counting.count_cpu_compiled(lambda: step.run(fn))
    breaks = _compat.graph_break_reasons() if mode != "eager" else {}
    return ModeResult(kernels, graphs[0], logits.detach().float().cpu(), report, breaks)


def stack_pairs(kinds: list[str]) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Layer kind -> (larger stack, smaller stack) whose kernel difference is one such layer."""
    base = tuple(kinds)
    pairs = {}
    for kind in dict.fromkeys(kinds):
        last = max(i for i, k in enumerate(kinds) if k == kind)
        smaller = base[:last] + base[last + 1 :]
        if set(smaller) == set(base):
            pairs[kind] = (base, smaller)
        else:
            pairs[kind] = (base + (kind,), base)
    return pairs


def build_stack(adapter: ModelAdapter, size: str, kinds: tuple[str, ...], device: str, dtype):
    """The adapter's model with exactly these layer kinds (hybrid models: via `layer_types`)."""
    overrides = {}
    config = adapter.hf_config(size, len(kinds))
    if list(getattr(config, "layer_types", None) or [])[: len(kinds)] == adapter.layer_kinds(config):
        overrides["layer_types"] = list(kinds)
    model = adapter.build_hf(size=size, layers=len(kinds), device=device, dtype=dtype, seed=0, **overrides)
    built = tuple(adapter.layer_kinds(model.config))
    if built != kinds:
        raise ValueError(f"{adapter.name}: asked for layer kinds {list(kinds)}, the config gives {list(built)}")
    return model


def inspect_model(
    adapter: ModelAdapter,
    size: str,
    layers: int,
    device: str,
    batch: int = 1,
    context: int = 16,
    progress: Callable[[str], contextlib.AbstractContextManager[list[str]]] = lambda label: contextlib.nullcontext([]),
    compile_timing: bool = True,
) -> dict:
    """``progress(label)`` wraps each step (a mode on a stack, the compile timing, the CUDA
    graph check, the numerics gate's float64 run and bisect when it fires); the step appends short
    notes (its kernel count) to the list it yields. ``compile_timing``: time a second compile per
    mode (`compile_seconds`); off, ``compile_seconds`` is None."""
    dtype = torch.bfloat16
    kinds = adapter.layer_kinds(adapter.hf_config(size, layers))
    pairs = stack_pairs(kinds)
    stacks = list(dict.fromkeys([tuple(kinds)] + [s for pair in pairs.values() for s in pair]))
    steps = len(stacks) * len(MODES) + compile_timing + (device == "cuda")
    done = 0

    def step_label(what: str) -> str:
        nonlocal done
        done += 1
        return f"{adapter.name} [{done}/{steps}] {what}"

    per_stack: dict[tuple[str, ...], dict[str, ModeResult]] = {}
    expected_full: dict[str, dict[str, int]] = {}
    no_family: dict[str, str] = {}
    for stack in stacks:
        per_stack[stack] = {}
        for mode in MODES:
            first = mode == MODES[0]
            with progress(step_label(f"{_layers(len(stack))}, {'build, ' if first else ''}{mode}")) as notes:
                if first:  # at real widths on CUDA, building takes a while of its own
                    model = build_stack(adapter, size, stack, device, dtype)
                    expected = adapter.expected_sites(model, batch=batch, context=context)
                step = make_decode_step(model, batch=batch, context=context, seed=0)
                per_stack[stack][mode] = run_mode(model, step, mode, device, expected)
                notes.append(f"{per_stack[stack][mode].kernels.count} kernels")
        if stack == tuple(kinds):
            expected_full = expected
            no_family = {name: why for name, (family, why) in attention_families(model).items() if family is None}
            logits = {mode: result.logits for mode, result in per_stack[stack].items()}
            numerics = gate.measure(logits)
            if numerics["fired"]:  # a float64 run, then maybe a compile per stage: a step of its own
                with progress(f"{adapter.name} numerics gate, {numerics['verdict']}: float64 run, bisect") as notes:
                    try:
                        numerics = gate.explain(numerics, model, batch, context, logits,
                                                per_stack[stack]["fusion_compiler"].report, _fusion_config(expected))
                    except Exception as e:  # noqa: BLE001 - the gate's diagnosis failing must not hide the table
                        numerics["verdict"] += f"; its float64 run or bisect failed: {type(e).__name__}: {e}"
                    notes.append(numerics["verdict"])
            compile_times = None
            if compile_timing:
                # The runs above were each mode's first compile of this stack; time a second.
                with progress(step_label(f"{_layers(len(stack))}, compile timing")):
                    compile_times = compile_seconds(model, batch, context, expected)
            cuda_graphs = None
            if device == "cuda":
                with progress(step_label(f"{_layers(len(stack))}, CUDA graphs of the whole step")):
                    cuda_graphs = step_graph_check(model, batch, context, expected)
        del model

    full = per_stack[tuple(kinds)]
    report = full["fusion_compiler"].report
    per_kind = {
        kind: {mode: (per_stack[big][mode].kernels - per_stack[small][mode].kernels) for mode in MODES}
        for kind, (big, small) in pairs.items()
    }
    families = list(expected_full) or [FAMILY]
    found = {f: report.per_layer(f) for f in families}
    expected_per_layer = {f: report.expected_per_layer(f) for f in families}
    # Families found from the graph alone, with no expectation from the module tree
    # (decode_attention: a site is any single-query SDPA the device lowered to an SDPA op):
    # their column is fused / candidate sites.
    for family in sorted({s.family for s in report.sites} - set(families)):
        families.append(family)
        found[family] = report.per_layer(family)
        expected_per_layer[family] = dict(Counter(s.layer for s in report.sites if s.family == family))
    misses = [m for f in families for m in report.misses(f)]

    def matches(layer):
        return {f: {"found": found[f].get(layer, 0), "expected": expected_per_layer[f].get(layer, 0)} for f in families}

    layer_rows = []
    for i, kind in enumerate(kinds):
        layer_rows.append(
            {
                "layer": i,
                "kind": kind,
                "kernels": {mode: per_kind[kind][mode].to_dict() for mode in MODES},
                # What is left to fuse, by kernel (the compiled modes; eager's list is long).
                "kernel_names": {mode: per_kind[kind][mode].names for mode in MODES if mode != "eager"},
                "matches": matches(i),
                "misses": [_miss_dict(m) for m in misses if m.layer == i],
            }
        )
    eager_logits = full["eager"].logits
    return {
        "model": adapter.name,
        "size": size,
        "layers": layers,
        "device": device,
        "batch": batch,
        "context": context,
        "versions": versions(),
        "per_layer": layer_rows,
        "kernel_pairs": {kind: {"stack": list(big), "less": list(small)} for kind, (big, small) in pairs.items()},
        "outside_layers": {
            "matches": matches(None),
            "misses": [_miss_dict(m) for m in misses if m.layer is None],
        },
        "whole_step_kernels": {mode: full[mode].kernels.to_dict() for mode in MODES},
        "graphs": {mode: full[mode].graphs for mode in MODES},
        # A graph break splits the step (several graphs, host work between them): never silent.
        "graph_breaks": {mode: full[mode].graph_breaks for mode in MODES if mode != "eager"},
        "relative_error_vs_eager": {
            mode: relative_error(full[mode].logits, eager_logits) for mode in MODES if mode != "eager"
        },
        "numerics_gate": numerics,
        "compile_seconds": compile_times,
        "cuda_graphs": cuda_graphs,
        "expected_sites": expected_full,
        # Attentions no prologue family applies to, with why (model_adapters.base.attention_families).
        "no_family": no_family,
        "match_summary": report.summary(),
        "merged_launches": [{"layer": l, "kind": k, "sites": n} for l, k, n in report.merges()],
        "merged_projections": report.merged_projections(),
    }


def _layers(n: int) -> str:
    return f"{n} layer{'s' if n != 1 else ''}"


def _miss_dict(site) -> dict:
    return {"family": site.family, "module": site.module, "node": site.stopped_at, "reason": site.reason,
            "chain": list(site.chain)}


def compile_seconds(model, batch: int, context: int, expected: dict) -> dict:
    """Backend compile time of the stack (after Dynamo's trace, which both share): stock Inductor
    and ours, each compiled from scratch (Dynamo reset) a second time, after ``run_mode``'s
    first. By then both find their kernels in Inductor's on-disk code cache and neither uses the
    FX-graph cache, so the difference is the graph work our pass adds. Our one-time pattern
    tracing (per process and lowering, cached after) is reported on its own."""
    seconds = {}
    for mode, inner in (("inductor", _stock_inductor), ("fusion_compiler", _fusion_backend(expected, model))):
        torch._dynamo.reset()
        backend, _, timed = _counting_backend(inner)
        make_decode_step(model, batch=batch, context=context, seed=0).run(torch.compile(model, backend=backend))
        seconds[mode] = timed[0]
    return {
        **seconds,
        "pattern_tracing": trace_seconds_total(),
        "pass_overhead_vs_inductor": seconds["fusion_compiler"] / seconds["inductor"] - 1,
        "method": "backend seconds of the second from-scratch compile per mode (the first: the counted run); "
                  "FX-graph cache off",
    }


def step_graph_check(model, batch: int, context: int, expected: dict) -> dict:
    """The whole step through our backend as users run it on CUDA (step graphs on): how many
    graphs Dynamo handed over (each graph break adds one, each is captured on its own), what was
    captured, the kernel nodes read from each captured graph, capture errors, and the replay's
    logits against the same backend's uncaptured first call."""
    torch._dynamo.reset()
    backend = FusionBackend(FusionConfig(expected=expected or {FAMILY: {}}), root=model)
    fn = torch.compile(model, backend=backend)
    step = make_decode_step(model, batch=batch, context=context, seed=0)
    uncaptured = step.run(fn).detach().float().clone()  # a bucket's first call runs uncaptured
    step.run(fn)  # captures, then replays
    replayed = step.run(fn).detach().float().clone()
    graphs = [g.report() for g in backend.step_graphs]
    return {
        "compiled_graphs": len(graphs),
        "captured_graphs": sum(g["graphs"] for g in graphs),
        "kernel_nodes": [node for g in graphs for node in g["kernel_nodes_by_rows"].values()],
        "capture_errors": [g["capture_error"] for g in graphs if g["capture_error"]],
        "uncaptured_calls": sum(g["uncaptured_calls"] for g in graphs),
        "replay_rel_err_vs_uncaptured": relative_error(replayed, uncaptured),
        "step_graphs": graphs,
    }


def versions() -> dict:
    """Every result records what produced it."""
    import transformers
    import triton

    return {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _miss_lines(misses: list[dict], explain: bool) -> list[str]:
    lines = []
    for miss in misses:
        reason = miss["reason"] if explain else miss["reason"][:200]
        lines.append(f"        miss {miss['family']} at {miss['module']} ({miss['node']}): {reason}")
        if explain:
            lines.extend(f"            {step}" for step in miss.get("chain", ()))
    return lines


def format_table(result: dict, explain: bool = False) -> str:
    """The per-layer table; with ``explain``, each miss's chain of FX nodes from its anchor to
    the node where matching diverged (fx/explain.py)."""
    head = f"{result['model']} ({result['size']}, {result['layers']} layers, {result['device']}, batch {result['batch']})"
    source = {m: result["per_layer"][0]["kernels"][m]["count_source"] for m in MODES}
    lines = [
        head,
        "kernels per layer = K(stack) - K(stack less one layer) per kind; sources: " + ", ".join(f"{m}={s}" for m, s in source.items()),
    ]
    families = list(result["per_layer"][0]["matches"]) if result["per_layer"] else [FAMILY]
    lines.append(f"{'layer':>5} {'kind':<16} {'eager':>6} {'inductor':>9} {'fusion':>7}  " + "  ".join(f"{f:>14}" for f in families))

    def found(matches):
        return "  ".join(f"{str(matches[f]['found']) + '/' + str(matches[f]['expected']):>14}" for f in families)

    for row in result["per_layer"]:
        k = row["kernels"]
        lines.append(
            f"{row['layer']:>5} {row['kind']:<16} {k['eager']['count']:>6} {k['inductor']['count']:>9} "
            f"{k['fusion_compiler']['count']:>7}  {found(row['matches'])}"
        )
        lines.extend(_miss_lines(row["misses"], explain))
    lines.append(f"{'-':>5} {'outside layers':<16} {'':>6} {'':>9} {'':>7}  {found(result['outside_layers']['matches'])}")
    reasons = list(result.get("no_family", {}).items())
    for why, modules in {w: [m for m, x in reasons if x == w] for _, w in reasons}.items():
        lines.append(f"{why} ({len(modules)} attention(s): {modules[0]}{', ...' if len(modules) > 1 else ''})")
    lines.extend(_miss_lines(result["outside_layers"]["misses"], explain))
    for merge in result.get("merged_launches", []):
        lines.append(f"merged {merge['sites']} {merge['kind']}-prologue sites of {merge['layer']} into one launch")
    if result.get("merged_projections"):
        groups = result["merged_projections"]
        lines.append(f"merged {sum(groups)} projections of shared activations into {len(groups)} GEMMs (groups of {groups})")
    seconds = result.get("compile_seconds")
    if seconds and seconds["pass_overhead_vs_inductor"] is not None:
        lines.append(
            f"compile (backend, full stack, warm kernel cache): stock Inductor {seconds['inductor']:.2f} s, "
            f"fusion_compiler {seconds['fusion_compiler']:.2f} s ({100 * seconds['pass_overhead_vs_inductor']:+.0f}%); "
            f"pattern tracing once per process {seconds['pattern_tracing']:.1f} s"
        )
    breaks = result.get("graph_breaks", {}).get("fusion_compiler")
    if breaks or result["graphs"]["fusion_compiler"] > 1:
        lines.append(f"WARNING: the compiled step is {result['graphs']['fusion_compiler']} graphs (graph breaks split it; "
                     "each piece is captured on its own, with host work between): "
                     + "; ".join(f"{n}x {reason}" for reason, n in (breaks or {}).items()))
    graphs = result.get("cuda_graphs")
    if graphs:
        lines.append(
            f"CUDA graphs (our backend, whole step): {graphs['captured_graphs']} captured of "
            f"{graphs['compiled_graphs']} compiled graph(s), kernel nodes {graphs['kernel_nodes']}, replay vs "
            f"uncaptured {graphs['replay_rel_err_vs_uncaptured']:.1e}"
            + "".join(f"; capture error: {error}" for error in graphs["capture_errors"])
        )
    lines.append(f"graphs per mode: {result['graphs']}; relative error vs eager: " + ", ".join(f"{m} {e:.2e}" for m, e in result["relative_error_vs_eager"].items()))
    lines.append(f"numerics gate: {result['numerics_gate']['verdict']}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []
    for result in results:
        seen = set()
        for row in result["per_layer"]:
            if row["kind"] in seen:
                continue
            seen.add(row["kind"])
            bars.append((f"{result['model']}\n{row['kind']}", [row["kernels"][m]["count"] for m in MODES]))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(bars)), 4.4))
    width = 0.27
    for j, mode in enumerate(MODES):
        ax.bar([i + (j - 1) * width for i in range(len(bars))], [b[1][j] for b in bars], width, label=mode)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    kernels = results[0]["per_layer"][0]["kernels"]
    ax.set_ylabel("kernels per decoder layer")
    ax.set_title("one decode step: kernels for one decoder layer of each kind", fontsize=10)
    fig.text(
        0.01, 0.01,
        f"{results[0]['device']}: eager = {kernels['eager']['count_source']}, compiled = {kernels['inductor']['count_source']}",
        fontsize=7,
    )
    ax.legend()
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
