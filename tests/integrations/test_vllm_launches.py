"""Inside vLLM, never worse (issue 30): vLLM 0.33's own model classes (MiniMaxM2ForCausalLM,
Qwen3_5MoeForCausalLM, DeepseekV3ForCausalLM), one decoder layer or two from tiny configs, built
on this CPU machine with the platform patched to make CUDA's choices, compiled through vLLM's
backend once stock and once with our pass in its slot, both with Inductor graph partition (what
our plugin sets), so one graph holds vLLM's K/V cache update and the K/V prologue can absorb it.

The count compared is the CPU proxy of the GPU count (inspect/counting.py): Inductor's launches
in the wrapper code of every graph piece, each call of one of our ops counted as the kernels it
launches on CUDA (ops/launches.py); vLLM's ops in the graph (attention, the cache update, the
GDN core, the MoE) one each. CUDA's choices made here, as on an H200 with a bf16 model:
vLLM's IR norms lowered to native torch (CudaPlatform's default when compiling), attention as
one opaque op (TRITON_ATTN; TRITON_MLA for DeepSeek), the unquantised MoE on Triton's experts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from unittest import mock

import pytest
import torch

from fusion_compiler import _compat
from fusion_compiler.inspect.counting import CUDA_PROXY, cuda_launch_proxy, wrapper_launches
from vllm_fixtures import SLOT, define_missing_c_ops

pytestmark = pytest.mark.vllm

TOKENS = 3
# vLLM's FixFunctionalizationPass (its last post-grad step) compares auto_functionalized targets
# with these ops of its CUDA extension, which cannot load here: schemas only, nothing calls them.
_C_OPS = ("fused_add_rms_norm", "fused_add_rms_norm_static_fp8_quant", "fused_qk_norm_rope", "rms_norm",
          "rms_norm_dynamic_per_token_quant", "rms_norm_static_fp8_quant", "silu_and_mul",
          "silu_and_mul_nvfp4_quant", "silu_and_mul_quant")  # fmt: skip
_LIBRARIES = []


@dataclasses.dataclass
class Compiled:
    launches: Counter  # wrapper launches of every graph piece, by name
    report: object  # our pass's VllmMatchReport; None for stock
    sources: list  # Inductor's output code, one module per graph piece

    @property
    def proxy(self) -> int:
        return cuda_launch_proxy(self.launches)

    def attention_prologue(self) -> Counter:
        """Launches from the last GEMM before the (last) attention op to it: the q/k norms, RoPE
        and the K/V cache write of a GQA attention (the qkv projection not counted)."""
        for source in self.sources:
            lines = source[source.index("def call(") :].splitlines() if "def call(" in source else []
            attention = [i for i, line in enumerate(lines)
                         if "unified_attention_with_output" in line and not line.lstrip().startswith("#")]  # fmt: skip
            if attention:
                end = attention[-1]
                start = max(i for i, line in enumerate(lines[:end]) if "extern_kernels.mm(" in line)
                return wrapper_launches("def call(\n" + "\n".join(lines[start + 1 : end]))
        raise AssertionError("no attention op in any graph piece")


def _define_stand_ins() -> None:
    define_missing_c_ops()
    if not _LIBRARIES:
        lib = torch.library.Library("_C", "FRAGMENT")
        for name in _C_OPS:
            if not hasattr(torch.ops._C, name):
                lib.define(f"{name}(Tensor(a!) x) -> ()")
        _LIBRARIES.append(lib)


def _cuda_choices(patch: pytest.MonkeyPatch) -> None:
    """The platform (UnspecifiedPlatform: a CUDA wheel, no GPU) patched to choose as CUDA does."""
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as moe_method
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    def attention_backend(cls, selected, attn_selector_config=None, num_heads=None):
        mla = getattr(attn_selector_config, "use_mla", False)
        return AttentionBackendEnum["TRITON_MLA" if mla else "TRITON_ATTN"].get_path()

    platform = type(current_platform)
    patch.setattr(platform, "get_attn_backend_cls", classmethod(attention_backend))
    # MLA prefill runs inside the opaque MLA op; the CPU one imports here.
    patch.setattr(platform, "get_mla_prefill_backend_cls",
                  classmethod(lambda cls, *a, **k: MLAPrefillBackendEnum.CPU.get_class()))  # fmt: skip
    patch.setattr(current_platform, "device_type", "cpu")
    patch.setattr(platform, "opaque_attention_op", classmethod(lambda cls: True))  # CudaPlatform's answer
    patch.setattr(platform, "num_compute_units", classmethod(lambda cls, device_id=0: 132))  # an H200's SMs (TRITON_MLA)
    # The H200's choice for an unquantised bf16 MoE on SM90 (FlashInfer sits behind Triton there).
    patch.setattr(moe_method, "select_unquantized_moe_backend",
                  lambda *a, **k: (UnquantizedMoeBackend.TRITON, TritonExperts))  # fmt: skip


def _write_config(root, name: str) -> str:
    """Tiny HF config dirs of our model adapters, for vLLM's ModelConfig."""
    from transformers import DeepseekV3Config, MiniMaxM2Config, Qwen3_5MoeTextConfig

    from fusion_compiler.model_adapters import deepseek_v32, minimax_m2, qwen35

    configs = {
        "minimax_m2": (MiniMaxM2Config, minimax_m2.TINY_CONFIG, "MiniMaxM2ForCausalLM", {"num_hidden_layers": 1}),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, qwen35.TINY_CONFIG, "Qwen3_5MoeForCausalLM",
                        {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}),
        # DeepSeek's generic path (MLA, no DSA indexer): vLLM 0.33 does not compile V3.2's.
        "deepseek_v3": (DeepseekV3Config, {k: v for k, v in deepseek_v32.TINY_CONFIG.items() if not k.startswith("index_")},
                        "DeepseekV3ForCausalLM", {"num_hidden_layers": 1}),
    }  # fmt: skip
    config_class, tiny, architecture, overrides = configs[name]
    config = config_class(**{**tiny, **overrides})
    config.architectures = [architecture]
    config.torch_dtype = "bfloat16"
    path = os.path.join(root, name)
    config.save_pretrained(path)
    return path


