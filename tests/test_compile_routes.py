"""Every route a user takes into the compiler, and what reaches them when something fails.

Routes: ``torch.compile(..., backend="fusion_compiler", mode=..., options=...)``; HF's
``generate(compile_config=CompileConfig(backend="fusion_compiler"))`` with HF's defaults;
``fusion_compiler.compile(hf_model)`` then ``generate()``; ``model.forward =
torch.compile(model.forward, backend=...)``. Errors: MissedSiteError, UnknownModuleError,
VerificationError and bad options reach the caller as themselves, not wrapped by Dynamo or
Inductor.

The routes' wiring is tested on a three-layer norm stack (a compile of a second or two); the HF
routes each compile a tiny one-layer MiniMax-M2.5 (10-20 s of CPU Inductor each), against one
shared eager run.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler import _compat
from fusion_compiler.backend import compile_settings
from fusion_compiler.model_adapters import get_adapter, make_decode_step
from fusion_compiler.verify import relative_error
from stack_fixtures import BF16, EXPECTED, Stack, wrong_add_rms_norm

X = torch.randn(4, 32, dtype=BF16)


def _run_stack(model=None, **compile_kwargs):
    model = (model or Stack()).to(BF16)
    with torch.no_grad():
        return torch.compile(model, backend="fusion_compiler", **compile_kwargs)(X)


# --------------------------------------------------------------------------------------------------
# mode and options through the registered backend
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, cudagraphs, inductor",
    [
        (None, True, {}),
        ("default", True, {}),
        ("reduce-overhead", True, {}),
        ("max-autotune", True, {"max_autotune": True, "coordinate_descent_tuning": True}),
        ("max-autotune-no-cudagraphs", False, {"max_autotune": True, "coordinate_descent_tuning": True}),
    ],
)
def test_each_mode_means_our_cuda_graphs_or_passes_inductors_settings(mode, cudagraphs, inductor):
    config, patches = compile_settings(fc.FusionConfig(), mode, None)
    assert config.cudagraphs is cudagraphs
    assert patches == inductor


def test_options_split_into_our_config_and_inductors():
    config, patches = compile_settings(
        fc.FusionConfig(), None, {"strict": True, "triton.cudagraphs": False, "coordinate-descent-tuning": True}
    )
    assert (config.strict, config.cudagraphs) == (True, False)
    assert patches == {"coordinate_descent_tuning": True}
    # Our own config off still wins over a mode that would run CUDA graphs.
    assert compile_settings(fc.FusionConfig(cudagraphs=False), "max-autotune", None)[0].cudagraphs is False


@pytest.fixture
def inductor_seen(monkeypatch):
    """Inductor's config as compile_fx would see it, per graph; the graph then runs as traced
    (these tests are about what reaches Inductor, not what it makes of it)."""
    seen = []

    def spy(gm, example_inputs):
        cfg = _compat.inductor_config
        seen.append({"max_autotune": cfg.max_autotune, "coordinate_descent_tuning": cfg.coordinate_descent_tuning})
        return gm.forward

    monkeypatch.setattr(_compat, "compile_fx", spy)
    return seen


def test_mode_through_torch_compile(inductor_seen):
    """torch passes mode= to a named backend (it did raise TypeError); max-autotune's Inductor
    settings hold while we compile, and no-cudagraphs turns ours off."""
    _run_stack(mode="max-autotune-no-cudagraphs")
    assert inductor_seen == [{"max_autotune": True, "coordinate_descent_tuning": True}]
    assert fc.last_backend().config.cudagraphs is False


def test_options_through_torch_compile(inductor_seen):
    _run_stack(options={"verify": True, "coordinate_descent_tuning": True, "triton.cudagraphs": False})
    assert inductor_seen == [{"max_autotune": False, "coordinate_descent_tuning": True}]
    config = fc.last_backend().config
    assert (config.verify, config.cudagraphs) == (True, False)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"options": {"strcit": True}}, fc.FusionOptionsError, r"\['strcit'\].*FusionConfig field \(.*strict"),
        ({"options": {"max_autotune": "yes"}}, fc.FusionOptionsError, r"max_autotune takes bool, got str"),
        ({"options": {"families": {"rope": "triton"}}}, fc.FusionOptionsError, r"unknown fusion families"),
        ({"options": {"post_grad_custom_post_pass": None}}, fc.FusionOptionsError, "its own pass"),
        ({"mode": "fastest"}, RuntimeError, r"Unrecognized mode=fastest"),
    ],
)
def test_bad_mode_or_options_is_a_clear_error(kwargs, error, message):
    """Raised at the first compile (torch calls a named backend only then), as itself: a
    ValueError naming the valid fields, and a RuntimeError as stock's errors are."""
    with pytest.raises(error, match=message) as raised:
        _run_stack(**kwargs)
    assert isinstance(raised.value, (ValueError, RuntimeError))
    assert not isinstance(raised.value, torch._dynamo.exc.BackendCompilerFailed)


def test_graphs_of_one_torch_compile_share_one_backend(request):
    """Dynamo calls the named backend once per graph: a recompile lands in the same report. A
    new torch.compile call that compiles gets a new backend (one with the same mode and options
    is a cache hit: Dynamo takes its backend for the same, and compiles nothing)."""
    compiled = torch.compile(Stack().to(BF16), backend="fusion_compiler")
    with torch.no_grad():
        compiled(X)
        first = fc.last_backend()
        compiled(torch.randn(4, 32, 32, dtype=BF16))  # another rank: a second graph
    assert fc.last_backend() is first
    assert len(first.report.graphs) == 2 and first.report.count("add_rms_norm") == 12
    request.getfixturevalue("inductor_seen")  # from here on nothing need be really compiled
    _run_stack(options={"verify": True})
    assert fc.last_backend() is not first and fc.last_backend().compiles == 1


