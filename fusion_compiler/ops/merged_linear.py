"""``fusion_compiler::merged_linear``: projections that read the same activation, as one GEMM.

``merged_linear(x [M, K], [w_0 [N_0, K], w_1 [N_1, K], ...]) -> x @ cat(w_i)^T  [M, sum N_i]``,
in x's dtype. The weights share one dtype, x's or a float that widens exactly to it (bf16 weights
of an fp32 GEMM): they are widened as they are read, not copied wider first.

On CUDA with at most ``kernels/skinny_gemm.MAX_TOKENS`` rows the GEMM is our skinny GEMM kernel
(one launch streaming the weight; cuBLAS takes a split-K GEMM and a reduce kernel there), else
torch.mm. A lone projection is this op with one weight (``FusionConfig.skinny_gemm``).

The first call with a set of weights concatenates them into one buffer and makes each weight a
view of its rows there (``w.data = merged[rows]``): the module's parameters then live in the
merged buffer, so the merge costs no memory after that call and an in-place update of a weight
(``load_state_dict``, ``copy_``) is seen by the GEMM. Every later call finds the weights already
adjacent in one buffer and reads them as one [sum N_i, K] view, with no copy. A weight replaced
by another tensor is merged again on its next eager call (a captured CUDA graph keeps the
addresses it recorded, as it does for every parameter).

The merging call must not be inside a CUDA-graph capture: the buffer would come from the
capture's private pool. The backend's step graphs and the bench's captures run the step once
first; a capture that comes first raises, saying so.
"""

from __future__ import annotations

import torch


def _adjacent(weights: list[torch.Tensor]) -> bool:
    """The weights are consecutive row blocks of one contiguous buffer."""
    first = weights[0]
    row = first.shape[1] * first.element_size()
    at = first.data_ptr()
    for w in weights:
        if not w.is_contiguous() or w.data_ptr() != at or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return False
        at += w.shape[0] * row
    return True


def merged_weight(weights: list[torch.Tensor]) -> torch.Tensor:
    """The [sum N_i, K] weight, a view when the weights are already adjacent (see the module
    docstring); otherwise made here, with each weight rebound to its rows."""
    first = weights[0]
    rows = sum(w.shape[0] for w in weights)
    if _adjacent(weights):
        return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))
    if first.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "fusion_compiler::merged_linear: the first call with these weights is inside a CUDA-graph capture; "
            "run the compiled step once before capturing it (the weights are merged on that call)"
        )
    # A buffer that outlives inference mode: it becomes the parameters' storage.
    with torch.inference_mode(False), torch.no_grad():
        merged = torch.cat([w.detach() for w in weights], dim=0)
        start = 0
        for w in weights:
            w.data = merged[start : start + w.shape[0]]
            start += w.shape[0]
    return merged


@torch.library.custom_op("fusion_compiler::merged_linear", mutates_args=())
def merged_linear(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    # One weight is read where it is: nothing to merge, so never rebound (it may be any 2-D
    # tensor the graph reads as a weight, even one the caller passed in).
    weight = weights[0] if len(weights) == 1 else merged_weight(weights)
    if x.is_cuda:
        # Imported lazily: only CUDA needs triton (and TRITON_INTERPRET must be set before it).
        from ..kernels import skinny_gemm as skinny

        if skinny.supports(x, weight):
            return skinny.skinny_gemm(x, weight)
    return torch.mm(x, weight.to(x.dtype).t())


@merged_linear.register_fake
def _(x, weights):
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))


def merged_linear_reference(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """The GEMMs it replaces, one by one, side by side."""
    return torch.cat([torch.mm(x, w.to(x.dtype).t()) for w in weights], dim=1)
