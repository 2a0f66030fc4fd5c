"""What HF's Qwen3.5 does under our backend when fla-core is importable (HF then runs fla's
delta-rule kernel in decode instead of its torch code): inspect at tiny dims on CUDA, with a
traceback dump if it hangs.  python3 bench/diagnostics/hf_qwen_fla.py OUT.json [SECONDS]"""

import faulthandler
import inspect
import json
import os
import sys
import time

import torch
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as hf

from fusion_compiler.inspect.run import inspect_model
from fusion_compiler.model_adapters import get_adapter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
import common  # noqa: E402

faulthandler.dump_traceback_later(float(sys.argv[2]) if len(sys.argv) > 2 else 170, exit=True)
resolved = {name: getattr(inspect.getclosurevars(getattr(hf, name)).nonlocals.get("implementation"), "__module__", "?")
            for name in
            ("torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule", "causal_conv1d_update")}
print("HF resolved:", resolved, flush=True)
adapter = get_adapter("qwen3.5")
start = time.perf_counter()
try:
    result = inspect_model(adapter, "tiny", adapter.default_layers, "cuda")
    error = None
except Exception as e:  # noqa: BLE001 - the diagnostic records what broke
    result, error = None, f"{type(e).__name__}: {e}"
record = {"resolved": resolved, "seconds": time.perf_counter() - start, "error": error,
          "torch": torch.__version__, "result": result}
common.write_json(sys.argv[1], json.loads(json.dumps(record, default=str)))  # tuples, dtypes as text
print(json.dumps({k: v for k, v in record.items() if k != "result"}, default=str))
print(json.dumps(result, default=str)[:3000] if result else "")
