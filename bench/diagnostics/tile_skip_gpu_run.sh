#!/usr/bin/env bash
# One device call, H200 only (DeepSeek's models need more than 80 GB), after decode_attention's
# skip passed over tiles its mask rules out whole (no MMA, no softmax step; before, each such
# tile still ran both on zeroed rows, and DeepSeek's HF layer at batch 64 stayed at 1.25x):
#   1. DeepSeek's HF layer at batch 64, experts computed (issue 27's 1.5x bar), until 150 s;
#   2. issue 27's end to end at batch 1, each mode in a fresh process (generate.py --isolate):
#      DeepSeek V3.2 until 290 s, MiniMax-M2.5 until 390 s;
#   3. the decode_attention kernel tests on CUDA (the new branch compiled for sm_90), until 440 s.
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
timeout $((440 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
  tests/gpu/test_decode_attention_gpu.py > "$R/tests.log" 2>&1
echo "tests: rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^E " "$R/tests.log" | head -n 12
