"""The gdn family's lowering "fla" (kernels/gdn_fla.py): fla-core's kernels composed into the
gdn_decode contract. The slot scatter runs everywhere (Triton interpreter on CPU); the op on
fla's kernels needs CUDA and fla-core (fla's recurrence cannot run under the interpreter: its
``tl.range`` over a runtime bound fails there), so those tests run on the GPU tier only."""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, HAS_CUDA, skip_unless_kernels_can_run

skip_unless_kernels_can_run()

from fusion_compiler.kernels import gdn_fla  # noqa: E402
from fusion_compiler.ops.gdn_decode import gdn_decode_reference  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402


def test_scatter_rows_writes_live_rows_and_skips_padding():
    dst = torch.randn(6, 3, 5, device=DEVICE)
    before = dst.clone()
    src = torch.randn(4, 3, 5, device=DEVICE)
    slots = torch.tensor([4, -1, 0, 2], device=DEVICE)
    gdn_fla.scatter_rows(dst, src, slots)
    expected = before.clone()
    expected[[4, 0, 2]] = src[[0, 2, 3]]
    assert torch.equal(dst, expected)


def test_scatter_rows_needs_contiguous_rows():
    with pytest.raises(ValueError, match="contiguous"):
        gdn_fla.scatter_rows(torch.zeros(4, 6, device=DEVICE).t(), torch.zeros(2, 4, device=DEVICE), torch.zeros(2))


def needs_cuda(test):
    """The GPU tier's (``-m gpu``): fla-core's kernels run on CUDA only."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="the fla lowering runs fla-core's kernels on CUDA")(test))


KEY_HEADS, RATIO, KEY_DIM, VALUE_DIM, KERNEL = 2, 4, 64, 64, 4


def _args(tokens=5, num_slots=9, width=KERNEL, qk_eps=1e-6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hv = KEY_HEADS * RATIO
    conv_dim = 2 * KEY_HEADS * KEY_DIM + hv * VALUE_DIM

    def rand(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    slots[1] = -1
    return [
        rand(tokens, conv_dim), rand(tokens, hv * VALUE_DIM), rand(tokens, hv), rand(tokens, hv),
        rand(conv_dim, 1, KERNEL, scale=0.5), (torch.rand(hv, generator=gen) * 2).to(DEVICE), rand(hv),
        rand(VALUE_DIM, scale=0.2) + 1, 1e-6, qk_eps, rand(num_slots, conv_dim, width),
        rand(num_slots, hv, KEY_DIM, VALUE_DIM, scale=0.2, dtype=torch.float32), slots.to(DEVICE),
    ]  # fmt: skip


@needs_cuda
def test_fla_op_matches_the_reference_at_the_slots():
    pytest.importorskip("fla")
    args = _args()
    ref_args = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
    expected = gdn_decode_reference(*ref_args)
    before = [args[10].clone(), args[11].clone()]
    out = torch.ops.fusion_compiler.gdn_decode_fla(*args)
    slots = args[12].cpu()
    live = slots >= 0
    # fla takes beta's sigmoid and the norm weight in fp32 where the reference (HF) rounds to bf16.
    assert relative_error(out[live.to(DEVICE)], expected[live.to(DEVICE)]) < 1e-2
    assert torch.equal(out[~live.to(DEVICE)], torch.zeros_like(out[~live.to(DEVICE)])), "padding rows are zero"
    written = slots[live]
    assert torch.equal(args[10][written], ref_args[10][written]), "conv state (a shift: exact)"
    assert relative_error(args[11][written], ref_args[11][written]) < 1e-2
    untouched = torch.ones(args[10].shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(args[10][untouched], before[0][untouched]) and torch.equal(args[11][untouched], before[1][untouched])


@needs_cuda
@pytest.mark.parametrize("change, words", [(dict(width=KERNEL - 1), "window of the kernel"), (dict(qk_eps=1e-5), "1e-6")])
def test_fla_op_refuses_what_fla_cannot_do(change, words):
    with pytest.raises(ValueError, match=words):
        torch.ops.fusion_compiler.gdn_decode_fla(*_args(**change))
