"""Count Triton kernel launches, on CUDA and under TRITON_INTERPRET alike.

    with count_launches() as launches:
        op(x)
    assert launches.names == ["rms_norm_kernel"]

Every `kernel[grid](...)` goes through `JITFunction.run` (compiled) or
`InterpretedFunction.run` (interpreter); both are wrapped for the duration of the block.
Warm-up calls (`warmup=True`) compile without launching and are not counted.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from triton.runtime import interpreter, jit


@dataclass
class Launches:
    names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)


def _name(fn) -> str:
    inner = getattr(fn, "fn", fn)
    return getattr(inner, "__name__", type(fn).__name__)


@contextlib.contextmanager
def count_launches():
    launches = Launches()
    originals = {cls: cls.run for cls in (jit.JITFunction, interpreter.InterpretedFunction)}

    def wrap(original):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                launches.names.append(_name(self))
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    for cls, original in originals.items():
        cls.run = wrap(original)
    try:
        yield launches
    finally:
        for cls, original in originals.items():
            cls.run = original
