"""The shipped launches of our Triton kernels at the models' widths compile for sm_90 (the H200) on
this CPU machine, and their SASS counts match ``bench/results/sass_offline_snapshot.json``:
``bench/sass_offline.py check --against``, in a subprocess because the CPU tier runs Triton in its
interpreter (which executes a kernel's Python and so never compiles the branches a test does not
take; bench/NOTES.md, session 15). The check also fails a GQA prologue launch with HF's rounded
RoPE whose PTX fuses a product into a half-precision FMA: the interpreter rounds every product,
the compiled code need not (kernels/gqa_prologue.py ``_rotated``).

The snapshot is the proof that a refactor of the kernels' launch code (issue 26) changed no kernel:
a change to a kernel or its launch config must rewrite it (``check --write``), in its own commit.
A new Triton changes the counts too: rewrite it with the upgrade."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCRIPT = os.path.join(ROOT, "bench", "sass_offline.py")
SNAPSHOT = os.path.join(ROOT, "bench", "results", "sass_offline_snapshot.json")
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
# The CI tier's launches (34 s): the GDN, routing and GQA prologue ones (the check before issue 26)
# and one small kernel of the rest; the nightly test compiles all 84 (about a minute).
CI_LAUNCHES = r"^(gdn |router |route from logits |gqa (minimax|qwen|glm4)|gqa variance minimax-m2.5 tp=8 )"
SMALL = r"^gqa variance minimax-m2.5 tp=8 "


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], env=ENV, capture_output=True, text=True, timeout=900)


def _check_against(snapshot: str, only: str | None) -> list[str]:
    result = _run("check", "--against", snapshot, *(("--only", only) if only else ()))
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok", "FAIL", "missing", "new", "changed"))]
    assert result.returncode == 0, "\n".join(line for line in lines if not line.startswith("ok")) + result.stderr[-2000:]
    return lines


def test_ci_launches_compile_for_sm90_as_snapshotted():
    lines = _check_against(SNAPSHOT, CI_LAUNCHES)
    assert len(lines) == 37 and all(line.startswith("ok") for line in lines), lines


@pytest.mark.nightly
def test_every_shipped_launch_compiles_for_sm90_as_snapshotted():
    with open(SNAPSHOT) as f:
        launches = json.load(f)["launches"]
    lines = _check_against(SNAPSHOT, None)
    assert len(lines) == len(launches) == 84 and all(line.startswith("ok") for line in lines), lines


def test_check_against_reports_a_changed_count(tmp_path):
    """A snapshot that differs in one count fails the comparison and names the launch and count."""
    with open(SNAPSHOT) as f:
        snapshot = json.load(f)
    label = next(label for label in snapshot["launches"] if re.search(SMALL, label))
    snapshot["launches"][label]["instructions"] += 1
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(snapshot))
    result = _run("check", "--against", str(path), "--only", SMALL)
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert re.search(rf"changed  {re.escape(label)}: instructions \d+ -> \d+", result.stdout), result.stdout


# Qwen3.5 nightly (14 s): the CI tier keeps MiniMax's here, and `check` above fails any ROUND_ROPE
# launch of either model whose PTX has a half-precision FMA.
@pytest.mark.parametrize("model", ["minimax-m2.5", pytest.param("qwen3.5", marks=pytest.mark.nightly)])
def test_gqa_hf_rope_products_stay_rounded(model):
    """HF's RoPE launch compiles without half-precision FMAs; with FMA contraction forced on the
    same launch has them (LLVM narrows each rounded fp32 product to a bf16 multiply, which the
    backend then fuses into the sum), so the count is what tells the two apart."""

    def fmas(*extra):
        result = _run("gqa", "--model", model, "--hf", *extra)
        assert result.returncode == 0, result.stderr[-2000:]
        return int(re.search(r"half-precision FMAs in the PTX: (\d+)", result.stdout)[1])

    assert fmas() == 0
    assert fmas("--fp-fusion", "on") > 0
