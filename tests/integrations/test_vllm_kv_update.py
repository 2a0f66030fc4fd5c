"""The K/V prologue through vLLM's ``unified_kv_cache_update`` (issue 30, item 3).

- Cache writes: ``fusion_compiler::gqa_prologue_vllm`` inside a real vLLM `ForwardContext` on CPU
  tensors (plain-torch reference), and our Triton kernel under ``TRITON_INTERPRET=1`` on the same
  cache views, against vLLM's own Triton writer (``triton_reshape_and_cache_flash``) given the
  same k and v: byte for byte, bf16 and FP8, over a poisoned cache whose other bytes must stay.
- Near misses of vLLM's MiniMaxM2ForCausalLM, reported with their reason: the update kept as a
  splitting op (no graph partition), and an FP8 e5m2 cache the op does not write.

The sites matched per layer and the launch counts stock vs ours are in test_vllm_launches.py,
which compiles every model once.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

pytestmark = pytest.mark.vllm

NAME = "model.layers.0.self_attn.attn"
T, HQ, HKV, D, ROT, BLOCKS, BLOCK_SIZE, POSITIONS = 5, 8, 2, 64, 32, 6, 16, 64
EPS = 1e-6


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    qkv = r(T, (HQ + 2 * HKV) * D, scale=2.0)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    return types.SimpleNamespace(
        q=q, k=k, v=v.view(T, HKV, D), q_weight=r(HQ * D, scale=0.5) + 1, k_weight=r(HKV * D, scale=0.5) + 1,
        cos_sin_cache=r(POSITIONS, ROT), positions=torch.randint(0, POSITIONS, (T,), generator=g),
        # distinct slots over several blocks; one padding token (-1)
        slots=torch.cat([torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[: T - 1], torch.tensor([-1])]),
    )  # fmt: skip


def _poisoned_cache(kv_cache_dtype: str, seed: int) -> torch.Tensor:
    """vLLM's [blocks, kv_heads, block_size, 2 * D] cache, random bytes (never zero), HND order."""
    dtype = torch.uint8 if kv_cache_dtype.startswith("fp8") else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, 255, (BLOCKS, HKV, BLOCK_SIZE, 2 * D * (1 if dtype == torch.uint8 else 2)), generator=g)
    raw = raw.to(torch.uint8)
    return raw if dtype == torch.uint8 else raw.view(torch.bfloat16)


def _layer(kv_cache, kv_cache_dtype, k_scale=0.75, v_scale=1.25):
    """What get_attention_context reads of vLLM's `Attention` layer (the op needs no more)."""
    return types.SimpleNamespace(
        kv_cache=kv_cache, kv_cache_dtype=kv_cache_dtype, _k_scale_float=k_scale, _v_scale_float=v_scale,
        _k_scale=torch.tensor([k_scale]), _v_scale=torch.tensor([v_scale]),
    )  # fmt: skip


def _forward_context(layer, slot_mapping):
    from vllm.forward_context import ForwardContext, override_forward_context

    context = ForwardContext(no_compile_layers={NAME: layer}, attn_metadata={NAME: None}, slot_mapping={NAME: slot_mapping})
    return override_forward_context(context)


def _roped_k(x):
    """rope(norm(k)) as the op computes it: the op itself with k as its query (one head group)."""
    from fusion_compiler.ops import gqa_prologue_vllm  # noqa: F401

    scratch = _layer(_poisoned_cache("auto", 0), "auto")
    with _forward_context(scratch, None):
        q_out, _ = torch.ops.fusion_compiler.gqa_prologue_vllm(
            x.k, x.k, x.v, x.k_weight, x.k_weight, EPS, 0.0, True, x.cos_sin_cache, x.positions, False, False, NAME
        )
    return q_out


