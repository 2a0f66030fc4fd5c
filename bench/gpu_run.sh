#!/usr/bin/env bash
# The device calls, one phase a call (the device caps a call at 10 minutes):
#   bash bench/gpu_run.sh PHASE [ARGS...]
# Every phase sources bench/device_setup.sh (an editable install, one line of versions). The
# device gets the tree without .git: pass FUSION_COMMIT=<sha> FUSION_DIRTY=0 for the JSONs'
# provenance. Every pytest log is grepped for FAILED / E lines.
#
# The GPU tier (issue 25):
#   tier [GROUP...]          carry [".gpu_snap"] with wheels/ in it: every test marked gpu, in
#                            three groups (kernels: kernels at real widths; step_graphs: the
#                            backend's step graphs; generate: HF generate()), each its own pytest
#                            run and $OUT/gpu_<group>.log, so a call cut short still leaves every
#                            finished group's report; GROUP names some of them (default all). The
#                            two HF-model groups run side by side over HF_WORKERS (4) xdist workers.
#                            wheels/ (git-ignored; fill it with `pip download fla-core==0.6.0
#                            einops==0.8.2 --no-deps -d wheels/`) holds fla-core, which the gdn
#                            family's lowering "fla" runs and the device lacks. It goes on
#                            PYTHONPATH for the kernels group only: with fla importable, HF's
#                            Qwen3.5 runs fla's delta-rule kernel instead of the torch code the
#                            HF-model tests exercise. The tier must end with 0 skipped.
#                            KERNELS_SECONDS / STEP_GRAPHS_SECONDS / GENERATE_SECONDS (220 / 300 /
#                            300) bound the groups (kernels took 135 s at e6895dd).
#   mutations [ARGS...]      bench/mutations.py --device cuda (baselines and faults, MUTATION_JOBS
#                            at once) into $OUT/mutations_cuda_<gpu>_<commit>.md; ARGS e.g. --only
# The user's path, HF generate() (issue 24; results in $OUT):
#   generate-checks [END_SECONDS MODEL]
#                            the GPU tier (as the tier phase; carry wheels/ too), then the kernels
#                            changed for issue 24 on CUDA;
#                            beside them, on the CPU cores, the CPU-tier tests that read torch's
#                            internals (decline, dtypes, routes) under the device's torch; then, if
#                            given, bench/generate.py for MODEL until END_SECONDS after the start
#   generate-bench SECONDS MODEL [ARGS...]
#                            bench/generate.py at real widths into $OUT/generate_<gpu>_MODEL.json
#                            (written after every case)
# The decode step per layer (issue 7; results in $OUT/decode_results.tgz):
#   decode ARGS...           bench/decode.py ARGS (e.g. --models minimax-m2.5 --batches 1 64); JSON
#                            and PNG written after every case. DECODE_SECONDS (540) bounds it.
#   decode-checks MODEL...   the GPU tier, the rms_norm kernel tests and inspect MODEL... side by
#                            side (7 min), then the gated norm's bench alone
#   inspect MODEL...         inspect --device cuda at real widths (each model compiles 6-7 times:
#                            allow ~3 min a model)
#   dsa ARGS...              the DSA top-k mask kernel's GPU tests, then bench/decode.py ARGS
#                            (--models deepseek-v3.2 ...)
#   gated                    the gated norm's kernel tests, then its bench (bench/rms_norm.py
#                            --gated, ~2 min)
# The kernels alone (results in $OUT, or $OUT/<family>_results.tgz):
#   kernels                  the GPU tests of tests/kernels and tests/gpu, the add + RMSNorm bench
#                            (bench/rms_norm.py), then the CPU-tier pattern and pass tests on the
#                            device's torch
#   moe                      issue 4: the routing kernels' tests on CUDA, the router at real widths
#                            (bench/moe_router_check.py), the routing bench, and inspect on HF
#                            DeepSeek V3.2 at real widths; about 5 min
#   moe-ab                   the routing-tail A/B (every variant checked, then timed at 1 / 2 / 16
#                            tokens, with the router-weight copy floor), about 2 min
#   moe-tail                 issue 4's 2x-the-copy bar: the one-token router's CUDA-graph replay
#                            tests, the routing bench through torch.compile, and the one-token
#                            launch (shipped, -15's shape, the counters, the GEMM alone) timed
#                            rotated-cold beside the copy; about 4 min
#   moe-variants             VARIANTS="...": one-token GEMM variants of bench/moe_router_check.py
#                            beside the copy, ~1 min. Run `python bench/sass_offline.py check` on
#                            CPU first.
#   gdn                      carry [".wheels"] (fla-core 0.6.0 and einops 0.8.2 wheels:
#                            `pip download --no-deps fla-core==0.6.0 einops==0.8.2 -d .wheels/`):
#                            issue 6's GDN op / kernel tests, the tiling sweep, the fla lowering's
#                            tests and the GDN core bench at Qwen3.5's real dims; ~8 min
#   gqa-tp                   on nvidia-h200-x2: issue 5's tensor-parallel test with each rank on its
#                            own GPU (NCCL; NVLink multicast off, the device library's KINDS.md)
#   moe-experts [ARGS...]    issue 27: the routed experts alone (bench/moe_experts.py ARGS, e.g.
#                            --models qwen3.5 --tokens 1 64): ours vs stock Inductor over HF's
#                            grouped_mm experts vs torch._grouped_mm, % of the copy bandwidth over
#                            the touched experts' bytes, into $OUT/moe_experts_results.tgz (JSON
#                            written after every row). MOE_EXPERTS_SECONDS (480) bounds it; ~5 min
#   moe-launches [ARGS...]   issue 27's launch count: the moe kernels' GPU tests, the router's one
#                            launch vs two at 1-256 tokens, then bench/moe_experts.py ARGS (scan
#                            and plan modes side by side), into $OUT/moe_launches_results.tgz
#   moe-layers [ARGS...]     issue 27 in one call: the moe kernels' GPU tests, the router's one
#                            launch vs two at 1-256 tokens, then bench/decode.py ARGS (HF's layers
#                            with their experts computed, e.g. --sources hf --hf-experts compute)
#                            into $OUT/moe_layers_results.tgz; LAYERS_END (570) is the second the
#                            decode bench must end by
#   sparse-attention [ARGS...]
#                            decode_attention's GPU tests, its skip_masked launch against the dense
#                            one (bench/diagnostics/decode_attention_sparse.py, ~2 min), then with
#                            ARGS bench/decode.py ARGS (e.g. --models deepseek-v3.2 --sources hf
#                            --hf-experts compute --batches 1 64) into $OUT/sparse_attention_results.tgz
# One-off calls of past sessions are in bench/diagnostics/*_gpu_run.sh.
OUT=${OUT:-/tmp/out}
phase=${1:-}; shift || true

