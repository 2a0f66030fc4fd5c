"""The vLLM tier: our pass inside vLLM 0.33's compilation pipeline (``make test-vllm``).

Graphs come from vLLM's own layers (RMSNorm, GemmaRMSNorm) and IR ops, compiled by vLLM's own
`VllmBackend` from a real `VllmConfig`, which adds the pass in its slot to its
`PostGradPassManager` exactly as ``vllm serve`` does. Runs in the venv `.ci/vllm_env` builds;
vLLM is imported inside the tests, so the CPU tier (which deselects ``-m vllm``) never needs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fusion_compiler import _compat
from fusion_compiler.verify import relative_error
from vllm_fixtures import SLOT, compile_with_vllm_backend, vllm_config

pytestmark = pytest.mark.vllm

BF16 = torch.bfloat16
WIDTH = 64
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_compile_caches(monkeypatch, tmp_path):
    # A cache hit skips the post-grad passes, and with them the report. vLLM turns Inductor's
    # FX-graph cache on in its own config patches; only force_disable_caches overrides that.
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # for the subprocesses
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.delenv("FUSION_COMPILER_VLLM", raising=False)
    with _compat.inductor_config.patch(force_disable_caches=True):
        yield


# The families these tests exercise, named: a named family runs as asked, where by default the
# pass leaves norms and RoPE to Inductor inside vLLM (test_vllm_launches.py tests that policy).
NAMED = {"add_rms_norm": "triton", "gated_rms_norm": "triton", "mla_prologue": "triton"}


def _recording_pass(config=None):
    """Our vLLM pass (the families above named), also keeping the targets of every graph vLLM
    hands it."""
    from fusion_compiler import FusionConfig
    from fusion_compiler.integrations.vllm import VllmFusionPass

    config = config or FusionConfig(families=NAMED)

    class Recording(VllmFusionPass):
        seen: list = []

        def __call__(self, graph):
            self.seen.append([n.target for n in graph.nodes])
            super().__call__(graph)

    return Recording(config)


class Norms(nn.Module):
    """A decoder layer's norms as vLLM models write them: RMSNorm with and without the
    residual, then a Gemma norm both ways (Qwen3.5 uses GemmaRMSNorm, MiniMax RMSNorm)."""

    def __init__(self, weight_dtype=BF16):
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

        super().__init__()
        self.input_layernorm = RMSNorm(WIDTH, eps=1e-6, dtype=weight_dtype)
        self.q_norm = RMSNorm(WIDTH, eps=1e-6, dtype=weight_dtype)
        self.gemma_norm = GemmaRMSNorm(WIDTH, eps=1e-6).to(weight_dtype)
        self.post_attention_layernorm = GemmaRMSNorm(WIDTH, eps=1e-6).to(weight_dtype)
        for p in self.parameters():
            p.data.normal_(0, 0.2)

    def forward(self, x, residual):
        h, residual = self.input_layernorm(x, residual)
        h = self.gemma_norm(self.q_norm(h) * 2)
        return self.post_attention_layernorm(h, residual)


def _inputs(tokens=5, residual_dtype=BF16):
    return torch.randn(tokens, WIDTH, dtype=BF16), torch.randn(tokens, WIDTH, dtype=residual_dtype)


def _assert_close(eager, compiled):
    for e, c in zip(eager, compiled, strict=True):
        assert c.dtype == e.dtype
        # One bf16 rounding apart at most (patterns/vllm_ir.py): the weight applied in fp32.
        assert relative_error(c, e) < 1e-2, relative_error(c, e)


def test_vllm_0_33_and_its_compilation_modules_import_on_cpu():
    import vllm
    from vllm.compilation.backends import VllmBackend  # noqa: F401
    from vllm.compilation.passes.pass_manager import PostGradPassManager  # noqa: F401

    assert vllm.__version__ == "0.33.0"
    assert torch.__version__.startswith("2.14.0")  # vLLM 0.33's own pin
    assert not torch.cuda.is_available()


@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
def test_every_norm_of_a_layer_fuses_inside_vllm(weight_dtype):
    our_pass = _recording_pass()
    config = vllm_config({SLOT: our_pass})
    eager, compiled, backend = compile_with_vllm_backend(config, lambda: Norms(weight_dtype), _inputs())

    assert backend.pass_manager.passes[-1] is our_pass  # added by vLLM's backend, after its own passes
    (targets,) = our_pass.seen
    handed_over = {str(t) for t in targets}
    assert {"vllm_ir.rms_norm.default", "vllm_ir.fused_add_rms_norm.default"} <= handed_over
    report = our_pass.report
    assert report.per_variant() == {
        "vllm_ir.fused_add_rms_norm": 1, "vllm_ir.rms_norm": 1,
        "vllm_ir.rms_norm.gemma": 1, "vllm_ir.fused_add_rms_norm.gemma": 1,
    }  # fmt: skip
    assert report.misses() == []
    assert report.graphs[0].pipeline.startswith("vllm 0.33.0, compile range")
    assert "inside vllm 0.33.0" in report.format()
    _assert_close(eager, compiled)


class FinalNorm(nn.Module):
    """A model's final norm as vLLM models write it: the residual sum is read by nothing."""

    def __init__(self):
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm

        super().__init__()
        self.norm = GemmaRMSNorm(WIDTH, eps=1e-6).to(BF16)
        self.norm.weight.data.normal_(0, 0.2)

    def forward(self, x, residual):
        hidden_states, _ = self.norm(x, residual)
        return hidden_states


