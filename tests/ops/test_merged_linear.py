"""fusion_compiler::merged_linear: one GEMM over the projections' weights, merged in place once."""

from __future__ import annotations

import torch

from fusion_compiler.ops import merged_linear as ops


def _weights(gen, *widths, k=64):
    return [torch.nn.Parameter(torch.randn(n, k, generator=gen)) for n in widths]


def test_equals_the_gemms_it_replaces():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    weights = _weights(gen, 48, 16, 16)
    expected = ops.merged_linear_reference(x.double(), [w.detach().double() for w in weights]).float()
    out = torch.ops.fusion_compiler.merged_linear(x, weights)
    assert out.shape == (5, 80)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_weights_narrower_than_x_are_widened_exactly():
    """bf16 weights under an fp32 x (``x @ w.float().t()``): merged in their own dtype, widened as
    read; the output is x's dtype and equals the fp32 GEMMs of the widened weights."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen)
    weights = [torch.nn.Parameter(w.bfloat16()) for w in _weights(gen, 24, 8)]
    expected = torch.cat([x.double() @ w.detach().double().t() for w in weights], dim=1).float()
    out = torch.ops.fusion_compiler.merged_linear(x, weights)
    assert out.dtype == torch.float32 and weights[0].dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.merged_linear_reference(x, weights), expected, rtol=1e-5, atol=1e-5)


def test_the_weights_become_rows_of_one_buffer_once():
    gen = torch.Generator().manual_seed(1)
    weights = _weights(gen, 32, 8)
    before = [w.detach().clone() for w in weights]
    merged = ops.merged_weight(weights)
    assert weights[0].data_ptr() == merged.data_ptr()  # the parameters now live in the buffer
    assert weights[1].data_ptr() == merged.data_ptr() + 32 * 64 * 4
    for w, old in zip(weights, before, strict=True):
        assert torch.equal(w.detach(), old) and isinstance(w, torch.nn.Parameter)
    again = ops.merged_weight(weights)  # adjacent now: a view, no copy
    assert again.data_ptr() == merged.data_ptr() and again.shape == (40, 64)


def test_an_in_place_update_is_seen_and_a_replaced_weight_is_merged_again():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen)
    weights = _weights(gen, 16, 16)
    torch.ops.fusion_compiler.merged_linear(x, weights)
    with torch.no_grad():
        weights[1].add_(1.0)  # e.g. load_state_dict after compiling
    torch.testing.assert_close(torch.ops.fusion_compiler.merged_linear(x, weights),
                               ops.merged_linear_reference(x, weights))  # fmt: skip
    weights[0] = torch.nn.Parameter(torch.randn(16, 64, generator=gen))
    torch.testing.assert_close(torch.ops.fusion_compiler.merged_linear(x, weights),
                               ops.merged_linear_reference(x, weights))  # fmt: skip


def test_under_inference_mode_the_parameters_stay_normal_tensors():
    gen = torch.Generator().manual_seed(3)
    weights = _weights(gen, 8, 8)
    with torch.inference_mode():
        torch.ops.fusion_compiler.merged_linear(torch.randn(2, 64), weights)
    assert not weights[0].is_inference()
    weights[0].detach().add_(0)  # still usable outside inference mode


def test_one_weight_is_read_in_place_never_rebound():
    """A lone projection's weight (FusionConfig.skinny_gemm) may be any tensor, even a
    non-contiguous input: it is read as it is, its storage left alone."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 64, generator=gen)
    weight = torch.randn(64, 24, generator=gen).t()  # [24, 64], not contiguous
    ptr, strides = weight.data_ptr(), weight.stride()
    out = torch.ops.fusion_compiler.merged_linear(x, [weight])
    torch.testing.assert_close(out, x @ weight.t())
    assert weight.data_ptr() == ptr and weight.stride() == strides
