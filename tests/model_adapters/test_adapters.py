"""Model adapters: tiny HF builds, decode steps, RMSNorm sites, generic configs (CPU, no compile)."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from fusion_compiler.model_adapters import (
    ADAPTERS,
    adapter_from_hf_config,
    get_adapter,
    is_rms_norm,
    layer_of,
    make_decode_step,
    rms_norm_sites,
)

NAMES = ["deepseek-v3.2", "minimax-m2.5", "qwen3.5"]


@pytest.fixture(scope="module", params=NAMES)
def built(request):
    adapter = get_adapter(request.param)
    return adapter, adapter.build_hf()


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def test_registry_names():
    assert set(ADAPTERS) == set(NAMES)
    for name in NAMES:
        assert get_adapter(name).name == name


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_adapter("gpt-5")
    for name in NAMES:
        assert name in str(e.value)


def test_layer_of():
    assert layer_of("model.layers.3.self_attn.q_norm") == 3
    assert layer_of("model.layers.12.input_layernorm") == 12
    assert layer_of("layers.0") == 0
    assert layer_of("model.norm") is None
    assert layer_of("lm_head") is None
    assert layer_of("model.sublayers.3.x") is None


# ---------------------------------------------------------------------------------------------
# configs and layer kinds
# ---------------------------------------------------------------------------------------------


def test_layer_kinds():
    ds, mm, qw = (get_adapter(n) for n in NAMES)
    assert ds.layer_kinds(ds.hf_config()) == ["moe", "moe"]
    assert ds.layer_kinds(ds.hf_config("real", layers=3)) == ["moe"] * 3  # first_k_dense_replace -> 0
    assert mm.layer_kinds(mm.hf_config()) == ["moe", "moe"]
    lin, full = "linear_attention", "full_attention"
    assert qw.layer_kinds(qw.hf_config()) == [lin, lin, lin, full]
    assert qw.layer_kinds(qw.hf_config(layers=8)) == [lin, lin, lin, full] * 2
    assert qw.layer_kinds(qw.hf_config(layers=2)) == [lin, lin]
    real = qw.hf_config("real", layers=60)
    assert qw.layer_kinds(real) == [lin, lin, lin, full] * 15


def test_default_layers_and_config_types():
    assert [get_adapter(n).default_layers for n in NAMES] == [2, 2, 4]
    ds, mm, qw = (get_adapter(n) for n in NAMES)
    assert type(ds.hf_config()).__name__ == "DeepseekV32Config"
    assert type(mm.hf_config()).__name__ == "MiniMaxM2Config"
    assert type(qw.hf_config()).__name__ == "Qwen3_5MoeTextConfig"
    for a in (ds, mm, qw):
        for size in ("tiny", "real"):
            cfg = a.hf_config(size, layers=3)
            assert cfg.num_hidden_layers == 3
        tiny = a.hf_config()
        assert tiny.hidden_size == 256
        assert tiny._attn_implementation == "sdpa"
    with pytest.raises(ValueError):
        ds.hf_config("huge")


def test_real_config_values():
    ds = get_adapter("deepseek-v3.2").hf_config("real", layers=2)
    assert (ds.hidden_size, ds.q_lora_rank, ds.kv_lora_rank) == (7168, 1536, 512)
    assert (ds.qk_nope_head_dim, ds.qk_rope_head_dim, ds.v_head_dim) == (128, 64, 128)
    assert (ds.n_routed_experts, ds.num_experts_per_tok, ds.n_group, ds.topk_group) == (256, 8, 8, 4)
    assert (ds.index_n_heads, ds.index_head_dim, ds.index_topk) == (64, 128, 2048)
    assert ds.rope_parameters["rope_type"] == "yarn" and ds.rope_parameters["factor"] == 40.0
    assert ds.mlp_layer_types == ["sparse", "sparse"]

    mm = get_adapter("minimax-m2.5").hf_config("real", layers=2)
    assert (mm.hidden_size, mm.num_attention_heads, mm.num_key_value_heads, mm.head_dim) == (3072, 48, 8, 128)
    assert mm.rope_parameters["partial_rotary_factor"] == 0.5
    assert mm.rope_parameters["rope_theta"] == 5e6

    qw = get_adapter("qwen3.5").hf_config("real", layers=4)
    assert (qw.hidden_size, qw.num_attention_heads, qw.num_key_value_heads, qw.head_dim) == (4096, 32, 2, 256)
    assert (qw.linear_num_key_heads, qw.linear_num_value_heads) == (16, 64)
    assert (qw.num_experts, qw.num_experts_per_tok, qw.moe_intermediate_size) == (512, 10, 1024)
    assert qw.rope_parameters["partial_rotary_factor"] == 0.25


def test_minimax_partial_rope():
    model = get_adapter("minimax-m2.5").build_hf()
    cfg = model.config
    # RoPE covers half of each head (the pitfall: without partial_rotary_factor it covers all).
    assert model.model.rotary_emb.inv_freq.numel() * 2 == cfg.head_dim // 2


# ---------------------------------------------------------------------------------------------
# build + random init
# ---------------------------------------------------------------------------------------------


def test_build_random_init(built):
    adapter, model = built
    assert type(model).__name__.endswith("ForCausalLM")
    assert not model.training
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if not name.endswith("dt_bias"):  # GDN dt_bias: HF inits it to ones on purpose
            assert p.numel() == 1 or p.float().std() > 0, f"{name} is constant"
    for name, b in model.named_buffers():
        assert torch.isfinite(b).all(), name
    norms = [(n, m) for n, m in model.named_modules() if is_rms_norm(m)]
    assert norms
    for name, m in norms:
        w = m.weight
        mean = w.float().mean().item()
        gemma = type(m).__name__ == "Qwen3_5MoeRMSNorm"  # x * (1 + w)
        target = 0.0 if gemma else 1.0
        assert abs(mean - target) < 0.1, (name, mean)
        assert 0.03 < w.float().std().item() < 0.3, name
    # router correction biases are randomized (HF leaves them at zero)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert b.abs().sum() > 0, name


def test_build_is_seeded():
    a = get_adapter("minimax-m2.5")
    m0, m0b, m1 = a.build_hf(seed=0), a.build_hf(seed=0), a.build_hf(seed=1)
    s0, s0b, s1 = m0.state_dict(), m0b.state_dict(), m1.state_dict()
    assert all(torch.equal(s0[k], s0b[k]) for k in s0)
    assert not torch.equal(s0["model.layers.0.self_attn.q_proj.weight"], s1["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(s0["model.norm.weight"], s1["model.norm.weight"])


# ---------------------------------------------------------------------------------------------
# decode step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_step_logits(built, batch):
    adapter, model = built
    step = make_decode_step(model, batch=batch, context=16)
    assert step.cache_kind == "static"
    assert step.kwargs["input_ids"].shape == (batch, 1)
    logits = step.run(model)
    vocab = model.config.vocab_size
    assert logits.shape == (batch, 1, vocab)
    assert torch.isfinite(logits).all()
    assert logits.float().std() > 0.05  # non-degenerate
    assert torch.isfinite(step.prefill_logits).all()


def test_decode_step_deterministic(built):
    adapter, model = built
    step = make_decode_step(model, batch=2, context=16, seed=3)
    fresh = step.fresh()
    first = step.run(model)
    again = step.run(model)  # cache is restored in place before a second run
    other = fresh.run(model)
    rebuilt = make_decode_step(model, batch=2, context=16, seed=3).run(model)
    assert torch.equal(first, again)
    assert torch.equal(first, other)
    assert torch.equal(first, rebuilt)
    different = make_decode_step(model, batch=2, context=16, seed=4).run(model)
    assert not torch.equal(first, different)


def test_decode_step_matches_full_forward(built):
    """The cached decode step computes the same logits as an uncached forward over context + 1
    tokens (fp32, so only op-order noise remains)."""
    adapter, _ = built
    model = adapter.build_hf(dtype=torch.float32)
    step = make_decode_step(model, batch=2, context=12)
    dec = step.run(model)
    ids = torch.cat([step.prefill_input_ids, step.input_ids], dim=1)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[:, -1:]
    torch.testing.assert_close(dec, full, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# RMSNorm sites (derived from forward hooks during one decode step)
# ---------------------------------------------------------------------------------------------

EXPECTED_PER_LAYER = {
    "deepseek-v3.2": {
        "moe": {"input_layernorm", "post_attention_layernorm", "self_attn.q_a_layernorm", "self_attn.kv_a_layernorm"},
    },
    "minimax-m2.5": {
        "moe": {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"},
    },
    "qwen3.5": {
        "linear_attention": {"input_layernorm", "post_attention_layernorm", "linear_attn.norm"},
        "full_attention": {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"},
    },
}


def test_rms_norm_sites(built):
    adapter, model = built
    sites = rms_norm_sites(model)
    assert all(n == 1 for n in sites.values()), sites
    assert "model.norm" in sites
    per_layer: dict[int, set[str]] = defaultdict(set)
    for path in sites:
        i = layer_of(path)
        if i is None:
            assert path == "model.norm"
            continue
        per_layer[i].add(path.split(f"layers.{i}.", 1)[1])
    kinds = adapter.layer_kinds(model.config)
    assert sorted(per_layer) == list(range(len(kinds)))
    for i, kind in enumerate(kinds):
        assert per_layer[i] == EXPECTED_PER_LAYER[adapter.name][kind], (i, kind)
    # The DSv3.2 indexer k_norm is a LayerNorm: never an RMSNorm site.
    assert not any("indexer" in p for p in sites)


# ---------------------------------------------------------------------------------------------
# generic HF configs
# ---------------------------------------------------------------------------------------------


def _write(tmp_path, data, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(p)


def test_adapter_from_hf_config_llama(tmp_path):
    path = _write(
        tmp_path,
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 384,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
    )
    adapter = adapter_from_hf_config(path)
    assert adapter.model_type == "llama" and adapter.default_layers == 3
    model = adapter.build_hf()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert adapter.layer_kinds(model.config) == ["decoder"] * 3
    step = make_decode_step(model, batch=2)
    logits = step.run(model)
    assert logits.shape == (2, 1, 384) and torch.isfinite(logits).all()
    sites = rms_norm_sites(model)
    assert len(sites) == 3 * 2 + 1


def test_adapter_from_hf_config_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        adapter_from_hf_config(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="model_type"):
        adapter_from_hf_config(_write(tmp_path, {"hidden_size": 128}))
    with pytest.raises(ValueError, match="JSON"):
        adapter_from_hf_config(_write(tmp_path, "{not json", "bad.json"))
    with pytest.raises(ValueError):
        adapter_from_hf_config(_write(tmp_path, [1, 2], "list.json"))
    with pytest.raises(ValueError, match="not known"):
        adapter_from_hf_config(_write(tmp_path, {"model_type": "no_such_model_xyz"}, "unk.json"))
