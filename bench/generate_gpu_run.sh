#!/usr/bin/env bash
# Device calls for issue 24 (the user's path), one phase a call (each call is capped at 10 min):
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/generate_gpu_run.sh tests
#       the GPU tier (tests/gpu: generate() on tiny models, real-vocabulary lm_heads, step graphs)
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/generate_gpu_run.sh checks [END_SECONDS MODEL]
#       the GPU tier, then the kernels changed for issue 24 on CUDA; beside them, on the CPU cores,
#       the CPU-tier tests that read torch's internals (decline, dtypes, routes) under torch 2.11;
#       then, if given, bench/generate.py for MODEL until END_SECONDS after the call's start
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/generate_gpu_run.sh bench SECONDS MODEL [ARGS...]
#       bench/generate.py at real widths into $OUT/generate_h200_MODEL.json (written after every case)
# The device gets the tree without .git: the caller passes the commit and the dirty flag.
OUT=${OUT:-/tmp/out}
R=$OUT
source bench/device_setup.sh "$R/setup"
phase=${1:-tests}; shift || true
run_tests() {  # NAME SECONDS PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? $(tail -n 1 "$R/$name.log")"
  grep -h -E "^FAILED|^E  " "$R/$name.log" | cut -c1-300 | head -n 30
}
if [ "$phase" = checks ]; then
  run_tests torch211_cpu_checks 420 tests/patterns/test_registry.py tests/patterns/test_hf_dtypes.py \
    tests/test_compile_routes.py tests/patterns/test_gqa_prologue_hf_paths.py \
    tests/patterns/test_mla_prologue.py::test_hf_latent_not_a_multiple_of_128_compiles_with_the_kv_site_a_reported_miss \
    > "$R/cpu_checks.summary" 2>&1 &
  run_tests gpu_tier 300 -m gpu tests/gpu
  run_tests kernels_cuda 100 tests/kernels/test_gqa_prologue.py tests/kernels/test_fp32_paths.py tests/kernels/test_skinny_gemm.py
  wait; cat "$R/cpu_checks.summary"
  if [ $# -ge 2 ]; then
    timeout $(($1 - SECONDS)) python3 bench/generate.py --model "$2" --out "$R/generate_h200_$2.json" > "$R/generate_$2.log" 2>&1
    echo "generate $2: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/generate_$2.log" | cut -c1-400 | tail -n 14
  fi
elif [ "$phase" = tests ]; then
  timeout "${TESTS_SECONDS:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu > "$R/gpu_tier.log" 2>&1
  echo "gpu tier: rc=$? $(tail -n 1 "$R/gpu_tier.log")"
  grep -h -E "^FAILED|^E " "$R/gpu_tier.log" | cut -c1-300 | head -n 30
else
  seconds=$1 model=$2; shift 2
  timeout "$seconds" python3 bench/generate.py --model "$model" --out "$R/generate_h200_$model.json" "$@" > "$R/generate_$model.log" 2>&1
  echo "generate $model: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/generate_$model.log" | cut -c1-400 | tail -n 24
fi
