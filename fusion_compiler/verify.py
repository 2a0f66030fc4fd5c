"""`verify`: check a compiled graph against the graph before our pass, on its first call."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .passes import Site


class VerificationError(AssertionError):
    """The fused graph disagrees with the unfused one beyond tolerance."""


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; inf if shapes differ or NaN appears."""
    if actual.shape != expected.shape:
        return float("inf")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if not torch.equal(torch.isnan(a), torch.isnan(e)):
        return float("inf")
    a, e = a.nan_to_num(0.0), e.nan_to_num(0.0)
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def verify_first_call(
    gm: torch.fx.GraphModule, compiled: Callable, sites: Sequence[Site], rtol: float
) -> Callable:
    """Wrap `compiled` so its first call is checked against `gm` run eagerly.

    `gm` is the graph Dynamo handed the backend: the graph as it was before our pass.
    It runs on cloned inputs, so mutated buffers (caches) are compared too.
    """
    state = {"checked": False}

    def run(*args):
        if state["checked"]:
            return compiled(*args)
        state["checked"] = True
        clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        with torch.no_grad():
            expected = gm(*clones)
        actual = compiled(*args)
        problems = _compare(_flat(actual), _flat(expected), "output", rtol)
        for i, (arg, clone) in enumerate(zip(args, clones)):
            if isinstance(arg, torch.Tensor):
                problems += _compare([arg], [clone], f"input {i} after mutation", rtol)
        if problems:
            where = ", ".join(f"{s.variant} at {s.module}" for s in sites) or "no fused sites"
            raise VerificationError(
                f"fused graph differs from the unfused graph: {'; '.join(problems)}. Fused sites: {where}"
            )
        return actual

    return run


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _compare(actual: list, expected: list, what: str, rtol: float) -> list[str]:
    problems = []
    for i, (a, e) in enumerate(zip(actual, expected)):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor) and a.is_floating_point():
            err = relative_error(a, e)
            if not err <= rtol:
                problems.append(f"{what} {i}: relative error {err:.3g} > {rtol}")
    return problems
