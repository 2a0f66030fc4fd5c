#!/usr/bin/env bash
# One device call for issue 3: kernels vs reference on CUDA (NaN included), the region bench,
# the add+RMSNorm launch sweep (issue 2's last shape). Everything lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/kernels/test_mla_kv_prologue.py tests/kernels/test_mla_q_prologue.py tests/ops -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/mla_kernels_gpu.log"
timeout 300 python3 bench/mla_prologue.py --out "$OUT/mla_prologue_h200.json" 2>&1 | tail -n 40 | tee "$OUT/mla_bench.log"
timeout 90 python3 bench/kernel_variants.py --out "$OUT/kernel_variants_h200_rms3.json" 2>&1 | tail -n 30 | tee "$OUT/variants.log"
