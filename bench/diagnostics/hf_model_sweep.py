"""Sweep many transformers decoder model types through the fusion_compiler backend on CPU.

For each model type: a tiny config (2 layers, hidden 128-256, vocab 512, the model's distinctive
features on), built at bf16 (seed 0), one decode step (batch 2, context 8, StaticCache of 16) run
eagerly, through ``torch.compile(model, backend="fusion_compiler")`` and through stock
``torch.compile(model, backend="inductor")`` (the cache restored between runs). Recorded per
model: errors (type, message, last frames inside fusion_compiler), the backend's matched/missed
sites per family and the miss reasons, max relative error of the logits against eager for ours and
for stock, and a status:

  ok            no crash; ours within max(2 x stock, 2e-2) of eager
  CRASH         ours raised where stock did not
  NUMERICS      ours far from eager where stock is close
  UNCLEAR_MISS  ok, but some miss reason is empty / a matcher dump / not one readable sentence
  n/a           transformers itself cannot build or step the model (eager fails)
  BOTH_FAIL     ours and stock both raised (not ours to fix)
  TIMEOUT       the model's subprocess ran past --timeout

Each model runs in its own subprocess (a crash or a hang costs one row). Results are merged into
the JSON (``--out``), so ``--only`` reruns a few models in place.

    .venv/bin/python bench/diagnostics/hf_model_sweep.py                       # all models
    .venv/bin/python bench/diagnostics/hf_model_sweep.py --only gemma2,dbrx    # a few, merged
    .venv/bin/python bench/diagnostics/hf_model_sweep.py --only dbrx --dtype float32 --out /tmp/f32.json
    .venv/bin/python bench/diagnostics/hf_model_sweep.py --list
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: common
import common  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "bench", "results", "hf_model_sweep_cpu.json")

BATCH, CONTEXT, MAX_CACHE_LEN = 2, 8, 16
# ours is ok within max(2 x stock's error, FLOOR): bf16's rounding noise, or fp32's (where a changed
# computation, not a rounding, is what shows above 1e-4).
FLOOR = {"bfloat16": 2e-2, "float32": 1e-4}
SLIDE = 4  # sliding / chunked windows shorter than the context, so the window really applies

# Shared tiny widths. Each model's dict overrides / adds its own keys.
_ATTN = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256,
         "tie_word_embeddings": False, "pad_token_id": 0}  # fmt: skip


DROP = object()  # a shared key this model's config must not get (falcon: head_dim is a read-only property)


def _c(model_type: str, **kw) -> dict:
    return {k: v for k, v in {"model_type": model_type, **_ATTN, **kw}.items() if v is not DROP}


def _mla(**kw) -> dict:
    return {"q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
            "v_head_dim": 32, "num_key_value_heads": 4, **kw}  # fmt: skip


def configs() -> dict[str, dict]:
    """model label -> transformers config dict (with model_type). Order: dense, MoE, hybrid."""
    from fusion_compiler.inspect import support_models as sm

    sw2 = ["sliding_attention", "full_attention"]
    cfgs = {
        # ---- dense ---------------------------------------------------------------------------------
        "llama": _c("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "mistral": _c("mistral", sliding_window=SLIDE),
        "qwen2": _c("qwen2"),  # q/k/v biases
        "qwen3": _c("qwen3"),  # per-head q/k RMSNorm
        "gemma": _c("gemma"),  # (1 + w) RMSNorm, sqrt(hidden) embedding scale
        "gemma2": _c("gemma2", sliding_window=SLIDE, layer_types=sw2, attn_logit_softcapping=50.0,
                     final_logit_softcapping=30.0, query_pre_attn_scalar=64),
        "gemma3_text": _c("gemma3_text", sliding_window=SLIDE, layer_types=sw2, query_pre_attn_scalar=64,
                          rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                           "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
        "phi3": _c("phi3", pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "phi": _c("phi", num_key_value_heads=4, qk_layernorm=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "olmo2": _c("olmo2"),  # q/k RMSNorm over the whole projection, post-norms
        "olmo3": _c("olmo3", sliding_window=SLIDE, layer_types=sw2),
        "cohere": _c("cohere", use_qk_norm=True, logit_scale=0.25),  # LayerNorm, parallel block, GPT-J rope
        "cohere2": _c("cohere2", sliding_window=SLIDE, layer_types=sw2, logit_scale=0.25),
        "granite": _c("granite", embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                      logits_scaling=8.0),
        "starcoder2": _c("starcoder2", use_bias=True, sliding_window=SLIDE),
        "gpt_neox": _c("gpt_neox", num_key_value_heads=4, use_parallel_residual=True, attention_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
        "falcon": _c("falcon", head_dim=DROP, num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, bias=False,
                     ffn_hidden_size=512),
        "stablelm": _c("stablelm", num_key_value_heads=4, qk_layernorm=True, use_qkv_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
        "exaone4": _c("exaone4", sliding_window=SLIDE, layer_types=sw2),
        "smollm3": _c("smollm3", pad_token_id=0, no_rope_layers=[1, 0]),  # layer 1 without RoPE (NoPE)
        "glm4": _c("glm4", pad_token_id=0, attention_bias=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "glm": _c("glm", pad_token_id=0, attention_bias=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "seed_oss": _c("seed_oss", attention_bias=True, attention_out_bias=False),
        "ernie4_5": _c("ernie4_5", use_bias=True),  # GPT-J pairs over the whole head
        "apertus": _c("apertus", hidden_act="xielu"),  # xIELU MLP, q/k norm
        "nemotron": _c("nemotron", num_key_value_heads=2, hidden_act="relu2",  # LayerNorm1P, partial rope
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        "hunyuan_v1_dense": _c("hunyuan_v1_dense"),  # q/k norm after RoPE
        "minicpm3": _c("minicpm3", **_mla(num_key_value_heads=4, head_dim=32), scale_emb=12, scale_depth=1.4,
                       dim_model_base=64),  # MLA in a dense model
        "gemma3n_text": _c("gemma3n_text", num_key_value_heads=2, sliding_window=SLIDE, layer_types=sw2,
                           vocab_size_per_layer_input=512, hidden_size_per_layer_input=64,
                           intermediate_size=[512, 512], activation_sparsity_pattern=[0.95, 0.0],
                           num_kv_shared_layers=0, altup_num_inputs=4, laurel_rank=16),
        # ---- MoE -----------------------------------------------------------------------------------
        "mixtral": _c("mixtral", intermediate_size=128, num_local_experts=8, num_experts_per_tok=2),
        "qwen2_moe": _c("qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                        shared_expert_intermediate_size=256, norm_topk_prob=False),
        "qwen3_moe": dict(sm.QWEN3_MOE),
        "olmoe": _c("olmoe", num_experts=8, num_experts_per_tok=2, intermediate_size=128, clip_qkv=8.0),
        "flex_olmo": _c("flex_olmo", num_experts=7, num_experts_per_tok=3, intermediate_size=128),
        "dbrx": {"model_type": "dbrx", "vocab_size": 512, "d_model": 256, "n_heads": 4, "n_layers": 2,
                 "max_seq_len": 256, "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                 "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
        "granitemoe": _c("granitemoe", intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                         embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                         logits_scaling=8.0),
        "granitemoeshared": _c("granitemoeshared", intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                               shared_intermediate_size=256, embedding_multiplier=12.0, residual_multiplier=0.22,
                               attention_multiplier=0.015625, logits_scaling=8.0),
        "phimoe": _c("phimoe", intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                     router_jitter_noise=0.01, lm_head_bias=True, attention_bias=True),
        "deepseek_v2": _c("deepseek_v2", **_mla(q_lora_rank=None), n_routed_experts=8, n_shared_experts=1,
                          num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1,
                          topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0),
        "deepseek_v3": dict(sm.DEEPSEEK_V3),
        "glm4_moe": dict(sm.GLM4_MOE),
        "glm4_moe_lite": _c("glm4_moe_lite", **_mla(), n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                            moe_intermediate_size=128, n_group=1, topk_group=1, routed_scaling_factor=1.8,
                            mlp_layer_types=["dense", "sparse"], rope_interleave=True),
        "dots1": _c("dots1", n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128,
                    first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=True,
                    sliding_window=SLIDE, layer_types=["full_attention", "full_attention"]),
        "hunyuan_v1_moe": _c("hunyuan_v1_moe", num_experts=8, moe_topk=2, intermediate_size=128),
        "gpt_oss": _c("gpt_oss", intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                      sliding_window=SLIDE, layer_types=sw2, attention_bias=True),
        "llama4_text": _c("llama4_text", intermediate_size=128, intermediate_size_mlp=256, num_local_experts=4,
                          num_experts_per_tok=1, moe_layers=[0, 1], interleave_moe_layer_step=1, use_qk_norm=True,
                          no_rope_layers=[1, 0], attention_chunk_size=SLIDE,
                          layer_types=["chunked_attention", "full_attention"], floor_scale=4, attn_scale=0.1),
        "minimax_m2": sm._minimax_hf_default(),
        "ernie4_5_moe": dict(sm.ERNIE4_5_MOE),
        "afmoe": _c("afmoe", moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                    num_dense_layers=1, sliding_window=SLIDE, layer_types=sw2, global_attn_every_n_layers=2,
                    route_scale=2.0),
        "exaone_moe": _c("exaone_moe", moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                         num_shared_experts=1, first_k_dense_replace=1, mlp_layer_types=["dense", "sparse"],
                         sliding_window=SLIDE, layer_types=sw2, n_group=1, topk_group=1),
        "mimo_v2_flash": _c("mimo_v2_flash", moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
                            head_dim=48, v_head_dim=32, sliding_window=SLIDE, layer_types=["full_attention", "sliding_attention"],
                            mlp_layer_types=["dense", "sparse"],
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.334}}),
        "longcat_flash": _c("longcat_flash", **_mla(head_dim=32), num_hidden_layers=2, num_layers=1, ffn_hidden_size=256,
                            expert_ffn_hidden_size=128, n_routed_experts=8, zero_expert_num=4, moe_topk=2,
                            routed_scaling_factor=6.0),
        "lfm2_moe": _c("lfm2_moe", moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
                       layer_types=["conv", "full_attention"], use_expert_bias=True),
        "cohere2_moe": _c("cohere2_moe", num_experts=8, num_experts_per_tok=2, sliding_window=SLIDE, layer_types=sw2,
                          mlp_layer_types=["sparse", "sparse"], logit_scale=0.25),
        "laguna": _c("laguna", moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, sliding_window=SLIDE, layer_types=sw2, mlp_layer_types=["dense", "sparse"],
                     num_attention_heads_per_layer=[4, 4]),
        "hy_v3": _c("hy_v3", num_experts=8, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=128,
                    mlp_layer_types=["dense", "sparse"]),
        # ---- hybrid: linear attention / SSM / conv layers -------------------------------------------
        "qwen3_next": dict(sm.QWEN3_NEXT),
        "jamba": _c("jamba", num_experts=4, num_experts_per_tok=2, intermediate_size=256, expert_layer_period=2,
                    expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False,
                    mamba_d_state=8, mamba_dt_rank=16, mamba_expand=2),
        "granitemoehybrid": _c("granitemoehybrid", intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                               shared_intermediate_size=256, layer_types=["mamba", "attention"], mamba_n_heads=16,
                               mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16, embedding_multiplier=12.0,
                               residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0),
        "bamba": _c("bamba", attn_layer_indices=[1], mamba_n_heads=16, mamba_d_head=32, mamba_d_state=16,
                    mamba_chunk_size=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5}),
        "falcon_h1": _c("falcon_h1", mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16,
                        mamba_chunk_size=16, mamba_rms_norm=True, key_multiplier=0.5, attention_in_multiplier=0.8,
                        ssm_multipliers=[0.5, 0.5, 0.5, 0.5, 0.5], mlp_multipliers=[0.9, 0.7], lm_head_multiplier=0.3),
        "minimax": _c("minimax", intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, block_size=4,
                      layer_types=["linear_attention", "full_attention"]),
        "lfm2": _c("lfm2", layer_types=["conv", "full_attention"], full_attn_idxs=[1], block_auto_adjust_ff_dim=False),
        "nemotron_h": _c("nemotron_h", layers_block_type=["mamba", "moe", "attention", "mlp"], num_hidden_layers=4,
                         mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16, n_groups=1, chunk_size=16,
                         n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=128,
                         moe_shared_expert_intermediate_size=128, num_experts_per_tok=2, use_mamba_kernels=False),
        "kimi_linear": _c("kimi_linear", **_mla(q_lora_rank=None), num_experts=8, num_experts_per_token=2,
                          num_shared_experts=1, moe_intermediate_size=128, mlp_layer_types=["dense", "sparse"],
                          layer_types=["linear_attention", "full_attention"], linear_head_dim=32, linear_num_heads=4,
                          num_expert_group=1, topk_group=1),
    }
    return cfgs


# Asked for in the brief but absent from this transformers (recorded as not applicable).
ABSENT = ["bailing_moe"]


# --------------------------------------------------------------------------------------------------
# One model (child process)
# --------------------------------------------------------------------------------------------------


def _frames(error: BaseException) -> dict:
    """The exception chain's types/messages and its last frames inside fusion_compiler."""
    chain, seen, ours = [], set(), []
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(f"{type(e).__name__}: {str(e).strip()[:600]}")
        for fr in traceback.extract_tb(e.__traceback__):
            if f"{os.sep}fusion_compiler{os.sep}" in fr.filename and ".venv" not in fr.filename:
                ours.append(f"{os.path.relpath(fr.filename, REPO)}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()[:160]}")
        e = e.__cause__ or e.__context__
    return {"type": type(error).__name__, "message": str(error).strip()[:1500], "chain": chain,
            "fusion_compiler_frames": ours[-8:]}  # fmt: skip


