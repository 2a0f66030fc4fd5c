# Commands, each does its own set-up on a fresh machine:
#   make demo         - `fusion-compiler inspect` on all three models, tiny, on CPU
#   make test         - the CPU test tier (what CI runs, then test-vllm and test-torch-2.11)
#   make test-nightly - every CPU-runnable test: the CPU tier plus `nightly` (knob variants,
#                       extra parametrizations, long sweeps, hypothesis's full example counts)
# The environment (.venv) is created if missing, pinned by constraints.txt.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers for the CPU tiers (0: in one process); each file's tests stay on one worker,
# so its module-scoped fixtures are built once. On 2 cores the CPU tier took 8.5 min in one process, 6 in two.
WORKERS ?= 2

.PHONY: demo test test-nightly test-vllm test-torch-2.11 gpu-test clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch triton
	$(PY) -m pip install -q -c constraints.txt -e '.[test,hf,bench]'
	touch $(STAMP)

demo: $(STAMP)
	mkdir -p demo-results
	for model in deepseek-v3.2 minimax-m2.5 qwen3.5; do \
		$(VENV)/bin/fusion-compiler inspect $$model --json demo-results/$$model.json --plot demo-results/$$model.png || exit 1; \
	done

test: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile

# -m here replaces addopts' (which deselects nightly); hypothesis's nightly profile: tests/hypothesis_profile.py.
test-nightly: $(STAMP)
	FUSION_HYPOTHESIS_PROFILE=nightly $(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m 'not gpu and not vllm'

# The vLLM tier: vllm 0.33.0 (which pins torch 2.14.0) in its own venv outside the clone
# (.ci/vllm_env: about 9.5 GB, installed once, timed, reused; an install that fails fails the tier).
# bin/pytest, not python -m pytest: the clone's root on sys.path would let a stale
# fusion_compiler.egg-info there (written by .venv's editable install) hide our vLLM entry point.
test-vllm:
	venv="$$(.ci/vllm_env)" && "$$venv/bin/pytest" -q -m vllm tests/integrations

# The oldest supported torch, 2.11.0 (the H200's), in its own venv outside the clone (.ci/torch_env:
# about 5 GB, installed once, reused): the tests that compile models and match their graphs, whose
# spelling moves between torch versions (GLM-4.5's routing mask did, 2026-12-05).
TORCH_FLOOR_TESTS ?= tests/patterns tests/passes tests/model_adapters tests/inspect tests/test_compile_routes.py
test-torch-2.11:
	venv="$$(.ci/torch_env)" && "$$venv/bin/pytest" -q -n $(WORKERS) --dist loadfile $(TORCH_FLOOR_TESTS)

# On a CUDA machine with the package installed (e.g. the H200): the GPU tier.
gpu-test:
	$(PYTHON) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) demo-results .pytest_cache .hypothesis
