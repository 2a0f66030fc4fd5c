"""The shipped launches of the GDN and routing kernels at the models' widths compile for sm_90
(the H200) on this CPU machine: ``bench/sass_offline.py check``, in a subprocess because the CPU tier runs Triton in its
interpreter (which executes a kernel's Python and so never compiles the branches a test does not
take; bench/NOTES.md, session 15)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "sass_offline.py")


def test_shipped_launches_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, SCRIPT, "check"], env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert result.returncode == 0, "\n".join(lines) + result.stderr[-2000:]
    assert len(lines) == 19 and all(line.startswith("ok") for line in lines), result.stdout
