#!/usr/bin/env bash
# Device call for issue 25: the whole GPU tier (every test marked gpu, tests/ included) in one call.
#   carry ["wheels"]; FUSION_COMMIT=<sha> FUSION_DIRTY=0 bash bench/gpu_tier_run.sh
# wheels/ (git-ignored; fill it here with `pip download fla-core==0.6.0 einops==0.8.2 --no-deps
# -d wheels/`) holds fla-core, which the gdn family's lowering "fla" runs and the device lacks,
# and einops, its one dependency (installed only if the device has none). The tier must end with
# 0 skipped: a test that needs fla fails without it rather than skipping.
# Writes $OUT/gpu_tier.log (the pytest log) and $OUT/setup/ (install logs, versions); prints the
# summary line, the failures and every skip. TIER_SECONDS (default 480) bounds pytest so the
# call ends inside its 10 minutes.
OUT=${OUT:-/tmp/out}
R=$OUT
source bench/device_setup.sh "$R/setup"
echo "commit ${FUSION_COMMIT:-unknown} dirty ${FUSION_DIRTY:-unknown}" | tee -a "$R/setup/versions.log"
python3 -m pip install -q --no-index --no-deps wheels/fla_core-*.whl > "$R/setup/wheels.log" 2>&1 \
  || { cat "$R/setup/wheels.log"; exit 1; }
python3 -c "import einops" 2> /dev/null \
  || python3 -m pip install -q --no-index --no-deps wheels/einops-*.whl >> "$R/setup/wheels.log" 2>&1 \
  || { cat "$R/setup/wheels.log"; exit 1; }
python3 -c "import fla, einops; print('fla-core', fla.__version__, 'einops', einops.__version__)" 2>&1 \
  | grep -v -i warn | tee -a "$R/setup/versions.log"
timeout "${TIER_SECONDS:-480}" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=20 -m gpu tests \
  > "$R/gpu_tier.log" 2>&1
rc=$?
echo "gpu tier: rc=$rc $(tail -n 1 "$R/gpu_tier.log")"
grep -E "^(FAILED|ERROR) " "$R/gpu_tier.log" | cut -c1-300 | head -n 40
grep -E "^E  " "$R/gpu_tier.log" | cut -c1-300 | head -n 30
skips=$(grep -c -E "^SKIPPED" "$R/gpu_tier.log")
echo "skipped: $skips"
grep -E "^SKIPPED" "$R/gpu_tier.log" | cut -c1-300 | head -n 20
sed -n '/slowest .*durations/,/^$/p' "$R/gpu_tier.log" | head -n 22
exit $rc
