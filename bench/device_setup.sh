# Sourced by bench/gpu_run.sh and bench/diagnostics/*_gpu_run.sh: strict shell, an editable
# install of this checkout (the device is offline: no deps, no build isolation), one line of
# versions, inspect_one and generate_isolated.
# Usage: source bench/device_setup.sh DIR   (DIR receives install.log and versions.log)
set -uo pipefail
export PYTHONUNBUFFERED=1
SETUP_DIR=$1
mkdir -p "$1"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$1/install.log" 2>&1 || { cat "$1/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$1/versions.log"
# The card in result names (h100, h200): the device tool may hand out either.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -o -E 'H[0-9]+' | tr H h)
GPU=${GPU:-gpu}

# inspect_one MODEL SECONDS: inspect --device cuda at real widths into DIR (JSON and log), then
# the log's tail.
inspect_one() {
  timeout "$2" fusion-compiler inspect "$1" --device cuda --json "$SETUP_DIR/inspect_$1_real_cuda.json" > "$SETUP_DIR/inspect_$1.log" 2>&1
  echo "inspect $1: rc=$?"; grep -v -i warn "$SETUP_DIR/inspect_$1.log" | cut -c1-300 | tail -n 14
}

# generate_isolated MODEL END: bench/generate.py at batch 1, stock and ours each in a fresh process
# (--isolate), into DIR until second END of the call, then the log's table.
generate_isolated() {
  timeout $(($2 - SECONDS)) python3 bench/generate.py --model "$1" --batches 1 --modes stock ours --isolate \
    --repeats 5 --out "$SETUP_DIR/generate_${GPU}_$1_isolated_${FUSION_COMMIT:0:7}.json" > "$SETUP_DIR/generate_$1.log" 2>&1
  echo "$1: rc=$? at ${SECONDS}s"; grep -E "^(mode|stock|ours) " "$SETUP_DIR/generate_$1.log" | tail -n 3 | cut -c1-200
}
