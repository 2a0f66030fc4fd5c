"""HF's sliding-window static cache under the GQA prologue (a sweep of HF models found it).

Once its window is full, ``StaticSlidingWindowLayer.update`` rolls the cache and writes the new
token at ``torch.tensor([-1])``: in the graph an ``index_put`` at ``[None, None, full([1], -1)]``,
which torch reads as the last row. The fused op reads slot -1 as padding (no write), so before
the canonical rewrite (fx/canonicalize.py, ``_wrapped_constant_indices``) the token was dropped:
tiny bf16 Mistral with a window of 8 read 0.31 from eager at its first decode step, Gemma-2
0.56. Here: tiny fp32 Mistral (no bf16 near-ties to flip a greedy token), a window of 4 and a
6-token prompt, so every decode step takes the rolled path.
"""

from __future__ import annotations

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.fx.canonicalize import canonicalize

aten = torch.ops.aten
WINDOW, PROMPT, NEW_TOKENS = 4, 6, 3


def _put_graph(fill: int, size: int = WINDOW) -> tuple[torch.fx.Graph, torch.fx.Node]:
    """``index_put(cache [1, 2, size, 8], [None, None, full([1], fill)], rows)``, with fake values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    with FakeTensorMode() as mode:
        cache_val, rows_val = torch.empty(1, 2, size, 8), torch.empty(1, 2, 1, 8)
        index_val = torch.full([1], fill, dtype=torch.int64)
    cache, rows = graph.placeholder("cache"), graph.placeholder("rows")
    cache.meta["val"], rows.meta["val"] = cache_val, rows_val
    index = graph.call_function(aten.full.default, ([1], fill), {"dtype": torch.int64})
    index.meta["val"] = index_val
    put = graph.call_function(aten.index_put.default, (cache, [None, None, index], rows))
    with mode:
        put.meta["val"] = torch.empty(1, 2, size, 8)
    graph.output(put)
    return graph, put


@pytest.mark.parametrize(("fill", "wrapped"), [(-1, WINDOW - 1), (-WINDOW, 0), (2, 2), (-WINDOW - 1, -WINDOW - 1)])
def test_a_constant_negative_cache_index_counts_from_the_end(fill, wrapped):
    graph, put = _put_graph(fill)
    canonicalize(graph)
    index = put.args[1][2]
    assert index.target is aten.full.default and index.args[1] == wrapped
    assert index.meta["val"].shape == (1,) and index.meta["val"].dtype == torch.int64


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=64,
                           sliding_window=WINDOW, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    return MistralForCausalLM(config).eval()


def test_sliding_window_cache_once_full_fuses_and_generates_like_eager():
    from transformers import CompileConfig

    model = _mistral()
    prompt = torch.randint(3, 512, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    generate = dict(max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static", pad_token_id=0,
                    output_logits=True, return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        eager = model.generate(prompt, disable_compile=True, **generate)
        config = CompileConfig(backend="fusion_compiler")
        config._compile_all_devices = True
        ours = model.generate(prompt, compile_config=config, **generate)
    report = fc.last_report()
    assert report.count("gqa_prologue") == 2 * len(report.graphs) and report.misses() == [], report.format()
    assert ours.sequences.tolist() == eager.sequences.tolist()
    for step, (got, want) in enumerate(zip(ours.logits, eager.logits)):
        error = float((got - want).norm() / want.norm())
        assert error < 1e-4, f"step {step}: {error:.1e} from eager (the rolled cache's new row dropped?)"