def test_final_norm_with_its_residual_sum_unread_fuses():
    our_pass = _recording_pass()
    eager, compiled, _ = compile_with_vllm_backend(vllm_config({SLOT: our_pass}), FinalNorm, _inputs())
    assert our_pass.report.per_variant() == {"vllm_ir.fused_add_rms_norm.out_only.gemma": 1}
    assert our_pass.report.misses() == []
    _assert_close([eager], [compiled])


def test_cli_string_resolves_to_our_pass_and_runs(monkeypatch):
    import fusion_compiler
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from fusion_compiler.integrations.vllm import VllmFusionPass

    # vLLM's CLI builds a default DeviceConfig ("auto"), which needs a known platform; this
    # machine has none (no GPU, and the wheel is not vLLM's CPU build).
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    option = json.dumps({"inductor_passes": {SLOT: "fusion_compiler.vllm_pass"}})
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    from_cli = parser.parse_args(["--compilation-config", option])
    assert from_cli.compilation_config.inductor_compile_config[SLOT] is fusion_compiler.vllm_pass
    assert isinstance(fusion_compiler.vllm_pass, VllmFusionPass)

    config = vllm_config(inductor_passes={SLOT: "fusion_compiler.vllm_pass"})
    assert config.compilation_config.inductor_compile_config[SLOT] is fusion_compiler.vllm_pass
    before = len(fusion_compiler.vllm_pass.report.left())
    eager, compiled, backend = compile_with_vllm_backend(config, Norms, _inputs())
    assert fusion_compiler.vllm_pass in backend.pass_manager.passes
    # The default config: the four norms are sites, each left to Inductor (one kernel each there).
    assert len(fusion_compiler.vllm_pass.report.left()) - before == 4
    _assert_close(eager, compiled)


def test_cli_string_resolves_in_a_process_that_never_imported_us():
    """vLLM resolves the string with ``__import__("fusion_compiler").__dict__``: the package must
    set the attribute itself when vLLM is already loaded."""
    code = (
        "import vllm, sys\n"
        "from vllm.config import CompilationConfig\n"
        "assert 'fusion_compiler' not in sys.modules\n"
        f"c = CompilationConfig(mode=3, inductor_passes={{{SLOT!r}: 'fusion_compiler.vllm_pass'}})\n"
        f"print(type(c.inductor_compile_config[{SLOT!r}]).__qualname__)\n"
    )
    assert _python(code).splitlines()[-1] == "VllmFusionPass"


