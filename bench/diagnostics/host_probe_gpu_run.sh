#!/usr/bin/env bash
# One device call, H200 only (DeepSeek's 2-layer model needs more than 80 GB):
#   1. bench/diagnostics/generate_host_probe.py for DeepSeek V3.2 at batch 1: ours read 0.799x
#      stock at a8e5443 (266.4 vs 333.3 tok/s) with its eager prefill 31 against 15 ms, the
#      symptom of MiniMax's unexplained 0.553x at 553705b; until second 230;
#   2. issue 27's reference layers for DeepSeek V3.2 at batch 1 and 64, routed experts computed
#      (plain torch grouped_mm), stock Inductor + graph against ours, until second 575.
# Results in $OUT/host_probe_results.tgz. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/host_probe_gpu_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/host_probe_results
source bench/device_setup.sh "$R"
timeout $((230 - SECONDS)) python3 bench/diagnostics/generate_host_probe.py --model deepseek-v3.2 \
  --out "$R/generate_host_probe_${GPU}_deepseek-v3.2_${FUSION_COMMIT:0:7}.json" > "$R/probe.log" 2>&1
echo "probe: rc=$?"; grep -v -i "warn\|originates\|is_torch\|^ *\^\|^  File\|^    \|^$\|USDT" "$R/probe.log" | cut -c1-260 | head -n 60
timeout $((575 - SECONDS)) python3 bench/decode.py --models deepseek-v3.2 --sources reference --batches 1 64 \
  --modes eager inductor_graph fusion_compiler --no-pinned \
  --out "$R/decode_${GPU}_reference_deepseek_experts_computed_${FUSION_COMMIT:0:7}.json" > "$R/decode.log" 2>&1
echo "decode: rc=$?"; grep -v -i "warn\|decode bench:" "$R/decode.log" | cut -c1-400 | tail -n 10
tar -czf "$OUT/host_probe_results.tgz" -C "$OUT" host_probe_results && rm -rf "$R"
