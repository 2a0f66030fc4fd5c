"""The numerics gate of `inspect`: is ours' error against eager explained, and if not, by which stage?

It fires when ours' relative error against eager exceeds ``max(1.5 × stock Inductor's, 1e-2)``.
Then, and only then (each step below costs a run or a compile):

1. A float64 run of the whole model (a deep copy; prefill and decode in float64) and the MoE
   routing of eager bf16 against it, read from forward hooks on HF's routed experts (their
   ``top_k_index`` argument) and routers (``*TopKRouter``, the scores they rank experts by). bench/NOTES.md §19: in a
   bf16 MoE model a routing near-tie that last-bit differences upstream flip puts any compiled
   mode 2e-2–8e-2 from eager, and turning off any one of several upstream stages then "fixes" it
   with no stage wrong. If ours is within the threshold of the float64 output while eager is not,
   the error is eager's tie, not ours: the gate says so and does not bisect.
2. Otherwise a bisect: ours recompiled with one stage off at a time (`stages.STAGES` order; a
   family via ``families={name: "off"}``, a graph pass or fold via its bool flag), only the stages
   that fused something in this step. Every stage whose removal brings ours back under the
   threshold is named. Several at once, with a routing flip in the row that dominates the error,
   is the mark of a near-tie, and the verdict says that too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from ..backend import FusionBackend
from ..config import FusionConfig
from ..fx.module_paths import layer_of
from ..model_adapters import make_decode_step
from ..stages import FAMILY, FOLD, GRAPH_PASS, STAGES
from ..verify import relative_error

FACTOR, FLOOR = 1.5, 1e-2


def threshold(stock_error: float) -> float:
    """What ours' error against eager may reach: 1.5 × stock Inductor's, and never under 1e-2."""
    return max(FACTOR * stock_error, FLOOR)


def switchable_stages(report) -> list[tuple[str, dict]]:
    """(stage, FusionConfig kwargs turning it alone off) for each stage that fused something in
    ``report``. A fold with no flag of its own (the GQA prologue's) goes off only with its family."""
    matched = {s.family for s in report.sites if s.status == "matched"}
    folds = report.stage_results()
    out = []
    for stage in STAGES:
        if stage.kind == FAMILY and stage.name in matched:
            out.append((stage.name, {"families": {stage.name: "off"}}))
        elif stage.kind == GRAPH_PASS and stage.name in matched:
            out.append((stage.name, {stage.flag: False}))
        elif stage.kind == FOLD and stage.flag and any(folds.get(stage.name, {}).values()):
            out.append((stage.name, {stage.flag: False}))
    return out


def ours_logits(model, batch: int, context: int, config: FusionConfig) -> torch.Tensor:
    """One decode step through our backend under ``config`` (the same inputs as inspect's runs)."""
    torch._dynamo.reset()
    fn = torch.compile(model, backend=FusionBackend(config, root=model))
    return make_decode_step(model, batch=batch, context=context, seed=0).run(fn).detach().float().cpu()


def _is_experts(module) -> bool:
    weights = [getattr(module, a, None) for a in ("gate_up_proj", "down_proj")]
    return all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)


def _choice_scores(router, logits: torch.Tensor, inputs: list) -> torch.Tensor:
    """What the router ranks experts by: ``sigmoid(logits) + e_score_correction_bias`` where it has
    that bias (DeepSeek, GLM, MiniMax; an attribute or, MiniMax, an argument), else its logits
    (softmax routers rank by them)."""
    experts = logits.shape[-1]
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        bias = next((t for t in inputs if isinstance(t, torch.Tensor) and t.shape == (experts,)), None)
    logits = logits.detach().double().cpu().reshape(-1, experts)
    return logits if bias is None else logits.sigmoid() + bias.detach().double().cpu()


@contextlib.contextmanager
def recording_routing(model):
    """Per MoE layer, the decode step's chosen expert ids ``[rows, k]`` and the scores its router
    ranked them by ``[rows, E]``, from hooks on eager modules (yields ``{layer: {"ids", "scores"}}``)."""
    seen: dict = {}
    handles = []

    def on_experts(name):
        def hook(module, args, kwargs):
            ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if isinstance(ids, torch.Tensor):
                seen.setdefault(layer_of(name), {})["ids"] = ids.detach().cpu()
        return hook

    def on_router(name):
        def hook(module, args, kwargs, out):
            logits = out[0] if isinstance(out, tuple) else out
            if isinstance(logits, torch.Tensor) and logits.is_floating_point():
                seen.setdefault(layer_of(name), {})["scores"] = _choice_scores(module, logits, [*args, *kwargs.values()])
        return hook

    for name, module in model.named_modules():
        if _is_experts(module):
            handles.append(module.register_forward_pre_hook(on_experts(name), with_kwargs=True))
        elif type(module).__name__.lower().endswith("topkrouter"):
            handles.append(module.register_forward_hook(on_router(name), with_kwargs=True))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _eager_run(model, batch: int, context: int) -> tuple[torch.Tensor, dict]:
    step = make_decode_step(model, batch=batch, context=context, seed=0)
    with recording_routing(model) as routing:
        logits = step.run(model)
    return logits.detach().double().cpu(), routing


def _float64_copy(model):
    model64 = copy.deepcopy(model).to(torch.float64)
    # torch's grouped_mm takes bf16 only (on CPU as on CUDA): the loop over experts is the same math.
    for module in model64.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    return model64


