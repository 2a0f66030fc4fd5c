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
#   bash bench/decode_gpu_run.sh gated             the gated norm's kernel tests, then its bench
#                                                  (bench/kernels.py --gated, ~2 min)
# Results in $OUT/decode_results.tgz. Every pytest log is grepped for FAILED / E lines.
OUT=${OUT:-/tmp/out}
R=$OUT/decode_results
source bench/device_setup.sh "$R"
phase=${1:-tests}; shift || true
if [ "$phase" = tests ]; then
  timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu > "$R/gpu_tier.log" 2>&1
  echo "gpu tier: rc=$? $(tail -n 1 "$R/gpu_tier.log")"
  grep -h -E "^FAILED|^E " "$R/gpu_tier.log" | cut -c1-300 | head -n 20
elif [ "$phase" = checks ]; then
  # Everything that only checks or counts, side by side (16 CPU cores compile; the GPU is shared),
  # then the one timed part alone: the gated norm's bench.
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu > "$R/gpu_tier.log" 2>&1 &
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_rms_norm.py > "$R/rms_norm_tests.log" 2>&1 &
  # Two inspect chains (real widths hold every routed expert: Qwen3.5's 4-layer stack alone is
  # ~56 GB, so three at once would not fit beside the tests): the first model, then the rest in turn.
  start=$SECONDS
  inspect_one() { timeout $((420 - (SECONDS - start))) fusion-compiler inspect "$1" --device cuda \
                    --json "$R/inspect_$1_real_cuda.json" > "$R/inspect_$1.log" 2>&1; }
  inspect_one "$1" &
  ( for model in "${@:2}"; do inspect_one "$model"; done ) &
  wait
  for log in gpu_tier rms_norm_tests; do
    echo "$log: $(tail -n 1 "$R/$log.log")"; grep -h -E "^FAILED|^E " "$R/$log.log" | cut -c1-300 | head -n 12
  done
  for model in "$@"; do echo "inspect $model:"; grep -v -i warn "$R/inspect_$model.log" | cut -c1-300 | tail -n 14; done
  timeout 150 python3 bench/kernels.py --gated --out "$R/gated_norm_h200.json" > "$R/gated_bench.log" 2>&1
  echo "gated bench: rc=$?"; grep -v -i warn "$R/gated_bench.log" | tail -n 8
elif [ "$phase" = inspect ]; then
  for model in "$@"; do
    timeout 280 fusion-compiler inspect "$model" --device cuda --json "$R/inspect_${model}_real_cuda.json" > "$R/inspect_$model.log" 2>&1
    echo "inspect $model: rc=$?"; grep -v -i warn "$R/inspect_$model.log" | tail -n 14
  done
elif [ "$phase" = gated ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_rms_norm.py -k gated > "$R/gated_tests.log" 2>&1
  echo "gated kernel tests: rc=$? $(tail -n 1 "$R/gated_tests.log")"
  grep -h -E "^FAILED|^E " "$R/gated_tests.log" | cut -c1-300 | head -n 20
  timeout 300 python3 bench/kernels.py --gated --out "$R/gated_norm_h200.json" > "$R/gated_bench.log" 2>&1
  echo "gated bench: rc=$?"; grep -v -i warn "$R/gated_bench.log" | tail -n 8
else
  timeout 540 python3 bench/decode.py --out "$R/decode_h200.json" --png "$R/decode_h200.png" "$@" > "$R/decode.log" 2>&1
  echo "decode bench: rc=$?"; grep -v -i "warn\|decode bench:" "$R/decode.log" | cut -c1-400 | tail -n 30
fi
tar -czf "$OUT/decode_results.tgz" -C "$OUT" decode_results && rm -rf "$R"
