"""HF ``generate()`` at real widths, the user's path: eager, stock ``torch.compile(mode=
"reduce-overhead")`` and fusion_compiler through each compile route, side by side in one process
(or a process each: ``--isolate``, below).

What a user runs: an HF ``*ForCausalLM`` (random weights, real widths and vocabulary, HF's default
experts implementation), ``cache_implementation="static"``, greedy ``generate()``. Modes:

* ``eager``: ``generate(disable_compile=True)``;
* ``stock``: ``compile_config=CompileConfig(backend="inductor")`` (HF's defaults: mode
  "reduce-overhead"; what HF does by itself with a static cache on CUDA);
* ``ours``: ``compile_config=CompileConfig(backend="fusion_compiler")`` (the default route);
* ``ours_forward``: ``model.forward = torch.compile(model.forward, backend="fusion_compiler")``,
  ``generate(disable_compile=True)`` (else HF's own compile of ``__call__`` would wrap it, and
  the outer backend wins in Dynamo);
* ``ours_fc_compile``: ``fusion_compiler.compile(model)``, then ``generate()``;
* ``stock_forward``: ``ours_forward`` with stock Inductor (default mode, no CUDA graphs): its
  numerics baseline, since both compile the prefill, which HF's own route leaves eager (for
  tests; not run by default).

Per (mode, batch):

* **logits**: ``generate()`` teacher-forced on eager's greedy ids (a logits processor forces each
  step's token; ``output_logits`` returns the raw logits), relative error against eager's per
  step: with random weights greedy ids split at near-ties, so every mode reads the same ids. A
  near-tie in the MoE top-k also flips an expert under any change of rounding, and stock's logits
  then leave eager's by 0.1 or more at that step: ``steps_beyond_stock`` counts the steps where
  ours is off by more than 2e-2 and more than 1.5x stock;
* **decode tokens/s**: ``batch x (N - 1) / (t(N new tokens) - t(1 new token))``, medians of
  timed ``generate()`` calls (each makes a new static cache, as HF does);
* **captured steps, from the hardware**: one ``generate()`` under the torch profiler. Each
  compiled-forward call is a ``Torch-Compiled Region`` on the CPU timeline; a decode call is
  captured when its region launched one or more CUDA graphs and no kernel (a ``cu*LaunchKernel``
  / ``cudaLaunchKernel*`` runtime call: loose, or recorded by a capture on that call); memcpys
  (the copy-in of a step's inputs) are counted apart. The prefill, where a route compiles it, is
  reported apart.
  Our own report's CUDA-graph counts are written beside it, not used for the verdict.

**Isolation** (``--isolate``): each mode in a process of its own (this script again, one mode,
its own eager reference), the rows merged here. In one process, every compile and profile makes
the later modes' host work slower: on the H200, DeepSeek V3.2's eager launch went 7.1 → 13.9 µs
and its eager prefill 14.1 → 20.2 ms between a fresh process and the third mode
(bench/NOTES.md, the user's path), so at batch 1, where HF's loop sets the rate, the mode run
last reads slower for no fault of its own. Users run one mode in a process.

    python bench/generate.py --model minimax-m2.5 --out bench/results/generate_h200_minimax-m2.5.json
    python bench/generate.py --model deepseek-v3.2 --batches 1 --modes stock ours --isolate --out r.json
    python bench/generate.py --model qwen3.5 --smoke        # tiny widths on CPU: the logic only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler.model_adapters import get_adapter  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402

LAYERS = {"deepseek-v3.2": 2, "minimax-m2.5": 2, "qwen3.5": 4}  # Qwen3.5: 3 GDN + 1 full attention
ROUTES_AT_BATCH_1 = ("ours_forward", "ours_fc_compile")
PROMPT = 16
_KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
_MEMCPYS = ("cudaMemcpyAsync", "cudaMemsetAsync", "cuMemcpyAsync")
_REGION = "Torch-Compiled Region"


class ForceIds:
    """A logits processor that makes every step pick the given ids (eager's), so each mode's
    logits are computed on the same sequence. Returns a new tensor: HF keeps the raw logits."""

    def __init__(self, ids: torch.Tensor, prompt: int):
        self.ids, self.prompt = ids, prompt

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = self.ids[:, input_ids.shape[1]]
        return torch.full_like(scores, float("-inf")).scatter_(1, forced[:, None], 0.0)


def step_relative_errors(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    """``verify.relative_error`` per step (float64; inf on a shape mismatch or a NaN eager has not)."""
    return [relative_error(got, ref) for got, ref in zip(logits, reference, strict=True)]


def decode_tokens_per_second(batch: int, new_tokens: int, seconds_all: float, seconds_first: float) -> float:
    """Tokens/s of the decode steps alone: a generate of ``new_tokens`` less one of 1 token
    (prefill + first token), ``new_tokens - 1`` steps of ``batch`` tokens."""
    return batch * (new_tokens - 1) / (seconds_all - seconds_first)


def region_launches(events) -> list[dict]:
    """Per ``Torch-Compiled Region`` of a profile (torch.profiler FunctionEvents), in time order:
    the CUDA-graph launches, kernel launches and memcpys among its CPU descendants, by runtime
    call. A capture records its kernels through the same runtime calls, so a call that captured
    a graph shows both."""
    regions = []
    for event in sorted((e for e in events if e.name.startswith(_REGION)), key=lambda e: e.time_range.start):
        counts = {"graph_launches": 0, "kernel_launches": 0, "memcpys": 0, "launched_by": {}}
        stack = [(child, event.name) for child in event.cpu_children]
        while stack:
            child, parent = stack.pop()
            stack.extend((grandchild, child.name) for grandchild in child.cpu_children)
            if child.name in _GRAPH_LAUNCHES:
                counts["graph_launches"] += 1
            elif child.name in _KERNEL_LAUNCHES:
                counts["kernel_launches"] += 1
                counts["launched_by"][parent] = counts["launched_by"].get(parent, 0) + 1  # which op launched it
            elif child.name in _MEMCPYS:
                counts["memcpys"] += 1
        regions.append(counts)
    return regions


def capture_verdict(regions: list[dict]) -> dict:
    """Calls that only replayed graphs (captured), that captured and then replayed (recorded),
    and that launched kernels with no graph (uncaptured); loose kernel launches and memcpys."""
    verdict = {"calls": len(regions), "captured_calls": 0, "recorded_calls": 0, "uncaptured_calls": 0,
               "loose_kernels": 0, "memcpys": 0, "launched_by": {}}  # fmt: skip
    for r in regions:
        for name, n in r.get("launched_by", {}).items():
            verdict["launched_by"][name] = verdict["launched_by"].get(name, 0) + n
        if r["graph_launches"] == 0:
            verdict["uncaptured_calls"] += 1
        else:
            verdict["recorded_calls" if r["kernel_launches"] else "captured_calls"] += 1
        verdict["loose_kernels"] += r["kernel_launches"]
        verdict["memcpys"] += r["memcpys"]
    return verdict


def decode_calls(calls: list, new_tokens: int) -> list:
    """The decode calls are the last ``new_tokens - 1`` compiled calls of a generate(); a route
    that compiles the forward itself also runs the prefill through it, first."""
    return calls[len(calls) - (new_tokens - 1):] if len(calls) >= new_tokens - 1 else calls


def split_calls(regions: list[dict], new_tokens: int) -> dict:
    decode = decode_calls(regions, new_tokens)
    return {"decode": capture_verdict(decode), "prefill": capture_verdict(regions[: len(regions) - len(decode)])}


def pin_routing(model) -> int:
    """Routers that choose by ``sigmoid + e_score_correction_bias`` (DeepSeek, MiniMax) choose the
    same experts for every token once the bias steps by 2 per expert (more than sigmoid's range):
    no near-tie is left to flip, while the routing weights still come from each token's scores.
    Returns the number of routers pinned (Qwen3.5's softmax router has no bias: 0)."""
    pinned = 0
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            with torch.no_grad():
                bias.copy_(-2.0 * torch.arange(bias.numel(), dtype=bias.dtype, device=bias.device))
            pinned += 1
    return pinned


class Runner:
    """One model, its modes. ``generate(mode, batch, ...)`` installs the mode's compile route."""

    def __init__(self, model, device: str, new_tokens: int, cpu_compile: bool):
        self.model, self.device, self.new_tokens, self.cpu_compile = model, device, new_tokens, cpu_compile
        self.original_forward = model.forward
        self.mode = None
        self.fused = None  # the compiled object of ours_fc_compile
        self.prompts: dict[int, torch.Tensor] = {}

    def prompt(self, batch: int) -> torch.Tensor:
        if batch not in self.prompts:
            vocab = self.model.config.get_text_config(decoder=True).vocab_size
            gen = torch.Generator().manual_seed(batch)
            self.prompts[batch] = torch.randint(0, vocab, (batch, PROMPT), generator=gen).to(self.device)
        return self.prompts[batch]

    def use(self, mode: str) -> None:
        """Install ``mode``'s route; a route change starts from a clean Dynamo cache."""
        if mode == self.mode:
            return
        torch._dynamo.reset()
        self.model.forward = self.original_forward
        for attr in ("_compiled_call", "_last_compile_config"):
            self.model.__dict__.pop(attr, None)
        self.model.generation_config.compile_config = None
        self.model._compiled_call_impl = None  # fc.compile compiles the model in place
        self.fused = None
        if mode == "ours_forward":
            self.model.forward = torch.compile(self.original_forward, backend="fusion_compiler")
        elif mode == "stock_forward":  # ours_forward's numerics baseline: the prefill compiled too
            self.model.forward = torch.compile(self.original_forward)
        elif mode == "ours_fc_compile":
            self.fused = fc.compile(self.model)
        self.mode = mode

    def kwargs(self, mode: str, tokens: int) -> dict:
        from transformers import CompileConfig

        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, cache_implementation="static",
                  pad_token_id=0)  # fmt: skip
        if mode in ("eager", "ours_forward", "stock_forward"):
            kw["disable_compile"] = True
        elif mode in ("stock", "ours"):
            config = CompileConfig(backend="inductor" if mode == "stock" else "fusion_compiler")
            if self.cpu_compile:
                config._compile_all_devices = True
            kw["compile_config"] = config
        return kw

    def generate(self, mode: str, batch: int, tokens: int | None = None, **extra):
        self.use(mode)
        tokens = tokens or self.new_tokens
        ids = self.prompt(batch)
        target = self.fused if mode == "ours_fc_compile" else self.model
        with torch.no_grad():
            return target.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs(mode, tokens), **extra)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def timed(self, mode: str, batch: int, tokens: int, repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            self.sync()
            start = time.perf_counter()
            self.generate(mode, batch, tokens)
            self.sync()
            times.append(time.perf_counter() - start)
        return times


def step_timeline(events, new_tokens: int) -> dict:
    """Where a decode step's wall time goes, off one profiled ``generate()``: the median period
    between consecutive decode calls' starts (a whole step: HF's own per-step work, then the
    compiled call), the median host time inside a compiled call, and the GPU's busy time per
    period (the union of the device's kernel and memcpy intervals over the decode calls' span,
    graph-replayed kernels included). A period well above the busy time: the step waits on the
    host, and a faster GPU step moves tokens/s by less. Times in µs; {} without device events."""
    regions = sorted((e for e in events if e.name.startswith(_REGION)), key=lambda e: e.time_range.start)
    decode = decode_calls(regions, new_tokens)
    if len(decode) < 2:
        return {}
    starts = [e.time_range.start for e in decode]
    lo, hi = starts[0], starts[-1]
    spans = sorted((max(e.time_range.start, lo), min(e.time_range.end, hi)) for e in events
                   if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                   and e.time_range.end > lo and e.time_range.start < hi)  # fmt: skip
    if not spans:
        return {}
    busy, reach = 0.0, lo
    for start, end in spans:  # the union of the intervals
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    periods = len(decode) - 1
    return {"period_us": statistics.median(b - a for a, b in zip(starts, starts[1:])),
            "compiled_call_host_us": statistics.median(e.time_range.end - e.time_range.start for e in decode[:-1]),
            "gpu_busy_us": busy / periods, "gpu_busy_fraction": busy / (hi - lo)}  # fmt: skip


def profiled_generate(runner: Runner, mode: str, batch: int):
    """One ``generate()`` under the torch profiler (CPU and CUDA activity); its events."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        runner.generate(mode, batch)
        runner.sync()
    return prof.events()


def our_graph_stats() -> list[dict]:
    backend = getattr(fc, "last_backend", lambda: None)()
    return [g.report() for g in getattr(backend, "step_graphs", [])]


def run_case(runner: Runner, mode: str, batch: int, reference: dict, repeats: int) -> dict:
    row: dict = {"mode": mode, "batch": batch}
    started = time.perf_counter()
    try:
        out = runner.generate(mode, batch, output_logits=True, return_dict_in_generate=True,
                              logits_processor=[ForceIds(reference["ids"], PROMPT)])  # fmt: skip
        row["first_generate_s"] = time.perf_counter() - started  # compile included
        errors = step_relative_errors([t.float() for t in out.logits], reference["logits"])
        row["logits_rel_err_max"], row["logits_rel_err_by_step"] = max(errors), errors
        runner.generate(mode, batch)  # warm-up: every capture of the route done
        runner.generate(mode, batch, 1)
        all_times = runner.timed(mode, batch, runner.new_tokens, repeats)
        first_times = runner.timed(mode, batch, 1, repeats)
        row["generate_s_each"], row["first_token_s_each"] = all_times, first_times  # the spread
        seconds_all, seconds_first = statistics.median(all_times), statistics.median(first_times)
        row["generate_s"], row["first_token_s"] = seconds_all, seconds_first
        row["decode_tokens_per_s"] = decode_tokens_per_second(batch, runner.new_tokens, seconds_all, seconds_first)
        if runner.device == "cuda" and mode != "eager":
            events = profiled_generate(runner, mode, batch)
            row["profiled_calls"] = split_calls(region_launches(events), runner.new_tokens)
            row["step_timeline"] = step_timeline(events, runner.new_tokens)
        if mode.startswith("ours"):
            row["our_step_graphs"] = our_graph_stats()
            report = fc.last_report()
            row["fused"] = report.per_variant() if report is not None else None
            row["missing_expected"] = report.missing_expected() if report is not None else None
    except Exception as error:  # noqa: BLE001 - a crash is a result of this bench, recorded and reported
        row["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
    row["wall_s"] = time.perf_counter() - started
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(LAYERS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["eager", "stock", "ours", *ROUTES_AT_BATCH_1])
    parser.add_argument("--smoke", action="store_true", help="tiny widths on CPU (HF compiles there when asked)")
    parser.add_argument("--pin-routing", action="store_true",
                        help="bias-routed models send every token to the same experts (pin_routing): logits "
                             "without near-tie flips; not for timing, since real routing spreads tokens")  # fmt: skip
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default LAYERS: the fewest with each layer kind); more bring the "
                             "share of the step outside the layers (HF's per-step host work, the LM head) "
                             "towards a real model's")  # fmt: skip
    parser.add_argument("--isolate", action="store_true",
                        help="each mode in a fresh process of its own (the timings of a mode run after others "
                             "carry the host cost their compiles leave in the process)")  # fmt: skip
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.isolate and len(args.modes) > 1:
        return run_isolated(args, list(sys.argv[1:] if argv is None else argv))
    device = "cpu" if args.smoke else "cuda"
    adapter = get_adapter(args.model)
    layers = args.layers or LAYERS[args.model]
    model = adapter.build_hf(size="tiny" if args.smoke else "real", layers=layers, device=device)
    pinned = pin_routing(model) if args.pin_routing else 0
    runner = Runner(model, device, args.new_tokens, cpu_compile=args.smoke)
    result = {
        "bench": "generate", "model": args.model, "layers": layers, "size": "tiny" if args.smoke else "real",
        "vocab": model.config.get_text_config(decoder=True).vocab_size, "new_tokens": args.new_tokens,
        "prompt": PROMPT, "experts_implementation": adapter.experts_implementation, "pinned_routers": pinned,
        "provenance": common.provenance(None if device == "cuda" else "cpu (smoke)"),
    }  # fmt: skip
    if device == "cuda":
        result.update(common.device_facts())
        result["copy_gbs"] = common.copy_bandwidth_gbs()
    references = {}
    for batch in args.batches:  # eager first: every mode is compared with it
        out = runner.generate("eager", batch, output_logits=True, return_dict_in_generate=True)
        references[batch] = {"ids": out.sequences, "logits": [t.float() for t in out.logits]}
    rows = []
    for mode in args.modes:
        for batch in args.batches:
            if mode in ROUTES_AT_BATCH_1 and batch != 1:
                continue
            row = run_case(runner, mode, batch, references[batch], args.repeats)
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                   if k not in ("logits_rel_err_by_step", "our_step_graphs")}, flush=True)  # fmt: skip
            if args.out:
                common.write_json(args.out, {**result, "rows": rows})
    result["rows"] = rows
    return finish(result, args.out)


def isolated_argv(argv: list[str], mode: str, out: str) -> list[str]:
    """``argv`` for one mode alone: without ``--isolate``, ``--modes`` and ``--out`` (and their
    values), then ``--modes MODE --out OUT``."""
    kept, skipping = [], False
    for arg in argv:
        if arg == "--isolate":
            skipping = False
            continue
        if arg in ("--modes", "--out"):
            skipping = True
            continue
        if arg.startswith("--modes=") or arg.startswith("--out="):
            skipping = False
            continue
        if skipping and not arg.startswith("--"):
            continue
        skipping = False
        kept.append(arg)
    return [*kept, "--modes", mode, "--out", out]


def run_isolated(args, argv: list[str]) -> dict:
    """Each mode in its own process (this script, one mode), the rows merged in mode order; the
    first process's header (provenance, device) is the result's."""
    result, rows = None, []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            out = os.path.join(tmp, f"{mode}.json")
            child = subprocess.Popen([sys.executable, os.path.abspath(__file__), *isolated_argv(argv, mode, out)])
            # A timeout's SIGTERM to this process ends the child too (it holds the GPU).
            previous = signal.signal(signal.SIGTERM, lambda *_: (child.kill(), sys.exit(143)))
            try:
                returncode = child.wait()
            finally:
                signal.signal(signal.SIGTERM, previous)
            if not os.path.exists(out):
                rows.append({"mode": mode, "error": f"its process wrote no result (rc {returncode})"})
                continue
            with open(out) as f:
                part = json.load(f)
            part_rows = part.pop("rows", [])
            if result is None:
                result = part
            rows.extend(part_rows)
    result = result or {"bench": "generate", "model": args.model}
    result["isolated"] = True
    result["rows"] = rows
    return finish(result, args.out)


def finish(result: dict, out: str | None) -> dict:
    """vs_stock and the near-tie counts per row, the table, and the JSON."""
    rows = result["rows"]
    stock = {r["batch"]: r for r in rows if r.get("mode") == "stock" and "error" not in r}
    for row in rows:
        base = stock.get(row.get("batch"))
        if base is None or "error" in row:
            continue
        row["vs_stock"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        # A near-tie in the MoE top-k flips an expert under any change of rounding: at such a
        # step stock's logits leave eager's too. Steps where ours is off by more than 2e-2 and
        # more than 1.5x stock are the ones that count against us.
        pairs = zip(row["logits_rel_err_by_step"], base["logits_rel_err_by_step"])
        row["steps_over_2e-2"] = sum(e > 2e-2 for e in row["logits_rel_err_by_step"])
        row["steps_beyond_stock"] = sum(e > max(2e-2, 1.5 * b) for e, b in pairs)
    print(f"{'mode':16} {'batch':>5} {'tok/s':>9} {'vs stock':>8} {'max rel err':>11} {'>2e-2':>5} "
          f"{'>stock':>6} {'captured':>9} {'uncapt.':>7} {'step µs':>8} {'GPU busy':>8}")
    for row in rows:
        calls = row.get("profiled_calls", {}).get("decode", {})
        timeline = row.get("step_timeline") or {}
        print(f"{row['mode']:16} {row.get('batch', '-'):>5} {row.get('decode_tokens_per_s', float('nan')):9.1f} "
              f"{row.get('vs_stock', float('nan')):8.3f} {row.get('logits_rel_err_max', float('nan')):11.2e} "
              f"{row.get('steps_over_2e-2', '-'):>5} {row.get('steps_beyond_stock', '-'):>6} "
              f"{calls.get('captured_calls', '-'):>9} {calls.get('uncaptured_calls', '-'):>7} "
              f"{timeline.get('period_us', float('nan')):8.1f} {timeline.get('gpu_busy_fraction', float('nan')):8.1%}"
              + (f"  ERROR {row['error'][:200]}" if "error" in row else ""))  # fmt: skip
    if out:
        common.write_json(out, result)
    return result


if __name__ == "__main__":
    main()
