"""bench/diagnostics/attention_probe.py: it records the launches decode_attention's CUDA impl
makes and says, per mask row, what the skip keeps (the GPU question it answers is in its
docstring). On CPU the kernel runs under the Triton interpreter."""

from __future__ import annotations

import inspect
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from diagnostics import attention_probe  # noqa: E402

from fusion_compiler.kernels import decode_attention as kernel_module  # noqa: E402
from fusion_compiler.ops import decode_attention as op_module  # noqa: E402


def _inputs(batch=2, heads=2, seq=40, d=16, dv=8):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, d, generator=gen)
    k = torch.randn(batch, heads, seq, d, generator=gen)
    v = torch.randn(batch, heads, seq, dv, generator=gen)
    return q, k, v


def test_probe_records_the_launch_and_restores_the_kernel():
    q, k, v = _inputs()
    mask = torch.zeros(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :5] = True
    mask[1, ..., 10:13] = True
    out = torch.empty(2, 2, 1, 8)
    original = kernel_module.decode_attention_fwd
    with attention_probe.probe() as calls:
        kernel_module.decode_attention_fwd(q, k, v, mask, 0.25, out, skip_masked=True)
    assert kernel_module.decode_attention_fwd is original
    assert len(calls) == 1 and calls[0].skip_masked and calls[0].k is k
    expected = op_module.decode_attention_reference(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    (row,) = attention_probe.summarise(calls)
    assert row["mask"]["kind"] == "bool"
    assert row["mask"]["kept_per_row"] == {"min": 3, "max": 5, "mean": 4.0}
    assert (row["mask"]["first_kept_max"], row["mask"]["last_kept_max"]) == (10, 12)
    assert row["skip_masked"] and row["splits"] * row["tiles_per_split"] * row["block_s"] >= 40
    assert "us_skip_on" not in row  # timing is CUDA only


def test_additive_mask_facts_keep_finfo_min_as_the_kernel_does():
    mask = torch.full((1, 1, 1, 8), float("-inf"), dtype=torch.bfloat16)
    mask[..., 2] = 0.0
    mask[..., 5] = torch.finfo(torch.bfloat16).min
    facts = attention_probe.mask_facts(mask)
    assert facts["kind"] == "additive" and facts["kept_per_row"]["max"] == 2
    assert (facts["finfo_min_entries"], facts["neg_inf_entries"]) == (1, 6)
    assert attention_probe.mask_facts(None) == {"kind": "none"}


def test_the_ops_cuda_impl_looks_the_kernel_up_at_call_time():
    """The probe patches the kernel module's attribute; the op's CUDA impl must import it inside
    the call, or a probe would record nothing."""
    source = inspect.getsource(op_module._cuda)
    assert "from fusion_compiler.kernels.decode_attention import decode_attention_fwd" in source