# One pytest run into $R/NAME.log, then its last line and any FAILED / E lines.
run_tests() {  # NAME SECONDS PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? $(tail -n 1 "$R/$name.log")"
  grep -h -E "^FAILED|^E " "$R/$name.log" | cut -c1-300 | head -n 30
}
# bench/generate.py for MODEL into $R, then the log's tail.
generate_bench() {  # SECONDS MODEL TAIL [ARGS...]
  local limit=$1 model=$2 lines=$3; shift 3
  timeout "$limit" python3 bench/generate.py --model "$model" --out "$R/generate_${GPU}_$model.json" "$@" \
    > "$R/generate_$model.log" 2>&1
  echo "generate $model: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/generate_$model.log" | cut -c1-400 | tail -n "$lines"
}
gated_bench() {  # SECONDS
  timeout "$1" python3 bench/rms_norm.py --gated --out "$R/gated_norm_${GPU}.json" > "$R/gated_bench.log" 2>&1
  echo "gated bench: rc=$?"; grep -v -i warn "$R/gated_bench.log" | tail -n 8
}
# The routing and experts kernels' GPU tests, then the router at real widths: checked, and one
# launch against two at 1-256 tokens (bench/moe_router_check.py check,split), into $R.
moe_checks() {  # TESTS_SECONDS ROUTER_SECONDS
  run_tests moe_kernel_tests "$1" -m gpu tests/kernels/test_moe_experts.py tests/kernels/test_moe_route.py \
    tests/gpu/test_moe_router_gpu.py tests/gpu/test_moe_routing_gpu.py
  timeout "$2" python3 bench/moe_router_check.py --parts check,split \
    --out "$R/moe_router_split_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/moe_router.log" 2>&1
  echo "router check/split: rc=$?"; grep -v -i "warn" "$R/moe_router.log" | cut -c1-300 | tail -n 30
}
# A tier group: its own pytest run and log; a failed group sets status.
run_group() {  # NAME SECONDS PATHS...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider -rfEs --durations=10 -m gpu "$@" > "$R/gpu_$name.log" 2>&1
  local rc=$?
  echo "gpu $name: rc=$rc $(tail -n 1 "$R/gpu_$name.log")"
  grep -E "^(FAILED|ERROR) " "$R/gpu_$name.log" | cut -c1-300 | head -n 20
  grep -E "^E  " "$R/gpu_$name.log" | cut -c1-300 | head -n 12
  grep -E "^SKIPPED|SKIPPED \[" "$R/gpu_$name.log" | cut -c1-300 | head -n 10
  [ $rc -eq 0 ] || status=1
}
# The GPU tier (the tier phase's header says how) into $R: GROUP... of kernels, step_graphs,
# generate (default all); returns 1 if a group failed.
gpu_tier() {  # [GROUP...]
  local groups=${*:-kernels step_graphs generate} FLA=$R/setup/fla_site status=0 pids=() g paths limit pid
  # fla-core on PYTHONPATH for the kernels group only (the header says why)
  mkdir -p "$R/setup"
  python3 -m pip install -q --no-index --no-deps --target "$FLA" wheels/fla_core-*.whl wheels/einops-*.whl \
    > "$R/setup/wheels.log" 2>&1 || { cat "$R/setup/wheels.log"; return 1; }
  PYTHONPATH=$FLA python3 -c "import fla, einops; print('fla-core', fla.__version__, 'einops', einops.__version__)" \
    2>&1 | grep -v -i warn | tee -a "$R/setup/versions.log"
  python3 -c "import fla" 2> /dev/null && { echo "fla is installed site-wide: HF's Qwen3.5 would run its kernels"; return 1; }
  local kernel_files xdist
  kernel_files=$(ls tests/gpu/test_*_gpu.py | grep -v -E "test_(backend|cudagraph|generate)_gpu.py")
  xdist=$(python3 -c "import xdist" 2> /dev/null && echo "-n ${HF_WORKERS:-4}")
  case " $groups " in *" kernels "*)
    PYTHONPATH=$FLA run_group kernels "${KERNELS_SECONDS:-220}" tests/kernels tests/ops tests/model_adapters $kernel_files;;
  esac
  # The HF-model groups side by side, each over $HF_WORKERS pytest workers where xdist is installed.
  for g in step_graphs generate; do
    case " $groups " in *" $g "*) ;; *) continue;; esac
    [ $g = step_graphs ] && paths="tests/gpu/test_backend_gpu.py tests/gpu/test_cudagraph_gpu.py" limit=${STEP_GRAPHS_SECONDS:-300}
    [ $g = generate ] && paths="tests/gpu/test_generate_gpu.py" limit=${GENERATE_SECONDS:-300}
    ( status=0; run_group $g "$limit" $xdist $paths > "$R/gpu_$g.summary"; exit $status ) &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  cat "$R"/gpu_*.summary 2> /dev/null
  echo "skipped: $(cat "$R"/gpu_*.log | grep -c -E "SKIPPED")"
  return $status
}
# Pack $OUT/NAME into $OUT/NAME.tgz (fewer files for the device to return).
pack() { tar -czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"; }

case "$phase" in
tier)
  R=$OUT
  source bench/device_setup.sh "$R/setup"
  echo "commit ${FUSION_COMMIT:-unknown} dirty ${FUSION_DIRTY:-unknown}" | tee -a "$R/setup/versions.log"
  gpu_tier "$@"
  exit $?
  ;;
