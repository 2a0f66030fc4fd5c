#!/usr/bin/env bash
# One device call, H200 only (DeepSeek's 2-layer stack needs more than 80 GB): where batch 64's
# microseconds go in the two layers short of issue 27's bars, ours against stock Inductor + graph,
# per kernel name (bench/diagnostics/profile_step.py):
#   1. DeepSeek V3.2's reference layer, routed experts computed (plain torch grouped_mm): 1.20x at
#      9ec1c7b against a bar of 1.25x, and a subtraction says a non-expert stage of ours is slower
#      than stock's; until second 300;
#   2. Qwen3.5's HF layers, experts computed, plan mode (the last profile, d926c86, was scan
#      mode): the GDN layer is 1.45x against a bar of 1.5x; until second 520.
# Results under $OUT/profile_b64_results. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/profile_b64_gpu_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/profile_b64_results
source bench/device_setup.sh "$R"
profile() {  # profile END NAME ARGS...: profile_step.py at batch 64 into DIR, then its summary
  local end=$1 name=$2; shift 2
  timeout $((end - SECONDS)) python3 bench/diagnostics/profile_step.py --batch 64 "$@" \
    --out "$R/profile_step_${GPU}_${name}_b64_${FUSION_COMMIT:0:7}.json" > "$R/$name.log" 2>&1
  echo "$name: rc=$? at ${SECONDS}s"; grep -v -i "warn" "$R/$name.log" | cut -c1-200 | tail -n 60
}
profile 300 reference_deepseek --source reference --experts grouped --models deepseek-v3.2
profile 520 hf_qwen_experts --source hf --experts compute --models qwen3.5
