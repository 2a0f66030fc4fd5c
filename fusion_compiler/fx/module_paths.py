"""Module paths as `named_modules()` spells them, and the decoder layer they belong to.

Shared by the match report (which reads paths out of `nn_module_stack`) and the model
adapters (which derive expected sites from the module tree); no other dependencies.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_ROOT = re.compile(r"^L\[['\"][^'\"]+['\"]\]\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_MODULES_KEY = re.compile(r"_modules\[['\"]([^'\"]+)['\"]\]")


def normalize_module_path(raw: str) -> str:
    """`L['self'].model.layers.0.input_layernorm` (or with `_modules['x']` / `[0]`, as some
    torch versions write `nn_module_stack`) -> `model.layers.0.input_layernorm`."""
    path = _ROOT.sub("", raw)
    path = _MODULES_KEY.sub(r"\1", path)
    path = _INDEX.sub(r".\1", path)
    return path.strip(".").replace("..", ".")


def layer_of(path: str | None) -> int | None:
    """`model.layers.3.self_attn.q_norm` -> 3; None outside the decoder layers."""
    if not path:
        return None
    found = _LAYER.findall(path)
    return int(found[-1]) if found else None


def module_path(node: torch.fx.Node) -> str | None:
    """The innermost module an FX node came from (its `nn_module_stack`), normalised."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    return normalize_module_path(next(reversed(stack.values()))[0])
