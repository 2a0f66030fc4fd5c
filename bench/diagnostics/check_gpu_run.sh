#!/usr/bin/env bash
# One short device call (session 7, ~6 min): the GPU tests that had not passed on the final code
# - the routing kernels (moe_route-12), the GDN op / kernels (gdn_decode-7) and the GPU tier
# (backend + step graphs over 1,000 steps) - run side by side as three processes (correctness
# only, so sharing the GPU is harmless); then fla-core installed, its lowering's tests, and the
# GDN core bench alone on the GPU. Call it with carry: [".wheels"] (see the gdn phase of bench/gpu_run.sh).
# Results in $OUT/check_results.tgz; every pytest log is grepped for FAILED / E lines.
OUT=${OUT:-/tmp/out}
R=$OUT/check_results
source bench/device_setup.sh "$R"
tests() {  # name, then pytest arguments
  local name=$1; shift
  timeout 150 python3 -m pytest -q -p no:cacheprovider "$@" > "$R/$name.log" 2>&1
  echo "$name: rc=$? $(tail -n 1 "$R/$name.log")"
}
tests moe_kernels tests/kernels/test_moe_route.py &
tests gdn_kernels tests/kernels/test_gdn_decode.py tests/ops/test_gdn_decode.py &
tests gpu_tier tests/gpu &
wait
grep -h -E "^FAILED|^E " "$R"/moe_kernels.log "$R"/gdn_kernels.log "$R"/gpu_tier.log | cut -c1-300 | head -n 30
python3 -m pip install -q --no-deps --no-index .wheels/einops-*.whl .wheels/fla_core-*.whl > "$R/fla_install.log" 2>&1 \
  || { echo "fla install failed:"; tail -n 5 "$R/fla_install.log"; }
tests fla_lowering tests/kernels/test_gdn_fla.py
grep -h -E "^FAILED|^E " "$R"/fla_lowering.log | cut -c1-300 | head -n 10
timeout 200 python3 bench/gdn_decode.py --out "$R/gdn_decode_h200.json" > "$R/gdn_decode.log" 2>&1
echo "gdn bench rc=$?"; grep -v -i warn "$R/gdn_decode.log" | cut -c1-600 | tail -n 30
tar -czf "$OUT/check_results.tgz" -C "$OUT" check_results && rm -rf "$R"
