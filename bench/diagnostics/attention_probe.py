"""What decode_attention is given inside a compiled step, and what it costs there.

The kernel alone skips the K / V rows a mask rules out (1.45-1.99x on the H100), yet DeepSeek
V3.2's HF layer at batch 64 took the same time with the dense launch (1786ff1: 8854 us a layer)
as with the row skip (a8e5443: 8972) and the tile range (739122c: 18404 us for two layers). The
dense launch must read the whole expanded cache (21.5 GB a layer, >= 4.5 ms), so either the skip
does not skip inside the layer or something as costly took its place. This probe answers the
first half on the GPU: while ``probe()`` is active, every eager (not capturing) launch of
``decode_attention_fwd`` is recorded (q and the mask copied, K / V by reference, the skip flag),
and ``summarise`` reports, per launch, the mask's kind and kept positions per row, the split plan,
and the launch re-timed alone on those very tensors with the skip on and off.

    with attention_probe.probe() as calls:
        step.call(compiled_fn)          # the warm-up call of our backend's step graph
    rows = attention_probe.summarise(calls, time_it=True)
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from fusion_compiler.kernels import decode_attention as kernel_module


@dataclasses.dataclass
class Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    scale: float
    skip_masked: bool


@contextlib.contextmanager
def probe(limit: int = 8):
    """Record up to ``limit`` eager launches of ``decode_attention_fwd`` (launches inside a CUDA
    graph capture run unrecorded); the recorded list is yielded and filled in place."""
    calls: list[Call] = []
    original = kernel_module.decode_attention_fwd

    def recording(q, k, v, mask, scale, out, splits=None, block_s=None, skip_masked=False):
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and len(calls) < limit:
            calls.append(Call(q.clone(), k, v, None if mask is None else mask.clone(), float(scale), bool(skip_masked)))
        return original(q, k, v, mask, scale, out, splits=splits, block_s=block_s, skip_masked=skip_masked)

    kernel_module.decode_attention_fwd = recording
    try:
        yield calls
    finally:
        kernel_module.decode_attention_fwd = original


def kept(mask: torch.Tensor) -> torch.Tensor:
    """Per mask row (the last dim), the positions the skip keeps: bool True, additive not -inf
    (``finfo.min`` is kept, as the kernel keeps it)."""
    keep = mask if mask.dtype == torch.bool else mask != float("-inf")
    return keep.reshape(-1, mask.shape[-1])


def mask_facts(mask: torch.Tensor | None) -> dict:
    if mask is None:
        return {"kind": "none"}
    keep = kept(mask)
    count = keep.sum(-1)
    positions = torch.arange(keep.shape[-1], device=keep.device)
    first = torch.where(keep, positions, keep.shape[-1]).amin(-1)
    last = torch.where(keep, positions, -1).amax(-1)
    facts = {
        "kind": "bool" if mask.dtype == torch.bool else "additive",
        "dtype": str(mask.dtype).replace("torch.", ""),
        "shape": list(mask.shape),
        "strides": list(mask.stride()),
        "kept_per_row": {"min": int(count.min()), "max": int(count.max()), "mean": float(count.float().mean())},
        "first_kept_max": int(first.max()),
        "last_kept_max": int(last.max()),
    }
    if mask.dtype != torch.bool:
        low = torch.finfo(mask.dtype).min
        facts["finfo_min_entries"] = int((mask == low).sum())
        facts["neg_inf_entries"] = int((mask == float("-inf")).sum())
    return facts


def summarise(calls: list[Call], time_it: bool = False) -> list[dict]:
    """One row per recorded launch; ``time_it`` (CUDA only) re-times it alone, skip on and off,
    on the recorded q / mask and the live K / V (read only)."""
    rows = []
    for call in calls:
        batch, heads, _, d = call.q.shape
        _, kv_heads, seq_len, dv = call.v.shape
        block_s = kernel_module.block_s_for(d, dv)
        splits, per_split = kernel_module.split_plan(batch, kv_heads, seq_len, block_s, None)
        row = {
            "q": list(call.q.shape), "k": list(call.k.shape), "v": list(call.v.shape),
            "k_strides": list(call.k.stride()), "v_strides": list(call.v.stride()),
            "dtype": str(call.q.dtype).replace("torch.", ""), "skip_masked": call.skip_masked,
            "block_s": block_s, "splits": splits, "tiles_per_split": per_split,
            "mask": mask_facts(call.mask),
        }  # fmt: skip
        if time_it and call.q.is_cuda:
            import decode  # bench/decode.py: the layers' own timer (imported here: CUDA only)

            out = torch.empty((batch, heads, 1, dv), dtype=call.q.dtype, device=call.q.device)
            for flag in (True, False):
                row[f"us_skip_{'on' if flag else 'off'}"] = decode.time_us(
                    lambda flag=flag: kernel_module.decode_attention_fwd(call.q, call.k, call.v, call.mask, call.scale,
                                                                         out, skip_masked=flag))  # fmt: skip
        rows.append(row)
    return rows