def _max_rel(actual, expected) -> float:
    import torch

    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape or not torch.isfinite(a).all():
        return float("inf")
    scale = e.abs().max().item()
    return (a - e).abs().max().item() / scale if scale > 0 else (a - e).abs().max().item()


def _unclear(reason) -> str | None:
    """Why a miss reason is not one readable sentence about the model's code, or None."""
    if not reason or not str(reason).strip():
        return "empty reason"
    r = str(reason)
    if r.strip() in ("no variant matched", "None"):
        return "generic fallback: says nothing about the model's code"
    if "did not take it: its re-trace" in r:
        return "Inductor's re-trace refused a structural match: says what the matcher did, not what the model has"
    if len(r) > 600:
        return f"{len(r)} characters long"
    if "\n" in r.strip():
        return "several lines"
    for token in ("CallFunction(", "KeywordArg(", "Arg()", "FailedMatch", "Ignored(", "ExclusiveKeywordArg",
                  "torch.fx.node", "<function ", " object at 0x", "Traceback"):
        if token in r:
            return f"matcher/internal text {token!r}"
    return None


def _matcher_level(reason) -> str | None:
    """A reason in the matcher's terms (FX node names, the closest variant's name) rather than the
    model's: readable, but not about the model's code. Noted, not a status of its own."""
    r = str(reason or "")
    if r.startswith("closest variant "):
        return "the closest variant's first departure, in FX node names"
    if "bound to the same node" in r:
        return "starts with the matcher's binding of q and k to one node"
    return None