def test_manager_uuid_and_vllm_config_hash_follow_our_config():
    from vllm.compilation.backends import VllmBackend
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range

    from fusion_compiler import FusionConfig
    from fusion_compiler.integrations.vllm import VllmFusionPass

    def keys(fusion_config):
        config = vllm_config({SLOT: VllmFusionPass(fusion_config)})
        with set_current_vllm_config(config), pass_context(Range(1, 8)):
            backend = VllmBackend(config)
            backend.configure_post_pass()
            return backend.pass_manager.uuid(), config.compute_hash()

    default = keys(FusionConfig())
    assert keys(FusionConfig()) == default
    inductor = keys(FusionConfig(families={"add_rms_norm": "inductor"}))
    assert inductor[0] != default[0] and inductor[1] != default[1]
    assert keys(FusionConfig(horizontal_merge=False))[0] != default[0]


def test_in_place_form_from_plain_torch_compile_fuses():
    """Outside vLLM's backend (no pre-grad functionalisation), RMSNorm(x, residual) arrives as
    auto_functionalized_v2(vllm_ir.fused_add_rms_norm.maybe_inplace) + copy_ into x, residual."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    our_pass = _recording_pass()
    x, residual = _inputs()
    with set_current_vllm_config(vllm_config()), torch.no_grad():
        norm = RMSNorm(WIDTH, eps=1e-6, dtype=BF16)
        norm.weight.data.normal_(1, 0.2)
        eager_inputs, compiled_inputs = (x.clone(), residual.clone()), (x.clone(), residual.clone())
        eager = norm(*eager_inputs)
        with _compat.inductor_patches(our_pass, use_caches=False):
            compiled = torch.compile(norm, backend="inductor")(*compiled_inputs)

    (targets,) = our_pass.seen
    assert _compat.auto_functionalized_v2 in targets and torch.ops.aten.copy_.default in targets
    assert our_pass.report.per_variant() == {"vllm_ir.fused_add_rms_norm": 1}
    assert our_pass.report.graphs[0].pipeline == "vllm 0.33.0, outside vLLM's backend"
    _assert_close(eager, compiled)
    for e, c in zip(eager_inputs, compiled_inputs):  # what copy_ writes back into x and residual
        assert torch.equal(c, e)


def test_in_place_call_on_a_view_is_a_reported_miss():
    """Near miss of the in-place form: x a slice of a wider tensor (v2 records the view against
    its base), left as vLLM's call and reported."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    our_pass = _recording_pass()
    wide, residual = torch.randn(5, 2 * WIDTH, dtype=BF16), torch.randn(5, WIDTH, dtype=BF16)
    with set_current_vllm_config(vllm_config()), torch.no_grad():
        norm = RMSNorm(WIDTH, eps=1e-6, dtype=BF16)
        eager = norm(wide.clone()[:, WIDTH:], residual.clone())
        with _compat.inductor_patches(our_pass, use_caches=False):
            compiled = torch.compile(lambda w, r: norm(w[:, WIDTH:], r), backend="inductor")(wide.clone(), residual.clone())

    (miss,) = our_pass.report.misses()
    assert "writes into a view of a larger tensor" in miss.reason
    assert our_pass.report.count() == 0
    _assert_close(eager, compiled)


class _NearMiss(nn.Module):
    def __init__(self, **norm_kwargs):
        from vllm.model_executor.layers.layernorm import RMSNorm

        super().__init__()
        self.norm = RMSNorm(WIDTH, eps=1e-6, dtype=BF16, **norm_kwargs)

    def forward(self, x, residual):
        return self.norm(x), *self.norm(x, residual)


