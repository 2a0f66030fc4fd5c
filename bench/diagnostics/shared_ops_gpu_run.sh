#!/usr/bin/env bash
# Device calls of session 12 (each <= 10 minutes), by phase:
#   bash bench/diagnostics/shared_ops_gpu_run.sh shared   the reference layers' shared ops: the paged split-KV
#       attention and the small-batch experts kernels (GPU tests, then bench/diagnostics/paged_attention_check.py
#       and bench/diagnostics/experts_check.py: checked, then timed against the old paths); issue 5: the TP
#       prologue test with both ranks on the one GPU (gloo, in the background: mostly CPU
#       compiles) and the GQA grid sweep at 4096 tokens (lanes x warps x order x roles)
#   bash bench/diagnostics/shared_ops_gpu_run.sh ab       the GQA kernel tests and bench at 1 and 4096 tokens
#       (gqa_prologue-10's defaults), the router GEMM-phase A/B (moe_router_check.py --parts gemm),
#       the paged attention's split counts at 1 and 8 tokens, then bench/decode.py on MiniMax's
#       reference layers at batch 1 and 64 (eager, stock Inductor + graph, ours)
#   bash bench/diagnostics/shared_ops_gpu_run.sh final    paged_decode_attention-2 (GPU test, check at 1 and 8
#       tokens), moe_route-14 against -13 and its two halves, then bench/decode.py on Qwen3.5's and
#       DeepSeek's reference layers at batch 1 and 64 (the same modes)
# Session 13 (one call each):
#   retest    every kernel test file touched by f32f9b0 (CPU- and GPU-marked tests, three pytest
#             processes side by side), the GQA bench at 1 and 4096 tokens with its role diagnostics
#             (--sweep-roles; that call's memory-hint sets are gone: none helped), then inspect on
#             HF Qwen3.5 at real widths (issue 7's compile-time bar)
#   confirm   the FP8 division by the scale as a multiply + one FMA correction (_device.div_rn_by:
#             its GPU test, the GQA kernel / op tests), the GQA bench at 1-4096 tokens, then inspect
#             on HF DeepSeek V3.2 and MiniMax-M2.5 at real widths
#   pieces    gqa_prologue-11 (rotary halves side by side): tests, the GQA bench at 1-4096 tokens,
#             and the lanes x warps x order sweep at 4096 tokens
#   decode    bench/decode.py on the reference layers: MiniMax at batch 1 and 64, Qwen3.5 at 1
# (inspect alone at real widths: bash bench/gpu_run.sh inspect MODEL...)
# Results in $OUT/shared_ops_results.tgz.
OUT=${OUT:-/tmp/out}
R=$OUT/shared_ops_results
source bench/device_setup.sh "$R"

run_tests() {  # NAME SECONDS PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? $(tail -n 1 "$R/$name.log")"
  grep -h -E "^FAILED|^E " "$R/$name.log" | cut -c1-300 | head -n 20
}
bench() {  # NAME SECONDS SCRIPT ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$?"; grep -v -i "warn" "$R/$name.log" | cut -c1-300 | tail -n 30
}


phase=${1:-shared}
if [ "$phase" = shared ]; then
  FUSION_TP_ONE_GPU=1 run_tests tp_one_gpu 300 tests/patterns/test_gqa_prologue_tp.py > "$R/tp.summary" 2>&1 &
  run_tests shared_ops_gpu_tests 150 -m gpu tests/kernels/test_paged_decode_attention.py \
    tests/kernels/test_routed_experts.py
  bench paged_attention 120 bench/diagnostics/paged_attention_check.py --out "$R/paged_attention_h200.json"
  bench experts 200 bench/diagnostics/experts_check.py --grouped-sweep-tokens --budget-s 170 --out "$R/experts_check_h200.json"
  wait
  cat "$R/tp.summary"
  bench gqa_sweep 180 bench/gqa_prologue.py --tokens 4096 --sweep-lanes 1024 2048 --out "$R/gqa_prologue_h200_sweep.json"