# --------------------------------------------------------------------------------------------------
# strict, expected and verify: their errors reach the caller as themselves
# --------------------------------------------------------------------------------------------------


def test_strict_without_expected_raises_on_any_missed_candidate():
    try:
        _run_stack(Stack(broken_layer=1), options={"strict": True})
    except fc.MissedSiteError as error:
        assert type(error) is fc.MissedSiteError
        assert "layers.1.input_layernorm" in str(error) and "eps is a tensor" in str(error)
    else:
        pytest.fail("strict mode fused 5 of 6 candidate sites and raised nothing")


def test_strict_with_expected_raises_as_itself():
    try:
        _run_stack(Stack(broken_layer=2), options={"strict": True, "expected": EXPECTED})
    except fc.MissedSiteError as error:
        assert "add_rms_norm at layers.2.input_layernorm: expected 1, fused 0" in str(error)
    else:
        pytest.fail("an expected site did not fuse and strict raised nothing")


TYPO = {"add_rms_norm": {"layers.0.input_layernorn": 1}}


def test_an_expected_path_naming_no_module_is_an_error():
    """Through the named backend (checked against the compiled frame's module) and through
    fc.compile (checked against the model before anything compiles)."""
    try:
        _run_stack(options={"expected": TYPO})
    except fc.UnknownModuleError as error:
        assert "layers.0 has no submodule 'input_layernorn'; did you mean 'input_layernorm'?" in str(error)
    else:
        pytest.fail("a typo'd expected path was silently dropped")
    with pytest.raises(fc.UnknownModuleError, match="input_layernorn"):
        fc.compile(Stack(), fc.FusionConfig(expected=TYPO))
    with pytest.raises(ValueError, match="the model has no submodule 'model'"):
        fc.compile(Stack(), fc.FusionConfig(expected={"add_rms_norm": {"model.layers.0.input_layernorm": 1}}))


def test_verification_error_reaches_the_caller():
    with wrong_add_rms_norm():
        try:
            _run_stack(options={"verify": True})
        except fc.VerificationError as error:
            assert type(error) is fc.VerificationError and "add_rms_norm.hf at layers." in str(error)
        else:
            pytest.fail("a wrong fused op passed verify")


# --------------------------------------------------------------------------------------------------
# HF: generate() through each route (tiny one-layer MiniMax-M2.5, static cache)
# --------------------------------------------------------------------------------------------------

NEW_TOKENS = 3
GENERATE = dict(max_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static",
                output_logits=True, return_dict_in_generate=True)  # fmt: skip


def _model():
    return get_adapter("minimax-m2.5").build_hf(size="tiny", layers=1)


@functools.cache
def _prompt_and_eager():
    model = _model()
    prompt = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return prompt, model.generate(prompt, **GENERATE)


def _assert_generates_like_eager(out) -> None:
    prompt, eager = _prompt_and_eager()
    assert out.sequences.tolist() == eager.sequences.tolist()
    for step, (ours, theirs) in enumerate(zip(out.logits, eager.logits)):
        assert relative_error(ours, theirs) < 2e-2, f"step {step}"


def _assert_fused(report, graphs: int) -> None:
    assert len(report.graphs) == graphs, report.format()
    assert report.count("gqa_prologue") == graphs and report.count("moe_routing") == graphs, report.format()
    assert report.misses() == [], report.format()


def test_hf_compile_config_route_with_hfs_defaults():
    """HF passes mode="reduce-overhead" (its default) to the named backend. On CPU HF compiles
    only with _compile_all_devices; the prefill runs eager, the decode steps are one graph."""
    from transformers import CompileConfig

    compile_config = CompileConfig(backend="fusion_compiler")
    assert (compile_config.mode, compile_config.fullgraph, compile_config.dynamic) == ("reduce-overhead", False, None)
    compile_config._compile_all_devices = True
    prompt, _ = _prompt_and_eager()
    with torch.no_grad():
        out = _model().generate(prompt, compile_config=compile_config, **GENERATE)
    _assert_fused(fc.last_report(), graphs=1)
    _assert_generates_like_eager(out)


def test_fc_compile_then_generate_compiles_what_generate_calls():
    """fc.compile on an HF model compiles it in place: generate()'s prefill and decode both
    run our graphs. Strict with no expected sites takes them from the model's adapter."""
    model = _model()
    compiled = fc.compile(model, fc.FusionConfig(strict=True))
    assert compiled is model and model.generation_config.disable_compile  # no second Dynamo context
    assert set(model.fusion_backend.config.expected) >= {"gqa_prologue", "moe_routing", "add_rms_norm"}
    prompt, _ = _prompt_and_eager()
    with torch.no_grad():
        out = compiled.generate(prompt, **GENERATE)
    _assert_fused(compiled.fusion_report, graphs=2)
    assert fc.last_report() is compiled.fusion_report
    _assert_generates_like_eager(out)


def test_compiled_forward_route():
    """model.forward = torch.compile(model.forward, backend=...): one decode step."""
    model = _model()
    step = make_decode_step(model, context=6)
    eager = step.run(model)
    model.forward = torch.compile(model.forward, backend="fusion_compiler")
    fused = step.run(model)
    _assert_fused(fc.last_report(), graphs=1)
    assert relative_error(fused, eager) < 2e-2
