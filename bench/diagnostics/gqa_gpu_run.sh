#!/usr/bin/env bash
# One device call for issue 5 (and issue 6's kernel): the GQA prologue and GDN decode kernel /
# op tests on CUDA, the GQA prologue region bench at real widths, and inspect on HF MiniMax-M2.5
# at real widths. Results in $OUT/gqa_results.tgz (the device returns at most 8 files). ~8 min.
OUT=${OUT:-/tmp/out}
R=$OUT/gqa_results
source bench/device_setup.sh "$R"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gqa_prologue.py tests/ops/test_gqa_prologue.py \
  tests/kernels/test_gdn_decode.py tests/ops/test_gdn_decode.py 2>&1 | tail -n 25 | tee "$R/kernel_tests_cuda.log"
timeout 300 python3 bench/gqa_prologue.py --out "$R/gqa_prologue_h200.json" > "$R/gqa_prologue.log" 2>&1; grep -v -i warn "$R/gqa_prologue.log" | cut -c1-600 | tail -n 40
timeout 100 fusion-compiler inspect minimax-m2.5 --device cuda --layers 2 --json "$R/inspect_minimax_real_cuda.json" > "$R/inspect.log" 2>&1; tail -n 12 "$R/inspect.log"
tar -czf "$OUT/gqa_results.tgz" -C "$OUT" gqa_results && rm -rf "$R"
