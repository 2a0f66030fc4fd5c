# Sourced by the bench/*_gpu_run.sh scripts: strict shell, an editable install of this checkout
# (the device is offline: no deps, no build isolation) and one line of versions.
# Usage: source bench/device_setup.sh DIR   (DIR receives install.log and versions.log)
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$1"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$1/install.log" 2>&1 || { cat "$1/install.log"; exit 1; }
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$1/versions.log"
