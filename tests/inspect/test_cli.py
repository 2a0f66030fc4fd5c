"""`fusion-compiler inspect` v1 on CPU: the JSON contract, what stderr holds, a dense model
outside our three, and bad arguments."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import subprocess
import sys
import warnings

import pytest
import torch

from fusion_compiler.cli import main

MODES = ("eager", "inductor", "fusion_compiler")


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    """One `inspect minimax-m2.5` run, recording the stacks it built and the graphs each of its
    compiling backends was handed (in order)."""
    import fusion_compiler.inspect.run as run

    out = tmp_path_factory.mktemp("inspect") / "r.json"
    png = out.with_suffix(".png")
    stderr = io.StringIO()  # what a user's terminal would show: the CLI writes to sys.stderr
    work = {"built": [], "graphs": []}
    build_stack, counting_backend = run.build_stack, run._counting_backend

    def build(adapter, size, kinds, *args):
        work["built"].append((size, len(kinds)))
        return build_stack(adapter, size, kinds, *args)

    def counting(inner):
        backend, graphs, seconds = counting_backend(inner)
        work["graphs"].append(graphs)  # filled in as Dynamo hands the backend its graphs
        return backend, graphs, seconds

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setattr(run, "build_stack", build)
        patch.setattr(run, "_counting_backend", counting)
        assert main(["inspect", "minimax-m2.5", "--json", str(out), "--plot", str(png)]) == 0
    work["graphs"] = [graphs[0] for graphs in work["graphs"]]
    return json.loads(out.read_text()), work, png, stderr.getvalue()


def test_inspect_minimax_builds_each_stack_once_and_compiles_each_mode_once(minimax):
    """The work that bounds inspect's time (this test once asserted under three minutes): the
    tiny stacks, 2 layers and 1, each built once; each compiling mode (stock Inductor, ours)
    compiles each stack once and the full stack once more for the compile timing: six compiles
    of one graph each. A recompile, a graph break or a stack built per mode adds to these."""
    _, work, png, _ = minimax
    assert work["built"] == [("tiny", 2), ("tiny", 1)]
    assert work["graphs"] == [1] * 6
    assert png.stat().st_size > 10_000


PROGRESS = re.compile(r"minimax-m2\.5 \[(\d)/7\] [12] layers?, [a-z_ ,]+ \.\.\. \d+\.\d s(, \d+ kernels)?")
HIDDEN = re.compile(r"\d+ library warnings? hidden; -v shows them")


def test_default_stderr_is_one_progress_line_per_step(minimax):
    """Dynamo's `lru_cache` warnings on transformers' MoE code (one per trace) and the
    compiler's per-compile log are not the user's: without -v, stderr holds the 7 steps
    (2 stacks x 3 modes, the compile timing), each with its time, and at most a count of the
    hidden warnings."""
    lines = minimax[3].splitlines()
    steps = [int(m.group(1)) for line in lines if (m := PROGRESS.fullmatch(line))]
    assert steps == list(range(1, 8)), lines
    assert all(PROGRESS.fullmatch(line) or HIDDEN.fullmatch(line) for line in lines), lines


def test_json_holds_kernels_matches_and_misses_per_layer(minimax):
    result, _, _, _ = minimax
    assert result["device"] == "cpu" and result["layers"] == 2
    assert [row["layer"] for row in result["per_layer"]] == [0, 1]
    for row in result["per_layer"]:
        for mode in MODES:
            kernels = row["kernels"][mode]
            assert kernels["device"] == "cpu"
            assert kernels["count_source"] in ("aten_ops_dispatched", "inductor_wrapper_launches")
            assert kernels["count"] > 0
        # The per-layer names add up to the per-layer count (what is left to fuse, by kernel).
        for mode in ("inductor", "fusion_compiler"):
            assert sum(row["kernel_names"][mode].values()) == row["kernels"][mode]["count"]
        # MiniMax layer: input and post-attention norms; the full-width q and k norms are part
        # of the attention prologue.
        assert row["matches"]["add_rms_norm"] == {"found": 2, "expected": 2}
        assert row["matches"]["gqa_prologue"] == {"found": 1, "expected": 1}
        assert row["misses"] == []
    assert result["outside_layers"]["matches"]["add_rms_norm"] == {"found": 1, "expected": 1}
    assert result["no_family"] == {}
    assert result["graphs"]["fusion_compiler"] == 1
    assert result["relative_error_vs_eager"]["fusion_compiler"] < 2e-2
    # An honest run: the numerics gate (tests/inspect/test_gate.py) does not fire, and does no more work.
    numerics = result["numerics_gate"]
    assert not numerics["fired"] and numerics["verdict"].startswith("pass: ") and numerics["bisect"] == []
    assert result["cuda_graphs"] is None  # the step-graph check runs on CUDA only
    assert result["graph_breaks"] == {"inductor": {}, "fusion_compiler": {}}
    seconds = result["compile_seconds"]  # measured CPU, tiny: 3.87 s stock, 3.12 s ours, tracing 4.7 s
    assert seconds["inductor"] > 0 and seconds["fusion_compiler"] > 0 and seconds["pattern_tracing"] > 0
    assert seconds["pass_overhead_vs_inductor"] == seconds["fusion_compiler"] / seconds["inductor"] - 1


def test_inspect_dense_llama_from_hf_config(tmp_path, capsys):
    """Llama's attention has no q/k norms and HF's rotate_half RoPE: the no-norm gqa_prologue
    takes it, one site per layer, and no attention is left without a family."""
    config = {
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
    }
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "r.json"
    assert main(["inspect", "--hf-config", str(path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for row in result["per_layer"]:
        assert row["matches"]["add_rms_norm"] == {"found": 2, "expected": 2}, row
        assert row["matches"]["gqa_prologue"] == {"found": 1, "expected": 1}, row
    assert result["outside_layers"]["matches"]["add_rms_norm"] == {"found": 1, "expected": 1}
    assert not result["no_family"]
    assert "no family applies" not in capsys.readouterr().out


BAD_ARGUMENTS = [
    (["inspect"], "exactly one of MODEL or --hf-config"),
    (["inspect", "minimax-m2.5", "--hf-config", "x.json"], "exactly one of MODEL or --hf-config"),
    (["inspect", "--hf-config", "/no/such/file.json"], "not found"),
    (["inspect", "minimax-m2.5", "--layers", "0"], "--layers must be >= 1"),
    (["inspect", "minimax-m2.5", "--batch", "0"], "--batch must be >= 1"),
    (["inspect", "llama-7b"], "invalid choice"),
    (["inspect", "minimax-m2.5", "--size", "huge"], "invalid choice"),
    (["inspect", "minimax-m2.5", "--context", "-1"], "--context must be >= 1"),
    (["inspect", "minimax-m2.5", "--context", "0"], "--context must be >= 1"),
    (["inspect", "minimax-m2.5", "--json", "/no/such/dir/r.json"], "directory /no/such/dir does not exist"),
    (["inspect", "minimax-m2.5", "--plot", "/no/such/dir/r.png"], "directory /no/such/dir does not exist"),
    (["inspect", "minimax-m2.5", "--json", "."], "--json .: is a directory"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS)
def test_bad_arguments_exit_2_before_the_run(argv, message, capsys, monkeypatch):
    # In this process: a fresh interpreter costs ~5 s (torch's import) per case; the one below
    # checks that `python -m fusion_compiler.cli` turns main's status into the exit status.
    import fusion_compiler.inspect.run

    def run(*args, **kwargs):
        raise AssertionError("a bad argument must fail before the run, which takes minutes")

    monkeypatch.setattr(fusion_compiler.inspect.run, "inspect_model", run)
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own errors exit 2 from parse_args
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_module_entry_point_exits_with_mains_status():
    argv, message = BAD_ARGUMENTS[3]
    proc = subprocess.run(
        [sys.executable, "-m", "fusion_compiler.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert message in proc.stderr


def test_stack_pairs_keep_every_layer_kind_runnable():
    """Dropping Qwen3.5's only full-attention layer would leave a cache HF cannot run, so
    that kind is counted by adding a layer instead."""
    from fusion_compiler.inspect.run import stack_pairs

    lin, full = "linear_attention", "full_attention"
    pairs = stack_pairs([lin, lin, lin, full])
    assert pairs[lin] == ((lin, lin, lin, full), (lin, lin, full))
    assert pairs[full] == ((lin, lin, lin, full, full), (lin, lin, lin, full))
    assert stack_pairs(["moe", "moe"]) == {"moe": (("moe", "moe"), ("moe",))}


def test_hf_config_with_layer_types_builds_every_stack(tmp_path):
    """A hybrid model we have no adapter for (Qwen3-Next): its layer kinds come from the file's
    ``layer_types``, each stack inspect builds gets a list of its own depth (transformers
    rejects a mismatch), and the expected sites come from the module tree: gdn per
    linear-attention layer, gqa_prologue for the partial-rotary q/k-norm attention.
    (tests/patterns/test_gdn.py compiles this model and asserts every site fuses.)"""
    from fusion_compiler.inspect.run import build_stack, stack_pairs
    from fusion_compiler.model_adapters import adapter_from_hf_config
    from model_configs import QWEN3_NEXT

    path = tmp_path / "qwen3_next.json"
    path.write_text(json.dumps(QWEN3_NEXT))
    adapter = adapter_from_hf_config(path)
    kinds = adapter.layer_kinds(adapter.hf_config("tiny"))
    assert kinds == QWEN3_NEXT["layer_types"]
    for larger, smaller in stack_pairs(kinds).values():
        for stack in (larger, smaller):
            assert tuple(adapter.layer_kinds(build_stack(adapter, "tiny", stack, "cpu", torch.bfloat16).config)) == stack
    model = build_stack(adapter, "tiny", tuple(kinds), "cpu", torch.bfloat16)
    expected = adapter.expected_sites(model)
    assert expected["gdn"] == {f"model.layers.{i}.linear_attn": 1 for i in range(3)}
    assert expected["gqa_prologue"] == {"model.layers.3.self_attn": 1}
    assert not {m for m in expected["add_rms_norm"] if m.endswith(("linear_attn.norm", "q_norm", "k_norm"))}


@pytest.mark.nightly  # 46 s on 2 CPU cores; the explain chain itself: tests/patterns/test_dsa_topk_mask.py
def test_explain_names_the_diverging_node_of_a_broken_variant(tmp_path, capsys):
    """A DeepSeek V3.2 config that keeps 1 group of 4 (topk_group 1): Inductor then rewrites the
    group mask into another graph (model_adapters/deepseek_v32), so routing does not match; every
    other site fuses as in our own adapter's runs.
    ``--explain`` prints each miss's FX nodes from the node where matching diverged to the
    site's anchor, and the JSON carries the same chain. Each miss is printed once, in the
    table: inspect compiles every stack several times, and each compile logs its misses."""
    from fusion_compiler.model_adapters.deepseek_v32 import TINY_CONFIG

    config = {**TINY_CONFIG, "model_type": "deepseek_v32", "num_hidden_layers": 2, "topk_group": 1}
    path, out = tmp_path / "broken.json", tmp_path / "r.json"
    path.write_text(json.dumps(config))
    assert main(["inspect", "--hf-config", str(path), "--explain", "--json", str(out)]) == 0
    printed, err = capsys.readouterr()
    misses = [m for row in json.loads(out.read_text())["per_layer"] for m in row["misses"]]
    assert misses
    for miss in misses:
        # Each miss said once: in the table, never in the compiler's per-compile log on stderr.
        line = f"miss {miss['family']} at {miss['module']} ({miss['node']})"
        assert printed.count(line) == 1 and miss["module"] not in err, err
    for row in json.loads(out.read_text())["per_layer"]:
        assert row["matches"]["moe_routing"] == {"found": 0, "expected": 1}, row
        # A known model_type keeps its adapter's site rules: kv_a_layernorm is the MLA prologue's.
        assert row["matches"]["mla_prologue"] == {"found": 4, "expected": 4}, row
        assert row["matches"]["add_rms_norm"] == {"found": 3, "expected": 3}, row
        (miss,) = [m for m in row["misses"] if m["family"] == "moe_routing"]
        diverged = [line for line in miss["chain"] if line.endswith("<- diverged here")]
        assert len(diverged) == 1 and diverged[0].startswith(f"{miss['node']} = "), miss
        assert miss["node"] in miss["reason"] and len(miss["chain"]) > 1
        assert diverged[0] in printed and f"miss moe_routing at {miss['module']} ({miss['node']})" in printed


def _emit_what_a_compile_emits():
    logging.getLogger("fusion_compiler").warning("fusion_compiler: expected 1 moe_routing at model.layers.0.mlp, fused 0")
    logging.getLogger("fusion_compiler").info("graph 0: 3 sites fused")
    logging.getLogger("torch._dynamo.variables.functions").warning("a Dynamo log warning")
    logging.getLogger("transformers.modeling_utils").warning("a transformers log warning")
    for _ in range(2):  # Dynamo warns again after each reset
        warnings.warn("Dynamo detected a call to a `functools.lru_cache`-wrapped function", UserWarning)
    logging.getLogger("torch._inductor").error("an Inductor error")


def test_library_warnings_are_counted_by_default_and_shown_once_under_verbose():
    from fusion_compiler.inspect.terminal import Terminal

    loggers = [logging.getLogger(name) for name in ("", "fusion_compiler", "torch._dynamo", "transformers")]
    before = [(logger.handlers[:], logger.propagate, logger.level) for logger in loggers]
    quiet, verbose = io.StringIO(), io.StringIO()
    for stream, is_verbose in ((quiet, False), (verbose, True)):
        terminal = Terminal(is_verbose, stream)
        with terminal.capture():
            with terminal.progress("model [1/1] 2 layers, inductor") as notes:
                _emit_what_a_compile_emits()
                notes.append("45 kernels")
    lines = quiet.getvalue().splitlines()
    assert lines[:2] == ["model [1/1] 2 layers, inductor ...", "torch._inductor: an Inductor error"]  # errors: always
    assert re.fullmatch(r"model \[1/1\] 2 layers, inductor: \d+\.\d s, 45 kernels", lines[2])
    assert lines[3:] == ["3 library warnings hidden; -v shows them"]
    shown = verbose.getvalue()
    assert shown.count("lru_cache") == 1
    # The message names its package already: the log line does not name it twice.
    assert "fusion_compiler: expected 1 moe_routing" in shown and "fusion_compiler: fusion_compiler" not in shown
    for line in ("fusion_compiler: graph 0: 3 sites fused", "torch._dynamo.variables.functions: a Dynamo log warning",
                 "transformers.modeling_utils: a transformers log warning"):
        assert line in shown.splitlines()
    assert [(logger.handlers, logger.propagate, logger.level) for logger in loggers] == before


class _Breaking(torch.nn.Module):
    """A step with a host-side call in the middle: Dynamo breaks the graph there."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        print("host work inside the step")
        return self.proj(h.relu())


class _Step:
    def __init__(self):
        self.x = torch.randn(2, 16)

    def run(self, fn):
        with torch.no_grad():
            return fn(self.x)

    def reset(self):
        pass


def test_a_graph_break_is_counted_with_its_reason():
    from fusion_compiler.inspect.run import run_mode

    result = run_mode(_Breaking().eval(), _Step(), "fusion_compiler", "cpu", None)
    assert result.graphs == 2
    assert any("print" in reason for reason in result.graph_breaks), result.graph_breaks
