"""The Qwen3.5 serving-engine reference attention (model_adapters/reference/qwen35.py) against
HF's Qwen3_5MoeAttention (the full-attention layer 3 of the tiny model), and its paged KV-cache
writes.

HF runs a causal prefill of a whole sequence; the reference decodes the same tokens one at a
time, writing each token's K/V into a paged cache (scattered blocks) and attending over it.
Row p of HF's output must equal the reference's step p (bf16: HF rounds cos/sin to bf16 and after
each RoPE product, the reference rounds RoPE once and attends in fp32).

HF's rotary embedding wants M-RoPE position ids [3, batch, length] (a 2-D [batch, length] one
raises IndexError); text-only: the three rows are equal.
"""

from __future__ import annotations

import pytest
import torch

from fusion_compiler._compat import JOINT_GRAPH_DROPS_ROUND_TRIPS
from fusion_compiler.model_adapters import get_adapter
from fusion_compiler.model_adapters.reference import paged_kv
from fusion_compiler.model_adapters.reference import qwen35 as ref
from fusion_compiler.verify import relative_error
from gqa_fixtures import assert_prologue_writes_only_its_slots, paged_decode

LENGTH = 9


@pytest.fixture(scope="module")
def hf_tiny():
    model = get_adapter("qwen3.5").build_hf(size="tiny", layers=4, dtype=torch.bfloat16)
    assert model.config.layer_types[3] == "full_attention"
    hf_attn = model.model.layers[3].self_attn
    # build_hf draws the Gemma norms' offsets w as 0.1 * randn (HF inits them to zeros), so the
    # (1 + w) of the reference is really tested.
    assert hf_attn.q_norm.weight.float().std() > 0.05 and hf_attn.k_norm.weight.float().std() > 0.05
    torch.manual_seed(0)
    x = torch.randn(1, LENGTH, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, torch.arange(LENGTH)[None, None].expand(3, 1, -1))
        hf_out, _ = hf_attn(x, (cos, sin), attention_mask=None)
    return model, hf_attn, x[0], hf_out[0]


def test_reference_decode_equals_hf_prefill(hf_tiny):
    model, hf_attn, x, hf_out = hf_tiny
    cfg = ref.config_of(model.config, block_size=4)
    assert cfg.rotary_dim == 16  # partial: 16 of 64 dims (partial_rotary_factor 0.25)
    out, _ = paged_decode(ref, ref.from_hf(hf_attn, cfg), cfg, x)
    assert relative_error(out, hf_out) < 1e-2  # measured 2.6e-3; full-width RoPE gives 0.19


def test_fp8_cache_decode_equals_hf_prefill_within_fp8_precision(hf_tiny):
    model, hf_attn, x, hf_out = hf_tiny
    cfg = ref.config_of(model.config, block_size=4, kv_cache_dtype="fp8")
    out, k_cache = paged_decode(ref, ref.from_hf(hf_attn, cfg), cfg, x, k_scale=0.05, v_scale=0.02)
    assert k_cache.dtype == paged_kv.FP8
    assert relative_error(out, hf_out) < 0.1  # e4m3 keeps 3 mantissa bits; measured 3.1e-2


def _plain_w(ours: ref.Attention) -> None:
    """Near miss: a norm times w, not (1 + w) (Llama-style weight on Gemma-style offsets)."""
    with torch.no_grad():
        ours.q_norm_weight.sub_(1.0)
        ours.k_norm_weight.sub_(1.0)


def _q_gate_not_interleaved(ours: ref.Attention) -> None:
    """Near miss: q_proj read as [all q | all gates] instead of per head [q_h | gate_h]."""
    cfg = ours.cfg
    with torch.no_grad():
        q_gate = ours.qkv_proj.weight[: 2 * cfg.q_width]
        q_gate.copy_(q_gate.view(cfg.num_heads, 2, cfg.head_dim, -1).transpose(0, 1).reshape_as(q_gate).clone())


@pytest.mark.parametrize("near_miss", [_plain_w, _q_gate_not_interleaved])
def test_near_misses_differ_from_hf(hf_tiny, near_miss):
    """The comparison above is sensitive to the two Qwen3.5 details a port gets wrong."""
    model, hf_attn, x, hf_out = hf_tiny
    cfg = ref.config_of(model.config, block_size=4)
    ours = ref.from_hf(hf_attn, cfg)
    near_miss(ours)
    out, _ = paged_decode(ref, ours, cfg, x)
    assert relative_error(out, hf_out) > 0.1  # measured: plain w 0.48, not interleaved 0.60


def test_cache_writes_only_the_tokens_slots():
    assert_prologue_writes_only_its_slots(ref)


@pytest.mark.parametrize("emulate_precision_casts", [False, True])
def test_prologue_compiles_without_graph_breaks_and_equals_eager(emulate_precision_casts):
    """Default Inductor keeps the norm's output in fp32 inside the fused norm + RoPE kernel (it
    skips the bf16 rounding between them), so the rotary dims of q and k may differ by a bf16 ulp;
    with ``emulate_precision_casts`` it rounds as eager does and the results are bit-equal (where
    Inductor's joint graph keeps a bf16 round trip: torch 2.13 on, `_compat.JOINT_GRAPH_DROPS_ROUND_TRIPS`)."""
    cfg = ref.ReferenceConfig(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=16, block_size=4)
    torch.manual_seed(0)
    ours = ref.Attention(cfg).to(torch.bfloat16)
    with torch.no_grad():
        ours.q_norm_weight.normal_(0.0, 0.1)
        ours.k_norm_weight.normal_(0.0, 0.1)
    x = torch.randn(3, cfg.hidden_size, dtype=torch.bfloat16)
    args = (ref.rope_cos_sin_cache(cfg), torch.tensor([7, 0, 33]), torch.tensor([9, 41, 40]))
    k_eager = torch.randn(12, cfg.block_size, cfg.num_kv_heads, cfg.head_dim).bfloat16()
    v_eager = torch.randn_like(k_eager)
    k_comp, v_comp = k_eager.clone(), v_eager.clone()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=emulate_precision_casts):
        q_eager, gate_eager = ours.prologue(x, *args, k_eager, v_eager, 1.0, 1.0)
        q_comp, gate_comp = torch.compile(ours.prologue, fullgraph=True)(x, *args, k_comp, v_comp, 1.0, 1.0)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch.equal(gate_comp, gate_eager)
    assert torch.equal(v_comp, v_eager)
    if emulate_precision_casts and not JOINT_GRAPH_DROPS_ROUND_TRIPS:
        assert torch.equal(q_comp, q_eager) and torch.equal(k_comp, k_eager)
    else:  # measured: q 1.1e-3, k 1.6e-4 (34 of 768 q values, all in the 16 rotary dims)
        # Torch 2.11's joint-graph pointless_convert folds the norm's bf16 round trip even under
        # emulate_precision_casts (stock Inductor, no pass of ours), so there only this bound holds.
        assert relative_error(q_comp, q_eager) < 5e-3
        assert relative_error(k_comp, k_eager) < 5e-3
