"""gpt-oss's attention prologue (HF transformers 5.17) as a no-norm GQA prologue variant.

gpt-oss writes NeoX RoPE's halves out (``_apply_rotary_emb``: ``torch.chunk(x, 2, -1)``, then
``cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin))``) on cos / sin half as wide as the head (its
rotary embedding does not duplicate ``freqs``). Rounding point for rounding point that is HF
Llama's ``x * cos + rotate_half(x) * sin``: each bf16 product rounded, then the add or subtract
rounded (``a - b`` is ``a + (-b)`` and ``-(x2 * sin)`` is ``(-x2) * sin``, negation being exact),
and cos / sin's values are those of ``cat(freqs, freqs)``'s halves. So the same op and kernel run:
``none.hf_full_rope_chunk`` (HF's static cache) and ``none.hf_flat_full_rope_chunk``
(continuous batching's flat cache).

- HF's own gpt-oss at a tiny config, sliding and full layers alternating, the window (8) smaller
  than the prefilled context (16): the sliding layer's decode step takes
  ``StaticSlidingWindowLayer``'s rolled path (roll, write at ``torch.tensor([-1])``, ``copy_``)
  and is a site like the full layer. One gqa_prologue per layer; the first layer's caches (rolled
  ones) are eager's bits, the second's new rows within bf16 rounding (its input comes through
  Inductor's code for the first layer and the MoE), every other byte unchanged.
- HF's ``apply_rotary_pos_emb`` of modeling_gpt_oss on one prologue, static and flat caches: q
  and the cache rows are eager's bits and within bf16 tolerance of float64.
- Near misses, each a miss in words: the second half's sign flipped (a rotation's transpose on
  one half), and the halves swapped in the cat.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.model_adapters import make_decode_step
from fusion_compiler.verify import relative_error

FAMILY = "gqa_prologue"
VARIANT, FLAT_VARIANT = "none.hf_full_rope_chunk", "none.hf_flat_full_rope_chunk"
WINDOW, CONTEXT = 8, 16
_CONFIG = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               vocab_size=256, intermediate_size=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
               eos_token_id=2, num_local_experts=4, num_experts_per_tok=2,
               layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)  # fmt: skip


@functools.cache
def decode_run() -> dict:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**_CONFIG)).to(torch.bfloat16).eval()
    step = make_decode_step(model, context=CONTEXT)
    fused_step = step.fresh()
    eager = step.run(model)
    families = {family: "off" for family in fc.FAMILY_ORDER} | {FAMILY: "triton", "mla_prologue": "triton"}
    backend = fc.FusionBackend(fc.FusionConfig(families=families))
    torch._dynamo.reset()
    fused = fused_step.run(torch.compile(model, backend=backend))
    return dict(model=model, report=backend.report, eager=eager, fused=fused, eager_step=step, fused_step=fused_step)


def test_hf_gpt_oss_fuses_every_layer_sliding_and_full():
    run = decode_run()
    report = run["report"]
    layers = [type(layer).__name__ for layer in run["eager_step"].cache.layers]
    assert layers == ["StaticSlidingWindowLayer", "StaticLayer"]
    assert run["eager_step"].cache.layers[0].keys.shape[2] == WINDOW < CONTEXT  # full: the rolled write
    assert report.misses(FAMILY) == [] and report.misses("mla_prologue") == [], report.format()
    assert report.per_module(FAMILY) == {f"model.layers.{i}.self_attn": 1 for i in range(2)}
    assert report.per_variant() == {VARIANT: 2}
    assert relative_error(run["fused"], run["eager"]) < 1e-2
    eager_cache, fused_cache = run["eager_step"].cache.layers, run["fused_step"].cache.layers
    # The sliding layer: its rolled caches, the new row last, are eager's bits.
    assert torch.equal(fused_cache[0].keys, eager_cache[0].keys)
    assert torch.equal(fused_cache[0].values, eager_cache[0].values)
    position = run["eager_step"].context
    for want, got in ((eager_cache[1].keys, fused_cache[1].keys), (eager_cache[1].values, fused_cache[1].values)):
        others = torch.arange(want.shape[2]) != position
        assert torch.equal(got[:, :, others], want[:, :, others])
        assert relative_error(got[:, :, position], want[:, :, position]) < 1e-2


# ------------------------------------------------------------------------------------------
# One prologue with HF gpt-oss's own RoPE: eager's bits, float64's values; near misses
# ------------------------------------------------------------------------------------------

_D = 32


def _rope(kind: str):
    """HF gpt-oss's ``apply_rotary_pos_emb``, or a near miss of its ``_apply_rotary_emb``:
    ``flipped`` (the second half x2 * cos - x1 * sin), ``swapped`` (the halves' order in the cat)."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    if kind == "hf":
        return modeling_gpt_oss.apply_rotary_pos_emb

    def turn(x, cos, sin):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        first, second = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if kind == "flipped":
            second = x2 * cos - x1 * sin
        return torch.cat((second, first) if kind == "swapped" else (first, second), dim=-1)

    def rope(q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return turn(q, cos, sin), turn(k, cos, sin)

    return rope


class GptOssPrologue(torch.nn.Module):
    """gpt-oss's attention up to its cache write on q, k, v projections [1, S, heads * 32]: the
    rotary embedding's half-width cos / sin (fp32 ``freqs``, cast), the heads transposed, the RoPE,
    then HF's static cache (``index_copy_`` along dim 2) or continuous batching's flat one
    (``index_copy_(0, slots, k.transpose(1, 2).squeeze(0))``)."""

    def __init__(self, rope: str = "hf", flat: bool = False):
        super().__init__()
        self.rope, self.flat = _rope(rope), flat

    def forward(self, q, k, v, freqs, k_cache, v_cache, where):
        cos, sin = freqs.cos().to(q.dtype), freqs.sin().to(q.dtype)
        q, k, v = (x.view(1, x.shape[1], -1, _D).transpose(1, 2) for x in (q, k, v))
        q, k = self.rope(q, k, cos, sin)
        if self.flat:
            k_cache.index_copy_(0, where, k.transpose(1, 2).squeeze(0))
            v_cache.index_copy_(0, where, v.transpose(1, 2).squeeze(0))
        else:
            k_cache.index_copy_(2, where, k)
            v_cache.index_copy_(2, where, v)
        return q


def _one_prologue(module, seed: int = 0):
    """Eager, compiled and float64 runs of ``module`` on random bf16 inputs: (report, (q, caches)
    of each run)."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(1, 3, h * _D, dtype=torch.bfloat16) for h in (4, 2, 2))
    freqs = torch.rand(1, 3, _D // 2) * 10
    shape = (16, 2, _D) if module.flat else (1, 2, 8, _D)
    caches = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(2)]
    where = torch.tensor([9, 3, 12]) if module.flat else torch.tensor([3, 4, 5])
    eager_caches, wide_caches = [c.clone() for c in caches], [c.double() for c in caches]
    backend = fc.FusionBackend(fc.FusionConfig(families={"mla_prologue": "off", "add_rms_norm": "off", FAMILY: "triton"}))
    with torch.no_grad():
        eager = module(q, k, v, freqs, *eager_caches, where)
        wide = module(q.double(), k.double(), v.double(), freqs.double(), *wide_caches, where)
        torch._dynamo.reset()
        fused = torch.compile(module, backend=backend)(q, k, v, freqs, *caches, where)
    return backend.report, (fused, caches), (eager, eager_caches), (wide, wide_caches)


@pytest.mark.parametrize(("flat", "variant"), [(False, VARIANT), (True, FLAT_VARIANT)])
def test_hf_gpt_oss_rope_keeps_eager_bits(flat, variant):
    report, (fused, caches), (eager, eager_caches), (wide, wide_caches) = _one_prologue(GptOssPrologue(flat=flat))
    assert report.per_variant() == {variant: 1} and report.misses() == [], report.format()
    assert torch.equal(fused, eager)
    assert all(torch.equal(got, want) for got, want in zip(caches, eager_caches))
    assert relative_error(fused.double(), wide) < 1e-2
    assert all(relative_error(got.double(), want) < 1e-2 for got, want in zip(caches, wide_caches))


@pytest.mark.parametrize(("rope", "spelled"), [
    ("flipped", "cat((x1 * cos - x2 * sin, x2 * cos - x1 * sin))"),
    ("swapped", "cat((x2 * cos + x1 * sin, x1 * cos - x2 * sin))"),
])  # fmt: skip
def test_near_misses_of_gpt_oss_halves_are_misses_in_words(rope, spelled):
    report, *_ = _one_prologue(GptOssPrologue(rope), 1)
    assert report.per_variant() == {}, report.format()
    [miss] = report.misses(FAMILY)
    assert f"k is rotated by NeoX halves written out as {spelled}, not as gpt-oss's _apply_rotary_emb writes them" in (
        miss.reason
    ), miss.reason
    assert "closest variant" not in miss.reason and "no variant matched" not in miss.reason
