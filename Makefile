# Two commands, each does its own set-up on a fresh machine:
#   make demo   - `fusion-compiler inspect` on all three models, tiny, on CPU
#   make test   - the CPU test tier (what CI runs)
# The environment (.venv) is created if missing, pinned by constraints.txt.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-test clean

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
	$(PY) -m pytest -q

# On a CUDA machine with the package installed (e.g. the H200): the GPU tier.
gpu-test:
	$(PYTHON) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) demo-results .pytest_cache .hypothesis
