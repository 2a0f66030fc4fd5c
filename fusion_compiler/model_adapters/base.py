"""Generic HF helpers shared by the model adapters.

* :class:`ModelAdapter` -- one model family: real/tiny configs, building a randomly initialised
  HF ``*ForCausalLM`` and naming the kind of each decoder layer.
* :func:`make_decode_step` / :class:`DecodeStep` -- an eagerly prefilled ``StaticCache`` plus the
  kwargs of one next-token step, runnable by the eager model and by ``torch.compile(model)``.
* :func:`rms_norm_sites` -- the RMSNorm modules that really run in one decode step (found with
  forward hooks, not written by hand) and how often each runs.

Only random weights are used: nothing is ever downloaded.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..fx.module_paths import layer_of

log = logging.getLogger("fusion_compiler")

# Experts implementation used when none is asked for: "grouped_mm" (the transformers 5.17 default,
# torch.nn.functional.grouped_mm over the full expert weights with per-expert offsets). Checked on
# torch 2.13 CPU and torch 2.11 H200: eager decode matches the "eager" loop to 1e-6 (fp32) and
# torch.compile(backend="inductor") traces the whole decode step with 0 graph breaks.
# Alternatives (pass `experts_implementation=`): "eager" is a Python loop over the experts hit
# (`nonzero`: 8 graph breaks for a 2-layer tiny MiniMax, one graph per expert loop); "batched_mm"
# is also break-free but gathers the top-k experts' weights (gate_up_proj[expert_ids]) into a copy,
# i.e. ~0.5 GB per DSv3.2 layer per decode step at real size.
DEFAULT_EXPERTS_IMPLEMENTATION = "grouped_mm"
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"

# Random-init scales (see `randomize_weights_`).
_INIT_STD = 0.02
_NORM_WEIGHT_STD = 0.1


# --------------------------------------------------------------------------------------------------
# Module classification helpers
# --------------------------------------------------------------------------------------------------

def is_rms_norm(module: torch.nn.Module) -> bool:
    """True for RMSNorm modules: ``torch.nn.RMSNorm`` or any class whose name contains "RMSNorm"
    (so gated norms such as ``Qwen3_5MoeRMSNormGated`` count). LayerNorm never counts."""
    if isinstance(module, torch.nn.LayerNorm):
        return False
    return isinstance(module, torch.nn.RMSNorm) or "RMSNorm" in type(module).__name__


def generic_layer_kinds(config) -> list[str]:
    """A config's ``layer_types`` where it has them (hybrid stacks: Qwen3-Next's
    "linear_attention" / "full_attention"), else one "decoder" per layer."""
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or [])
    return types[:n] if len(types) >= n else ["decoder"] * n


def repeated_layer_types(cfg: dict, layers: int) -> dict:
    """``layer_types`` for a stack of ``layers`` from a config file's own list, repeated as its
    pattern repeats (transformers requires one entry per layer)."""
    types = cfg.get("layer_types")
    if not isinstance(types, list) or not types:
        return {}
    return {"layer_types": [types[i % len(types)] for i in range(layers)]}


# --------------------------------------------------------------------------------------------------
# Random initialisation
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def randomize_weights_(model: torch.nn.Module, generator_seed: int) -> None:
    """Make HF's random init informative for tests (in place, deterministic for a seed).

    * RMSNorm weights: HF inits them to ones (``x*w``) or, for Gemma-style ``x*(1+w)`` norms, to
      zeros. Either way a missing weight multiply would go unseen, so: ones -> ``1 + 0.1*randn``,
      zeros (Gemma-style) -> ``0.1*randn``.
    * LayerNorm: weight -> ``1 + 0.1*randn``; its bias (zeros) follows the rule below.
    * Any other floating parameter or persistent buffer left all-zero (biases, the routers'
      ``e_score_correction_bias``) or non-finite -> ``normal(0, 0.02)``.
    Non-persistent buffers (RoPE ``inv_freq``) are left alone.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(generator_seed))

    def randn_like(t: torch.Tensor) -> torch.Tensor:
        # Draw on CPU (fp32) so the values do not depend on the device; then move.
        return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)

    def big(t: torch.Tensor) -> bool:
        return t.numel() > 50_000_000  # real-size tensors: draw on device instead (CPU draw too slow)

    def fill_normal_(t: torch.Tensor, mean: float, std: float) -> None:
        if big(t):
            t.normal_(mean, std)
        else:
            t.copy_(randn_like(t) * std + mean)

    done: set[int] = set()
    for _, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            continue
        if is_rms_norm(mod):
            gemma_style = bool((w == 0).all())
            fill_normal_(w, 0.0 if gemma_style else 1.0, _NORM_WEIGHT_STD)
            done.add(id(w))
        elif isinstance(mod, torch.nn.LayerNorm) and mod.elementwise_affine:
            fill_normal_(w, 1.0, _NORM_WEIGHT_STD)
            done.add(id(w))

    for _, mod in model.named_modules():
        non_persistent = getattr(mod, "_non_persistent_buffers_set", set())
        tensors = [(n, p) for n, p in mod.named_parameters(recurse=False)]
        tensors += [(n, b) for n, b in mod.named_buffers(recurse=False) if n not in non_persistent]
        for n, t in tensors:
            if t is None or id(t) in done or not t.is_floating_point() or t.numel() == 0:
                continue
            if bool((t == 0).all()) or not bool(torch.isfinite(t).all()):
                fill_normal_(t, 0.0, _INIT_STD)
            done.add(id(t))