@pytest.mark.parametrize(
    "norm_kwargs, residual_dtype, reasons",
    [
        ({"var_hidden_size": 32}, BF16, ["variance_size=32", "variance_size=32"]),
        ({"has_weight": False}, BF16, ["weight is None", "weight is None"]),
        ({}, torch.float32, ["torch.float32 does not equal x"]),
    ],
    ids=["partial_variance", "no_weight", "fp32_residual"],
)
def test_near_misses_are_reported_and_leave_vllm_graph_alone(norm_kwargs, residual_dtype, reasons):
    our_pass = _recording_pass()
    config = vllm_config({SLOT: our_pass})
    eager, compiled, _ = compile_with_vllm_backend(config, lambda: _NearMiss(**norm_kwargs), _inputs(residual_dtype=residual_dtype))

    report = our_pass.report
    misses = [s for s in report.misses() if s.anchor.startswith(("rms_norm", "fused_add_rms_norm"))]
    assert len(misses) == len(reasons)
    for miss, reason in zip(sorted(misses, key=lambda s: s.anchor, reverse=True), reasons):
        assert reason in miss.reason, miss.reason
    assert report.count() == 2 - len(reasons)
    for e, c in zip(eager, compiled, strict=True):
        assert relative_error(c, e) < 1e-2


def test_gemma_offset_other_than_one_fuses_as_a_plain_norm():
    """Near miss of the Gemma variants: ``w.float() + 0.5`` is not Gemma's (1 + w); the plain
    variant takes it, with that sum as its weight."""
    from vllm import ir

    class HalfOffset(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(WIDTH, dtype=BF16) * 0.2)

        def forward(self, x, residual):
            return ir.ops.rms_norm(x, self.weight.float() + 0.5, 1e-6)

    our_pass = _recording_pass()
    eager, compiled, _ = compile_with_vllm_backend(vllm_config({SLOT: our_pass}), HalfOffset, _inputs())
    assert our_pass.report.per_variant() == {"vllm_ir.rms_norm": 1}
    _assert_close([eager], [compiled])


def test_plugin_entry_point_is_registered():
    from importlib.metadata import entry_points

    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("fusion_compiler") == "fusion_compiler.integrations.vllm:register"


_PLUGIN_RUN = """
import json, os, sys
import torch, vllm
from vllm.plugins import load_general_plugins
from vllm.config import VllmConfig
from vllm.compilation.passes.inductor_pass import pass_context
from vllm.config.utils import Range
from vllm_fixtures import SLOT, compile_with_vllm_backend, vllm_config
from vllm.model_executor.layers.layernorm import RMSNorm

# The plugin's graph partition turns on vLLM's MLA RoPE + cache fusion at -O2, whose pass needs
# vLLM's CUDA extension: off here.
NO_MLA_FUSION = {"pass_config": {"fuse_rope_kvcache_cat_mla": False}}

def state():
    config = vllm_config(**NO_MLA_FUSION)
    from vllm.compilation.backends import VllmBackend
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(config), pass_context(Range(1, 8)):
        backend = VllmBackend(config)
        backend.configure_post_pass()
        return {"slot": type(config.compilation_config.inductor_compile_config.get(SLOT)).__qualname__,
                "passes": [type(p).__qualname__ for p in backend.pass_manager.passes],
                "manager_uuid": backend.pass_manager.uuid(), "config_hash": config.compute_hash(),
                "partition": config.compilation_config.use_inductor_graph_partition}

before = state()
post_init = VllmConfig.__post_init__
load_general_plugins()
after = state()
out = {"before": before, "after": after, "post_init_unchanged": VllmConfig.__post_init__ is post_init}
if os.environ.get("FUSION_COMPILER_VLLM") == "1":
    import fusion_compiler
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(64, eps=1e-6, dtype=torch.bfloat16)
        def forward(self, x, r):
            return self.norm(x, r)
    inputs = [torch.randn(3, 64, dtype=torch.bfloat16) for _ in range(2)]
    compile_with_vllm_backend(vllm_config(**NO_MLA_FUSION), Layer, inputs)
    out["fused"] = fusion_compiler.vllm_pass.report.per_variant()
print(json.dumps(out))
"""


