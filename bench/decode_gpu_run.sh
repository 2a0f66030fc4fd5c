#!/usr/bin/env bash
# Device calls for issue 7 (each call is capped at 10 minutes, so one phase a call):
#   bash bench/decode_gpu_run.sh checks MODEL...  tests, rms_norm kernel tests and inspect MODEL...
#                                                  side by side (7 min), then the gated bench alone
#   bash bench/decode_gpu_run.sh tests             the GPU tier (step graphs, inspect's graph check,
#                                                  merged_linear, the backend on tiny HF models)
#   bash bench/decode_gpu_run.sh inspect MODEL...  inspect --device cuda at real widths (each model
#                                                  compiles 6-7 times: allow ~3 min a model)
#   bash bench/decode_gpu_run.sh decode ARGS...    bench/decode.py ARGS (e.g. --models minimax-m2.5
#                                                  --batches 1 64); JSON + PNG written after every case
#   bash bench/decode_gpu_run.sh dsa ARGS...       the DSA top-k mask kernel's GPU tests, then
#                                                  bench/decode.py ARGS (--models deepseek-v3.2 ...)
#   bash bench/decode_gpu_run.sh gated             the gated norm's kernel tests, then its bench
#                                                  (bench/kernels.py --gated, ~2 min)
# Results in $OUT/decode_results.tgz. Every pytest log is grepped for FAILED / E lines.
# DECODE_SECONDS (default 540) bounds the decode phase when a call runs something before it.
OUT=${OUT:-/tmp/out}
R=$OUT/decode_results
source bench/device_setup.sh "$R"
phase=${1:-tests}; shift || true

# One pytest run into $R/NAME.log, then its last line and any FAILED / E lines.
run_tests() {  # NAME SECONDS PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? $(tail -n 1 "$R/$name.log")"
  grep -h -E "^FAILED|^E " "$R/$name.log" | cut -c1-300 | head -n 20
}
gated_bench() {  # SECONDS
  timeout "$1" python3 bench/kernels.py --gated --out "$R/gated_norm_h200.json" > "$R/gated_bench.log" 2>&1
  echo "gated bench: rc=$?"; grep -v -i warn "$R/gated_bench.log" | tail -n 8
}

if [ "$phase" = tests ]; then
  run_tests gpu_tier 500 tests/gpu
elif [ "$phase" = checks ]; then
  # Everything that only checks or counts, side by side (16 CPU cores compile; the GPU is shared),
  # then the one timed part alone: the gated norm's bench. Two inspect chains (real widths hold
  # every routed expert: Qwen3.5's 4-layer stack alone is ~56 GB, so three at once would not fit
  # beside the tests): the first model, then the rest in turn; their output is printed at the end.
  run_tests gpu_tier 420 tests/gpu > "$R/gpu_tier.summary" &
  run_tests rms_norm_tests 420 tests/kernels/test_rms_norm.py > "$R/rms_norm_tests.summary" &
  start=$SECONDS
  inspect_one "$1" $((420 - (SECONDS - start))) > "$R/inspect_$1.summary" &
  ( for model in "${@:2}"; do inspect_one "$model" $((420 - (SECONDS - start))) > "$R/inspect_$model.summary"; done ) &
  wait
  cat "$R"/*.summary && rm -f "$R"/*.summary
  gated_bench 150
elif [ "$phase" = inspect ]; then
  for model in "$@"; do inspect_one "$model" 280; done
elif [ "$phase" = dsa ]; then
  run_tests dsa_kernel_tests 150 tests/kernels/test_dsa_topk_mask.py
  timeout $((570 - SECONDS)) python3 bench/decode.py --out "$R/decode_h200.json" --png "$R/decode_h200.png" "$@" > "$R/decode.log" 2>&1
  echo "decode bench: rc=$?"; grep -h "| x\|Error" "$R/decode.log" | cut -c1-400 | tail -n 30
elif [ "$phase" = gated ]; then
  run_tests gated_tests 200 tests/kernels/test_rms_norm.py -k gated
  gated_bench 300
else
  timeout "${DECODE_SECONDS:-540}" python3 bench/decode.py --out "$R/decode_h200.json" --png "$R/decode_h200.png" "$@" > "$R/decode.log" 2>&1
  echo "decode bench: rc=$?"; grep -v -i "warn\|decode bench:" "$R/decode.log" | cut -c1-400 | tail -n 30
fi
tar -czf "$OUT/decode_results.tgz" -C "$OUT" decode_results && rm -rf "$R"