mutations)
  R=$OUT
  source bench/device_setup.sh "$R/setup"
  timeout "${MUTATIONS_SECONDS:-540}" python3 bench/mutations.py --device cuda --jobs "${MUTATION_JOBS:-6}" \
    --timeout 420 --out "$R/mutations_cuda_${GPU}_${FUSION_COMMIT:-unknown}.md" "$@" 2>&1 | grep -v -i warn | tail -n 20
  ;;
generate-checks)
  R=$OUT
  source bench/device_setup.sh "$R/setup"
  run_tests torch211_cpu_checks 420 tests/patterns/test_registry.py tests/patterns/test_hf_dtypes.py \
    tests/test_compile_routes.py tests/patterns/test_gqa_prologue_hf_paths.py \
    tests/patterns/test_mla_prologue.py::test_hf_latent_not_a_multiple_of_128_compiles_with_the_kv_site_a_reported_miss \
    > "$R/cpu_checks.summary" 2>&1 &
  gpu_tier
  run_tests kernels_cuda 100 tests/kernels/test_gqa_prologue.py tests/kernels/test_fp32_paths.py tests/kernels/test_skinny_gemm.py
  wait; cat "$R/cpu_checks.summary"
  if [ $# -ge 2 ]; then generate_bench $(($1 - SECONDS)) "$2" 14; fi
  ;;
generate-bench)
  R=$OUT
  source bench/device_setup.sh "$R/setup"
  seconds=$1 model=$2; shift 2
  generate_bench "$seconds" "$model" 24 "$@"
  ;;