def _vllm_writer(fp8_as_fp32: bool = False):
    """vLLM's ``triton_reshape_and_cache_flash`` module loaded afresh with the real Triton: on a
    machine without a GPU driver vLLM's ``triton_utils`` hands out placeholders (HAS_TRITON
    False), so the installed module's kernel is a stub; its source is the same.

    ``fp8_as_fp32``: the platform's FP8 dtype read as float32, so vLLM's FP8 path stores its
    quotients ``key / k_scale`` unrounded into an fp32 cache. Triton's interpreter rounds fp32 to
    e4m3 wrongly (ties away from zero, and a mantissa carry lost: 1.96875 -> 1.0), where the
    GPU's store is ``cvt.rn.satfinite`` (round to nearest even); the test rounds the quotients as
    the GPU does, with torch."""
    import importlib.util

    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils

    spec = importlib.util.find_spec("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_utils, "triton", triton)
        patch.setattr(triton_utils, "tl", tl)
        spec.loader.exec_module(module)
    if fp8_as_fp32:
        module.current_platform = types.SimpleNamespace(
            fp8_dtype=lambda: torch.float32, is_rocm=lambda: False, is_xpu=lambda: False,
            has_device_capability=lambda *a, **k: True,
        )  # fmt: skip
    return module.triton_reshape_and_cache_flash


def _vllm_write(kv_cache, kv_cache_dtype, layer, k_rows, v, slots):
    """vLLM's TritonAttentionImpl.do_kv_cache_update, from its cache views on (FP8: its
    quotients, rounded to e4m3 as the GPU rounds them; `_vllm_writer`)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    if not kv_cache_dtype.startswith("fp8"):
        _vllm_writer()(k_rows, v, key_cache, value_cache, slots, kv_cache_dtype, layer._k_scale, layer._v_scale)
        return
    quotients = [torch.full(key_cache.shape, float("nan")) for _ in range(2)]
    _vllm_writer(fp8_as_fp32=True)(k_rows, v, *quotients, slots, kv_cache_dtype, layer._k_scale, layer._v_scale)
    for cache, quotient in zip((key_cache, value_cache), quotients):
        written = ~quotient.isnan()
        cache.view(torch.float8_e4m3fn)[written] = quotient[written].to(torch.float8_e4m3fn)


@pytest.fixture
def cuda_like(monkeypatch):
    """vLLM's Triton writer asks the device's capability (an H200's) and the platform's FP8 support."""
    from vllm.platforms import current_platform

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(type(current_platform), "has_device_capability", classmethod(lambda cls, *a, **k: True))


def _reference_q(x):
    """q_out in float64: the full-width norm rounded to bf16 (vLLM's ``.to(orig_dtype)``), then
    NeoX RoPE on the first ROT dims."""
    q = x.q.double()
    q = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + EPS) * x.q_weight.double()).to(torch.bfloat16).double()
    q = q.view(T, HQ, D)
    cos, sin = x.cos_sin_cache.double()[x.positions].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    first, second = q[..., : ROT // 2], q[..., ROT // 2 : ROT]
    return torch.cat([first * cos - second * sin, second * cos + first * sin, q[..., ROT:]], dim=-1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("seed", [1, 2])
def test_op_writes_the_bytes_vllms_triton_writer_writes(cuda_like, kv_cache_dtype, seed):
    from fusion_compiler.ops import gqa_prologue_vllm  # noqa: F401

    x = _inputs(seed)
    ours, theirs = _poisoned_cache(kv_cache_dtype, seed), _poisoned_cache(kv_cache_dtype, seed)
    before = ours.clone()
    layer = _layer(ours, kv_cache_dtype)
    with _forward_context(layer, x.slots):
        q_out, dummy = torch.ops.fusion_compiler.gqa_prologue_vllm(
            x.q, x.k, x.v, x.q_weight, x.k_weight, EPS, 0.0, True, x.cos_sin_cache, x.positions, False, False, NAME
        )
    _vllm_write(theirs, kv_cache_dtype, _layer(theirs, kv_cache_dtype), _roped_k(x), x.v, x.slots)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), "cache bytes differ from vLLM's writer"
    assert not torch.equal(ours.view(torch.uint8), before.view(torch.uint8)), "nothing was written"
    assert dummy.numel() == 0
    torch.testing.assert_close(q_out.double(), _reference_q(x), atol=2**-8, rtol=2**-8)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kernel_writes_the_bytes_vllms_triton_writer_writes(cuda_like, kv_cache_dtype):
    """Our Triton kernel (interpreted on CPU) on the op's cache views."""
    from fusion_compiler.kernels.gqa_prologue import gqa_prologue_fwd
    from fusion_compiler.ops import gqa_prologue_vllm

    x = _inputs(3)
    ours, theirs = _poisoned_cache(kv_cache_dtype, 3), _poisoned_cache(kv_cache_dtype, 3)
    fp8 = kv_cache_dtype == "fp8"
    key_cache, value_cache = gqa_prologue_vllm.cache_views(ours, D, fp8)
    layer = _layer(theirs, kv_cache_dtype)
    q_out = torch.empty(T, HQ, D, dtype=torch.bfloat16)
    half = ROT // 2
    gqa_prologue_fwd(
        q=x.q.view(T, HQ, D), k=x.k.view(T, HKV, D), v=x.v, q_norm_weight=x.q_weight, k_norm_weight=x.k_weight,
        eps=EPS, weight_offset=0.0, full_width_norm=True, cos=x.cos_sin_cache[:, :half], sin=x.cos_sin_cache[:, half:],
        positions=x.positions, k_cache=key_cache, v_cache=value_cache, slots=x.slots,
        k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, cache_heads_first=False, q_variance=None,
        k_variance=None, variance_divisor=1.0, round_normalized=False, round_rope_products=False, q_out=q_out,
    )  # fmt: skip
    # vLLM's writer given the k rows our kernel computed: read back where they are exact (bf16).
    k_rows = _roped_k(x)
    _vllm_write(theirs, kv_cache_dtype, layer, k_rows, x.v, x.slots)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), "cache bytes differ from vLLM's writer"
    torch.testing.assert_close(q_out.double(), _reference_q(x), atol=2**-8, rtol=2**-8)


def test_padded_tokens_and_profiling_run_write_nothing_past_the_slot_mapping():
    from fusion_compiler.ops import gqa_prologue_vllm  # noqa: F401

    x = _inputs(4)
    cache = _poisoned_cache("auto", 4)
    before = cache.clone()
    layer = _layer(cache, "auto")
    args = (x.q, x.k, x.v, x.q_weight, x.k_weight, EPS, 0.0, True, x.cos_sin_cache, x.positions, False, False, NAME)
    with _forward_context(layer, None):  # vLLM's profiling run: no slot mapping
        q_none, _ = torch.ops.fusion_compiler.gqa_prologue_vllm(*args)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    with _forward_context(layer, x.slots[:2]):  # padded batch: a shorter slot mapping
        q_out, _ = torch.ops.fusion_compiler.gqa_prologue_vllm(*args)
    torch.testing.assert_close(q_out, q_none, atol=0, rtol=0)
    key_cache, _ = cache.transpose(1, 2).split(D, dim=-1)
    written = (cache.view(torch.uint8) != before.view(torch.uint8)).any(-1).any(1).nonzero().tolist()
    assert key_cache.shape == (BLOCKS, BLOCK_SIZE, HKV, D)
    assert {tuple(w) for w in written} == {divmod(int(s), BLOCK_SIZE) for s in x.slots[:2]}, "wrote past the slots"


# ------------------------------------------------------------------------------------------
# Near misses in vLLM's MiniMaxM2ForCausalLM, each reported with its reason
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def near_misses(tmp_path_factory):
    """MiniMax compiled with our pass: vLLM's default FX split at the update, and graph
    partition with an FP8 e5m2 cache."""
    from integrations.test_vllm_launches import _compile, _write_config, cpu_world

    from fusion_compiler.integrations.vllm import VllmFusionPass

    root = tmp_path_factory.mktemp("vllm_kv_update")
    with cpu_world(root):
        path = _write_config(str(root), "minimax_m2")
        yield {
            "split": _compile(path, VllmFusionPass(), partition=False),
            "fp8_e5m2": _compile(path, VllmFusionPass(), cache_dtype="fp8_e5m2"),
        }


def test_update_as_a_splitting_op_is_reported_per_attention_layer(near_misses):
    from fusion_compiler.integrations.vllm import KV_SPLIT_REASON

    misses = [s for s in near_misses["split"].report.misses() if s.family == "gqa_prologue"]
    assert [(s.layer, s.reason) for s in misses] == [(0, KV_SPLIT_REASON)], misses
    assert "torch.ops.fusion_compiler.gqa_prologue_vllm.default" not in near_misses["split"].launches


def test_fp8_e5m2_cache_is_declined_with_its_reason(near_misses):
    compiled = near_misses["fp8_e5m2"]
    misses = [s for s in compiled.report.misses() if s.family == "gqa_prologue"]
    assert len(misses) == 1 and misses[0].layer == 0, misses
    assert "kv_cache_dtype 'fp8_e5m2'" in misses[0].reason, misses[0].reason
    assert compiled.launches["torch.ops.vllm.unified_kv_cache_update.default"] == 1
