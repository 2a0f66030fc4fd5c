#!/usr/bin/env bash
# Device call for the DSA top-k mask (passes/dsa_topk_mask.py): its kernel's GPU tests at
# DeepSeek V3.2's real shapes, then the HF DeepSeek decode layer (bench/decode.py ARGS, e.g.
# --sources hf --models deepseek-v3.2 --batches 1 8 64). Results in $OUT/dsa_results.tgz.
OUT=${OUT:-/tmp/out}
R=$OUT/dsa_results
source bench/device_setup.sh "$R"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_dsa_topk_mask.py > "$R/dsa_kernel_tests.log" 2>&1
echo "dsa kernel tests: rc=$? $(tail -n 1 "$R/dsa_kernel_tests.log")"
grep -h -E "^FAILED|^E " "$R/dsa_kernel_tests.log" | cut -c1-300 | head -n 20
timeout $((570 - SECONDS)) python3 bench/decode.py --out "$R/decode_h200.json" --png "$R/decode_h200.png" "$@" > "$R/decode.log" 2>&1
echo "decode bench: rc=$?"; grep -h "| x\|Error" "$R/decode.log" | cut -c1-400 | tail -n 30
tar -czf "$OUT/dsa_results.tgz" -C "$OUT" dsa_results && rm -rf "$R"
