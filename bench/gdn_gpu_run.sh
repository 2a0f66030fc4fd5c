#!/usr/bin/env bash
# One device call for issue 6: the GDN decode op / kernel tests on CUDA, the kernel's tiling
# sweep, then (fla-core installed) the fla lowering's tests and the GDN core bench at Qwen3.5's
# real dims (eager, stock Inductor, fla's kernels, ours, ours with the "fla" lowering; batch 1,
# 8, 64, 256). Results in $OUT/gdn_results.tgz (the device returns at most 8 files). ~8 min.
#
# Call it with carry: [".wheels"]. .wheels/ (git-ignored) holds fla-core 0.6.0 and its one
# non-torch dependency, einops (the device is offline):
#   pip download --no-deps fla-core==0.6.0 einops==0.8.2 -d .wheels/
# fla-core's other requirements (torch >= 2.7, triton >= 3.3) are the device's own.
OUT=${OUT:-/tmp/out}
R=$OUT/gdn_results
source bench/device_setup.sh "$R"
# The tests first: with fla installed, HF's GDN layer (their reference) would run fla's kernels.
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_decode.py tests/ops/test_gdn_decode.py 2>&1 | tail -n 25 | tee "$R/gdn_tests_cuda.log"
timeout 200 python3 bench/gdn_tiling_sweep.py --out "$R/gdn_tiling_sweep_h200.json" 2>&1 | grep -v -i warn | grep "best\|error" | tail -n 12
if ls .wheels/fla_core-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .wheels/einops-*.whl .wheels/fla_core-*.whl > "$R/fla_install.log" 2>&1 \
    || { echo "fla install failed (the bench runs without the fla rows):"; tail -n 5 "$R/fla_install.log"; }
  python3 -c "import fla.ops.gated_delta_rule, fla.modules.causal_conv1d, fla.modules.norm.layernorm_gated; print('fla', fla.__version__)" 2>&1 | tail -n 2 | tee -a "$R/versions.log"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gdn_fla.py 2>&1 | tail -n 5 | tee "$R/fla_tests_cuda.log"
else
  echo "no .wheels/fla_core-*.whl: was the call made with carry: [\".wheels\"]? The bench runs without the fla rows." | tee -a "$R/versions.log"
fi
timeout 200 python3 bench/gdn_decode.py --out "$R/gdn_decode_h200.json" > "$R/gdn_decode.log" 2>&1
grep -v -i warn "$R/gdn_decode.log" | cut -c1-700 | tail -n 40
tar -czf "$OUT/gdn_results.tgz" -C "$OUT" gdn_results && rm -rf "$R"
