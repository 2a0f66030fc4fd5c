#!/usr/bin/env bash
# One device call: install, GPU tier tests, the CPU-tier pattern tests on the H200's torch,
# and the kernel bench. Everything lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -m gpu tests/kernels tests/gpu -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/gpu_tier.log"
python3 bench/kernels.py --out "$OUT/kernels_h200.json" 2>&1 | tee "$OUT/bench.log"
timeout 240 python3 -m pytest -q -x -p no:faulthandler -p no:cacheprovider tests/patterns tests/passes 2>&1 | tail -n 30 | tee "$OUT/cpu_tier_on_gpu_torch.log"
