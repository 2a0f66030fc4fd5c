#!/usr/bin/env bash
# One device call on the 2-GPU kind (nvidia-h200-x2), for issue 5's tensor-parallel path: the
# TP test with each rank on its own GPU (NCCL; the ops' Triton kernels, not their references).
# NVLink multicast stays off (the device library's KINDS.md). Results in $OUT/tp_results.tgz.
OUT=${OUT:-/tmp/out}
R=$OUT/tp_results
source bench/device_setup.sh "$R"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee -a "$R/versions.log"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/patterns/test_gqa_prologue_tp.py 2>&1 | tail -n 30 | tee "$R/tp_tests_cuda.log"
tar -czf "$OUT/tp_results.tgz" -C "$OUT" tp_results && rm -rf "$R"
