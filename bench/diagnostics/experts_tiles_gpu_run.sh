#!/usr/bin/env bash
# Issue 27: the grouped experts' decode tiles (default_config at block_m <= 32, chosen from an
# H100 sweep) on the H200 in one call: the sweep again at 64 tokens (does the H100's best hold
# here?), then the batch-64 layers short of their bars re-measured with them, ours against
# stock Inductor + CUDA graph: Qwen3.5's HF layers (GDN 1.45x at 1786ff1, bar 1.5x) until second
# QWEN_END (330), DeepSeek V3.2's reference layer (1.20x at 9ec1c7b, bar 1.25x) until DEEPSEEK_END
# (570); SWEEP=0 skips the sweep, FP8_SECONDS > 0 then gives bench/moe_experts_fp8.py that long
# (FP8_SWEEP=1 adds its launch-shape sweep, ~4-6 min for three models: raise FP8_SECONDS by that).
# Results under $OUT/experts_tiles_results. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/experts_tiles_gpu_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/experts_tiles_results
source bench/device_setup.sh "$R"
if [[ ${SWEEP:-1} == 1 ]]; then
  timeout 200 python3 bench/diagnostics/experts_check.py --tokens --grouped-sweep-tokens 64 --budget-s 180 \
    --out "$R/experts_check_grouped_sweep_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/sweep.log" 2>&1
  echo "sweep: rc=$? at ${SECONDS}s"; grep -E "grouped sweep:|GB/s|ERROR" "$R/sweep.log" | grep -v "^  " | cut -c1-240 | tail -n 12
fi
layers() {  # NAME END DECODE-ARGS...
  local name=$1 end=$2; shift 2
  timeout $((end - SECONDS)) python3 bench/decode.py --batches 64 --modes inductor_graph fusion_compiler --no-pinned \
    --out "$R/decode_${GPU}_${name}_b64_${FUSION_COMMIT:0:7}.json" "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? at ${SECONDS}s"; grep -h "| x\|Error" "$R/$name.log" | cut -c1-330 | tail -n 6
}
layers hf_qwen "${QWEN_END:-330}" --models qwen3.5 --sources hf --hf-experts compute
layers reference_deepseek "${DEEPSEEK_END:-570}" --models deepseek-v3.2 --sources reference --ref-experts grouped
if [[ ${FP8_SECONDS:-0} -gt 0 ]]; then
  timeout "$FP8_SECONDS" python3 bench/moe_experts_fp8.py --seconds $((FP8_SECONDS - 60)) $([[ ${FP8_SWEEP:-0} == 1 ]] && echo --sweep) \
    --out "$R/moe_experts_fp8_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/experts_fp8.log" 2>&1
  echo "experts_fp8: rc=$? at ${SECONDS}s"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/experts_fp8.log" | cut -c1-400 | tail -n 14
fi