def classify(res: dict, dtype_name: str) -> None:
    """res["status"] (and res["notes"]) from what run_one recorded; also rereads a stored result."""
    if res.get("stage") in ("build", "eager") or res.get("status") in ("TIMEOUT", "CHILD_DIED"):
        return
    ours_err, stock_err = res.get("ours_error"), res.get("stock_error")
    if not ours_err and "ours_err" not in res:  # never got to run (a model_type this transformers lacks)
        return
    notes = []
    if ours_err and stock_err:
        status = "BOTH_FAIL"
    elif ours_err:
        status = "CRASH"
    elif stock_err:
        status = "ok"
        notes.append("stock Inductor raised, ours did not")
    else:
        ours_e, stock_e = res["ours_err"], res["stock_err"]
        status = "ok" if ours_e <= max(2 * stock_e, FLOOR[dtype_name]) else "NUMERICS"
    report = res.get("report", {})
    reasons = report.get("miss_reasons", [])
    report["unclear"] = [{"family": m["family"], "why": _unclear(m["reason"]), "reason": m["reason"][:300]}
                         for m in reasons if _unclear(m["reason"])]  # fmt: skip
    report["matcher_level"] = [{"family": m["family"], "why": _matcher_level(m["reason"]), "reason": m["reason"][:300]}
                               for m in reasons if _matcher_level(m["reason"])]  # fmt: skip
    if status == "ok" and report["unclear"]:
        status = "UNCLEAR_MISS"
    if report.get("matcher_level"):
        notes.append(f"{len(report['matcher_level'])} miss reason(s) in the matcher's terms (closest variant / FX names)")
    res["status"], res["notes"] = status, notes


