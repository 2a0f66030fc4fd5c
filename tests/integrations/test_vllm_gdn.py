"""Qwen3.5's GDN decode through vLLM's ``qwen_gdn_attention_core`` (issue 31): the core and the
gated norm after it become ``fusion_compiler::gdn_decode_vllm`` (patterns/vllm_gdn.py,
ops/gdn_decode_vllm.py).

Two halves:

- vLLM's own Qwen3_5MoeForCausalLM (tiny config, one linear-attention layer and one full
  attention layer), built on the CPU with CUDA's choices and compiled through vLLM's backend
  (test_vllm_launches.py's builder), stock and with our pass, with
  ``use_inductor_graph_partition=True``; and with our pass under vLLM's default FX split, where
  the site is a miss saying why. vLLM's Qwen3NextForCausalLM (two GDN layers), stock and ours,
  with partition: its interleaved in-projections are unpacked before the same core.
- The state update itself: vLLM's KV-cache page layout (conv and SSM states as strided views of
  one int8 page per slot), one decode step through vLLM's own Triton path
  (``_forward_core_decode_non_spec``: causal_conv1d_update, then
  fused_recurrent_gated_delta_rule_packed_decode; the gated norm after it in torch) on one copy,
  through our op's kernel path on another, both under TRITON_INTERPRET=1 in a process of their own.

The count (the GDN mixer's non-GEMM decode kernels): the launches in the wrapper code between the
layer's input-projection GEMM(s) and its out_proj GEMM, GEMMs (extern mm, our merged_linear) not
counted; vLLM's GDN core counts as its 2 CUDA launches on an all-decode batch (causal_conv1d_update
and the packed recurrent decode kernel, bench/NOTES.md §22), our op as ops/launches.py says (1),
an Inductor kernel as 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections import Counter

import pytest
import torch
import triton
import triton.language as tl

from fusion_compiler import _compat
from fusion_compiler.inspect.counting import _LAUNCH, cuda_launch_proxy

pytestmark = pytest.mark.vllm

CORE = "torch.ops.vllm.qwen_gdn_attention_core.default"
CORE_CUDA_LAUNCHES = 2  # causal_conv1d_update + fused_recurrent_gated_delta_rule_packed_decode
_GEMMS = ("extern_kernels.mm", "extern_kernels.addmm", "torch.ops.fusion_compiler.merged_linear")


def _launch_order(sources) -> list[str]:
    """Every launch of the wrapper code, in order (inspect/counting.py's pattern)."""
    order = []
    for source in sources:
        for line in source[source.find("def call(") :].splitlines() if "def call(" in source else ():
            match = _LAUNCH.match(line)
            if match:
                order.append(match.group(1))
    return order


def gdn_mixer_launches(order: list[str], nth: int = 0) -> list[str]:
    """The non-GEMM launches between the ``nth`` GDN core's last GEMM before it and the first after it."""
    ours = "torch.ops.fusion_compiler.gdn_decode_vllm.default"
    core = [i for i, name in enumerate(order) if name in (CORE, ours)][nth]
    start = max(i for i in range(core) if order[i].startswith(_GEMMS))
    end = next(i for i in range(core, len(order)) if order[i].startswith(_GEMMS))
    return order[start + 1 : end]


def cuda_count(names: list[str]) -> int:
    counts = Counter(names)
    core = counts.pop(CORE, 0)
    return cuda_launch_proxy(counts) + CORE_CUDA_LAUNCHES * core


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{"stock" | "ours" | "ours_split" | "next_stock" | "next_ours": (Compiled, launch order)},
    compiled once for the module (next_: Qwen3-Next)."""
    from integrations import test_vllm_launches as launches  # its builder (tests/ is on the path)

    from fusion_compiler.integrations.vllm import VllmFusionPass

    root = tmp_path_factory.mktemp("vllm_gdn")
    with launches.cpu_world(root):
        path = launches._write_config(str(root), "qwen3_5_moe")
        out = {}
        for name, our_pass, partition in (("stock", None, True), ("ours", VllmFusionPass(), True),
                                          ("ours_split", VllmFusionPass(), False)):  # fmt: skip
            build = launches._compile(path, our_pass, partition=partition)
            out[name] = (build, _launch_order(build.sources))
        path = _write_qwen3_next(root)
        for name, our_pass in (("next_stock", None), ("next_ours", VllmFusionPass())):
            build = launches._compile(path, our_pass)
            out[name] = (build, _launch_order(build.sources))
        yield out


def _write_qwen3_next(root) -> str:
    """vLLM's Qwen3NextForCausalLM, tiny: Qwen3.5's tiny sizes (model_adapters/qwen35), two GDN
    layers and one full-attention layer, NeoX partial RoPE without mrope."""
    import inspect

    from transformers import Qwen3NextConfig

    from fusion_compiler.model_adapters.qwen35 import TINY_CONFIG

    keys = inspect.signature(Qwen3NextConfig.__init__).parameters
    config = Qwen3NextConfig(**{
        **{k: v for k, v in TINY_CONFIG.items() if k in keys}, "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    })  # fmt: skip
    config.architectures = ["Qwen3NextForCausalLM"]
    config.torch_dtype = "bfloat16"
    path = str(root / "qwen3_next")
    config.save_pretrained(path)
    return path


def test_gdn_site_fused_in_every_linear_attention_layer(compiled):
    from fusion_compiler.patterns.vllm_gdn import VARIANT

    report = compiled["ours"][0].report
    gdn = [s for s in report.sites if s.family == "gdn"]
    assert [(s.layer, s.status, s.variant) for s in gdn] == [(0, "matched", VARIANT)], report.format()
    ours = compiled["ours"][1]
    assert "torch.ops.fusion_compiler.gdn_decode_vllm.default" in ours and CORE not in ours


def test_gdn_layer_non_gemm_kernels_at_most_two_against_stock(compiled):
    """Qwen3.5's GDN mixer on an all-decode batch, CPU proxy of the CUDA count. Stock: the
    contiguous copies of b and a with the core's zeros (1 Inductor kernel), the core (2), the
    gated norm (1). Ours: the op (1); the copies and zeros go dead."""
    stock, ours = (gdn_mixer_launches(compiled[name][1]) for name in ("stock", "ours"))
    print(f"GDN mixer, non-GEMM: stock {cuda_count(stock)} {stock}; ours {cuda_count(ours)} {ours}")
    assert (cuda_count(stock), cuda_count(ours)) == (4, 1)
    assert cuda_count(ours) <= 2
    whole = {name: cuda_launch_proxy(compiled[name][0].launches) + compiled[name][0].launches[CORE]
             * (CORE_CUDA_LAUNCHES - 1) for name in ("stock", "ours")}  # fmt: skip
    print(f"whole graph, the same rule: {whole}")
    assert whole["ours"] <= whole["stock"], whole


def test_qwen3_next_gdn_site_fused_in_every_linear_attention_layer(compiled):
    """vLLM's Qwen3NextForCausalLM (interleaved qkvz / ba in-projections, unpacked by split, cat
    and reshape copies before the core): the same core and gated norm, so the same site. Per GDN
    mixer, stock: the unpack with the core's zeros (1 Inductor kernel), the core (2), the gated
    norm (1). Ours: the unpack (1; its cat of q, k, v and copies of z, b, a stay), the op (1)."""
    from fusion_compiler.patterns.vllm_gdn import VARIANT

    report = compiled["next_ours"][0].report
    gdn = [s for s in report.sites if s.family == "gdn"]
    assert [(s.layer, s.status, s.variant) for s in gdn] == [(layer, "matched", VARIANT) for layer in (0, 1)], \
        report.format()
    stock, ours = compiled["next_stock"][1], compiled["next_ours"][1]
    assert CORE not in ours and stock.count(CORE) == 2
    counts = [(cuda_count(gdn_mixer_launches(stock, n)), cuda_count(gdn_mixer_launches(ours, n))) for n in (0, 1)]
    print(f"Qwen3-Next GDN mixers, non-GEMM (stock, ours): {counts}")
    assert counts == [(4, 2), (4, 2)]
    whole = {name: cuda_launch_proxy(compiled[name][0].launches) + compiled[name][0].launches[CORE]
             * (CORE_CUDA_LAUNCHES - 1) for name in ("next_stock", "next_ours")}  # fmt: skip
    print(f"Qwen3-Next whole graph, the same rule: {whole}")
    assert whole["next_ours"] <= whole["next_stock"], whole


def test_our_op_partitions_the_graph_where_vllms_core_did():
    from fusion_compiler.integrations.vllm import GDN_CORE, partition_like_replaced_ops

    with _compat.inductor_config.patch(custom_should_partition_ops=[GDN_CORE]):
        partition_like_replaced_ops()
        assert _compat.inductor_config.custom_should_partition_ops == [GDN_CORE, "fusion_compiler::gdn_decode_vllm"]
    with _compat.inductor_config.patch(custom_should_partition_ops=[]):
        partition_like_replaced_ops()
        assert _compat.inductor_config.custom_should_partition_ops == []


def test_default_split_reports_the_gdn_site_as_a_miss_saying_why(compiled):
    from fusion_compiler.patterns.vllm_gdn import SPLIT_REASON

    report = compiled["ours_split"][0].report
    gdn = [s for s in report.sites if s.family == "gdn"]
    assert [(s.layer, s.status, s.reason) for s in gdn] == [(0, "missed", SPLIT_REASON)], report.format()


# --- the state update, against vLLM's own Triton decode path -------------------------------------

HK, HV, DK, DV, KCONV = 2, 4, 32, 32, 4
CONV_DIM = 2 * HK * DK + HV * DV
SLOTS = 8
PAD_BYTES = 64  # the page's tail past both states: never written
# Rows: slots 3, 0 (NULL_BLOCK_ID: padding), 5, 1; a fifth row past num_actual_tokens (vLLM pads
# the batch for its CUDA graph). Slots 2, 4, 6, 7 are in no row.
INDICES = (3, 0, 5, 1, 0)
ACTUAL = 4
# The activations', conv state's and weights' dtype (Qwen3.5 serves in bf16; the SSM state is fp32).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _conv_bytes(act: torch.dtype) -> int:
    return (KCONV - 1) * CONV_DIM * act.itemsize


def _views(page: torch.Tensor, act: torch.dtype):
    """vLLM's layout (MambaBase.bind_kv_cache, mamba_utils.gated_delta_net_state_shape): per slot
    one page, conv [K-1, conv_dim] in the model's dtype first, then SSM [HV, DV, DK] fp32, then
    padding."""
    page_bytes = page.shape[1]
    flat = page.view(-1)
    conv = flat.view(act).as_strided((SLOTS, KCONV - 1, CONV_DIM), (page_bytes // act.itemsize, CONV_DIM, 1))
    ssm = flat.view(torch.float32).as_strided((SLOTS, HV, DV, DK), (page_bytes // 4, DV * DK, DK, 1),
                                              _conv_bytes(act) // 4)  # fmt: skip
    return conv, ssm


def _page(gen, act: torch.dtype) -> torch.Tensor:
    page_bytes = _conv_bytes(act) + HV * DV * DK * 4 + PAD_BYTES
    page = torch.randint(-128, 128, (SLOTS, page_bytes), dtype=torch.int8, generator=gen)
    conv, ssm = _views(page, act)
    conv.copy_(torch.randn(conv.shape, generator=gen))
    ssm.copy_(torch.randn(ssm.shape, generator=gen) * 0.2)
    return page


def _layer(page, weights):
    conv_weight, A_log, dt_bias = weights
    return types.SimpleNamespace(
        kv_cache=_views(page, conv_weight.dtype), conv1d=types.SimpleNamespace(weight=conv_weight, bias=None), activation="silu",
        A_log=A_log, dt_bias=dt_bias, head_k_dim=DK,
    )  # fmt: skip


def _reference_f64(mixed_qkv, b, a, z, norm_weight, eps, weights, conv, ssm, rows):
    """The step in float64 (ops/gdn_decode.py's `_step`, every rounding point float64)."""
    from fusion_compiler.ops.gdn_decode import GdnDims, _step

    conv_weight, A_log, dt_bias = weights
    f = lambda t: t.double()  # noqa: E731
    slots = torch.tensor([INDICES[r] for r in rows])
    dims = GdnDims(HK, DK, HV, DV, CONV_DIM, KCONV, KCONV - 1)
    out, _, _ = _step(f(mixed_qkv[rows]), f(z[rows].reshape(len(rows), -1)), f(b[rows]), f(a[rows]),
                      f(conv_weight.view(CONV_DIM, KCONV)), f(A_log), f(dt_bias), f(norm_weight), eps, 1e-6,
                      f(conv[slots].transpose(-1, -2)), f(ssm[slots].transpose(-1, -2)), dims)  # fmt: skip
    return out.reshape(len(rows), HV, DV)


@pytest.mark.parametrize("act", DTYPES)
def test_state_bytes_equal_vllms_decode_path_and_untouched_elsewhere(act):
    """vLLM disables Triton when no GPU driver is active, unless CUDA_VISIBLE_DEVICES is empty
    (vllm/triton_utils/importing.py): decided at its first import, so the check runs in a fresh
    process with that set, under the interpreter (with bf16: the GPU's bf16 arithmetic,
    interpreter_bf16.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(root), root, os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    run = subprocess.run([sys.executable, __file__, act], env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    assert run.returncode == 0, run.stderr[-4000:]


@triton.jit
def _exp(x):
    """tl.exp: the interpreter patches ``tl``'s functions, not fla's module-level alias ``exp = tl.exp``."""
    return tl.exp(x)


def state_check(act_name: str) -> None:
    """The assertions; run in a process of its own (`test_state_...`). Bit-equal states: our
    kernel's vllm_math takes vLLM's rounding points and its [V, K] state tile, so its sums over
    k reduce the same axis of the same shape (on the GPU the order also depends on the layout
    Triton picks for each kernel: not checked here)."""
    import interpreter_bf16
    import vllm.third_party.flash_linear_attention.ops.fused_recurrent as fused_recurrent
    from vllm.triton_utils.importing import HAS_TRITON

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm_fixtures import vllm_config

    from fusion_compiler.ops import gdn_decode_vllm as op
    from fusion_compiler.ops.rms_norm import gated_rms_norm_reference

    assert HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1", "vLLM's Triton kernels would be placeholders"

    interpreter_bf16.install()
    fused_recurrent.exp = _exp
    act = DTYPES[act_name]
    gen = torch.Generator().manual_seed(0)
    tokens, eps = len(INDICES), 1e-6
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(act)  # noqa: E731
    projected = rand(tokens, CONV_DIM + HV * DV + 2 * HV)  # [q k v | z | b a], as the merged GEMM's rows
    mixed_qkv = projected[:, :CONV_DIM]
    z = projected[:, CONV_DIM : CONV_DIM + HV * DV].view(tokens, HV, DV)
    b, a = projected[:, -2 * HV : -HV], projected[:, -HV:]
    norm_weight = rand(DV, scale=0.2) + 1
    weights = (rand(CONV_DIM, 1, KCONV, scale=0.5), (torch.rand(HV, generator=gen) * 2).to(act), rand(HV))
    metadata = types.SimpleNamespace(non_spec_state_indices_tensor=torch.tensor(INDICES, dtype=torch.int32),
                                     num_actual_tokens=ACTUAL, spec_sequence_masks=None, num_prefills=0,
                                     num_decodes=ACTUAL)  # fmt: skip
    before = _page(gen, act)
    theirs_page, ours_page = before.clone(), before.clone()

    with set_current_vllm_config(vllm_config()):
        # vLLM's path: its zeros, its decode kernels, its norm (RMSNormGated.forward_native).
        core = torch.full((tokens, HV, DV), float("nan"), dtype=act)
        core[:ACTUAL] = 0
        # (causal_conv1d_update writes its output over its input: vLLM's path gets a copy.)
        QwenGatedDeltaNetAttention._forward_core_decode_non_spec(
            _layer(theirs_page, weights), mixed_qkv.clone(), b.contiguous(), a.contiguous(), core, metadata)
        theirs = gated_rms_norm_reference(core, z, norm_weight, eps)
        # Ours: the op's kernel path, on the strided b / a / z and a poisoned output.
        ours = torch.full((tokens, HV, DV), float("nan"), dtype=act)
        op.decode_step(_layer(ours_page, weights), metadata, mixed_qkv, b, a, z, norm_weight, eps, ours)

    written = [s for s in INDICES[:ACTUAL] if s > 0]
    untouched = [s for s in range(SLOTS) if s not in written]
    assert torch.equal(ours_page[untouched], before[untouched]), "a slot in no row (or padding) was written"
    assert torch.equal(theirs_page[untouched], before[untouched])
    conv_bytes = _conv_bytes(act)
    assert torch.equal(ours_page[written, :conv_bytes], theirs_page[written, :conv_bytes]), "conv state bytes"
    assert torch.equal(ours_page[written, -PAD_BYTES:], before[written, -PAD_BYTES:]), "the page's padding"
    ssm_ours, ssm_theirs = _views(ours_page, act)[1][written], _views(theirs_page, act)[1][written]
    ssm_rel = float((ssm_ours - ssm_theirs).abs().max() / ssm_theirs.abs().max())
    live = [r for r in range(ACTUAL) if INDICES[r] > 0]
    padded = [r for r in range(tokens) if r not in live]
    out_rel = float((ours[live] - theirs[live]).abs().max() / theirs[live].abs().max())
    ref = _reference_f64(mixed_qkv, b, a, z, norm_weight, eps, weights, *_views(before, act), live)
    f64_rel = float((ours[live].double() - ref).abs().max() / ref.abs().max())
    print(f"{act_name}: SSM state: {int((ssm_ours != ssm_theirs).sum())} of {ssm_ours.numel()} differ, max "
          f"{ssm_rel:.1e} of the largest; outputs vs vLLM's {out_rel:.1e}, vs float64 {f64_rel:.1e}")  # fmt: skip
    assert torch.equal(ssm_ours, ssm_theirs), f"SSM state differs from vLLM's by {ssm_rel:.1e} of its largest value"
    assert torch.equal(ours[padded], torch.zeros_like(ours[padded])), "padded rows must be zeros, as vLLM's"
    # The gated norm: ours in the kernel, vLLM's in torch (another rsqrt and sum), then one rounding.
    tolerance = 1e-5 if act == torch.float32 else 1e-2
    assert out_rel < tolerance and f64_rel < tolerance, (out_rel, f64_rel)


if __name__ == "__main__":
    state_check(sys.argv[1])
