"""The shipped launches of the GDN, routing and GQA prologue kernels at the models' widths compile
for sm_90 (the H200) on this CPU machine: ``bench/sass_offline.py check``, in a subprocess because
the CPU tier runs Triton in its interpreter (which executes a kernel's Python and so never
compiles the branches a test does not take; bench/NOTES.md, session 15). The check also fails a
GQA prologue launch with HF's rounded RoPE whose PTX fuses a product into a half-precision FMA:
the interpreter rounds every product, the compiled code need not (kernels/gqa_prologue.py
``_rotated``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "sass_offline.py")
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], env=ENV, capture_output=True, text=True, timeout=900)


def test_shipped_launches_compile_for_sm90():
    result = _run("check")
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert result.returncode == 0, "\n".join(lines) + result.stderr[-2000:]
    assert len(lines) == 27 and all(line.startswith("ok") for line in lines), result.stdout


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
