#!/usr/bin/env bash
# The tile-skip call's part an 80 GB card can run (DeepSeek's layers and 2-layer model cannot):
#   1. decode_attention's skip against the dense launch, kernel alone, every model's rows
#      (DeepSeek's expanded cache, MiniMax, Qwen3.5; top-k, tail, nothing masked), until 120 s;
#   2. issue 27's end to end at batch 1, each mode in a fresh process (generate.py --isolate):
#      MiniMax-M2.5 until 250 s, Qwen3.5 until 370 s;
#   3. the decode_attention kernel tests on CUDA, until 420 s.
# Results under $OUT/tile_skip_results. From the repository root:
#   FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/diagnostics/tile_skip_h100_run.sh
OUT=${OUT:-/tmp/out}
R=$OUT/tile_skip_results
source bench/device_setup.sh "$R"
timeout $((120 - SECONDS)) python3 bench/diagnostics/decode_attention_sparse.py \
  --out "$R/decode_attention_sparse_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/sparse.log" 2>&1
echo "sparse: rc=$? at ${SECONDS}s"; grep -v -i warn "$R/sparse.log" | cut -c1-200 | tail -n 24
generate_isolated minimax-m2.5 250
generate_isolated qwen3.5 370
timeout $((420 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
  tests/gpu/test_decode_attention_gpu.py > "$R/tests.log" 2>&1
echo "tests: rc=$? at ${SECONDS}s"; grep -E "passed|failed|^FAILED|^E " "$R/tests.log" | head -n 12
