"""The replacements' one way to call the prologue ops, for either lowering.

``kv_prologue`` returns the kv-side op's five outputs, then its new latent and index caches
(None where absent): the Triton op through ``auto_functionalized`` (it mutates the caches), or
for lowering "inductor" the canonical decomposition, which returns the same tuple.
``q_prologue`` returns the q-side op's three outputs. Arguments not given take the ops'
defaults. Used by every family that lowers to these ops (mla_prologue, add_rms_norm's FP8
norms), so they all build the calls the horizontal merge recognises.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..ops import mla_kv_prologue as kv_ops
from ..ops import mla_q_prologue as q_ops


def kv_prologue(lowering: str, **kwargs):
    if lowering == "inductor":
        return kv_ops.mla_kv_prologue_canonical(**kwargs)
    return _compat.auto_functionalized(torch.ops.fusion_compiler.mla_kv_prologue.default, **{**kv_ops.DEFAULTS, **kwargs})


def q_prologue(lowering: str, **kwargs):
    if lowering == "inductor":
        return q_ops.mla_q_prologue_reference(**kwargs)  # plain torch, functional: Inductor fuses it
    args = {**q_ops.DEFAULTS, **kwargs}
    return torch.ops.fusion_compiler.mla_q_prologue(*(args[n] for n in q_ops._ARG_NAMES))
