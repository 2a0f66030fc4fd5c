#!/usr/bin/env bash
# One device call for issue 3: the kernels against their references at real widths and
# layouts, the region bench, and `fusion-compiler inspect` on HF DeepSeek V3.2 at real widths.
OUT=${OUT:-/tmp/out}
source bench/device_setup.sh "$OUT"
timeout 120 python3 bench/diagnostics/mla_kernel_check.py > "$OUT/mla_kernel_check.log" 2>&1; grep -c "bit-equal" "$OUT/mla_kernel_check.log"; grep "q op" "$OUT/mla_kernel_check.log"
timeout 300 python3 bench/mla_prologue.py --out "$OUT/mla_prologue_h200.json" > "$OUT/mla_bench_full.log" 2>&1
grep "^T=\|ours kernels" "$OUT/mla_bench_full.log" | cut -c1-420 | tail -n 20
timeout 300 fusion-compiler inspect deepseek-v3.2 --device cuda --layers 2 --json "$OUT/inspect_deepseek_real_cuda.json" > "$OUT/inspect.log" 2>&1; tail -n 25 "$OUT/inspect.log"
