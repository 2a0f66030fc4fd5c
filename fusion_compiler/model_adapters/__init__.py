"""Model adapters: tiny/real HF configs, random-weight builders and decode-step helpers for the
target models (DeepSeek V3.2, MiniMax-M2.5, Qwen3.5 MoE) and for generic HF configs."""

from __future__ import annotations

import dataclasses
import json
import os

from . import deepseek_v32, minimax_m2, qwen35
from .base import (
    DEFAULT_ATTN_IMPLEMENTATION,
    DEFAULT_EXPERTS_IMPLEMENTATION,
    DecodeStep,
    ModelAdapter,
    generic_layer_kinds,
    is_rms_norm,
    layer_of,
    make_decode_step,
    randomize_weights_,
    rms_norm_modules,
    repeated_layer_types,
    rms_norm_sites,
    attention_families,
    experts_sites,
    router_sites,
    structural_sites,
)

ADAPTERS: dict[str, ModelAdapter] = {
    a.name: a for a in (deepseek_v32.ADAPTER, minimax_m2.ADAPTER, qwen35.ADAPTER)
}


def get_adapter(name: str) -> ModelAdapter:
    """The adapter called ``name`` (one of ``ADAPTERS``); ValueError listing the valid names."""
    try:
        return ADAPTERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(ADAPTERS))}") from None


# Keys of a saved config.json that are metadata, not config-class kwargs.
_META_KEYS = ("model_type", "transformers_version", "_name_or_path", "auto_map")


def adapter_from_hf_config(path: str | os.PathLike | dict) -> ModelAdapter:
    """Adapter for any transformers config JSON that names its ``model_type`` (llama, qwen3, ...),
    given as a file or as the dict such a file holds.

    The config's widths are used as both the tiny and the real config (write a small config for CPU
    work); ``default_layers`` is its ``num_hidden_layers``. A model_type of one of ``ADAPTERS``
    keeps that adapter's layer kinds and expected sites; any other takes its layer kinds from its
    ``layer_types`` (else "decoder") and its expected sites from its module tree
    (``base.structural_sites``: q/k-norm GQA and MLA attention, Gated DeltaNet layers,
    top-k routers, routed experts, every other RMSNorm that runs).
    Raises ValueError if the file is missing, is not a JSON object, has no ``model_type``, or names
    a model_type this transformers does not know.
    """
    if isinstance(path, dict):
        data, p = path, "(given as a dict)"
    else:
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise ValueError(f"HF config file not found: {p!r}")
        try:
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"HF config file {p!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"HF config file {p!r} must hold a JSON object, got {type(data).__name__}")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"HF config file {p!r} has no 'model_type' key")

    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"HF config file {p!r}: model_type {model_type!r} is not known to transformers")

    cfg = {k: v for k, v in data.items() if k not in _META_KEYS}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    layers = text.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        layers = 2
    for known in ADAPTERS.values():
        if known.model_type == model_type:
            # The same HF code as one of our models at other widths: its layer kinds and its
            # rules for which norms a bigger site takes (DeepSeek's kv_a_layernorm goes into
            # the MLA prologue, the q/k norms into the GQA prologue) hold as they are.
            return dataclasses.replace(known, name=model_type, real_config=cfg, tiny_config=cfg, default_layers=layers)
    return _generic_adapter(model_type, cfg, layers)


def _generic_adapter(model_type: str, cfg: dict, layers: int) -> ModelAdapter:
    return ModelAdapter(
        name=model_type,
        model_type=model_type,
        real_config=cfg,
        tiny_config=cfg,
        default_layers=layers,
        layer_kind_fn=generic_layer_kinds,
        layer_config_fn=repeated_layer_types,
        expected_fn=structural_sites,
        # None: leave the choice to transformers (dense models reject any experts_implementation).
        experts_implementation=None,
    )


def adapter_for(model) -> ModelAdapter:
    """The adapter of a built HF model: the one of ``ADAPTERS`` for its ``config.model_type``,
    else a generic one (expected sites from its module tree: ``base.structural_sites``)."""
    config = model.config
    model_type = getattr(config, "model_type", None) or type(model).__name__
    for known in ADAPTERS.values():
        if known.model_type == model_type:
            return known
    layers = int(getattr(config.get_text_config(decoder=True), "num_hidden_layers", 1) or 1)
    return _generic_adapter(model_type, {}, layers)


__all__ = [
    "ADAPTERS",
    "DEFAULT_ATTN_IMPLEMENTATION",
    "DEFAULT_EXPERTS_IMPLEMENTATION",
    "DecodeStep",
    "ModelAdapter",
    "adapter_for",
    "adapter_from_hf_config",
    "get_adapter",
    "is_rms_norm",
    "layer_of",
    "make_decode_step",
    "randomize_weights_",
    "rms_norm_modules",
    "rms_norm_sites",
]
