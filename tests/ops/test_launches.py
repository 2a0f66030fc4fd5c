"""ops/launches.py: every fused op states how many kernels it launches on CUDA, and the CPU proxy
of the GPU count (inspect/counting.py) counts each call of one of our ops as that many."""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter

import pytest
import torch

import fusion_compiler.ops
from fusion_compiler.inspect.counting import cuda_launch_proxy
from fusion_compiler.ops.launches import CUDA_LAUNCHES, cuda_launches


def _registered_ops() -> set[str]:
    """Our ops; without vLLM installed, an ops module that imports it (an op of the vLLM route,
    named as its module) stands for its op."""
    vllm_only = set()
    for module in pkgutil.iter_modules(fusion_compiler.ops.__path__):
        try:
            importlib.import_module(f"fusion_compiler.ops.{module.name}")
        except ModuleNotFoundError as error:
            if error.name.split(".")[0] != "vllm":
                raise
            vllm_only.add(module.name)
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("fusion_compiler::")}
    return ops | vllm_only


def test_every_fused_op_states_its_cuda_launches():
    assert _registered_ops() == set(CUDA_LAUNCHES)


def test_proxy_counts_our_ops_by_their_cuda_launches():
    names = Counter({"inductor::generated_kernel": 3, "extern_kernels.mm": 2, "torch.ops.vllm.moe_forward.default": 1,
                     "torch.ops.fusion_compiler.decode_attention.default": 1,
                     "torch.ops.fusion_compiler.rms_norm.default": 2})  # fmt: skip
    assert cuda_launch_proxy(names) == 3 + 2 + 1 + 2 + 2


def test_an_op_without_a_fixed_count_is_refused():
    assert cuda_launches("fusion_compiler::moe_experts") == cuda_launches("moe_experts") == 2
    with pytest.raises(ValueError, match="gdn_decode_fla launches no fixed number"):
        cuda_launches("torch.ops.fusion_compiler.gdn_decode_fla.default")
    with pytest.raises(KeyError, match="no CUDA launch count"):
        cuda_launches("fusion_compiler::not_an_op")
