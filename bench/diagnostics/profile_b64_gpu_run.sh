#!/usr/bin/env bash
# Where batch 64's microseconds go in the layers short of issue 27's bars, ours against stock
# Inductor + graph, per kernel name (bench/diagnostics/profile_step.py). H200 for DeepSeek (its
# 2-layer stacks need more than 80 GB). Each named profile gets up to 290 s, in the order given
# (two fit one call):
#   hf_deepseek         DeepSeek V3.2's HF layer, experts computed: 1.25-1.27x (bar 1.5x). Ours
#                       took the same time with the dense attention (1786ff1) as with the skip
#                       (a8e5443, 739122c), though the dense launch must read 21.5 GB a layer;
#                       the profile says where the time goes, and attention_probe what the
#                       layer's decode_attention is given and what it costs alone, skip on / off;
#   reference_deepseek  DeepSeek V3.2's reference layer, experts computed (plain torch
#                       grouped_mm): 1.20x (bar 1.25x);
#   hf_qwen             Qwen3.5's HF layers, experts computed, plan mode: GDN 1.45x (bar 1.5x);
#   experts_sweep       not a profile: the grouped experts' launch shapes at 64 tokens for the
#                       three models (experts_check.py's grouped sweep, ~4 min, given what is
#                       left of 570 s): the experts are most of every batch-64 layer, and the
#                       shapes were never swept.
#   experts_fp8         not a profile: the FP8 experts' GPU tests, then bench/moe_experts_fp8.py
#                       (ours FP8 vs ours bf16 vs stock Inductor over a plain-torch FP8 forward,
#                       1 / 8 / 64 / 256 tokens, three models) in what is left of 570 s.
# Results under $OUT/profile_b64_results. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/profile_b64_gpu_run.sh hf_deepseek experts_sweep
OUT=${OUT:-/tmp/out}
R=$OUT/profile_b64_results
source bench/device_setup.sh "$R"
declare -A ARGS=(
  [hf_deepseek]="--source hf --experts compute --models deepseek-v3.2"
  [reference_deepseek]="--source reference --experts grouped --models deepseek-v3.2"
  [hf_qwen]="--source hf --experts compute --models qwen3.5"
)
for name in "$@"; do
  if [[ $name == experts_sweep ]]; then
    left=$((570 - SECONDS))
    timeout "$left" python3 bench/diagnostics/experts_check.py --tokens --grouped-sweep-tokens 64 \
      --budget-s $((left - 20)) --out "$R/experts_check_grouped_sweep_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/$name.log" 2>&1
    echo "$name: rc=$? at ${SECONDS}s"; grep -E "grouped sweep:|GB/s|ERROR" "$R/$name.log" | grep -v "^  " | cut -c1-240 | tail -n 12
    continue
  fi
  if [[ $name == experts_fp8 ]]; then
    timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_experts_fp8.py > "$R/experts_fp8_tests.log" 2>&1
    echo "experts_fp8 tests: rc=$? $(tail -n 1 "$R/experts_fp8_tests.log")"; grep -h -E "^FAILED|^E " "$R/experts_fp8_tests.log" | cut -c1-300 | head -n 20
    left=$((570 - SECONDS))
    timeout "$left" python3 bench/moe_experts_fp8.py --seconds $((left - 60)) \
      --out "$R/moe_experts_fp8_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/$name.log" 2>&1
    echo "$name: rc=$? at ${SECONDS}s"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/$name.log" | cut -c1-400 | tail -n 16
    continue
  fi
  [[ -n "${ARGS[$name]:-}" ]] || { echo "unknown profile $name (one of ${!ARGS[*]} experts_sweep experts_fp8)"; exit 2; }
  # shellcheck disable=SC2086  # ARGS holds several words
  timeout 290 python3 bench/diagnostics/profile_step.py --batch 64 ${ARGS[$name]} \
    --out "$R/profile_step_${GPU}_${name}_b64_${FUSION_COMMIT:0:7}.json" > "$R/$name.log" 2>&1
  echo "$name: rc=$? at ${SECONDS}s"; grep -v -i "warn" "$R/$name.log" | cut -c1-200 | tail -n 60
done
