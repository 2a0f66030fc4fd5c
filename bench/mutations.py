"""Can the tests fail?  Each row below applies one deliberate fault to a copy of fusion_compiler
and runs the test that must catch it; the test has to fail on the copy (and pass on an unmodified
copy, the baseline).

    .venv/bin/python bench/mutations.py                     # every CPU row -> bench/results/mutations_cpu.md
    .venv/bin/python bench/mutations.py --only mla_kv_zero_tokens_guard div_rn_by_no_correction
    .venv/bin/python bench/mutations.py --device cuda --jobs 6   # the GPU rows, on a CUDA machine

How a row runs: fusion_compiler/ is copied to a temp dir (never edited in place: others run tests
against the tree), ``old`` is replaced by ``new`` in ``file`` (``old`` must occur exactly once),
and ``python -P -m pytest -x <test>`` runs from the repo root with the copy first on PYTHONPATH.
``-P`` matters: ``python -m`` otherwise puts the current directory (the repo root, with the
real fusion_compiler) ahead of PYTHONPATH, and the copy would silently go unused.  A small pytest
plugin records ``fusion_compiler.__file__`` as the tests imported it; a row whose tests did not
import the copy is reported NOT-ISOLATED.

Results: PASS-as-expected-fail (the test failed on the fault), UNEXPECTED-PASS (it did not
notice), BASELINE-FAILS (it fails without the fault too, so its failure proves nothing), BAD-ROW
(``old`` not found exactly once), ERROR (pytest could not run it: collection error, timeout).

To add a row, append a ``Mutation(...)`` to MUTATIONS: a unique name, the file under the repo root,
the exact text to replace and its replacement, the pytest node id, and ``device="cuda"`` for a
fault only a GPU run can show.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repo root, under fusion_compiler/
    old: str  # must occur exactly once in file
    new: str
    test: str  # pytest node id that must fail on the mutant
    device: str = "cpu"  # "cuda": the fault shows only on a GPU run


# Faults that two tests must each catch: (file, old, new), shared by their rows.
_GQA_WRITES_PADDING_SLOT = ("fusion_compiler/kernels/gqa_prologue.py",
                            "    mask = (h < kv_heads) & lane_ok & (slot >= 0)", "    mask = (h < kv_heads) & lane_ok")
_STALE_COPIED_INPUTS = ("fusion_compiler/cudagraph.py", "            buffer.copy_(_distinct_elements(args[i]))",
                        "            pass")

MUTATIONS = [
    # -- empty inputs launch nothing (tests count launches with tests/launch_counter.py) --
    Mutation("rms_norm_empty_guard", "fusion_compiler/kernels/rms_norm.py",
             "    if x.numel() == 0:", "    if False:",
             "tests/kernels/test_rms_norm.py::test_empty_input_launches_nothing"),
    Mutation("mla_kv_zero_tokens_guard", "fusion_compiler/kernels/mla_kv_prologue.py",
             "    if tokens == 0 or roles == 0:", "    if roles == 0:",
             "tests/kernels/test_mla_kv_prologue.py::test_zero_tokens_launches_nothing"),
    Mutation("mla_q_zero_tokens_guard", "fusion_compiler/kernels/mla_q_prologue.py",
             "    if tokens == 0 or not (has_q or has_iq):", "    if not (has_q or has_iq):",
             "tests/kernels/test_mla_q_prologue.py::test_zero_tokens_launches_nothing"),
    Mutation("moe_route_zero_tokens_guard", "fusion_compiler/kernels/moe_route.py",
             '        raise ValueError(f"all tensors must be on {logits.device}")\n    if tokens == 0:\n        return\n',
             '        raise ValueError(f"all tensors must be on {logits.device}")\n',
             "tests/kernels/test_moe_route.py::test_zero_tokens_launches_nothing"),
    Mutation("inspect_compiles_a_second_batch", "fusion_compiler/inspect/run.py",
             "        make_decode_step(model, batch=batch, context=context, seed=0).run(torch.compile(model, backend=backend))\n",
             "        compiled = torch.compile(model, backend=backend)\n"
             "        make_decode_step(model, batch=batch, context=context, seed=0).run(compiled)\n"
             "        make_decode_step(model, batch=batch + 1, context=context, seed=0).run(compiled)\n",
             "tests/inspect/test_cli.py::test_inspect_minimax_builds_each_stack_once_and_compiles_each_mode_once"),
    # -- ops against an independent float64 formula (on CPU the op's impl is the reference) --
    Mutation("rms_norm_reference_drops_weight_offset", "fusion_compiler/ops/rms_norm.py",
             "    return _rms_norm_math(x, weight, eps, weight_offset, out_dtype)\n",
             "    return _rms_norm_math(x, weight, eps, 0.0, out_dtype)\n",
             "tests/ops/test_rms_norm.py::test_ops_match_float64_math"),
    Mutation("decode_attention_reference_gqa_head_order", "fusion_compiler/ops/decode_attention.py",
             "    k_rep = k.float().repeat_interleave(group, dim=1)\n    v_rep = v.float().repeat_interleave(group, dim=1)",
             "    k_rep = k.float().repeat(1, group, 1, 1)\n    v_rep = v.float().repeat(1, group, 1, 1)",
             "tests/ops/test_decode_attention.py::test_op_matches_float64_attention"),
    # -- moe_experts: the pass's SiLU check, the op's routing weights, the grouped combine --
    Mutation("moe_experts_pass_takes_any_activation", "fusion_compiler/patterns/moe_experts.py",
             "    if not is_silu(silu):", "    if False:",
             "tests/patterns/test_moe_experts.py::test_near_misses_are_reported_with_their_reason"),
    Mutation("moe_experts_reference_drops_routing_weights", "fusion_compiler/ops/moe_experts.py",
             "        total.index_add_(0, pairs // top_k, y * flat_w[pairs, None])",
             "        total.index_add_(0, pairs // top_k, y)",
             "tests/ops/test_moe_experts.py::test_reference_equals_a_loop_over_pairs_with_padding"),
    Mutation("moe_experts_grouped_combine_drops_weight", "fusion_compiler/kernels/moe_experts_grouped.py",
             "            total += _upcast(y) * weight", "            total += _upcast(y)",
             "tests/kernels/test_moe_experts.py::test_kernel_matches_reference_and_float64"),
    # -- div_rn_by: the interpreter branch, and the GPU branch's correction run on CPU --
    Mutation("div_rn_by_interpreter_branch_inexact", "fusion_compiler/kernels/_device.py",
             "        return tl.math.div_rn(x, tl.full(x.shape, 0.0, tl.float32) + d)",
             "        return x * (1.0 / d)",
             "tests/kernels/test_device_helpers.py::test_div_rn_by_is_correctly_rounded"),
    Mutation("div_rn_by_no_correction", "fusion_compiler/kernels/_device.py",
             "        corrected = tl.fma(tl.fma(-q, d, xs), d_inv, q)",
             "        corrected = q",
             "tests/kernels/test_device_helpers.py::test_correction_branch_is_correctly_rounded_with_a_single_rounding_fma"),
    Mutation("div_rn_by_no_zero_inf_edge", "fusion_compiler/kernels/_device.py",
             '        corrected = tl.where((corrected == 0.0) | (tl.abs(q) == float("inf")), q, corrected)\n',
             "",
             "tests/kernels/test_device_helpers.py::test_correction_branch_is_correctly_rounded_with_a_single_rounding_fma"),
    Mutation("div_rn_by_no_tiny_x_scaling", "fusion_compiler/kernels/_device.py",
             "            xs = tl.where(tiny, x * 1.8446744073709552e19, x)  # 2**64",
             "            xs = x",
             "tests/kernels/test_device_helpers.py::test_correction_branch_is_correctly_rounded_with_a_single_rounding_fma"),
    # -- paged decode attention: float64 per row, inputs untouched, reasons named --
    Mutation("paged_attention_skips_first_position", "fusion_compiler/kernels/paged_decode_attention.py",
             "    keep = tl.load(valid_base + c * stride_cv, mask=in_c, other=0) != 0",
             "    keep = (tl.load(valid_base + c * stride_cv, mask=in_c, other=0) != 0) & (c > 0)",
             "tests/kernels/test_paged_decode_attention.py::test_kernel_matches_reference"),
    Mutation("paged_attention_zeroes_k_rows_it_read", "fusion_compiler/kernels/paged_decode_attention.py",
             "    x = mma(q, _cache_operand(kt, q.dtype)) * scale  # [G_PAD, BLOCK_S] fp32\n",
             "    x = mma(q, _cache_operand(kt, q.dtype)) * scale  # [G_PAD, BLOCK_S] fp32\n"
             "    tl.store(k_base + d[:, None] * stride_kd + slot[None, :] * stride_ks, tl.zeros_like(kt),\n"
             "             mask=(d < D)[:, None] & keep[None, :])\n",
             "tests/kernels/test_paged_decode_attention.py::test_kernel_matches_reference"),
    Mutation("paged_attention_unnamed_reason", "fusion_compiler/kernels/paged_decode_attention.py",
             '        return "an empty context (C = 0)"', '        return "unsupported"',
             "tests/kernels/test_paged_decode_attention.py::test_unsupported_arguments_are_named"),
    # -- GPU tier (issue 25; run with --device cuda on the H200, fla-core installed) --
    Mutation("gqa_writes_padding_slot", *_GQA_WRITES_PADDING_SLOT,
             "tests/gpu/test_gqa_prologue_gpu.py::test_prologue_matches_float64[minimax-300-paged-fp8]", device="cuda"),
    Mutation("gqa_writes_padding_slot_step_graph", *_GQA_WRITES_PADDING_SLOT,
             "tests/gpu/test_cudagraph_gpu.py::test_replays_equal_eager_over_many_steps", device="cuda"),
    Mutation("gqa_v_rows_drop_last_lane_step_graph", "fusion_compiler/kernels/gqa_prologue.py",
             "v = upcast(tl.load(V + t * stride_vt + h * stride_vh + d, mask=(h < kv_heads) & (d < D), other=0.0))",
             "v = upcast(tl.load(V + t * stride_vt + h * stride_vh + d, mask=(h < kv_heads) & (d < D - 1), other=0.0))",
             "tests/gpu/test_cudagraph_gpu.py::test_replays_equal_eager_over_many_steps", device="cuda"),
    Mutation("gqa_cache_row_one_late", "fusion_compiler/kernels/gqa_prologue.py",
             "    slot = tl.maximum(slot, 0)", "    slot = tl.maximum(slot, 0) + 1",
             "tests/gpu/test_gqa_prologue_gpu.py::test_prologue_matches_float64[qwen3.5-1-paged-fp8]", device="cuda"),
    Mutation("gdn_padding_rows_live", "fusion_compiler/kernels/gdn_decode.py",
             "    live = slot >= 0", "    live = slot >= -1",
             "tests/gpu/test_gdn_gpu.py::test_gdn_decode_kernel_matches_float64[qwen3.5-8-hf]", device="cuda"),
    Mutation("decode_attention_skips_last_tile", "fusion_compiler/kernels/decode_attention.py",
             "        for i in range(0, tiles_per_split):", "        for i in range(0, tiles_per_split - 1):",
             "tests/gpu/test_decode_attention_gpu.py::test_decode_attention_matches_float64[minimax-m2.5-1x4096-add_min]",
             device="cuda"),
    Mutation("router_gemm_drops_last_hidden_column", "fusion_compiler/kernels/moe_route_gemm.py",
             "mask=(ex[None, :] < E + HAS_GATE) & (k[:, None] < H), other=0.0,",
             "mask=(ex[None, :] < E + HAS_GATE) & (k[:, None] < H - 1), other=0.0,",
             "tests/gpu/test_moe_router_gpu.py::test_one_token_router_replays_in_a_graph[minimax-m2.5]", device="cuda"),
    Mutation("routing_group_score_top1_twice", "fusion_compiler/kernels/moe_route_select.py",
             "    return first, second", "    return first, first",
             "tests/gpu/test_moe_routing_gpu.py::test_router_gemm_and_routing_match_float64[deepseek-v3.2-64]",
             device="cuda"),
    Mutation("skinny_grid_floors_row_blocks", "fusion_compiler/kernels/skinny_gemm.py",
             "    return LaunchPlan((tokens * triton.cdiv(n, config.block_n),), config.block_n, block_k, config.warps)",
             "    return LaunchPlan((tokens * (n // config.block_n),), config.block_n, block_k, config.warps)",
             "tests/gpu/test_skinny_gemm_gpu.py::test_hypothesis_shapes_match_float64", device="cuda"),
    Mutation("step_graph_stale_copied_inputs", *_STALE_COPIED_INPUTS,
             "tests/gpu/test_backend_gpu.py::test_compiled_graph_with_fused_ops_captures_in_a_cuda_graph", device="cuda"),
    Mutation("step_graph_stale_copied_inputs_hf", *_STALE_COPIED_INPUTS,
             "tests/gpu/test_backend_gpu.py::test_tiny_hf_model_fuses_and_matches_eager_on_cuda[qwen3.5]", device="cuda"),
]

# Loaded into the pytest run on the copy: records which fusion_compiler the tests imported.
_PROBE = '''import os, sys

def pytest_sessionfinish(session, exitstatus):
    module = sys.modules.get("fusion_compiler")
    with open(os.environ["MUTATION_PROBE_OUT"], "w") as f:
        f.write(getattr(module, "__file__", None) or "(fusion_compiler not imported)")
'''


@dataclass
class Outcome:
    result: str
    detail: str = ""
    imported: str = ""
    seconds: float = 0.0


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ", 1)[1] if " - " in line else line
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_on_copy(mutation: Mutation | None, test: str, device: str, timeout: float, keep: bool) -> Outcome:
    """Run ``test`` against a copy of fusion_compiler, with ``mutation`` applied (None: baseline)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"mut_{mutation.name if mutation else 'baseline'}_"))
    try:
        shutil.copytree(REPO / "fusion_compiler", tmp / "fusion_compiler", ignore=shutil.ignore_patterns("__pycache__"))
        if mutation is not None:
            target = tmp / mutation.file
            text = target.read_text()
            count = text.count(mutation.old)
            if count != 1:
                return Outcome("BAD-ROW", f"old text occurs {count} times in {mutation.file}")
            target.write_text(text.replace(mutation.old, mutation.new))
        (tmp / "_mutation_probe.py").write_text(_PROBE)
        probe_out = tmp / "imported.txt"
        env = dict(os.environ, MUTATION_PROBE_OUT=str(probe_out), COLUMNS="1000",  # unclipped summary lines
                   PYTHONPATH=os.pathsep.join([str(tmp), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        if device == "cpu":
            env["TRITON_INTERPRET"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
        marks = ["-m", "gpu"] if device == "cuda" else []  # addopts deselect the gpu tier
        cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "_mutation_probe", *marks, test]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Outcome("ERROR", f"timed out after {timeout:.0f} s", seconds=time.perf_counter() - start)
        seconds = time.perf_counter() - start
        imported = probe_out.read_text() if probe_out.exists() else "(no record)"
        output = proc.stdout + proc.stderr
        if not imported.startswith(str(tmp)):
            return Outcome("NOT-ISOLATED", f"tests imported {imported}", imported, seconds)
        if proc.returncode == 0:
            return Outcome("UNEXPECTED-PASS" if mutation else "passes", "", imported, seconds)
        if proc.returncode == 1:
            return Outcome("PASS-as-expected-fail" if mutation else "BASELINE-FAILS", _first_failure(output), imported, seconds)
        return Outcome("ERROR", f"pytest exit {proc.returncode}: {_first_failure(output)}", imported, seconds)
    finally:
        if keep:
            print(f"  kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _cell(text: str, limit: int = 240) -> str:
    text = text.replace("\n", "⏎").replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _code(text: str) -> str:
    return f"`{_cell(text).strip()}`" if text.strip() else "*(deleted)*"


def write_markdown(path: Path, device: str, rows: list[tuple[Mutation, Outcome, Outcome | None]], argv: list[str]) -> None:
    p = common.provenance()
    lines = [
        f"# Mutation checks ({device})",
        "",
        f"`{' '.join(['python bench/mutations.py', *argv])}`, written by bench/mutations.py (its docstring says how a row runs).",
        "",
        f"commit {p['commit']} (dirty: {p['dirty']}), {p['device']}, torch {p['torch']}, "
        f"triton {p['triton']}, transformers {p['transformers']}"
        + (f"; differing paths: {', '.join(p['dirty_paths'])}" if p["dirty_paths"] else ""),
        "",
        "| name | test | fault (file: old → new) | baseline | result | failure on the mutant | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, outcome, base in rows:
        fault = f"{m.file.removeprefix('fusion_compiler/')}: {_code(m.old)} → {_code(m.new)}"
        lines.append(f"| {m.name} | `{m.test}` | {fault} | {base.result if base else '-'} | **{outcome.result}** "
                     f"| {_cell(outcome.detail, 160)} | {outcome.seconds:.0f} |")
    lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="run the rows for this device")
    parser.add_argument("--only", nargs="+", help="row names")
    parser.add_argument("--no-baseline", action="store_true", help="skip running each test on an unmodified copy")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    parser.add_argument("--keep", action="store_true", help="keep the temp copies")
    parser.add_argument("--jobs", type=int, default=1, help="pytest runs at once")
    parser.add_argument("--out", help="markdown path (default bench/results/mutations_<device>.md)")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTATIONS]
    assert len(set(names)) == len(names), "row names must be unique"
    chosen = [m for m in MUTATIONS if m.device == args.device and (not args.only or m.name in args.only)]
    unknown = set(args.only or ()) - set(names)
    if unknown:
        parser.error(f"unknown rows: {sorted(unknown)}")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"mutations_{args.device}.md"
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # each run is its own pytest process
        tests = [] if args.no_baseline else list(dict.fromkeys(m.test for m in chosen))
        baselines = {t: pool.submit(run_on_copy, None, t, args.device, args.timeout, args.keep) for t in tests}
        faults = [pool.submit(run_on_copy, m, m.test, args.device, args.timeout, args.keep) for m in chosen]
        rows = []
        for m, future in zip(chosen, faults):  # in row order; the file is rewritten after every row
            outcome, base = future.result(), baselines[m.test].result() if m.test in baselines else None
            if base is not None and base.result != "passes" and outcome.result == "PASS-as-expected-fail":
                outcome.result = "BASELINE-FAILS"
            print(f"{m.name:42} {outcome.result:22} {outcome.seconds:6.1f} s  {_cell(outcome.detail, 120)}", flush=True)
            rows.append((m, outcome, base))
            write_markdown(out, args.device, rows, argv)  # a call cut short keeps what ran
    print(f"wrote {out}")
    return 0 if all(o.result == "PASS-as-expected-fail" for _, o, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