def _compile(path: str, our_pass, partition: bool = True, cache_dtype: str = "auto") -> Compiled:
    """Build the model from ``path`` and run one step of TOKENS tokens through vLLM's compiled
    forward (every graph piece compiled by Inductor, our pass in the slot unless None). With
    ``partition`` (what our plugin sets) vLLM partitions at codegen and Inductor compiles one
    graph holding the K/V cache update; without, vLLM splits its FX graph at its splitting ops."""
    from vllm.config import CacheConfig, CompilationConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.kernel import IrOpPriorityConfig, KernelConfig
    from torch._inductor.graph import GraphLowering
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import initialize_model

    compilation = CompilationConfig(
        mode=3, custom_ops=["none"], compile_sizes=[], cudagraph_mode="NONE", use_inductor_graph_partition=partition,
        inductor_compile_config={SLOT: our_pass} if our_pass is not None else {},
        pass_config={"fuse_rope_kvcache_cat_mla": False},
    )  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=path, tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256),
        device_config=DeviceConfig(device="cpu"), compilation_config=compilation,
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
        kernel_config=KernelConfig(ir_op_priority=IrOpPriorityConfig(rms_norm=["native"], fused_add_rms_norm=["native"])),
    )  # fmt: skip
    torch._dynamo.reset()  # the same model class compiled again: no frame of the last compile
    with set_current_vllm_config(config):
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = initialize_model(vllm_config=config)
        finally:
            torch.set_default_dtype(default_dtype)
        input_ids, positions = torch.randint(0, 500, (TOKENS,)), torch.arange(TOKENS)
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        sources = []
        with set_forward_context(None, config, num_tokens=TOKENS), torch.no_grad(), \
                mock.patch.object(GraphLowering, "save_output_code", staticmethod(sources.append)):
            try:
                model(input_ids=input_ids, positions=positions)
            except AttributeError as error:
                # Every piece compiled, then run: vLLM's opaque MoE and GDN ops call kernels of its
                # CUDA extension (_moe_C) or Triton kernels, neither of which runs here.
                assert "_moe_C" in str(error) or "triton" in str(error), error
    assert sources, "no graph piece compiled"
    launches = Counter()
    for source in sources:
        launches.update(wrapper_launches(source))
    return Compiled(launches, our_pass.report if our_pass is not None else None, sources)


MODELS = ("minimax_m2", "qwen3_5_moe", "deepseek_v3")


@contextlib.contextmanager
def cpu_world(root):
    """A world of one CPU rank, CUDA's choices patched in, no compile cache (under ``root``)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)  # fmt: skip
    from vllm.v1.worker.workspace import init_workspace_manager

    with pytest.MonkeyPatch.context() as patch, _compat.inductor_config.patch(force_disable_caches=True):
        patch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
        patch.setenv("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
        patch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
        patch.delenv("FUSION_COMPILER_VLLM", raising=False)
        _define_stand_ins()
        _cuda_choices(patch)
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{root / 'dist'}")  # fmt: skip
            initialize_model_parallel(1, 1)
            init_workspace_manager(torch.device("cpu"))
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{model: (stock, ours)}, all compiled once for the module."""
    from fusion_compiler.integrations.vllm import VllmFusionPass

    root = tmp_path_factory.mktemp("vllm_models")
    with cpu_world(root):
        out = {}
        for name in MODELS:
            path = _write_config(str(root), name)
            out[name] = (_compile(path, None), _compile(path, VllmFusionPass()))
        yield out