def _python(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "FUSION_COMPILER_VLLM"}
    environ.update(env, PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), environ.get("PYTHONPATH")])))
    # Not from the clone's root: a stale fusion_compiler.egg-info there (another venv's editable
    # install) would shadow the installed entry points.
    done = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                          timeout=300, cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_plugin_disabled_changes_nothing():
    out = json.loads(_python(_PLUGIN_RUN).splitlines()[-1])
    assert out["after"] == out["before"]
    assert out["after"]["slot"] == "NoneType"
    assert "VllmFusionPass" not in out["after"]["passes"]
    assert out["post_init_unchanged"]


def test_plugin_enabled_installs_the_pass_in_every_new_config():
    options = json.dumps({"families": {"add_rms_norm": "triton"}})
    out = json.loads(_python(_PLUGIN_RUN, FUSION_COMPILER_VLLM="1", FUSION_COMPILER_VLLM_OPTIONS=options).splitlines()[-1])
    assert out["before"]["slot"] == "NoneType"
    assert out["after"]["slot"] == "VllmFusionPass"
    assert out["after"]["passes"][-1] == "VllmFusionPass"
    assert out["after"]["manager_uuid"] != out["before"]["manager_uuid"]
    assert out["after"]["config_hash"] != out["before"]["config_hash"]  # vLLM's cache key sees the pass
    assert (out["before"]["partition"], out["after"]["partition"]) == (False, True)  # the K/V prologue's graph
    assert out["fused"] == {"vllm_ir.fused_add_rms_norm": 1}


def test_plugin_refuses_bad_values_and_a_taken_slot(monkeypatch):
    from vllm.compilation.passes.inductor_pass import CallableInductorPass

    from fusion_compiler.integrations import vllm as integration

    monkeypatch.setenv("FUSION_COMPILER_VLLM", "yes")
    with pytest.raises(ValueError, match="FUSION_COMPILER_VLLM='yes'"):
        integration.register()
    with pytest.raises(RuntimeError, match="already holds"):
        integration.fill_slot({SLOT: CallableInductorPass(lambda graph: None)})
    ours = integration.VllmFusionPass()
    slot = {SLOT: ours}
    integration.fill_slot(slot)
    assert slot[SLOT] is ours


def test_pass_survives_vllms_deepcopy_and_pickle():
    import copy
    import pickle

    from fusion_compiler import FusionConfig
    from fusion_compiler.integrations.vllm import VllmFusionPass

    ours = VllmFusionPass(FusionConfig(families={"gdn": "off"}, expected={"add_rms_norm": {"layers.0.norm": 1}}))
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert clone.config == ours.config and clone.uuid() == ours.uuid()


# MiniMax-M2.5's attention shapes per head (head_dim 128, rotary_dim 64, theta 5e6), few heads.
HEADS, KV_HEADS, HEAD_DIM, ROTARY_DIM = 4, 2, 128, 64


class QkNormRope(nn.Module):
    """MiniMax-M2.5's attention prologue as vLLM writes it, up to the cache write: full-width
    q/k RMSNorm, then `get_rope`'s RotaryEmbedding (native forward_static under
    custom_ops=["none"])."""

    def __init__(self, is_neox_style=True, rotary_dim=ROTARY_DIM):
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.rotary_embedding import get_rope

        super().__init__()
        self.q_norm = RMSNorm(HEADS * HEAD_DIM, eps=1e-6, dtype=BF16)
        self.k_norm = RMSNorm(KV_HEADS * HEAD_DIM, eps=1e-6, dtype=BF16)
        for p in self.parameters():
            p.data.normal_(1, 0.2)
        rope = {"rope_theta": 5e6, "partial_rotary_factor": rotary_dim / HEAD_DIM}
        self.rotary_emb = get_rope(HEAD_DIM, max_position=64, is_neox_style=is_neox_style, rope_parameters=rope, dtype=BF16)

    def forward(self, positions, q, k):
        return self.rotary_emb(positions, self.q_norm(q), self.k_norm(k))


def _rope_inputs(tokens=3):
    positions = torch.tensor([3, 17, 60, 8, 33][:tokens])
    return positions, torch.randn(tokens, HEADS * HEAD_DIM, dtype=BF16), torch.randn(tokens, KV_HEADS * HEAD_DIM, dtype=BF16)