# --------------------------------------------------------------------------------------------------
# ModelAdapter
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelAdapter:
    """One model family.

    ``real_config`` / ``tiny_config`` are kwargs for the HF config class of ``model_type`` (minus
    ``num_hidden_layers``, which :meth:`hf_config` sets). ``layer_config_fn(cfg_dict, layers)`` may
    return extra keys that depend on the stack depth (e.g. Qwen3.5 ``layer_types``).
    """

    name: str
    model_type: str
    real_config: dict
    tiny_config: dict
    default_layers: int
    layer_kind_fn: Callable[[Any], list[str]] = field(default=generic_layer_kinds, repr=False, compare=False)
    layer_config_fn: Callable[[dict, int], dict] | None = field(default=None, repr=False, compare=False)
    # (model, {RMSNorm module: calls}) -> {family: {module: sites}}; None: every RMSNorm is an
    # add_rms_norm site.
    expected_fn: Callable[[torch.nn.Module, dict[str, int]], dict[str, dict[str, int]]] | None = field(
        default=None, repr=False, compare=False
    )
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION
    experts_implementation: str | None = DEFAULT_EXPERTS_IMPLEMENTATION  # None: non-MoE model

    # ---- config -----------------------------------------------------------------------------
    def config_dict(self, size: str = "tiny", layers: int | None = None) -> dict:
        """The kwargs :meth:`hf_config` passes to the HF config class (a fresh deep copy)."""
        if size == "tiny":
            base = self.tiny_config
        elif size == "real":
            base = self.real_config
        else:
            raise ValueError(f"size must be 'tiny' or 'real', got {size!r}")
        n = self.default_layers if layers is None else int(layers)
        if n < 1:
            raise ValueError(f"layers must be >= 1, got {n}")
        cfg = copy.deepcopy(base)
        cfg["num_hidden_layers"] = n
        if self.layer_config_fn is not None:
            cfg.update(self.layer_config_fn(cfg, n))
        return cfg

    def hf_config(
        self,
        size: str = "tiny",
        layers: int | None = None,
        *,
        attn_implementation: str | None = None,
        experts_implementation: str | None = None,
        **overrides,
    ):
        """A transformers ``PreTrainedConfig`` (the text/decoder config for VLM wrappers) with
        ``num_hidden_layers = layers`` (default :attr:`default_layers`). ``overrides`` replace keys."""
        from transformers import AutoConfig

        cfg = self.config_dict(size, layers)
        cfg.update(overrides)
        attn = attn_implementation or self.attn_implementation
        experts = experts_implementation or self.experts_implementation
        kwargs = dict(cfg)
        kwargs["attn_implementation"] = attn
        if experts is not None:
            kwargs["experts_implementation"] = experts
        config = AutoConfig.for_model(self.model_type, **kwargs)
        sub = getattr(config, "text_config", None)
        if sub is not None and sub is not config:
            config = config.get_text_config(decoder=True)
        return config

    def expected_sites(self, model: torch.nn.Module, batch: int = 1, context: int = 16) -> dict[str, dict[str, int]]:
        """Sites each family should fuse in one decode step: family -> {module path: count}.
        Derived from the module tree and the norms that really run (forward hooks)."""
        norms = rms_norm_sites(model, batch=batch, context=context)
        if self.expected_fn is None:
            return {"add_rms_norm": norms, "moe_routing": router_sites(model), "moe_experts": experts_sites(model)}
        return self.expected_fn(model, norms)

    # ---- model ------------------------------------------------------------------------------
    def build_hf(
        self,
        size: str = "tiny",
        layers: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
        *,
        attn_implementation: str | None = None,
        experts_implementation: str | None = None,
        **overrides,
    ) -> torch.nn.Module:
        """HF ``*ForCausalLM`` with seeded random weights, ``eval()``, parameters allocated directly
        on ``device`` in ``dtype`` (fp32-by-design buffers such as ``e_score_correction_bias`` stay
        fp32). Same seed + same device -> identical weights. A decoder with no ``*ForCausalLM``
        class is its base model plus a vocabulary head (``BaseModelWithHead``); a model class that
        rejects SDPA runs eager attention (both logged)."""
        config = self.hf_config(
            size,
            layers,
            attn_implementation=attn_implementation,
            experts_implementation=experts_implementation,
            **overrides,
        )
        device = torch.device(device)
        fork_devices = []
        if device.type == "cuda":
            fork_devices = [device.index if device.index is not None else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(seed)
            with torch.device(device):
                model = causal_lm_from_config(config, dtype)
            randomize_weights_(model, generator_seed=seed + 1)
        model.eval()
        model.requires_grad_(False)
        return model

    def layer_kinds(self, config) -> list[str]:
        """One kind string per decoder layer of ``config``."""
        return list(self.layer_kind_fn(config))


class BaseModelWithHead(torch.nn.Module):
    """A decoder transformers ships with no ``*ForCausalLM`` class (a multimodal model's text
    tower, say): its base model as ``model`` (so module paths read ``model.layers.N...`` as in a
    causal LM) and a bias-free vocabulary head; returns HF's causal-LM output (logits, cache)."""

    def __init__(self, base: torch.nn.Module, config):
        super().__init__()
        self.config = config
        self.model = base
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model(input_ids=input_ids, **kwargs)
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state),
                                      past_key_values=getattr(out, "past_key_values", None))  # fmt: skip


