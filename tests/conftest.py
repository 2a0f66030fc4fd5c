import os

import torch

# CPU tier: run Triton kernels through the interpreter.  Must happen before anything imports
# fusion_compiler.kernels (triton.jit picks interpreter vs compiler at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # one intra-op thread a worker: `make test` runs one worker a core
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

try:  # Hypothesis's profile (ci or nightly; tests/hypothesis_profile.py), before any test module imports
    import hypothesis_profile  # noqa: F401
except ImportError:  # without hypothesis its tests skip (pytest.importorskip)
    pass


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from a clean Dynamo cache: a recompile of a shared frame would
    make Dynamo unspecialise float attributes (eps) and change what the patterns see."""
    torch._dynamo.reset()
    yield