# Per model: the CPU proxy of the GPU count for the whole graph (stock, ours), both compiled with
# graph partition (what our plugin sets): vLLM's attention, its K/V cache update (vLLM's
# reshape_and_cache kernel) and its GDN core are in the graph, one launch each. The GEMMs our merge
# folded (group sizes); per layer (None: outside the layers, the final norm), the sites fused by
# family, left to Inductor by family, and missed (family, words of the reason). Inductor fuses
# every norm and RoPE with its neighbours; the K/V prologue absorbs vLLM's cache update.
EXPECTED = {
    "minimax_m2": {"launches": (10, 9), "prologue": (2, 1), "merged": [], "fused": {0: {"gqa_prologue": 1}},
                   "left": {0: {"add_rms_norm": 2}, None: {"add_rms_norm": 1}}, "missed": {}},
    # The GDN layer's in_proj_qkvz and in_proj_ba read the same activation: one GEMM; its core and
    # gated norm are one op of ours (patterns/vllm_gdn.py). Its full attention's q/k norm is vLLM's
    # per-head RMSNorm IR op on this build (on CUDA, vLLM's own Triton kernel): a reported miss.
    "qwen3_5_moe": {"launches": (19, 16), "prologue": (2, 2), "merged": [2], "fused": {0: {"gdn": 1}},
                    "left": {0: {"add_rms_norm": 2}, 1: {"add_rms_norm": 4, "mla_prologue": 2},
                             None: {"add_rms_norm": 1}},
                    "missed": {1: ("gqa_prologue", "vLLM's RMSNorm IR op")}},
    # Its RoPE (GPT-J pairs, YaRN-scaled) is no candidate of vLLM's RoPE spelling (NeoX halves);
    # MLA writes its cache in its own update op, no site of the K/V prologue.
    "deepseek_v3": {"launches": (12, 12), "prologue": None, "merged": [], "fused": {},
                    "left": {0: {"add_rms_norm": 4}, None: {"add_rms_norm": 1}}, "missed": {}},
}  # fmt: skip


def _by_layer(sites) -> dict:
    counts = Counter((s.layer, s.family) for s in sites)
    return {layer: {f: n for (l, f), n in counts.items() if l == layer} for layer, _ in counts}


@pytest.mark.parametrize("name", MODELS)
def test_ours_launches_no_more_than_stock_inside_vllm(compiled, name):
    stock, ours = compiled[name]
    print(f"{name}: {CUDA_PROXY}: stock {stock.proxy}, ours {ours.proxy}; stock {dict(stock.launches)}, "
          f"ours {dict(ours.launches)}\n{ours.report.format()}")  # fmt: skip
    assert ours.proxy <= stock.proxy, f"{CUDA_PROXY}: ours {ours.proxy} > stock {stock.proxy}"
    assert (stock.proxy, ours.proxy) == EXPECTED[name]["launches"]


@pytest.mark.parametrize("name", [name for name in MODELS if EXPECTED[name]["prologue"]])
def test_attention_prologue_launches(compiled, name):
    """MiniMax's bar: its attention prologue (non-GEMM launches, the cache write included) <= 2."""
    stock, ours = (cuda_launch_proxy(c.attention_prologue()) for c in compiled[name])
    print(f"{name} attention prologue: stock {dict(compiled[name][0].attention_prologue())}, "
          f"ours {dict(compiled[name][1].attention_prologue())}")  # fmt: skip
    assert ours <= stock and (name != "minimax_m2" or ours <= 2)
    assert (stock, ours) == EXPECTED[name]["prologue"]


@pytest.mark.parametrize("name", MODELS)
def test_sites_fused_and_left_to_inductor_per_layer(compiled, name):
    report = compiled[name][1].report
    assert report.merged_projections() == EXPECTED[name]["merged"]
    assert _by_layer(s for s in report.sites if s.status == "matched") == EXPECTED[name]["fused"]
    assert _by_layer(report.left()) == EXPECTED[name]["left"]
    for site in report.left():
        assert site.reason.startswith("left to Inductor: ") and "ours would launch 1" in site.reason, site.reason
    missed = {s.layer: (s.family, s.reason) for s in report.misses()}
    assert missed.keys() == EXPECTED[name]["missed"].keys(), missed
    for layer, (family, words) in EXPECTED[name]["missed"].items():
        assert missed[layer][0] == family and words in missed[layer][1], missed[layer]
