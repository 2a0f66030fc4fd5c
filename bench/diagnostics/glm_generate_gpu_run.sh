#!/usr/bin/env bash
# One device call (2026-12-05): issue 29's GLM-4.5 layer (HF code, batch 1, experts zeros:
# kernels and µs against stock Inductor + graph and reduce-overhead), then issue 27's end to end
# at batch 1: DeepSeek V3.2 at generate.py's default 2 layers (last measured at 7c7c44d, before
# the HF layer went 1.26x -> 1.69x), then MiniMax-M2.5 with LAYERS layers (a step nearer a real
# model's), stock and ours, with bench/generate.py's step timeline. Results in
# $OUT/glm_generate_results.tgz. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 LAYERS=8 bash bench/diagnostics/glm_generate_gpu_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/glm_generate_results
source bench/device_setup.sh "$R"
layers=${LAYERS:-8}
timeout 270 python3 bench/decode.py --models glm4-moe --sources hf --batches 1 --hf-experts zeros \
  --modes eager inductor_graph reduce_overhead fusion_compiler --out "$R/decode_hf_glm4-moe.json" > "$R/decode.log" 2>&1
echo "decode: rc=$?"; grep -v -i "warn" "$R/decode.log" | cut -c1-400 | tail -n 16
timeout 200 python3 bench/generate.py --model deepseek-v3.2 --batches 1 --modes stock ours \
  --out "$R/generate_deepseek-v3.2_layers2.json" > "$R/generate_deepseek.log" 2>&1
echo "generate deepseek: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/generate_deepseek.log" | cut -c1-400 | tail -n 6
timeout $((580 - SECONDS)) python3 bench/generate.py --model minimax-m2.5 --layers "$layers" --batches 1 \
  --modes stock ours --out "$R/generate_minimax-m2.5_layers$layers.json" > "$R/generate.log" 2>&1
echo "generate: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/generate.log" | cut -c1-400 | tail -n 8
tar -czf "$OUT/glm_generate_results.tgz" -C "$OUT" glm_generate_results && rm -rf "$R"