def _report(report, expected) -> dict:
    sites = report.sites
    families = sorted({s.family for s in sites})
    out = {"graphs": sum(g.runs is None for g in report.graphs), "families": {}, "miss_reasons": [], "unclear": []}
    for fam in families:
        out["families"][fam] = {"matched": sum(1 for s in sites if s.family == fam and s.status == "matched"),
                                "missed": sum(1 for s in sites if s.family == fam and s.status == "missed")}
    reasons = Counter((s.family, str(s.reason)) for s in sites if s.status == "missed")
    out["miss_reasons"] = [{"family": f, "count": n, "reason": r[:800]} for (f, r), n in reasons.items()]
    if expected:
        fc = {}
        for family, modules in expected.items():
            if modules:
                found = report.per_module(family)
                fc[family] = [sum(min(found.get(m, 0), n) for m, n in modules.items()), sum(modules.values())]
        out["expected_fused"] = fc
        out["missing_expected"] = [list(m) for m in report.missing_expected()][:20]
        out["unseen_expected"] = [list(m) for m in report.unseen_expected()][:20]
    return out


def run_one(label: str, dtype_name: str) -> dict:
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    import fusion_compiler as fc
    from fusion_compiler.model_adapters import adapter_from_hf_config, make_decode_step

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
    cfg = configs()[label]
    res: dict = {"model": label, "model_type": cfg["model_type"], "dtype": dtype_name, "config": cfg}
    t0 = time.perf_counter()

    # ---- build (transformers; our adapter only forwards the config) ------------------------------
    try:
        adapter = adapter_from_hf_config(dict(cfg))
        layers = adapter.default_layers
        model = adapter.build_hf("tiny", layers, device="cpu", dtype=dtype, seed=0)
        res["class"] = type(model).__name__
        res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        res["params"] = sum(p.numel() for p in model.parameters())
    except Exception as e:  # noqa: BLE001
        res.update(stage="build", error=_frames(e))
        res["status"] = "CRASH" if res["error"]["fusion_compiler_frames"] and _builds_plainly(cfg, dtype) else "n/a"
        return res

    # ---- expected sites (our adapter's structural walk; a failure is ours but not the backend's) ---
    expected = {}
    try:
        expected = adapter.expected_sites(model, batch=BATCH, context=CONTEXT)
        res["expected"] = {f: sum(m.values()) for f, m in expected.items() if m}
    except Exception as e:  # noqa: BLE001
        res["expected_error"] = _frames(e)

    # ---- eager -----------------------------------------------------------------------------------
    try:
        try:
            step = make_decode_step(model, batch=BATCH, context=CONTEXT, seed=0, max_cache_len=MAX_CACHE_LEN)
        except ValueError as e:
            if "cache of its own" not in str(e):
                raise
            step = _own_cache_step(model)  # MiniMax: its MiniMaxCache, made by the model itself
        res["cache_kind"] = step.cache_kind
        eager = step.run(model).detach().float().clone()
        step.reset()
        again = step.run(model).detach().float().clone()
        res["eager_repeat_err"] = _max_rel(again, eager)
        if not torch.isfinite(eager).all():
            raise FloatingPointError("eager logits are not finite")
    except Exception as e:  # noqa: BLE001
        res.update(stage="eager", error=_frames(e), status="n/a")
        return res
    res["t_eager_s"] = round(time.perf_counter() - t0, 1)

    # ---- ours ------------------------------------------------------------------------------------
    torch._dynamo.reset()
    t1 = time.perf_counter()
    ours_err = None
    try:
        errs = _compiled_errors(model, "fusion_compiler", step, eager, calls=2)
        res["ours_err"], res["ours_err_first_call"] = max(errs), errs[0]
    except Exception as e:  # noqa: BLE001
        ours_err = _frames(e)
        res["ours_error"] = ours_err
    backend = fc.last_backend()
    if backend is not None:
        try:
            res["report"] = _report(backend.report, expected)
            res["report_text"] = backend.report.format()[:4000]
        except Exception as e:  # noqa: BLE001
            res["report_error"] = _frames(e)
    res["t_ours_s"] = round(time.perf_counter() - t1, 1)

    # ---- stock Inductor --------------------------------------------------------------------------
    torch._dynamo.reset()
    t2 = time.perf_counter()
    stock_err = None
    try:
        (res["stock_err"],) = _compiled_errors(model, "inductor", step, eager, calls=1)
    except Exception as e:  # noqa: BLE001
        stock_err = _frames(e)
        res["stock_error"] = stock_err
    res["t_stock_s"] = round(time.perf_counter() - t2, 1)

    classify(res, dtype_name)
    return res


