"""The GQA prologue under HF's continuous batching (``model.generate_batch``; issue 29's paged
cache): HF's own attention code, one packed [1, T] step padded to a fixed size, its K / V written
into flat [slots, kv_heads, D] caches by ``cache.index_copy_(0, write_index, k.transpose(1,
2).squeeze(0))`` and read back by ``index_select`` (transformers/generation/continuous_batching/
cache.py). The ``hf_flat`` variants take it: Qwen2 and Llama (no q/k norms), Qwen3 (per-head
plain norm), full NeoX RoPE in bf16; without q/k norms, GPT-J pairs: ERNIE-4.5 (dense and MoE)
and Cohere over the whole head turned in fp32 (``none.hf_flat_full_rope_gptj_fp32`` and
``_upcast``), GLM-4 (half the head) and Helium (whole) in bf16 (``none.hf_flat_gptj``,
``none.hf_flat_full_rope_gptj``): the flat forms of their static-cache variants.

- ``generate_batch`` eager and compiled with ``CompileConfig(backend=FusionBackend(strict))``:
  one gqa_prologue per attention layer, no mla_prologue site at all, the same greedy tokens as
  eager continuous batching; the first layer's cache rows are eager's bits, later layers' within
  bf16 rounding (their inputs come through Inductor's code for the layers before: measured
  2.5e-3 to 3.7e-3 relative, ERNIE-4.5 2.8e-3 to 2.9e-3, Cohere 3.9e-3 to 4.3e-3, V's plain
  copies alike), and the compiled run writes exactly eager's rows plus its warm-up step's,
  every other row left at its poison. The padding tokens' shared trash slot (never read by HF) is
  left out. Nightly (36 s cold for the first model).
- Graph level (fast): HF CB's prologue spelled with HF's own functions (``Qwen3RMSNorm``,
  ``Qwen3NextRMSNorm``, ``apply_rotary_pos_emb`` of Qwen3 and of GLM-4-MoE for half-head RoPE,
  the cache lines of cache.py), fused for each norm and RoPE width; the near miss
  (K written along dim 1 of a heads-first flat cache) is a miss in words, and no mla_prologue
  miss is reported for these GQA attentions.
- Graph level, HF's own ERNIE-4.5, Cohere, GLM-4 and Helium (2 layers) on one packed step under
  ``paged|sdpa``, HF's ``PagedAttentionCache.update`` writing the flat caches: one gqa_prologue
  per layer with the model's flat GPT-J variant, the first layer's rows eager's bits; the near miss (K along dim 1) is
  no site of either prologue family for these un-normed attentions: nothing fuses, nothing is
  reported.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.verify import relative_error

cb_cache = pytest.importorskip("transformers.generation.continuous_batching.cache")

FAMILY = "gqa_prologue"
_SIZES = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256)  # fmt: skip
VARIANTS = {"qwen2": "none.hf_flat_full_rope", "llama": "none.hf_flat_full_rope", "qwen3": "per_head.hf_flat_full_rope",
            "ernie4_5": "none.hf_flat_full_rope_gptj_fp32", "ernie4_5_moe": "none.hf_flat_full_rope_gptj_fp32",
            "cohere": "none.hf_flat_full_rope_gptj_fp32_upcast", "glm4": "none.hf_flat_gptj",
            "helium": "none.hf_flat_full_rope_gptj"}  # fmt: skip
# ERNIE-4.5-MoE: a dense layer, then a MoE layer
_EXTRA = {"ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=64, moe_layer_start_index=1,
                               moe_num_shared_experts=1),
          "glm4": dict(pad_token_id=0), "helium": dict(pad_token_id=0)}  # fmt: skip
# Cohere's decoder norms are LayerNorms: add_rms_norm's reported misses, which strict would raise on.
_OFF = {"cohere": ("add_rms_norm",)}
PROMPTS = [[1, 5, 9, 13, 7], [2, 4, 6], [11, 12, 13, 14, 15, 16, 17]]
_BLOCK, _TOKENS = 16, 32  # block_size, max_batch_tokens
POISON = 7.0  # every cache row but the read trash (zeroed by HF): a row HF never wrote keeps it


def _model(name: str):
    import transformers

    config_class = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
                    "qwen3": transformers.Qwen3Config, "ernie4_5": transformers.Ernie4_5Config,
                    "ernie4_5_moe": transformers.Ernie4_5_MoeConfig,
                    "cohere": transformers.CohereConfig, "glm4": transformers.Glm4Config,
                    "helium": transformers.HeliumConfig}[name]  # fmt: skip
    model_class = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM,
                   "qwen3": transformers.Qwen3ForCausalLM, "ernie4_5": transformers.Ernie4_5ForCausalLM,
                   "ernie4_5_moe": transformers.Ernie4_5_MoeForCausalLM,
                   "cohere": transformers.CohereForCausalLM, "glm4": transformers.Glm4ForCausalLM,
                   "helium": transformers.HeliumForCausalLM}[name]  # fmt: skip
    torch.manual_seed(0)
    model = model_class(config_class(**_SIZES, **_EXTRA.get(name, {}))).to(torch.bfloat16).eval()
    for param_name, param in model.named_parameters():  # norm weights away from their init of ones
        if param_name.endswith(("q_norm.weight", "k_norm.weight")):
            torch.nn.init.normal_(param, 1.0, 0.2)
    return model


def _generate(model, backend=None) -> tuple[dict, list[torch.Tensor], int]:
    """(tokens per request, the K and V caches of every layer, the write trash slot) of one
    ``generate_batch`` run, eager or compiled with ``backend``."""
    from transformers import CompileConfig, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    caches = []
    init = cb_cache.PagedAttentionCache.__init__

    def poisoned_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for cache in self.key_cache + self.value_cache:  # every block but the read trash, zeroed by HF
            blocks = cache.view(-1, self.block_size, *cache.shape[1:])
            blocks[: self.read_trash_index // self.block_size].fill_(POISON)
            blocks[self.write_trash_index // self.block_size :].fill_(POISON)
        caches.append(self)

    compile_config = None if backend is None else CompileConfig(backend=backend, fullgraph=False)
    cb_config = ContinuousBatchingConfig(block_size=_BLOCK, num_blocks=8, max_batch_tokens=_TOKENS,
                                         varlen_compile_config=compile_config)  # fmt: skip
    generation = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # CPU without psutil has no memory figure (cache.py); the tiny caches need far less than this.
    with mock.patch.object(cb_cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30), \
            mock.patch.object(cb_cache.PagedAttentionCache, "__init__", poisoned_init), torch.no_grad():  # fmt: skip
        out = model.generate_batch(inputs=PROMPTS, generation_config=generation, continuous_batching_config=cb_config)
    [cache] = caches
    tokens = {request: list(state.generated_tokens) for request, state in sorted(out.items())}
    return tokens, [c.clone() for c in cache.key_cache + cache.value_cache], cache.write_trash_index


@functools.cache
def cb_run(name: str) -> dict:
    model = _model(name)
    eager_tokens, eager_caches, trash = _generate(model)
    torch._dynamo.reset()
    # CompileConfig.to_dict deep-copies the backend: its report is the last one compiled.
    families = dict.fromkeys(_OFF.get(name, ()), "off")
    tokens, caches, _ = _generate(model, fc.FusionBackend(fc.FusionConfig(families=families, strict=True)))
    return dict(model=model, report=fc.last_report(), eager_tokens=eager_tokens, tokens=tokens,
                eager_caches=eager_caches, caches=caches, trash=trash)  # fmt: skip


def _assert_fuses_every_layer(name: str) -> None:
    run = cb_run(name)
    report, layers = run["report"], run["model"].config.num_hidden_layers
    assert report.per_layer(FAMILY) == dict.fromkeys(range(layers), 1), report.format()
    assert report.per_variant()[VARIANTS[name]] == layers
    assert report.misses() == [] and not [s for s in report.sites if s.family == "mla_prologue"], report.format()
    assert run["tokens"] == run["eager_tokens"]
    for i, (want, got) in enumerate(zip(run["eager_caches"], run["caches"])):  # K of each layer, then V
        rows = torch.ones(want.shape[0], dtype=torch.bool)
        rows[run["trash"] : run["trash"] + _BLOCK] = False  # the padding tokens' rows, never read back
        written, fused_written = (rows & (c != POISON).flatten(1).any(-1) for c in (want, got))
        assert int(written.sum()) >= sum(len(p) for p in PROMPTS) + 3 * len(PROMPTS)  # prompts, 3 decoded each
        # The compiled run warms up first (model_runner.warmup: one step of max_batch_tokens);
        # beyond those rows it writes exactly the rows eager writes.
        assert torch.equal(fused_written & written, written) and int((fused_written & ~written).sum()) == _TOKENS
        if i % layers == 0:  # the first layer's inputs are eager's: its rows are eager's bits
            assert torch.equal(got[written].view(torch.int16), want[written].view(torch.int16))
        else:  # later layers read Inductor's output of the layers before (V's plain copies alike)
            assert relative_error(got[written], want[written]) < 1e-2


# Nightly: a cold process takes 36 s for Qwen2 (its first compile traces every family's patterns),
# then 5-9 s for each of the others; the graph-level tests below keep the CPU tier's coverage.
@pytest.mark.nightly
@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "ernie4_5", "ernie4_5_moe", "cohere", "glm4", "helium"])
def test_generate_batch_fuses_every_attention_layer(name):
    _assert_fuses_every_layer(name)


# ------------------------------------------------------------------------------------------
# Graph level: HF continuous batching's prologue with HF's own functions
# ------------------------------------------------------------------------------------------

_D = 32


class CbAttention(torch.nn.Module):
    """HF's attention prologue as ``generate_batch`` runs it (modeling_qwen3 + cache.py): the
    projections' head views, Qwen3's per-head norm (``per_head``), Qwen3-Next's per-head Gemma
    norm (``gemma``) or none, the rotary embedding's ``cat(freqs, freqs)`` cos / sin, then
    ``apply_rotary_pos_emb`` over the whole head (Qwen3's) or half of it (GLM-4-MoE's, with
    ``half_rope``), then the flat caches written with ``index_copy_`` at the write index and read
    back with ``index_select``.
    ``write_dim=1``: a near miss, the cache heads-first [kv_heads, slots, D] written along dim 1."""

    def __init__(self, norm: str = "none", write_dim: int = 0, half_rope: bool = False):
        super().__init__()
        from transformers.models.glm4_moe import modeling_glm4_moe
        from transformers.models.qwen3 import modeling_qwen3
        from transformers.models.qwen3_next import modeling_qwen3_next

        self.rope = (modeling_glm4_moe if half_rope else modeling_qwen3).apply_rotary_pos_emb
        self.norm, self.write_dim, self.rot = norm, write_dim, _D // 2 if half_rope else _D
        norm_class = modeling_qwen3_next.Qwen3NextRMSNorm if norm == "gemma" else modeling_qwen3.Qwen3RMSNorm
        self.q_norm, self.k_norm = norm_class(_D, eps=1e-6), norm_class(_D, eps=1e-6)
        for w in (self.q_norm.weight, self.k_norm.weight):
            torch.nn.init.normal_(w, 0.0 if norm == "gemma" else 1.0, 0.2)

    def forward(self, q, k, v, freqs, k_cache, v_cache, write_index, read_index):
        freqs = freqs[..., : self.rot // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        hidden_shape = (*q.shape[:-1], -1, _D)
        q, k = q.view(hidden_shape), k.view(hidden_shape)
        if self.norm != "none":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(hidden_shape).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        key_states, value_states = k.transpose(1, 2).squeeze(0), v.transpose(1, 2).squeeze(0)
        if self.write_dim == 1:
            key_states, value_states = key_states.transpose(0, 1), value_states.transpose(0, 1)
        k_cache.index_copy_(self.write_dim, write_index, key_states)
        v_cache.index_copy_(self.write_dim, write_index, value_states)
        return q, *(torch.index_select(cache, self.write_dim, read_index) for cache in (k_cache, v_cache))


class CbLayer(torch.nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.self_attn = CbAttention(**kwargs)

    def forward(self, *args):
        return self.self_attn(*args)


def _compiled_cb(lowering: str = "triton", **kwargs):
    """Eager and compiled on one packed step of 6 tokens, 2 of them padding (the trash slot 30);
    returns (report, eager outputs and caches, compiled outputs and caches)."""
    torch.manual_seed(0)
    t, trash = 6, 30
    module = CbLayer(**kwargs).to(torch.bfloat16)
    q, k, v = (torch.randn(1, t, h * _D, dtype=torch.bfloat16) for h in (4, 2, 2))
    freqs = torch.rand(1, t, _D // 2) * 10
    shape = (2, 32, _D) if kwargs.get("write_dim") == 1 else (32, 2, _D)
    caches = [torch.full(shape, POISON, dtype=torch.bfloat16) for _ in range(2)]
    write_index, read_index = torch.tensor([3, 9, 4, 17, trash, trash]), torch.tensor([0, 1, 2, 3, 9, 4, 17])
    eager_caches = [c.clone() for c in caches]
    backend = fc.FusionBackend(fc.FusionConfig(families={FAMILY: lowering}))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = module(q, k, v, freqs, *eager_caches, write_index, read_index)
        fused = torch.compile(module, backend=backend)(q, k, v, freqs, *caches, write_index, read_index)
    return backend.report, (eager, eager_caches), (fused, caches)


VARIANT_OF = {("none", False): "none.hf_flat_full_rope", ("per_head", False): "per_head.hf_flat_full_rope",
              ("gemma", False): "qwen.hf_flat_full_rope", ("none", True): "none.hf_flat",
              ("per_head", True): "per_head.hf_flat", ("gemma", True): "qwen.hf_flat"}  # fmt: skip


@pytest.mark.parametrize("norm, half_rope, lowering", [
    ("none", False, "triton"), ("per_head", False, "triton"), ("gemma", True, "triton"), ("per_head", True, "triton"),
    pytest.param("none", True, "triton", marks=pytest.mark.nightly),
    pytest.param("gemma", False, "triton", marks=pytest.mark.nightly),
    pytest.param("per_head", False, "inductor", marks=pytest.mark.nightly),
])  # fmt: skip
def test_hf_continuous_batching_prologue_fuses(norm, half_rope, lowering):
    """One site, its variant, no mla_prologue site; q, the read-back K / V and the written cache
    rows are eager's bits through the op (its reference on CPU), within bf16 rounding through the
    canonical decomposition (Inductor drops its bf16 round trips: measured 4.1e-3 on q, 3.8e-3 on
    K's rows); every other row but the trash slot unchanged."""
    report, (eager, eager_caches), (fused, caches) = _compiled_cb(lowering, norm=norm, half_rope=half_rope)
    variant = VARIANT_OF[norm, half_rope]
    assert report.per_variant() == {variant: 1} and report.per_module(FAMILY) == {"self_attn": 1}, report.format()
    assert report.misses() == [] and not [s for s in report.sites if s.family == "mla_prologue"]
    written = torch.tensor([3, 9, 4, 17])
    others = torch.ones(32, dtype=torch.bool)
    others[written], others[30] = False, False
    pairs = [*zip(eager, fused), *((want[written], got[written]) for want, got in zip(eager_caches, caches))]
    for want, got in pairs:
        assert torch.equal(got, want) if lowering == "triton" else relative_error(got, want) < 1e-2
    assert all(bool((got[others] == POISON).all()) for got in caches)


def test_a_write_along_dim_1_is_a_miss_in_words():
    """Per-head normed, roped K written along dim 1 of a heads-first flat cache: neither HF's
    static cache nor its continuous batching's, a miss in words (and no mla_prologue miss)."""
    report, _, _ = _compiled_cb(norm="per_head", write_dim=1)
    [miss] = report.misses(FAMILY)
    assert report.per_module(FAMILY) == {} and "per head with a plain weight" in miss.reason
    assert "continuous batching's flat one" in miss.reason
    assert not [s for s in report.sites if s.family == "mla_prologue"], report.format()


# ------------------------------------------------------------------------------------------
# Graph level: ERNIE-4.5's and Cohere's GPT-J pairs in fp32, HF's own model on one packed step
# ------------------------------------------------------------------------------------------


class FlatCache:
    """What HF's ``PagedAttentionCache.update`` reads of its cache (one group of full-attention
    layers, [slots, kv_heads, D] each), with that ``update`` itself: the cache lines as
    ``paged|sdpa`` runs them. Three cached rows (slots 0-2) random, every other row POISON.
    ``heads_first``: the near miss, [kv_heads, slots, D] written along dim 1."""

    update = cb_cache.PagedAttentionCache.update

    def __init__(self, layers: int, heads_first: bool = False):
        torch.manual_seed(1)
        shape = (2, 32, _D) if heads_first else (32, 2, _D)
        self.key_cache, self.value_cache = ([torch.full(shape, POISON, dtype=torch.bfloat16) for _ in range(layers)]
                                            for _ in range(2))  # fmt: skip
        for cache in self.key_cache + self.value_cache:
            (cache[:, :3] if heads_first else cache[:3]).normal_()
        self.layer_index_to_group_indices = {i: (0, i) for i in range(layers)}
        self.sliding_windows = dict.fromkeys(range(layers), 1)


class HeadsFirstCache(FlatCache):
    def __init__(self, layers: int):
        super().__init__(layers, heads_first=True)

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        caches = self.key_cache[layer_idx], self.value_cache[layer_idx]
        for cache, states in zip(caches, (key_states, value_states)):
            cache.index_copy_(1, write_index[0], states.squeeze(0))
        return tuple(torch.index_select(cache, 1, read_index[0]).transpose(0, 1) for cache in caches)


# One packed step of 6 tokens: request A's 2 new tokens (positions 3, 4; its 3 cached rows at slots
# 0-2) at slots 3, 4, request B's 3 prompt tokens at slots 16-18, one padding token (trash slot 30).
_IDS, _POSITIONS = torch.tensor([[5, 9, 1, 2, 3, 0]]), torch.tensor([[3, 4, 0, 1, 2, 0]])
_WRITE, _READ = torch.tensor([3, 4, 16, 17, 18, 30]), torch.tensor([0, 1, 2, 3, 4, 16, 17, 18])
# Which read rows each token attends (A causally over its 5, B over its 3, the padding one row).
_SEEN = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0],
                      [0, 0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0, 0]],
                     dtype=torch.bool)  # fmt: skip


