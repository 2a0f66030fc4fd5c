#!/usr/bin/env bash
# One device call for issue 3: the kernels against their references at real widths and
# layouts, then the region bench. Everything lands in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 120 python3 bench/mla_kernel_check.py 2>&1 | tee "$OUT/mla_kernel_check.log" | grep -v "bit-equal" | tail -n 30; grep -c "bit-equal" "$OUT/mla_kernel_check.log"
timeout 400 python3 bench/mla_prologue.py --out "$OUT/mla_prologue_h200.json" > "$OUT/mla_bench_full.log" 2>&1
grep "^T=\|ours vs\|ours kernels" "$OUT/mla_bench_full.log" | cut -c1-700 | tail -n 30
