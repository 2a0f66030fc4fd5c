#!/usr/bin/env bash
# One device call: install, GPU tier tests, the CPU-tier pattern tests on the H200's torch,
# and the kernel bench. Everything lands in $OUT.
OUT=${OUT:-/tmp/out}
source bench/device_setup.sh "$OUT"
python3 -m pytest -q -m gpu tests/kernels tests/gpu -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/gpu_tier.log"
python3 bench/kernels.py --out "$OUT/kernels_h200.json" 2>&1 | tee "$OUT/bench.log"
timeout 240 python3 -m pytest -q -x -p no:faulthandler -p no:cacheprovider tests/patterns tests/passes 2>&1 | tail -n 30 | tee "$OUT/cpu_tier_on_gpu_torch.log"