def causal_lm_from_config(config, dtype: torch.dtype) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config``, or, where transformers has no causal-LM class for the
    config, ``AutoModel`` + a head; where the class rejects the config's attention implementation
    (SDPA), eager attention."""
    from transformers import AutoModel, AutoModelForCausalLM

    def build(auto):
        try:
            return auto.from_config(config, dtype=dtype)
        except ValueError as err:
            if "attn_implementation" not in str(err) and "scaled_dot_product_attention" not in str(err):
                raise
            log.warning("%s rejects %s attention (%s); building it with eager attention", config.model_type,
                        getattr(config, "_attn_implementation", None), str(err).splitlines()[0])  # fmt: skip
            config._attn_implementation = "eager"
            return auto.from_config(config, dtype=dtype)

    if type(config) in AutoModelForCausalLM._model_mapping:
        return build(AutoModelForCausalLM)
    log.warning("transformers has no causal-LM class for %s; building its base model plus a vocabulary head",
                type(config).__name__)
    base = build(AutoModel)
    model = BaseModelWithHead(base, config)
    return model.to(dtype=dtype) if dtype is not None else model


# --------------------------------------------------------------------------------------------------
# Decode step
# --------------------------------------------------------------------------------------------------


def _logits_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    if isinstance(out, dict):
        return out["logits"]
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find logits in {type(out).__name__}")


def _restore_(live: Any, snap: Any) -> Any:
    """Copy the state of ``snap`` into ``live`` in place where possible (keeps tensor identity,
    which compiled graphs / CUDA graphs rely on); returns the value ``live`` should hold."""
    if isinstance(snap, torch.Tensor):
        if (
            isinstance(live, torch.Tensor)
            and live.shape == snap.shape
            and live.dtype == snap.dtype
            and live.device == snap.device
        ):
            live.copy_(snap)
            return live
        return snap.clone()
    if isinstance(snap, dict):
        if not isinstance(live, dict):
            return copy.deepcopy(snap)
        for k in list(live.keys()):
            if k not in snap:
                del live[k]
        for k, v in snap.items():
            live[k] = _restore_(live.get(k), v)
        return live
    if isinstance(snap, list):
        if not isinstance(live, list) or len(live) != len(snap):
            return copy.deepcopy(snap)
        for i, v in enumerate(snap):
            live[i] = _restore_(live[i], v)
        return live
    if hasattr(snap, "__dict__") and not isinstance(snap, type) and type(live) is type(snap):
        for k, v in vars(snap).items():
            setattr(live, k, _restore_(getattr(live, k, None), v))
        return live
    return copy.deepcopy(snap)


class DecodeStep:
    """Everything needed to run one decode step: a cache prefilled eagerly with ``context`` random
    tokens and the kwargs of the next single-token step.

    ``run(fn)`` calls ``fn(**kwargs)`` under ``torch.no_grad()`` and returns the logits
    ``[batch, 1, vocab]``. The first ``run`` uses the cache as prefilled; every later ``run``
    first restores the cache in place to its post-prefill state, so repeated runs see identical
    inputs (the tensors keep their identity: no recompiles). ``fresh()`` returns an independent
    step with the same inputs and a copy of the same post-prefill cache.
    """

    def __init__(
        self,
        *,
        kwargs: dict,
        cache_kind: str,
        batch: int,
        context: int,
        seed: int,
        max_cache_len: int | None,
        prefill_input_ids: torch.Tensor,
        prefill_logits: torch.Tensor,
        snapshot: Any,
    ):
        self.kwargs = kwargs
        self.cache_kind = cache_kind
        self.batch = batch
        self.context = context
        self.seed = seed
        self.max_cache_len = max_cache_len
        self.prefill_input_ids = prefill_input_ids
        self.prefill_logits = prefill_logits
        self._snapshot = snapshot  # pristine deep copy of the post-prefill cache
        self._dirty = False

    @property
    def cache(self):
        return self.kwargs["past_key_values"]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.kwargs["input_ids"]

    def reset(self) -> None:
        """Restore the cache, in place, to its post-prefill contents."""
        _restore_(self.cache, self._snapshot)
        self._dirty = False

    def run(self, fn: Callable[..., Any]) -> torch.Tensor:
        if self._dirty:
            self.reset()
        self._dirty = True
        with torch.no_grad():
            out = fn(**self.kwargs)
        return _logits_of(out)

    def fresh(self) -> DecodeStep:
        """A new, independent step: same input ids/positions, a deep copy of the pristine cache."""
        kwargs = dict(self.kwargs)
        kwargs["past_key_values"] = copy.deepcopy(self._snapshot)
        for k, v in list(kwargs.items()):
            if isinstance(v, torch.Tensor):
                kwargs[k] = v.clone()
        return DecodeStep(
            kwargs=kwargs,
            cache_kind=self.cache_kind,
            batch=self.batch,
            context=self.context,
            seed=self.seed,
            max_cache_len=self.max_cache_len,
            prefill_input_ids=self.prefill_input_ids,
            prefill_logits=self.prefill_logits,
            snapshot=self._snapshot,
        )

    def __repr__(self) -> str:
        return (
            f"DecodeStep(batch={self.batch}, context={self.context}, cache_kind={self.cache_kind!r}, "
            f"max_cache_len={self.max_cache_len}, seed={self.seed})"
        )


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _default_max_cache_len(context: int) -> int:
    # Room for the decode token, rounded up to a multiple of 16: the static cache then also holds
    # a few empty (masked) slots, as it does in real serving.
    return int(math.ceil((context + 1) / 16) * 16)


def make_decode_step(
    model: torch.nn.Module,
    batch: int = 1,
    context: int = 16,
    seed: int = 0,
    max_cache_len: int | None = None,
) -> DecodeStep:
    """Prefill a cache eagerly with ``context`` random tokens (seeded) and return the step that
    decodes the next (random) token at position ``context``.

    A transformers ``StaticCache`` of ``max_cache_len`` slots (default: ``context + 1`` rounded up
    to 16) is preferred; if it cannot be built or prefilled for this model a ``DynamicCache`` is
    used and ``step.cache_kind`` says ``"dynamic"``. kwargs: ``input_ids [batch, 1]``,
    ``position_ids [batch, 1]``, ``past_key_values``, ``use_cache=True``. (transformers 5.17 models
    take no ``cache_position``: static layers keep their own write position; the causal mask is built
    from ``position_ids`` and the cache.)
    """
    from transformers import DynamicCache, StaticCache

    if batch < 1 or context < 1:
        raise ValueError("batch and context must be >= 1")
    device = _model_device(model)
    config = model.config
    vocab = int(config.get_text_config(decoder=True).vocab_size)
    if max_cache_len is None:
        max_cache_len = _default_max_cache_len(context)
    if max_cache_len < context + 1:
        raise ValueError(f"max_cache_len={max_cache_len} < context + 1 = {context + 1}")

    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    prefill_ids = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
    next_ids = torch.randint(0, vocab, (batch, 1), generator=gen).to(device)
    prefill_pos = torch.arange(context, device=device).unsqueeze(0).expand(batch, -1).contiguous()
    next_pos = torch.full((batch, 1), context, dtype=torch.long, device=device)

    def prefill(cache):
        with torch.no_grad():
            out = model(input_ids=prefill_ids, position_ids=prefill_pos, past_key_values=cache, use_cache=True)
        return _logits_of(out)

    cache_kind = "static"
    try:
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
        prefill_logits = prefill(cache)
    except Exception:  # noqa: BLE001 - fall back only when the static cache is unusable
        cache_kind = "dynamic"
        max_cache_len = None
        cache = DynamicCache(config=config)
        prefill_logits = prefill(cache)

    snapshot = copy.deepcopy(cache)
    kwargs = {
        "input_ids": next_ids,
        "position_ids": next_pos,
        "past_key_values": cache,
        "use_cache": True,
    }
    return DecodeStep(
        kwargs=kwargs,
        cache_kind=cache_kind,
        batch=batch,
        context=context,
        seed=seed,
        max_cache_len=max_cache_len,
        prefill_input_ids=prefill_ids,
        prefill_logits=prefill_logits,
        snapshot=snapshot,
    )


# --------------------------------------------------------------------------------------------------
# RMSNorm sites
# --------------------------------------------------------------------------------------------------


def router_sites(model: torch.nn.Module) -> dict[str, int]:
    """MoE routers (HF ``*TopKRouter`` / ``*TopkRouter`` modules): one routing site per call.
    Every MoE layer calls its router once per decode step."""
    return {name: 1 for name, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")}


# HF experts implementations whose decode graph holds a whole experts site (patterns/moe_experts.py);
# "eager" loops over the experts hit with `nonzero` and breaks the graph at each.
FUSED_EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")


def experts_sites(model: torch.nn.Module) -> dict[str, int]:
    """HF's gated routed experts (``*Experts`` with 3-D ``gate_up_proj`` and ``down_proj``) run
    by ``grouped_mm`` or ``batched_mm``: one moe_experts site each per decode step."""
    sites = {}
    for name, m in model.named_modules():
        weights = [getattr(m, a, None) for a in ("gate_up_proj", "down_proj")]
        if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
            continue
        implementation = getattr(getattr(m, "config", None), "_experts_implementation", None)
        if implementation in FUSED_EXPERTS_IMPLEMENTATIONS and not getattr(m, "is_transposed", False):
            sites[name] = 1
    return sites


def gdn_sites(model: torch.nn.Module) -> dict[str, int]:
    """Gated DeltaNet layers (HF's ``*GatedDeltaNet``: a ``conv1d``, ``A_log``, ``dt_bias`` and the
    gated output ``norm``, whatever their projections are called): one gdn site each per decode
    step, which takes that gated norm."""
    return {name: 1 for name, m in model.named_modules()
            if all(hasattr(m, a) for a in ("conv1d", "A_log", "dt_bias", "norm"))}  # fmt: skip


def mla_sites(model: torch.nn.Module) -> dict[str, int]:
    """MLA attention (a ``kv_a_layernorm``: DeepSeek V3 / V3.2, Kimi-K2): its kv and q RoPE sites
    (mla_prologue), and the k and q RoPE sites of a DSA ``indexer`` where it has one (a GLM-MoE-DSA
    "shared" layer's ``indexer`` is None: it reuses an earlier layer's top-k)."""
    mla: dict[str, int] = {}
    families = attention_families(model)
    for name, module in model.named_modules():
        if hasattr(module, "kv_a_layernorm") and families.get(name, (None,))[0] == "mla_prologue":
            mla[name] = 2
            if getattr(module, "indexer", None) is not None:
                mla[f"{name}.indexer"] = 2
    return mla


def dsa_mask_sites(model: torch.nn.Module) -> dict[str, int]:
    """DSA indexers (an MLA attention's ``indexer``) whose top-k the attention scatters into its
    mask (HF's eager and SDPA paths; flash-mla reads the indices): one dsa_topk_mask site each. A
    layer that reuses an earlier layer's top-k (``indexer`` None) has no site: that indexer's one
    fused mask stands for its scatter too."""
    if getattr(model.config, "_attn_implementation", None) not in ("eager", "sdpa"):
        return {}
    return {f"{name}.indexer": 1 for name, module in model.named_modules()
            if hasattr(module, "kv_a_layernorm") and getattr(module, "indexer", None) is not None}  # fmt: skip


def structural_sites(model: torch.nn.Module, norms: dict[str, int]) -> dict[str, dict[str, int]]:
    """Expected sites of a model we have no adapter for, from what its modules compute (the
    module tree and config, never the model's name): a GQA attention with q/k norms, or without
    them and HF's rotate_half RoPE, is a gqa_prologue site (the math gqa_prologue fuses, whatever
    its rotary dim), an MLA attention with RoPE mla_prologue sites (which take its
    kv_a_layernorm), a Gated DeltaNet layer a gdn site, a top-k router a moe_routing site, HF's
    routed experts a moe_experts site, every other RMSNorm that runs an add_rms_norm site.
    Attentions no prologue family applies to are ``attention_families``' declined ones, with the
    reason."""
    sites = qk_norm_attention_sites(model, norms)
    # Each bigger site takes a norm of its module: kv_a_layernorm into the kv site, the gated
    # norm into the GDN site.
    for family, found, norm in (("mla_prologue", mla_sites(model), "kv_a_layernorm"), ("gdn", gdn_sites(model), "norm")):
        if found:
            sites[family] = found
            sites["add_rms_norm"] = _without(sites["add_rms_norm"], {f"{name}.{norm}" for name in found})
    dsa = dsa_mask_sites(model)
    if dsa:
        sites["dsa_topk_mask"] = dsa
    return sites


PROLOGUE_FAMILIES = ("gqa_prologue", "mla_prologue")


def attention_families(model: torch.nn.Module) -> dict[str, tuple[str | None, str]]:
    """Every softmax attention of the tree -> (its prologue family, or None; why), from what the
    module computes: a latent K/V (``kv_a_proj_with_mqa``: MLA) with RoPE is mla_prologue's, per-head
    K/V projections (``k_proj`` / ``v_proj``) with q/k norms gqa_prologue's, and without them too
    where the module's code ropes with HF's ``rotate_half`` (NeoX halves: Mixtral, Qwen2-MoE,
    GLM-4-MoE without use_qk_norm; GPT-J pairs: GLM-4, Helium). Anything else gets no family and
    the reason (an MLA without RoPE; no q/k norms and another RoPE, as gpt-oss's
    ``_apply_rotary_emb``)."""
    out: dict[str, tuple[str | None, str]] = {}
    config = getattr(model, "config", None)
    for name, m in model.named_modules():
        if hasattr(m, "kv_a_proj_with_mqa"):
            rope = int(getattr(getattr(m, "config", config), "qk_rope_head_dim", 0) or 0)
            out[name] = (("mla_prologue", "a latent K/V (MLA) with RoPE") if rope > 0 else
                         (None, "no family applies: an MLA attention without RoPE (qk_rope_head_dim 0)"))  # fmt: skip
        elif all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")):
            if hasattr(m, "q_norm") and hasattr(m, "k_norm"):
                out[name] = ("gqa_prologue", "per-head K/V with q/k norms")
            elif _ropes_with_rotate_half(m):
                out[name] = ("gqa_prologue", "per-head K/V without q/k norms, HF's rotate_half RoPE (NeoX or GPT-J)")
            else:
                out[name] = (None, "no family applies: the attention has no q/k norms and its code has no "
                                   "rotate_half RoPE (NeoX or GPT-J), the no-norm gqa_prologue's")  # fmt: skip
    return out


def _ropes_with_rotate_half(module: torch.nn.Module) -> bool:
    """The module's code (its class's module) defines HF's ``rotate_half`` and
    ``apply_rotary_pos_emb``: the RoPE that gqa_prologue's no-norm variants are written as (NeoX
    halves, or GLM-4's GPT-J pairs)."""
    code = sys.modules.get(type(module).__module__)
    return all(callable(getattr(code, f, None)) for f in ("rotate_half", "apply_rotary_pos_emb"))


def _without(norms: dict[str, int], taken: set[str]) -> dict[str, int]:
    return {m: n for m, n in norms.items() if m not in taken}


def qk_norm_attention_sites(model: torch.nn.Module, norms: dict[str, int]) -> dict[str, dict[str, int]]:
    """GQA attention (``attention_families``: with HF's ``q_norm`` / ``k_norm`` beside ``q_proj``,
    MiniMax-M2, Qwen3.5's full-attention layers; or without them, Mixtral): one gqa_prologue site
    each, which takes its q/k norms, so they are not add_rms_norm sites; every other RMSNorm that
    runs is."""
    attention = {name: 1 for name, (family, _) in attention_families(model).items() if family == "gqa_prologue"}
    taken = {f"{name}.{norm}" for name in attention for norm in ("q_norm", "k_norm")}
    return {
        "gqa_prologue": attention,
        "add_rms_norm": _without(norms, taken),
        "moe_routing": router_sites(model),
        "moe_experts": experts_sites(model),
    }


def rms_norm_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """All RMSNorm modules of the tree (whether or not they run in decode), by module path."""
    return {name: m for name, m in model.named_modules() if name and is_rms_norm(m)}


def rms_norm_sites(model: torch.nn.Module, batch: int = 1, context: int = 16, seed: int = 0) -> dict[str, int]:
    """RMSNorm sites that actually run in one decode step: module path -> calls per decode forward.

    Derived, not hand-written: forward hooks count the calls of every RMSNorm module (see
    :func:`is_rms_norm`) while the model runs one decode step (the prefill is not counted).
    Modules that exist but do not run at decode are left out.
    """
    mods = rms_norm_modules(model)
    step = make_decode_step(model, batch=batch, context=context, seed=seed)
    counts = dict.fromkeys(mods, 0)
    handles = []
    for name, m in mods.items():

        def hook(_m, _args, _out, _name=name):
            counts[_name] += 1

        handles.append(m.register_forward_hook(hook))
    try:
        step.run(model)
    finally:
        for h in handles:
            h.remove()
    return {name: n for name, n in counts.items() if n > 0}