def test_vllm_native_partial_neox_rope_fuses_after_the_qk_norms():
    our_pass = _recording_pass()
    eager, compiled, _ = compile_with_vllm_backend(vllm_config({SLOT: our_pass}), QkNormRope, _rope_inputs())

    (targets,) = our_pass.seen
    # The table gather (index_select) and no cache write: vLLM's Attention writes the cache in
    # its own op, outside this graph, so no gqa_prologue site exists (patterns/vllm_rope.py).
    assert torch.ops.aten.index.Tensor in targets and torch.ops.aten.index_put.default not in targets
    report = our_pass.report
    assert report.per_variant() == {"vllm.rope_neox_partial": 2, "vllm_ir.rms_norm": 2}
    assert report.misses() == []
    _assert_close(eager, compiled)  # the op rounds once in fp32; vLLM's eager rounds each bf16 step


def test_by_default_qk_norms_and_rope_stay_with_inductor():
    """Never worse (integrations/vllm.py): Inductor fuses q-norm, k-norm, RoPE and the cos/sin
    gather into one kernel; our two norms and two RoPE ops would launch 4. By default the four
    sites are left to Inductor, each with its reason, and the graph is stock vLLM's."""
    from fusion_compiler.inspect.counting import cuda_launch_proxy, wrapper_launches
    from fusion_compiler.integrations.vllm import VllmFusionPass

    def launches(slot):
        _, sources = _compat.run_and_get_code(
            lambda: compile_with_vllm_backend(vllm_config(slot), QkNormRope, _rope_inputs()))
        return cuda_launch_proxy(sum((wrapper_launches(code) for code in sources), Counter()))

    default, named = VllmFusionPass(), _recording_pass()
    assert launches({}) == launches({SLOT: default}) < launches({SLOT: named})
    report = default.report
    assert report.per_variant() == {} and report.misses() == []
    assert {s.variant: s.family for s in report.left()} == {"vllm_ir.rms_norm": "add_rms_norm", "vllm.rope_neox_partial": "mla_prologue"}
    assert len(report.left()) == 4
    assert "left to Inductor: RoPE with its cos/sin gather and no cache write is one Inductor kernel" in report.format()


@pytest.mark.parametrize(
    "rope_kwargs, reason",
    [
        ({"is_neox_style": False}, "RoPE layout is GPT-J pairs"),
        ({"rotary_dim": HEAD_DIM}, f"RoPE covers all {HEAD_DIM} dims of the head"),
    ],
    ids=["gptj_where_neox", "full_where_partial"],
)
def test_vllm_rope_near_misses_are_reported_and_left_alone(rope_kwargs, reason):
    our_pass = _recording_pass()
    eager, compiled, _ = compile_with_vllm_backend(
        vllm_config({SLOT: our_pass}), lambda: QkNormRope(**rope_kwargs), _rope_inputs()
    )

    report = our_pass.report
    assert report.per_variant() == {"vllm_ir.rms_norm": 2}  # the norms still fuse
    ours = [s for s in report.misses() if reason in s.reason]
    assert len(ours) == 2, [s.reason for s in report.misses()]  # q's RoPE and k's
    _assert_close(eager, compiled)


# Qwen3.5's GDN output norm (qwen_gdn_linear_attn.py: RMSNormGated(head_v_dim, group_size=None,
# norm_before_gate=True)), applied per head to the [T, heads, head_v_dim] core output.
GDN_HEADS, GDN_HEAD_V_DIM = 4, 128


class GatedNorm(nn.Module):
    """vLLM's `RMSNormGated` as the GDN layer calls it: ``self.norm(core_attn_out, z)``."""

    def __init__(self, weight_dtype=BF16, **norm_kwargs):
        from vllm.model_executor.layers.layernorm import RMSNormGated

        super().__init__()
        kwargs = {"group_size": None, "norm_before_gate": True, "activation": "silu", **norm_kwargs}
        self.norm = RMSNormGated(GDN_HEAD_V_DIM, eps=1e-6, dtype=weight_dtype, **kwargs)
        self.norm.weight.data.normal_(1, 0.2)

    def forward(self, core_attn_out, z):
        return self.norm(core_attn_out, z)


