#!/usr/bin/env bash
# One device call: HF generate() for MODEL at batch 1 (eager, stock, ours) from two trees in one
# process each, alternating new / old / new, to tell a change of ours from a change of the
# machine (MiniMax at batch 1 went from 1.145x stock at e365f08 to 0.553x at 553705b with the same
# step graph; bench/NOTES.md, the user's path). Each tree is installed editable before its run and
# the log names the fusion_compiler it imported.
#   carry [".gpu_snap", ".gpu_old"]: .gpu_snap = git archive HEAD, .gpu_old = git archive OLD
#   cd .gpu_snap && FUSION_COMMIT=<new> OLD_COMMIT=<old> bash bench/diagnostics/generate_ab_gpu_run.sh MODEL [SECONDS]
# Results: $OUT/ab_results.tgz (one JSON and log per run).
OUT=${OUT:-/tmp/out}
R=$OUT/ab_results
model=${1:-minimax-m2.5}; limit=${2:-150}
source bench/device_setup.sh "$R"
NEW=$PWD OLD=$(cd ../.gpu_old && pwd)
run() {  # TREE COMMIT TAG
  (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install_$3.log" 2>&1 \
    && python3 -c "import fusion_compiler; print('imported', fusion_compiler.__file__)" \
    && FUSION_COMMIT=$2 FUSION_DIRTY=0 timeout "$limit" python3 bench/generate.py --model "$model" --batches 1 \
         --modes eager stock ours --repeats 5 --out "$R/generate_${model}_$3.json") > "$R/generate_$3.log" 2>&1
  echo "$3 ($2): rc=$?"; grep -E "^imported|^(eager|stock|ours) " "$R/generate_$3.log" | cut -c1-200
}
run "$NEW" "${FUSION_COMMIT:-new}" new1
run "$OLD" "${OLD_COMMIT:-old}" old
run "$NEW" "${FUSION_COMMIT:-new}" new2
tar -czf "$OUT/ab_results.tgz" -C "$OUT" ab_results && rm -rf "$R"
