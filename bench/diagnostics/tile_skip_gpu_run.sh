#!/usr/bin/env bash
# One device call, H200 only (DeepSeek's models need more than 80 GB), after decode_attention's
# skip stopped visiting the tiles outside the first..last position its mask keeps (the loop's
# range; DeepSeek's HF layer at batch 64 stayed at 1.25x with every tile walked):
#   1. DeepSeek's HF layer at batch 64, experts computed (issue 27's 1.5x bar), until 150 s;
#   2. issue 27's end to end at batch 1, each mode in a fresh process (generate.py --isolate):
#      DeepSeek V3.2 until 290 s, MiniMax-M2.5 until 390 s, Qwen3.5 until 490 s.
# The decode_attention kernel tests on CUDA: bench/diagnostics/tile_skip_h100_run.sh.
# Results under $OUT/tile_skip_results (no archive: a call cut short still returns every file).
# From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/tile_skip_gpu_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/tile_skip_results
source bench/device_setup.sh "$R"
timeout $((150 - SECONDS)) python3 bench/decode.py --models deepseek-v3.2 --sources hf --hf-experts compute \
  --batches 64 --modes inductor_graph fusion_compiler \
  --out "$R/decode_${GPU}_hf_deepseek_experts_computed_${FUSION_COMMIT:0:7}.json" > "$R/decode.log" 2>&1
echo "decode: rc=$? at ${SECONDS}s"; grep -E "^ +hf deepseek.*B=|seconds" "$R/decode.log" | cut -c1-400
generate_isolated deepseek-v3.2 290
generate_isolated minimax-m2.5 390
generate_isolated qwen3.5 490