elif [ "$phase" = ab ]; then
  run_tests gqa_kernel_tests 100 tests/kernels/test_gqa_prologue.py tests/ops/test_gqa_prologue.py
  bench gqa 150 bench/gqa_prologue.py --tokens 1 4096 --sweep-lanes 2048 --out "$R/gqa_prologue_h200.json"
  bench router_gemm 170 bench/moe_router_check.py --parts gemm --out "$R/moe_router_gemm_h200.json"
  bench paged_splits 60 bench/diagnostics/paged_attention_check.py --tokens 1 8 --split-factors 2 4 \
    --out "$R/paged_attention_h200_splits.json"
  bench decode $((585 - SECONDS)) bench/decode.py --sources reference --models minimax-m2.5 --batches 1 64 \
    --modes eager inductor_graph fusion_compiler --out "$R/decode_h200_reference_minimax.json"
elif [ "$phase" = final ]; then
  run_tests paged_gpu_tests 60 -m gpu tests/kernels/test_paged_decode_attention.py
  bench paged 60 bench/diagnostics/paged_attention_check.py --tokens 1 8 --out "$R/paged_attention_h200_v2.json"
  bench router_gemm 100 bench/moe_router_check.py --parts gemm --gemm-variants shipped route13 gemv_span_no_hint \
    span_evict_last_no_gemv --gemm-tokens 1 16 --out "$R/moe_router_gemm_h200_v2.json"
  bench decode_qwen $((360 - SECONDS)) bench/decode.py --sources reference --models qwen3.5 --batches 1 64 \
    --modes eager inductor_graph fusion_compiler --out "$R/decode_h200_reference_qwen.json"
  bench decode_deepseek $((585 - SECONDS)) bench/decode.py --sources reference --models deepseek-v3.2 --no-pinned \
    --batches 1 64 --modes eager inductor_graph fusion_compiler --out "$R/decode_h200_reference_deepseek.json"
elif [ "$phase" = retest ]; then
  run_tests retest_gqa_paged_experts 240 -m "not vllm" tests/kernels/test_gqa_prologue.py tests/ops/test_gqa_prologue.py \
    tests/kernels/test_paged_decode_attention.py tests/kernels/test_routed_experts.py &
  run_tests retest_moe_route 240 -m "not vllm" tests/kernels/test_moe_route.py &
  run_tests retest_attention_dsa 240 -m "not vllm" tests/kernels/test_decode_attention.py tests/ops/test_decode_attention.py \
    tests/kernels/test_dsa_topk_mask.py &
  wait
  bench gqa_hints 200 bench/gqa_prologue.py --tokens 1 4096 --sweep-roles shipped kv1 q_only kv_only \
    --out "$R/gqa_prologue_h200_hints.json"
  left=$((585 - SECONDS))
  [ "$left" -gt 120 ] && inspect_one qwen3.5 "$left"
elif [ "$phase" = confirm ]; then
  run_tests confirm_gqa_tests 150 -m "not vllm" tests/kernels/test_device_helpers.py tests/kernels/test_gqa_prologue.py \
    tests/ops/test_gqa_prologue.py tests/kernels/test_paged_decode_attention.py
  bench gqa 200 bench/gqa_prologue.py --sweep-roles shipped kv1 q_only kv_only \
    --out "$R/gqa_prologue_h200_div_by.json"
  for model in deepseek-v3.2 minimax-m2.5; do
    left=$((585 - SECONDS)); [ "$left" -gt 90 ] && inspect_one "$model" "$left"
  done
elif [ "$phase" = pieces ]; then
  run_tests pieces_gqa_tests 150 -m "not vllm" tests/kernels/test_device_helpers.py tests/kernels/test_gqa_prologue.py \
    tests/ops/test_gqa_prologue.py
  bench gqa 240 bench/gqa_prologue.py --sweep-roles shipped kv1 q_only kv_only --out "$R/gqa_prologue_h200_gqa11.json"
  bench gqa_sweep $((585 - SECONDS)) bench/gqa_prologue.py --tokens 4096 --sweep-lanes 1024 2048 --sweep-warps 2 4 \
    --out "$R/gqa_prologue_h200_gqa11_sweep.json"
elif [ "$phase" = decode ]; then
  bench decode_minimax 170 bench/decode.py --sources reference --models minimax-m2.5 --batches 1 64 \
    --modes eager inductor_graph fusion_compiler --out "$R/decode_h200_reference_minimax.json"
  bench decode_qwen $((380 - SECONDS)) bench/decode.py --sources reference --models qwen3.5 --batches 1 \
    --modes eager inductor_graph fusion_compiler --out "$R/decode_h200_reference_qwen_b1.json"
fi
tar -czf "$OUT/shared_ops_results.tgz" -C "$OUT" shared_ops_results && rm -rf "$R"