decode|decode-checks|inspect|dsa|gated)
  R=$OUT/decode_results
  source bench/device_setup.sh "$R"
  if [ "$phase" = decode-checks ]; then
    # Everything that only checks or counts, side by side (16 CPU cores compile; the GPU is
    # shared), then the one timed part alone: the gated norm's bench. Two inspect chains (real
    # widths hold every routed expert: Qwen3.5's 4-layer stack alone is ~56 GB, so three at once
    # would not fit beside the tests): the first model, then the rest in turn.
    run_tests gpu_tier 420 -m gpu tests/gpu > "$R/gpu_tier.summary" &
    run_tests rms_norm_tests 420 -m gpu tests/kernels/test_rms_norm.py > "$R/rms_norm_tests.summary" &
    start=$SECONDS
    inspect_one "$1" $((420 - (SECONDS - start))) > "$R/inspect_$1.summary" &
    ( for model in "${@:2}"; do inspect_one "$model" $((420 - (SECONDS - start))) > "$R/inspect_$model.summary"; done ) &
    wait
    cat "$R"/*.summary && rm -f "$R"/*.summary
    gated_bench 150
  elif [ "$phase" = inspect ]; then
    for model in "$@"; do inspect_one "$model" 280; done
  elif [ "$phase" = dsa ]; then
    run_tests dsa_kernel_tests 150 -m gpu tests/kernels/test_dsa_topk_mask.py
    timeout $((570 - SECONDS)) python3 bench/decode.py --out "$R/decode_${GPU}.json" --png "$R/decode_${GPU}.png" "$@" > "$R/decode.log" 2>&1
    echo "decode bench: rc=$?"; grep -h "| x\|Error" "$R/decode.log" | cut -c1-400 | tail -n 30
  elif [ "$phase" = gated ]; then
    run_tests gated_tests 200 -m gpu tests/kernels/test_rms_norm.py -k gated
    gated_bench 300
  else
    timeout "${DECODE_SECONDS:-540}" python3 bench/decode.py --out "$R/decode_${GPU}.json" --png "$R/decode_${GPU}.png" "$@" > "$R/decode.log" 2>&1
    echo "decode bench: rc=$?"; grep -v -i "warn\|decode bench:" "$R/decode.log" | cut -c1-400 | tail -n 30
  fi
  pack decode_results
  ;;
kernels)
  source bench/device_setup.sh "$OUT"
  python3 -m pytest -q -m gpu tests/kernels tests/gpu -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/gpu_tier.log"
  python3 bench/rms_norm.py --out "$OUT/kernels_${GPU}.json" 2>&1 | tee "$OUT/bench.log"
  timeout 240 python3 -m pytest -q -x -p no:faulthandler -p no:cacheprovider tests/patterns tests/passes 2>&1 | tail -n 30 | tee "$OUT/cpu_tier_on_gpu_torch.log"
  ;;
moe|moe-ab|moe-tail|moe-variants)
  R=$OUT/moe_results
  source bench/device_setup.sh "$R"
  if [ "$phase" = moe-ab ]; then
    timeout 240 python3 bench/moe_router_check.py --parts ab --out "$R/moe_router_ab_${GPU}.json" > "$R/moe_router_ab.log" 2>&1; echo "rc $?"
    grep -v "^ *$" "$R/moe_router_ab.log" | cut -c1-300 | tail -n 80
  elif [ "$phase" = moe-variants ]; then
    timeout 400 python3 bench/moe_router_check.py --parts gemm --gemm-variants ${VARIANTS:-shipped route15} \
      --gemm-tokens 1 --out "$R/moe_router_tail_${GPU}.json" > "$R/moe_router_tail.log" 2>&1; echo "rc $?"
    grep "copy\|^  [a-z]" "$R/moe_router_tail.log" | grep -v "{" | cut -c1-130
  elif [ "$phase" = moe-tail ]; then
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_moe_router_gpu.py 2>&1 | tail -n 8 | tee "$R/moe_router_gpu_tests.log"
    timeout 200 python3 bench/moe_routing.py --out "$R/moe_routing_${GPU}.json" > "$R/moe_routing.log" 2>&1; grep -v Warning "$R/moe_routing.log" | cut -c1-400 | tail -n 14
    timeout 150 python3 bench/moe_router_check.py --parts gemm --gemm-variants shipped route15 counters \
      --gemm-tokens 1 --out "$R/moe_router_tail_${GPU}.json" > "$R/moe_router_tail.log" 2>&1; echo "rc $?"
    grep "copy\|^  [a-z]" "$R/moe_router_tail.log" | grep -v "{" | cut -c1-130
  else
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_route.py 2>&1 | tail -n 15 | tee "$R/moe_kernel_tests_cuda.log"
    timeout 150 python3 bench/moe_router_check.py --out "$R/moe_router_check_${GPU}.json" > "$R/moe_router_check.log" 2>&1; grep -v "^ *$" "$R/moe_router_check.log" | cut -c1-300 | tail -n 60
    timeout 200 python3 bench/moe_routing.py --out "$R/moe_routing_${GPU}.json" > "$R/moe_routing.log" 2>&1; grep -v Warning "$R/moe_routing.log" | cut -c1-400 | tail -n 30
    timeout 120 fusion-compiler inspect deepseek-v3.2 --device cuda --layers 2 --json "$R/inspect_deepseek_real_cuda.json" > "$R/inspect.log" 2>&1; tail -n 14 "$R/inspect.log"
  fi
  pack moe_results
  ;;
gdn)
  R=$OUT/gdn_results
  source bench/device_setup.sh "$R"
  # The tests first: with fla installed, HF's GDN layer (their reference) would run fla's kernels.
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_decode.py tests/ops/test_gdn_decode.py 2>&1 | tail -n 25 | tee "$R/gdn_tests_cuda.log"
  timeout 200 python3 bench/diagnostics/gdn_tiling_sweep.py --out "$R/gdn_tiling_sweep_${GPU}.json" 2>&1 | grep -v -i warn | grep "best\|error" | tail -n 12
  if ls .wheels/fla_core-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index .wheels/einops-*.whl .wheels/fla_core-*.whl > "$R/fla_install.log" 2>&1 \
      || { echo "fla install failed (the bench runs without the fla rows):"; tail -n 5 "$R/fla_install.log"; }
    python3 -c "import fla.ops.gated_delta_rule, fla.modules.causal_conv1d, fla.modules.norm.layernorm_gated; print('fla', fla.__version__)" 2>&1 | tail -n 2 | tee -a "$R/versions.log"
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_fla.py 2>&1 | tail -n 5 | tee "$R/fla_tests_cuda.log"
  else
    echo "no .wheels/fla_core-*.whl: was the call made with carry: [\".wheels\"]? The bench runs without the fla rows." | tee -a "$R/versions.log"
  fi
  timeout 200 python3 bench/gdn_decode.py --out "$R/gdn_decode_${GPU}.json" > "$R/gdn_decode.log" 2>&1
  grep -v -i warn "$R/gdn_decode.log" | cut -c1-700 | tail -n 40
  pack gdn_results
  ;;
gqa-tp)
  R=$OUT/tp_results
  source bench/device_setup.sh "$R"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi -L | tee -a "$R/versions.log"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/patterns/test_gqa_prologue_tp.py 2>&1 | tail -n 30 | tee "$R/tp_tests_cuda.log"
  pack tp_results
  ;;
moe-launches)
  # Issue 27's kernel count: moe_checks, then the experts alone (scan mode's 2 launches beside the
  # plan mode's 4) at the token counts in ARGS.
  R=$OUT/moe_launches_results
  source bench/device_setup.sh "$R"
  moe_checks 200 150
  limit=$((570 - SECONDS))
  timeout "$limit" python3 bench/moe_experts.py --seconds $((limit - 40)) \
    --out "$R/moe_experts_${GPU}_${FUSION_COMMIT:0:7}.json" "$@" > "$R/moe_experts.log" 2>&1
  echo "moe-experts bench: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/moe_experts.log" | cut -c1-400 | tail -n 30
  pack moe_launches_results
  ;;
moe-layers)
  R=$OUT/moe_layers_results
  source bench/device_setup.sh "$R"
  moe_checks 170 110
  timeout $((${LAYERS_END:-570} - SECONDS)) python3 bench/decode.py --out "$R/decode_${GPU}.json" "$@" > "$R/decode.log" 2>&1
  echo "decode bench: rc=$?"; grep -v -i "warn\|decode bench:" "$R/decode.log" | cut -c1-400 | tail -n 30
  pack moe_layers_results
  ;;
moe-experts)
  R=$OUT/moe_experts_results
  source bench/device_setup.sh "$R"
  limit=${MOE_EXPERTS_SECONDS:-480}
  timeout "$limit" python3 bench/moe_experts.py --seconds $((limit - 60)) \
    --out "$R/moe_experts_${GPU}_${FUSION_COMMIT:0:7}.json" "$@" > "$R/moe_experts.log" 2>&1
  echo "moe-experts bench: rc=$?"; grep -v -i "warn\|^ \|^$\|originates\|is_torch" "$R/moe_experts.log" | cut -c1-400 | tail -n 30
  pack moe_experts_results
  ;;
sparse-attention)
  R=$OUT/sparse_attention_results
  source bench/device_setup.sh "$R"
  run_tests decode_attention_tests 150 -m gpu tests/gpu/test_decode_attention_gpu.py tests/kernels/test_decode_attention.py
  timeout 240 python3 bench/diagnostics/decode_attention_sparse.py \
    --out "$R/decode_attention_sparse_${GPU}_${FUSION_COMMIT:0:7}.json" > "$R/sparse.log" 2>&1
  echo "sparse bench: rc=$?"; grep -v -i warn "$R/sparse.log" | cut -c1-300 | tail -n 20
  if [ $# -gt 0 ]; then
    timeout $((570 - SECONDS)) python3 bench/decode.py --out "$R/decode_${GPU}.json" "$@" > "$R/decode.log" 2>&1
    echo "decode bench: rc=$?"; grep -v -i "warn\|decode bench:" "$R/decode.log" | cut -c1-400 | tail -n 30
  fi
  pack sparse_attention_results
  ;;
*)
  echo "usage: bash bench/gpu_run.sh PHASE [ARGS...]; phases: tier mutations generate-checks generate-bench decode" \
    "decode-checks inspect dsa gated kernels moe moe-ab moe-tail moe-variants gdn gqa-tp moe-experts sparse-attention" \
    "(see the header)" >&2
  exit 2
  ;;
esac
