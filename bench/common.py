"""The measuring harness every bench script shares: CUDA-graph timing, the same-run copy
bandwidth, device facts. Method: ../../shared docs and bench/NOTES.md."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def module_knobs(module, **values):
    """``module``'s module-level knobs (a kernel module's A/B switches, read at launch) set to
    ``values`` while inside, restored on the way out."""
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def device_facts() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "device": torch.cuda.get_device_name(),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def graph_time_us(fn: Callable[[int], object], rotations: int, calls_per_graph: int = 20, replays: int = 50) -> float:
    """Median µs per call of `fn(i)` (i picks the input set), timed as CUDA-graph replays.

    One graph holds `calls_per_graph` calls cycling through `rotations` input sets, so
    inputs bigger than L2 come from HBM as they would in a real step.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i % rotations)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            fn(i % rotations)
    for _ in range(5):
        graph.replay()
    return replay_median_us(graph, calls_per_graph, replays)


def replay_median_us(graph: torch.cuda.CUDAGraph, calls_per_graph: int, replays: int) -> float:
    """Median µs per call of a captured graph holding ``calls_per_graph`` calls (CUDA events
    around each of ``replays`` replays)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    return statistics.median(times)


def _median_call_s(op: Callable[[], object], calls: int = 20) -> float:
    """Median seconds of one ``op()`` after 3 warm-ups, CUDA events around each call."""
    for _ in range(3):
        op()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(gib: float = 2.0) -> float:
    """Device-to-device copy of `gib` GiB, bytes read plus bytes written, median of 20."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    seconds = _median_call_s(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / seconds / 1e9


def read_bandwidth_gbs(gib: float = 2.0) -> float:
    """Bytes read per second by a read-only pass over `gib` GiB of bf16 on the device (nothing
    written but a scalar): the faster of two torch reductions, ``torch.sum(x, dtype=float32)``
    and ``x.amax()``, each the median of 20 after 3 warm-ups, CUDA events around each.

    The yardstick for kernels that mostly read (the experts' weights): a copy moves as many bytes
    out as in, and HBM streams reads alone faster, so % of ``copy_bandwidth_gbs`` can pass 100
    where % of this stays below. It is torch's reduction kernel, not a bound: a kernel may beat
    it, and where it comes out under the copy bandwidth the reduction, not HBM, limited it."""
    n = int(gib * 2**30) // 2  # bf16 elements
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_(-1.0, 1.0)
    seconds = min(_median_call_s(op) for op in (lambda: torch.sum(x, dtype=torch.float32), lambda: x.amax()))
    del x
    return 2 * n / seconds / 1e9


def bandwidth_env(device: str) -> dict:
    """On CUDA the device's facts and the copy bandwidth measured now (printed), for a results
    JSON's top level; {} on CPU."""
    if device != "cuda":
        return {}
    env = {"device_facts": device_facts(), "copy_bandwidth_gbs": copy_bandwidth_gbs()}
    print(f"copy bandwidth {env['copy_bandwidth_gbs']:.0f} GB/s", flush=True)
    return env


def check_cpu_tiny(parser, args, interpreter: bool = True) -> None:
    """``--device cpu`` runs ``--tiny`` only (no CUDA graphs, no timing); with ``interpreter`` it
    also needs TRITON_INTERPRET=1 set before the kernels are imported."""
    if args.device != "cpu":
        return
    if not args.tiny:
        parser.error("--device cpu runs --tiny only (no CUDA graphs, no timing)")
    if interpreter and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu needs TRITON_INTERPRET=1 set before the kernels are imported")


def kernels_in(fn: Callable[[], object]) -> int:
    from fusion_compiler.inspect.counting import count_cuda_kernels

    return count_cuda_kernels(fn).count


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 (the worst element against the scale)."""
    return float(((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item())


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_state() -> tuple[str, bool, list[str]] | None:
    """(commit, dirty, dirty paths) of this checkout, or None where git cannot tell (no .git,
    no git). Dirty: a tracked file differs from the commit, or an untracked file sits under
    fusion_compiler/ or bench/ (code a run may import; bench/results/ excepted)."""
    if not (REPO / ".git").exists():  # a copy of the tree: never ask a repository around it
        return None
    try:
        def git(*args):
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True,
                                  timeout=60).stdout  # fmt: skip

        commit = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain=v1", "--untracked-files=all")
    except (OSError, subprocess.SubprocessError):
        return None
    paths = []
    for line in status.splitlines():
        path = line[3:]
        if line.startswith("??") and not (path.startswith("fusion_compiler/") or
                                          (path.startswith("bench/") and not path.startswith("bench/results/"))):
            continue
        paths.append(path)
    return commit, bool(paths), paths


def _env_flag(value: str | None) -> bool | None:
    if value is None:
        return None
    return {"1": True, "true": True, "0": False, "false": False}.get(value.strip().lower())


def provenance(device: str | None = None) -> dict:
    """What a result was measured on; every results JSON under bench/ carries it (``write_json``
    adds it): the commit, whether the tree differed from it (``dirty``, with up to 20 of the
    differing paths), the device, and the torch, triton and transformers versions.

    The commit and dirty flag come from git in this checkout.  Where git cannot tell (the GPU
    machine gets a copy of the tree without .git) they come from FUSION_COMMIT and FUSION_DIRTY
    (1 / 0), set by whoever sent the tree; with neither, commit "unknown" and dirty None, never
    a guess.  ``commit_source`` says which: "git", "env" or "none".  ``device``: the caller's
    name for it, else the CUDA device's name, else the CPU's.
    """
    state = _git_state()
    if state is not None:
        commit, dirty, paths = state
        source = "git"
    elif os.environ.get("FUSION_COMMIT"):
        commit, dirty, paths = os.environ["FUSION_COMMIT"], _env_flag(os.environ.get("FUSION_DIRTY")), []
        source = "env"
    else:
        commit, dirty, paths, source = "unknown", None, [], "none"
    if device is None:
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
        else:
            device = f"cpu ({platform.processor() or platform.machine()})"
    return {
        "commit": commit,
        "dirty": dirty,
        "dirty_paths": paths[:20],
        "commit_source": source,
        "device": device,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
    }


def write_json(path: str, payload: dict) -> None:
    """Write a results JSON with its ``provenance()`` first (a caller that made its own, e.g.
    with the device it ran on, keeps it)."""
    if "provenance" not in payload:
        payload = {"provenance": provenance(), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def time_variants(variants: dict, sets: list[dict], rotations: int, size: int, bandwidth: float, row: dict) -> None:
    """For each variant (called as ``fn(**sets[i])``): profiler kernel count (and names, but
    eager's), CUDA-graph µs over the rotated input sets, GB/s and % of ``bandwidth`` for
    ``size`` bytes, into ``row`` as ``<label>_kernels`` / ``_us`` / ``_gbs`` / ``_pct_bw``."""
    from fusion_compiler.inspect.counting import count_cuda_kernels

    for label, fn in variants.items():
        count = count_cuda_kernels(lambda fn=fn: fn(**sets[0]))
        row[f"{label}_kernels"] = count.count
        if label != "eager":
            row[f"{label}_kernel_names"] = count.names
        us = graph_time_us(lambda i, fn=fn: fn(**sets[i]), rotations)
        row[f"{label}_us"] = us
        row[f"{label}_gbs"] = size / us / 1e3
        row[f"{label}_pct_bw"] = 100 * size / us / 1e3 / bandwidth