def _packed_step(name: str, cache_class=FlatCache):
    """HF's model (``paged|sdpa``) on the packed step, eager and compiled with only the prologue
    families on; returns (report, eager logits and cache, compiled logits and cache)."""
    model = _model(name)
    model.set_attn_implementation("paged|sdpa")
    mask = torch.zeros(1, 1, *_SEEN.shape, dtype=torch.bfloat16).masked_fill(~_SEEN, float("-inf"))

    def run(forward, cache):
        with torch.no_grad():
            return forward(input_ids=_IDS, position_ids=_POSITIONS, attention_mask=mask, cache=cache,
                           read_index=[_READ], write_index=[_WRITE], use_cache=False).logits  # fmt: skip

    layers = model.config.num_hidden_layers
    eager_cache, cache = cache_class(layers), cache_class(layers)
    eager = run(model, eager_cache)
    families = {family: "off" for family in fc.FAMILY_ORDER} | {FAMILY: "triton", "mla_prologue": "triton"}
    backend = fc.FusionBackend(fc.FusionConfig(families=families))
    torch._dynamo.reset()
    fused = run(torch.compile(model, backend=backend), cache)
    return backend.report, (eager, eager_cache), (fused, cache)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ernie4_5", "cohere", "glm4", "helium"])
def test_hf_gptj_prologue_fuses_once_per_layer_on_the_flat_cache(name):
    """One gqa_prologue per attention layer, the model's flat GPT-J variant, no miss and no
    mla_prologue site; the logits within bf16 rounding of eager's, the first layer's written K / V
    rows eager's bits, the second's within bf16 rounding (its input comes through Inductor's code
    for the first layer: measured K 4.4e-3 / V 4.4e-3 ERNIE-4.5, 3.7e-3 / 4.3e-3 Cohere, the same
    with the family off), every other row unchanged but the trash slot."""
    report, (eager, eager_cache), (fused, cache) = _packed_step(name)
    assert report.per_layer(FAMILY) == {0: 1, 1: 1} and report.per_variant() == {VARIANTS[name]: 2}, report.format()
    assert report.misses() == [] and not [s for s in report.sites if s.family == "mla_prologue"], report.format()
    assert relative_error(fused, eager) < 1e-2
    written, others = _WRITE[:5], torch.ones(32, dtype=torch.bool)
    others[_WRITE] = False
    layers = len(cache.key_cache)
    for i, (want, got) in enumerate(zip(eager_cache.key_cache + eager_cache.value_cache,
                                        cache.key_cache + cache.value_cache)):  # fmt: skip
        assert torch.equal(got[others], want[others])
        if i % layers == 0:  # layer 0: eager's inputs
            assert torch.equal(got[written].view(torch.int16), want[written].view(torch.int16))
        else:
            assert relative_error(got[written], want[written]) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ernie4_5", "cohere"])
def test_a_gptj_fp32_write_along_dim_1_is_no_site(name):
    """The near miss above for the GPT-J form: K written along dim 1 of a heads-first flat cache
    is neither HF's static cache nor its continuous batching's. Without a q/k norm, a RoPE written
    to a cache other than HF's is no GQA site at all (DeepSeek V3's k_rot is one such), and GPT-J
    pairs are no mla_prologue site (the NeoX form is one there, a miss): nothing fuses and no miss
    is reported; the model's outputs stand."""
    report, (eager, eager_cache), (fused, cache) = _packed_step(name, HeadsFirstCache)
    assert report.per_module(FAMILY) == {} and report.per_variant() == {}, report.format()
    assert not [s for s in report.sites if s.family in (FAMILY, "mla_prologue")], report.format()
    assert relative_error(fused, eager) < 1e-2
    pairs = zip(eager_cache.key_cache + eager_cache.value_cache, cache.key_cache + cache.value_cache)
    assert all(relative_error(got, want) < 1e-2 for want, got in pairs)
