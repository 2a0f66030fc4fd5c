"""Serving-engine reference layers: the three models' decode layers written as a serving engine
writes them (paged KV caches, slot tables, one opaque op per attention core and per routed
experts stub), in plain torch, never our fused ops, so the patterns meet ordinary model code.

    paged_kv.py                    paged caches, slot tables, RoPE, the attention core op
                                   (``fusion_compiler_ref::paged_decode_attention``)
    moe.py                         routers, routed experts (HF's grouped_mm / batched_mm forms),
                                   the decode-layer and stack shared by the three models
    deepseek_v32.py                MLA + DSA indexer attention (DeepSeek's inference code)
    minimax_m2.py                  q/k-norm GQA attention, tensor parallel
    qwen35.py, qwen35_gdn.py       gated GQA attention; Gated DeltaNet with state slots
    <model>_decode_layer.py        one model's decode layer and stack: ``build``, ``make_step``

The HF adapters and their expected-site rules are the parent package's (``model_adapters``); the
CUDA kernel these layers launch is ``kernels/paged_decode_attention.py``, marked reference-only.
"""
