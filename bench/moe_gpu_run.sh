#!/usr/bin/env bash
# One device call for issue 4: the routing kernels' tests on CUDA (the gate column included),
# the router at real widths (correctness, one launch vs two per token count -> the split, launch
# shape, cuBLAS, routing warps), the routing bench, and inspect on HF DeepSeek V3.2 at real
# widths. Results in $OUT/moe_results.tgz (the device returns at most 8 files). About 5 min.
# `bash bench/moe_gpu_run.sh ab`: only the routing-tail A/B (every variant checked, then timed
# at 1 / 2 / 16 tokens, with the router-weight copy floor), about 2 min.
# `bash bench/moe_gpu_run.sh tail`: issue 4's 2x-the-copy bar: the one-token router's CUDA-graph
# replay tests, the routing bench through torch.compile, and the one-token launch (shipped, -15's
# shape, the counters, the GEMM alone) timed rotated-cold beside the copy; about 4 min.
# `VARIANTS="..." bash bench/moe_gpu_run.sh variants`: one-token GEMM variants of
# bench/moe_router_check.py beside the copy, ~1 min. Run `python bench/sass_offline.py check` on
# CPU first.
OUT=${OUT:-/tmp/out}
R=$OUT/moe_results
source bench/device_setup.sh "$R"
if [ "${1:-}" = ab ]; then
  timeout 240 python3 bench/moe_router_check.py --parts ab --out "$R/moe_router_ab_h200.json" > "$R/moe_router_ab.log" 2>&1; echo "rc $?"
  grep -v "^ *$" "$R/moe_router_ab.log" | cut -c1-300 | tail -n 80
  tar -czf "$OUT/moe_results.tgz" -C "$OUT" moe_results && rm -rf "$R"
  exit 0
fi
if [ "${1:-}" = variants ]; then
  timeout 400 python3 bench/moe_router_check.py --parts gemm --gemm-variants ${VARIANTS:-shipped route15 diag_gemm} \
    --gemm-tokens 1 --out "$R/moe_router_tail_h200.json" > "$R/moe_router_tail.log" 2>&1; echo "rc $?"
  grep "copy\|^  [a-z]" "$R/moe_router_tail.log" | grep -v "{" | cut -c1-130
  tar -czf "$OUT/moe_results.tgz" -C "$OUT" moe_results && rm -rf "$R"
  exit 0
fi
if [ "${1:-}" = tail ]; then
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_moe_router_gpu.py 2>&1 | tail -n 8 | tee "$R/moe_router_gpu_tests.log"
  timeout 200 python3 bench/moe_routing.py --out "$R/moe_routing_h200.json" > "$R/moe_routing.log" 2>&1; grep -v Warning "$R/moe_routing.log" | cut -c1-400 | tail -n 14
  timeout 150 python3 bench/moe_router_check.py --parts gemm --gemm-variants shipped route15 counters diag_gemm \
    --gemm-tokens 1 --out "$R/moe_router_tail_h200.json" > "$R/moe_router_tail.log" 2>&1; echo "rc $?"
  grep "copy\|^  [a-z]" "$R/moe_router_tail.log" | grep -v "{" | cut -c1-130
  tar -czf "$OUT/moe_results.tgz" -C "$OUT" moe_results && rm -rf "$R"
  exit 0
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_route.py 2>&1 | tail -n 15 | tee "$R/moe_kernel_tests_cuda.log"
timeout 150 python3 bench/moe_router_check.py --out "$R/moe_router_check_h200.json" > "$R/moe_router_check.log" 2>&1; grep -v "^ *$" "$R/moe_router_check.log" | cut -c1-300 | tail -n 60
timeout 200 python3 bench/moe_routing.py --out "$R/moe_routing_h200.json" > "$R/moe_routing.log" 2>&1; grep -v Warning "$R/moe_routing.log" | cut -c1-400 | tail -n 30
timeout 120 fusion-compiler inspect deepseek-v3.2 --device cuda --layers 2 --json "$R/inspect_deepseek_real_cuda.json" > "$R/inspect.log" 2>&1; tail -n 14 "$R/inspect.log"
tar -czf "$OUT/moe_results.tgz" -C "$OUT" moe_results && rm -rf "$R"
