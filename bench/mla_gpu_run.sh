#!/usr/bin/env bash
# One device call for issue 3: kernels vs reference on CUDA (NaN included), Triton's FP8 cast
# against torch's, the region bench. Everything lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 60 python3 bench/fp8_cast_check.py 2>&1 | tee "$OUT/fp8_cast_check.log"
timeout 150 python3 -m pytest -q -m "gpu or not gpu" tests/kernels/test_mla_kv_prologue.py tests/kernels/test_mla_q_prologue.py tests/ops -p no:cacheprovider 2>&1 | tail -n 8 | tee "$OUT/mla_kernels_gpu.log"
timeout 330 python3 bench/mla_prologue.py --out "$OUT/mla_prologue_h200.json" > "$OUT/mla_bench_full.log" 2>&1
grep -v "^\s" "$OUT/mla_bench_full.log" | grep "T=\|ours vs\|Error" | tail -n 40
