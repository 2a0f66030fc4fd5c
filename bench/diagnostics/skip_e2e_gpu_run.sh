#!/usr/bin/env bash
# One device call, H200 only (DeepSeek's models need more than 80 GB), after be8831d turned
# decode_attention's skip of masked rows on at every masked site:
#   1. the skip where nothing is masked and on a static cache's tail, at MiniMax's and Qwen3.5's
#      widths (Qwen3.5's D 256 launch was unmeasured: 223 registers against 144);
#   2. DeepSeek's HF layer at batch 1 and 64 with the skip, experts computed (issue 27's 1.5x bar;
#      1.28x at 64 before the skip), until second 390;
#   3. issue 27's end to end at batch 1 for DeepSeek V3.2 (2 layers, stock and ours, with the
#      step timeline), last measured at 7c7c44d before its HF layer went 1.26x -> 1.69x.
# Results in $OUT/skip_e2e_results.tgz. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/skip_e2e_gpu_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/skip_e2e_results
source bench/device_setup.sh "$R"
timeout 150 python3 bench/diagnostics/decode_attention_sparse.py --only "qwen|minimax" \
  --out "$R/decode_attention_sparse_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/sparse.log" 2>&1
echo "sparse: rc=$?"; grep -v -i warn "$R/sparse.log" | cut -c1-300 | tail -n 10
timeout $((390 - SECONDS)) python3 bench/decode.py --models deepseek-v3.2 --sources hf --hf-experts compute \
  --batches 1 64 --modes inductor_graph fusion_compiler \
  --out "$R/decode_${GPU}_hf_deepseek_experts_computed_${FUSION_COMMIT:0:7}.json" > "$R/decode.log" 2>&1
echo "decode: rc=$?"; grep -v -i "warn" "$R/decode.log" | cut -c1-400 | tail -n 8
timeout $((575 - SECONDS)) python3 bench/generate.py --model deepseek-v3.2 --batches 1 --modes stock ours \
  --out "$R/generate_${GPU}_deepseek-v3.2_${FUSION_COMMIT:0:7}.json" > "$R/generate.log" 2>&1
echo "generate: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/generate.log" | cut -c1-400 | tail -n 5
tar -czf "$OUT/skip_e2e_results.tgz" -C "$OUT" skip_e2e_results && rm -rf "$R"