def _compiled_errors(model, backend: str, step, eager, calls: int) -> list[float]:
    """``torch.compile(model, backend=backend)`` run ``calls`` times from the restored cache: each
    call's logits' max relative error against ``eager``."""
    import torch

    compiled = torch.compile(model, backend=backend)
    errs = []
    for _ in range(calls):
        step.reset()
        errs.append(_max_rel(step.run(compiled).detach().float().clone(), eager))
    return errs


def _own_cache_step(model):
    """make_decode_step's tokens and positions, with the cache the model makes itself on a prefill
    without ``past_key_values`` (MiniMax rejects both StaticCache and DynamicCache)."""
    import copy

    import torch
    from fusion_compiler.model_adapters.base import DecodeStep

    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0)
    prefill_ids = torch.randint(0, vocab, (BATCH, CONTEXT), generator=gen)
    next_ids = torch.randint(0, vocab, (BATCH, 1), generator=gen)
    prefill_pos = torch.arange(CONTEXT).unsqueeze(0).expand(BATCH, -1).contiguous()
    with torch.no_grad():
        out = model(input_ids=prefill_ids, position_ids=prefill_pos, use_cache=True)
    cache = out.past_key_values
    kwargs = {"input_ids": next_ids, "position_ids": torch.full((BATCH, 1), CONTEXT, dtype=torch.long),
              "past_key_values": cache, "use_cache": True}
    return DecodeStep(kwargs=kwargs, cache_kind=f"own ({type(cache).__name__})", batch=BATCH, context=CONTEXT, seed=0,
                      max_cache_len=None, prefill_input_ids=prefill_ids, prefill_logits=out.logits,
                      snapshot=copy.deepcopy(cache))


