#!/usr/bin/env bash
# Device calls for issue 24 (the user's path), one phase a call (each call is capped at 10 min):
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/generate_gpu_run.sh tests
#       the GPU tier (tests/gpu: generate() on tiny models, real-vocabulary lm_heads, step graphs)
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/generate_gpu_run.sh bench SECONDS MODEL [ARGS...]
#       bench/generate.py at real widths into $OUT/generate_h200_MODEL.json (written after every case)
# The device gets the tree without .git: the caller passes the commit and the dirty flag.
OUT=${OUT:-/tmp/out}
R=$OUT
source bench/device_setup.sh "$R/setup"
phase=${1:-tests}; shift || true
if [ "$phase" = tests ]; then
  timeout "${TESTS_SECONDS:-540}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu > "$R/gpu_tier.log" 2>&1
  echo "gpu tier: rc=$? $(tail -n 1 "$R/gpu_tier.log")"
  grep -h -E "^FAILED|^E " "$R/gpu_tier.log" | cut -c1-300 | head -n 30
else
  seconds=$1 model=$2; shift 2
  timeout "$seconds" python3 bench/generate.py --model "$model" --out "$R/generate_h200_$model.json" "$@" > "$R/generate_$model.log" 2>&1
  echo "generate $model: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/generate_$model.log" | cut -c1-400 | tail -n 24
fi