@dataclasses.dataclass
class Flip:
    layer: int | None
    row: int
    eager: list[int]
    float64: list[int]
    margin: float | None  # float64 router scores: |chosen by eager only - chosen by float64 only|, smallest

    def words(self) -> str:
        margin = f", margin {self.margin:.1e}" if self.margin is not None else ""
        return f"layer {self.layer} row {self.row} (experts {self.eager} vs {self.float64}{margin})"


def routing_flips(eager: dict, exact: dict) -> list[Flip]:
    """Rows whose chosen experts differ between eager bf16 and float64 (as sets), by layer."""
    flips = []
    for layer in sorted(set(eager) & set(exact), key=lambda l: (l is None, l)):
        a, b = eager[layer].get("ids"), exact[layer].get("ids")
        if a is None or b is None or a.shape != b.shape:
            continue
        scores = exact[layer].get("scores")
        for row in range(a.shape[0]):
            ea, eb = sorted(a[row].tolist()), sorted(b[row].tolist())
            if ea == eb:
                continue
            margin = None
            if scores is not None and scores.shape[0] == a.shape[0]:
                only_a, only_b = set(ea) - set(eb), set(eb) - set(ea)
                margin = min(abs(scores[row, i] - scores[row, j]).item() for i in only_a for j in only_b)
            flips.append(Flip(layer, row, ea, eb, margin))
    return flips


def _worst_row(actual: torch.Tensor, expected: torch.Tensor) -> int:
    diff = (actual.double() - expected.double()).reshape(actual.shape[0], -1).norm(dim=1)
    return int(diff.argmax())


def measure(logits: dict[str, torch.Tensor]) -> dict:
    """The gate's cheap half, on ``logits`` of modes eager / inductor / fusion_compiler from
    inspect's runs: the errors, the threshold and whether it fires."""
    ours, stock = (relative_error(logits[m], logits["eager"]) for m in ("fusion_compiler", "inductor"))
    limit = threshold(stock)
    fired = ours > limit
    return {"ours": ours, "stock": stock, "threshold": limit, "fired": fired, "float64": None, "flips": [],
            "bisect": [], "responsible": [],
            "verdict": f"{'FAIL' if fired else 'pass'}: ours {ours:.1e} vs stock {stock:.1e} (threshold {limit:.1e})"}


def explain(result: dict, model, batch: int, context: int, logits: dict[str, torch.Tensor], report,
            base: FusionConfig) -> dict:
    """The costly half, once `measure` fired: the float64 run, the routing against it and, unless
    a near-tie explains the error, the bisect. ``report``: our compile's, under config ``base``."""
    result = dict(result)
    eager, limit = logits["eager"], result["threshold"]
    head = f"ours {result['ours']:.1e} vs stock {result['stock']:.1e}"
    row = _worst_row(logits["fusion_compiler"], eager)
    eager_again, routing = _eager_run(model, batch, context)
    model64 = _float64_copy(model)
    exact, routing64 = _eager_run(model64, batch, context)
    del model64
    against = {m: relative_error(logits[m], exact) for m in ("fusion_compiler", "inductor")}
    against["eager"] = relative_error(eager_again, exact)
    flips = routing_flips(routing, routing64)
    result.update(float64=against, flips=[dataclasses.asdict(f) for f in flips], worst_row=row)
    in_row = [f for f in flips if f.row == row] or flips
    tie = f"a routing near-tie in {in_row[0].words()}" if in_row else ""

    if against["fusion_compiler"] <= limit < against["eager"]:
        result["responsible"] = ["routing near-tie" if tie else "eager bf16"]
        why = tie or f"eager bf16 is {against['eager']:.1e} from float64"
        result["verdict"] = f"routing: {head}: {why}; against float64 ours is {against['fusion_compiler']:.1e}"
        return result

    for name, off in switchable_stages(report):
        config = dataclasses.replace(base, **{**off, "families": {**base.families, **off.get("families", {})}},
                                     expected={})
        error = relative_error(ours_logits(model, batch, context, config), eager)
        result["bisect"].append({"stage": name, "error": error})
    fixes = [b for b in result["bisect"] if b["error"] <= limit]
    result["responsible"] = [b["stage"] for b in fixes]
    off_words = ", ".join(f"{b['stage']} (turning it off gives {b['error']:.1e})" for b in fixes)
    if len(fixes) == 1:
        why = f"family {off_words}" if fixes[0]["stage"] in {s.name for s in STAGES if s.kind == FAMILY} \
            else f"stage {off_words}"
        result["verdict"] = f"FAIL: {head}: {why}"
    elif fixes:
        why = f"any one of {off_words}"
        if tie:
            why += f"; several stages each fixing it, with {tie}: likely the tie, not a stage"
        result["verdict"] = f"FAIL: {head}: {why}"
    else:
        tried = ", ".join(f"{b['stage']} {b['error']:.1e}" for b in result["bisect"]) or "no stage fused anything"
        result["verdict"] = f"FAIL: {head}: no single stage brings it under {limit:.1e} ({tried})" + (
            f"; {tie}" if tie else "")
    result["verdict"] += f"; against float64 ours is {against['fusion_compiler']:.1e}, eager {against['eager']:.1e}"
    return result