def _builds_plainly(cfg: dict, dtype) -> bool:
    """Whether transformers builds the config without our adapter (AutoModelForCausalLM)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        kw = {k: v for k, v in cfg.items() if k != "model_type"}
        AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **kw), dtype=dtype)
        return True
    except Exception:  # noqa: BLE001
        return False


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def _save(path: str, doc: dict) -> None:
    """The JSON through common.write_json (its provenance: this run's), non-JSON values as text."""
    doc["provenance"] = common.provenance()
    common.write_json(path, json.loads(json.dumps(doc, default=str)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated model labels (default: all)")
    p.add_argument("--skip", default="", help="comma-separated model labels to leave out")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--timeout", type=int, default=180, help="seconds per model subprocess")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--fresh", action="store_true", help="overwrite the JSON instead of merging into it")
    p.add_argument("--list", action="store_true")
    p.add_argument("--reclassify", action="store_true", help="recompute every stored status in --out; run nothing")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        res = run_one(args.child, args.dtype)
        _save(args.child_out, res)
        return

    if args.reclassify:
        with open(args.out) as f:
            doc = json.load(f)
        for key, dtype_name in (("models", "bfloat16"), ("models_float32", "float32")):
            for res in doc.get(key, {}).values():
                classify(res, dtype_name)
        _save(args.out, doc)
        for key in ("models", "models_float32"):
            print(key, dict(Counter(r.get("status") for r in doc.get(key, {}).values())))
        return

    labels = list(configs())
    if args.list:
        print("\n".join(labels))
        return
    if args.only:
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = [w for w in wanted if w not in labels]
        if unknown:
            sys.exit(f"unknown labels {unknown}; see --list")
        labels = wanted
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    labels = [x for x in labels if x not in skip]

    doc = {"models": {}}
    if os.path.exists(args.out) and not args.fresh:
        with open(args.out) as f:
            doc = json.load(f)
    key = "models" if args.dtype == "bfloat16" else f"models_{args.dtype}"
    doc.setdefault(key, {})
    run_provenance = common.provenance()
    doc[f"setup_{args.dtype}"] = {"provenance": run_provenance, "device": "cpu", "dtype": args.dtype, "batch": BATCH, "context": CONTEXT,
                    "max_cache_len": MAX_CACHE_LEN, "seed": 0, "timeout_s": args.timeout,
                    "ok_rule": f"ours_err <= max(2 * stock_err, {FLOOR[args.dtype]}) (max |a-e| / max |e| of the logits)"}  # fmt: skip
    for name in ABSENT:
        doc["models"].setdefault(name, {"model": name, "status": "n/a",
                                        "error": {"message": f"transformers {run_provenance['transformers']} has no model_type {name!r}"}})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    for label in labels:
        started = time.perf_counter()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            child_out = tmp.name
        cmd = [sys.executable, os.path.abspath(__file__), "--child", label, "--child-out", child_out,
               "--dtype", args.dtype]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
            try:
                with open(child_out) as f:
                    res = json.load(f)
            except (OSError, json.JSONDecodeError):
                res = {"model": label, "status": "CHILD_DIED", "returncode": proc.returncode,
                       "stderr_tail": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            res = {"model": label, "status": "TIMEOUT",
                   "stderr_tail": (e.stderr or b"")[-2000:].decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)[-2000:]}
        finally:
            if os.path.exists(child_out):
                os.unlink(child_out)
        res["wall_s"] = round(time.perf_counter() - started, 1)
        res["commit"], res["dirty"] = run_provenance["commit"], run_provenance["dirty"]
        doc[key][label] = res
        _save(args.out, doc)
        fams = res.get("report", {}).get("families", {})
        fam_s = " ".join(f"{k}:{v['matched']}/{v['matched'] + v['missed']}" for k, v in fams.items())
        err = res.get("ours_error") or res.get("error") or {}
        print(f"{label:18s} {res.get('status', '?'):12s} ours={res.get('ours_err', float('nan')):.2e} "
              f"stock={res.get('stock_err', float('nan')):.2e} {res['wall_s']:6.1f}s  {fam_s}"
              + (f"  | {err.get('type')}: {str(err.get('message', ''))[:160]}" if err else ""), flush=True)


if __name__ == "__main__":
    main()
