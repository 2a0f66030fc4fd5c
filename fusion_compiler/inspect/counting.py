"""Kernel counting. Every count says where it came from (`count_source`), so a CPU
count is never mistaken for a hardware one.

- CUDA: kernel events from the torch profiler (memcpy/memset excluded).
- CPU, eager: aten ops dispatched at the top level (views and allocations excluded).
- CPU, compiled: launches in the wrapper code Inductor generated (its C++ kernels, extern
  GEMMs, our fused ops, fallbacks). A TorchDispatchMode cannot count these: Dynamo runs
  the model eagerly while such a mode is active. `cuda_launch_proxy` turns those into the
  CPU proxy of the GPU count: each of our ops counted as the kernels it launches on CUDA.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _compat
from ..ops.launches import cuda_launches

_ALLOCATIONS = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
    "as_strided", "lift_fresh", "detach", "alias", "_reinterpret_tensor",
}


@dataclasses.dataclass
class KernelCount:
    count: int
    device: str
    count_source: str
    names: dict[str, int] = dataclasses.field(default_factory=dict)

    def __sub__(self, other: "KernelCount") -> "KernelCount":
        names = Counter(self.names)
        names.subtract(other.names)
        return KernelCount(
            self.count - other.count,
            self.device,
            self.count_source,
            {k: v for k, v in names.items() if v},
        )

    def to_dict(self) -> dict:
        return {"count": self.count, "device": self.device, "count_source": self.count_source}


class _DispatchCounter(TorchDispatchMode):
    """Counts ops reaching the dispatcher from the top level (the mode is off inside an op)."""

    def __init__(self):
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _ALLOCATIONS and not _is_view(func):
            self.names[f"{func.namespace}::{name}"] += 1
        return func(*args, **(kwargs or {}))


def _is_view(func) -> bool:
    schema = func._schema
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def count_cpu_eager(run: Callable[[], object]) -> KernelCount:
    counter = _DispatchCounter()
    with counter:
        run()
    return KernelCount(sum(counter.names.values()), "cpu", "aten_ops_dispatched", dict(counter.names))


# A launch in Inductor's wrapper code: a generated C++/Triton kernel, an extern kernel
# (GEMMs), or an op it calls as a fallback (ours included). Allocations and views are not.
_LAUNCH = re.compile(
    r"^\s+(?:[\w, ]+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.[\w.]+|aten\.[\w.]+)\("
)


def wrapper_launches(source: str) -> Counter:
    """Kernel launches in the `call()` of one Inductor output module."""
    body = source[source.index("def call(") :] if "def call(" in source else ""
    names: Counter[str] = Counter()
    for line in body.splitlines():
        match = _LAUNCH.match(line)
        if match:
            name = match.group(1)
            names["inductor::generated_kernel" if name.startswith(("cpp_fused", "triton_")) else name] += 1
    return names


CUDA_PROXY = "CPU proxy of the GPU count"


def cuda_launch_proxy(names: Mapping[str, int]) -> int:
    """The CPU proxy of the GPU count, from `wrapper_launches` names: a call of one of our ops
    counts the kernels it launches on CUDA (ops/launches.py), any other launch (an Inductor
    kernel, an extern GEMM, a host's opaque op) one. On CUDA Inductor emits Triton kernels where
    the CPU has C++ ones, from the same scheduler (its backends differ in a few fusion rules):
    a proxy of the GPU's count, not a measurement of it."""
    return sum(n * (cuda_launches(name) if name.startswith("torch.ops.fusion_compiler.") else 1)
               for name, n in names.items())  # fmt: skip


def count_cpu_compiled(compile_and_run: Callable[[], object]) -> tuple[KernelCount, object]:
    """Compile and run once; count the launches in the wrapper code Inductor generated
    (static: decode graphs have no loops in the wrapper). Returns the count and the result."""
    result, sources = _compat.run_and_get_code(compile_and_run)
    names: Counter[str] = Counter()
    for source in sources:
        names.update(wrapper_launches(source))
    return KernelCount(sum(names.values()), "cpu", "inductor_wrapper_launches", dict(names)), result


_NOT_COMPUTE = ("memcpy", "memset", "Memcpy", "Memset")


def count_cuda_kernels(run: Callable[[], object]) -> KernelCount:
    """Kernel launches during one `run()`, read from the profiler's device events."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names: Counter[str] = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not any(s in event.name for s in _NOT_COMPUTE):
            names[event.name[:120]] += 1
    return KernelCount(sum(names.values()), "cuda", "profiler_kernel_events", dict(names))