SIGMOID = "the gate is a sigmoid"


@pytest.mark.parametrize(
    "build, fused, reason",
    [
        (lambda: GatedNorm(), {"gated_rms_norm.vllm": 1}, None),
        (lambda: GatedNorm(torch.float32), {"gated_rms_norm.vllm": 1}, None),
        (lambda: GatedNorm(activation="sigmoid"), {}, SIGMOID),
        # rms(x·silu(z)): the gate is the norm's input, no gated site; the plain norm after it fuses.
        (lambda: GatedNorm(norm_before_gate=False), {"rms_norm.hf_weight_last": 1}, None),
    ],
    ids=["qwen3_5", "fp32_weight", "sigmoid_gate", "gate_before_norm"],
)
def test_vllm_gated_norm_fuses_as_one_op(build, fused, reason):
    """`RMSNormGated.forward_static` (the GDN layer's ``self.norm(core_attn_out, z)``, outside
    vLLM's opaque GDN core) reaches the pass as plain aten ops and becomes one
    ``gated_rms_norm``; a sigmoid gate is a miss with its reason, and with the gate before the
    norm the plain norm family takes what is a plain norm."""
    our_pass = _recording_pass()
    tokens = 3
    inputs = [torch.randn(tokens, GDN_HEADS, GDN_HEAD_V_DIM, dtype=BF16) for _ in range(2)]
    eager, compiled, _ = compile_with_vllm_backend(vllm_config({SLOT: our_pass}), build, inputs)

    (targets,) = our_pass.seen
    aten = torch.ops.aten
    assert {aten.rsqrt.default, aten.mean.dim} <= set(targets)
    assert not [t for t in targets if str(t).startswith(("vllm", "_C"))]  # no opaque norm op
    report = our_pass.report
    assert report.per_variant() == fused
    gated_misses = [s.reason for s in report.misses() if s.family == "gated_rms_norm"]
    if reason is None:
        assert report.misses() == [], [s.reason for s in report.misses()]
    else:
        assert len(gated_misses) == 1 and reason in gated_misses[0], gated_misses
    _assert_close([eager], [compiled])


@pytest.mark.parametrize(
    "build, make_inputs, fused",
    [
        (QkNormRope, _rope_inputs, {"vllm.rope_neox_partial": 2, "vllm_ir.rms_norm": 2}),
        (GatedNorm, lambda tokens: [torch.randn(tokens, GDN_HEADS, GDN_HEAD_V_DIM, dtype=BF16) for _ in range(2)],
         {"gated_rms_norm.vllm": 1}),
    ],
    ids=["qk_norm_rope", "gated_norm"],
)
def test_vllm_dynamic_token_count_compiles_once_and_fuses(build, make_inputs, fused):
    """vLLM compiles one graph for a range of token counts (dim 0 symbolic): the sites fuse in
    that graph, and 3 and 5 tokens run through it without a recompile. (vLLM itself runs every
    size through that graph with Dynamo's guards dropped; plain Dynamo would recompile for one
    token, its 0/1 specialisation, so the sizes here start at 2.)"""
    our_pass = _recording_pass()
    eager, compiled, _ = compile_with_vllm_backend(
        vllm_config({SLOT: our_pass}, compile_sizes=[]), build, make_inputs(2),
        dynamic_batches=[make_inputs(3), make_inputs(5)],
    )

    assert len(our_pass.seen) == 1, f"{len(our_pass.seen)} graphs: the token count recompiled"
    report = our_pass.report
    assert report.per_variant() == fused
    assert report.misses() == []
    for e, c in zip(eager, compiled):
        _assert_close(e if isinstance(e, (tuple, list)) else [e], c if isinstance(c, (tuple, list)) else [c])
