"""Does Triton's fp32 -> float8e4nv cast (triton 3.6, H200) round like torch's? Counts codes
that differ over random values and over exact midpoints between adjacent e4m3 codes.

    python bench/diagnostics/fp8_cast_check.py
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float8e4nv), mask=mask)


def differing(x: torch.Tensor) -> tuple[int, list]:
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    _cast[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    ref = x.to(torch.float8_e4m3fn)
    bad = y.view(torch.uint8) != ref.view(torch.uint8)
    return int(bad.sum()), [(float(a), float(b), float(c)) for a, b, c in zip(x[bad][:5], y[bad][:5].float(), ref[bad][:5].float())]


print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
codes = torch.arange(0, 126, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn).float()
midpoints = (codes[:-1] + codes[1:]) / 2
near = torch.cat([midpoints, torch.nextafter(midpoints, torch.full_like(midpoints, 1e9)), torch.nextafter(midpoints, torch.zeros_like(midpoints))])
for name, x in (("random", torch.randn(1 << 24, device="cuda") * 64), ("midpoints", near), ("-midpoints", -near)):
    n, examples = differing(x.contiguous())
    print(f"{name}: {n} of {x.numel()} codes differ from torch; e.g. (x, triton, torch) {examples}")
