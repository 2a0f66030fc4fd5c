#!/usr/bin/env bash
# One device call, H200 only (DeepSeek's 2-layer model needs more than 80 GB): issue 27's end to
# end at batch 1, each mode in a fresh process (bench/generate.py --isolate), for DeepSeek V3.2,
# Qwen3.5 and MiniMax-M2.5 at the bench's layer counts. In one process the mode run later pays
# the host cost earlier compiles leave (generate_host_probe: eager launch 7.1 -> 13.9 us).
# Results in $OUT/isolated_results.tgz. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/isolated_generate_gpu_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/isolated_results
source bench/device_setup.sh "$R"
for spec in deepseek-v3.2:200 qwen3.5:390 minimax-m2.5:575; do
  model=${spec%%:*} end=${spec##*:}
  timeout $((end - SECONDS)) python3 bench/generate.py --model "$model" --batches 1 --modes stock ours --isolate \
    --repeats 5 --out "$R/generate_${GPU}_${model}_isolated_${FUSION_COMMIT:0:7}.json" > "$R/generate_$model.log" 2>&1
  echo "$model: rc=$? at ${SECONDS}s"; grep -E "^(mode|stock|ours) " "$R/generate_$model.log" | tail -n 3 | cut -c1-200
done
tar -czf "$OUT/isolated_results.tgz" -C "$OUT" isolated_results && rm -rf "$R"
