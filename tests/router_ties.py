"""Which tokens' MoE routing is a near tie, so that a test comparing a compiled HF model with eager
can leave exactly those tokens out (bench/NOTES.md section 19: where a router's k-th and
(k+1)-th experts score within a few bf16 steps, any change of rounding upstream, ours or stock
Inductor's or another torch version's, may pick the other expert, and that token's output moves
by 0.1-0.3; neither pick is wrong).

    with router_margins(model) as margins:
        eager = model(...)
    tied = near_tied(margins, (batch, tokens))   # bool [batch, tokens]

A router is a module named ``*.mlp.gate`` with an [experts, hidden] ``weight`` (HF's MoE
routers: DeepSeek V3.2, Qwen3.5, MiniMax, ...); it chooses by the logits (softmax keeps their
order) or by sigmoid + ``e_score_correction_bias`` where it has one (group selection is left
out: it only removes candidates). The margin is in logit units, where the rounding noise is: the
k-th and (k+1)-th logits' gap, or the sigmoid scores' gap over the sigmoid's slope at the k-th.
"""

from __future__ import annotations

import contextlib

import torch

# Gap in logits between the k-th and (k+1)-th choices under which a pick is a coin flip: about
# 2.5 bf16 steps of a logit near 1 (2**-8 each).
TIE_MARGIN = 1e-2


@contextlib.contextmanager
def router_margins(model: torch.nn.Module):
    """Yield a list that fills, per router call, with each token's gap in logits (fp32, from the
    router's own input) between its k-th and (k+1)-th choices."""
    top_k = model.config.get_text_config(decoder=True).num_experts_per_tok
    margins: list[torch.Tensor] = []

    def record(module, args, _out):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        logits = x @ module.weight.float().t()
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None:
            top = logits.topk(top_k + 1, dim=-1).values
            margins.append(top[:, top_k - 1] - top[:, top_k])
            return
        top, ids = (logits.sigmoid() + bias.float()).topk(top_k + 1, dim=-1)
        slope = logits.gather(1, ids[:, top_k - 1 : top_k]).sigmoid().squeeze(1)
        margins.append((top[:, top_k - 1] - top[:, top_k]) / (slope * (1 - slope)))

    routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate") and getattr(m, "weight", None) is not None]
    handles = [m.register_forward_hook(record) for m in routers]
    try:
        yield margins
    finally:
        for handle in handles:
            handle.remove()


def near_tied(margins: list[torch.Tensor], shape: tuple[int, int], prefill: bool = False) -> torch.Tensor:
    """Bool [batch, tokens]: tokens some router call put within ``TIE_MARGIN`` of a tie (only the
    calls over ``batch * tokens`` rows count). ``prefill``: also every later token of that
    sequence, which attends to the flipped one."""
    rows = [m.view(shape) for m in margins if m.numel() == shape[0] * shape[1]]
    tied = torch.zeros(shape, dtype=torch.bool)
    for m in rows:
        tied |= m < TIE_MARGIN
    return tied.cummax(dim=1).values if prefill else tied
