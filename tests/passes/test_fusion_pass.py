"""FusionPass machinery: expectations and strict mode, verify, uuid, logging, config errors."""

from __future__ import annotations

import importlib.metadata
import logging
import shutil

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.passes.fusion_pass import PACKAGE_ROOT, pass_uuid, source_digest
from fusion_compiler.passes.report import GraphReport, MatchReport
from fusion_compiler.fx.module_paths import layer_of, normalize_module_path
from stack_fixtures import BF16, EXPECTED, Stack, wrong_add_rms_norm


def _run(model, config):
    backend = fc.FusionBackend(config)
    x = torch.randn(4, 32, dtype=BF16)
    with torch.no_grad():
        out = torch.compile(model.to(BF16), backend=backend)(x)
    return backend, out


def test_expected_vs_found_per_layer():
    backend, _ = _run(Stack(), fc.FusionConfig(expected=EXPECTED))
    report = backend.report
    assert report.per_layer("add_rms_norm") == {0: 2, 1: 2, 2: 2}
    assert report.expected_per_layer("add_rms_norm") == {0: 2, 1: 2, 2: 2}
    assert report.missing_expected() == []


def test_strict_raises_naming_the_missing_site_and_its_reason():
    with pytest.raises(fc.MissedSiteError, match=r"layers\.1\.input_layernorm.*eps is a tensor"):
        _run(Stack(broken_layer=1), fc.FusionConfig(expected=EXPECTED, strict=True))


def test_without_strict_the_miss_is_reported_not_raised():
    backend, _ = _run(Stack(broken_layer=1), fc.FusionConfig(expected=EXPECTED))
    assert backend.report.missing_expected() == [("add_rms_norm", "layers.1.input_layernorm", 1, 0)]
    assert backend.report.per_layer("add_rms_norm") == {0: 2, 1: 1, 2: 2}
    (miss,) = backend.report.misses()
    assert miss.layer == 1 and "eps is a tensor" in miss.reason


def test_one_log_line_per_compile_summarises_matches(caplog):
    with caplog.at_level(logging.INFO, logger="fusion_compiler"):
        _run(Stack(), fc.FusionConfig())
    lines = [r.getMessage() for r in caplog.records if r.name == "fusion_compiler"]
    # The logger's name says fusion_compiler; the message does not say it again.
    assert lines == ["graph 0: add_rms_norm 6/6 sites fused"]


def test_verify_passes_on_a_correct_rewrite():
    backend, _ = _run(Stack(), fc.FusionConfig(verify=True))
    assert backend.report.count() == 6


def test_verify_raises_naming_sites_when_the_fused_op_is_wrong():
    op = torch.ops.fusion_compiler.add_rms_norm.default
    with wrong_add_rms_norm(), pytest.raises(
        fc.VerificationError, match=r"add_rms_norm\.hf at layers\.\d\.post_attention_layernorm"
    ):
        _run(Stack(), fc.FusionConfig(verify=True))
    assert op is torch.ops.fusion_compiler.add_rms_norm.default


def test_uuid_is_stable_and_covers_the_config():
    a = pass_uuid(fc.FusionConfig())
    assert a == pass_uuid(fc.FusionConfig(strict=True, verify=True))  # neither changes the graph
    assert a != pass_uuid(fc.FusionConfig(families={"add_rms_norm": "inductor"}))
    assert fc.FusionPass(fc.FusionConfig()).uuid() == a


def test_uuid_changes_when_any_source_file_changes(tmp_path):
    """The uuid hashes every source file of the package: an edit to a file no hand-kept list
    named (patterns/spellings.py) changes it, so no compile cache serves the old graph."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    same, edited = tmp_path / "same", tmp_path / "edited"
    shutil.copytree(PACKAGE_ROOT, same, ignore=ignore)
    shutil.copytree(PACKAGE_ROOT, edited, ignore=ignore)
    spellings = edited / "patterns" / "spellings.py"
    spellings.write_text(spellings.read_text() + "\n# an edit\n")
    # Content, not location (a copy of the copy: the live tree may be edited meanwhile).
    assert source_digest(same) == source_digest(shutil.copytree(same, tmp_path / "moved"))
    config = fc.FusionConfig()
    assert pass_uuid(config, root=edited) != pass_uuid(config, root=same)
    (same / "patterns" / "a_new_module.py").write_text("X = 1\n")
    source_digest.cache_clear()  # read once per process: a new file needs a fresh read
    assert source_digest(same) != source_digest(tmp_path / "moved")


def test_report_shows_cuda_graphs_and_expected_modules_no_graph_ran():
    """Each step graph's capture figures are in the report (format and JSON), read through its
    report(); an expected module that no compiled graph ran is listed, not dropped."""

    class Captured:
        def report(self):
            return {"name": "graph 0", "graphs": 1, "kernel_nodes_by_rows": {1: 79}, "warmup_calls": 1,
                    "replays": 30, "uncaptured_calls": 2, "capture_error": None}

    graph = GraphReport(0, expected={"add_rms_norm": {"layers.0.norm": 1, "layers.9.norm": 1}},
                        modules_in_graph={"layers.0", "layers.0.norm"})
    report = MatchReport([graph], step_graphs=[Captured()])
    text = report.format()
    assert "graph 0: 1 CUDA graph(s) captured (1 rows: 79 kernel nodes); calls: 1 warm-up, 30 replayed, 2 uncaptured" in text
    assert "expected 1 add_rms_norm at layers.9.norm: no compiled graph ran this module" in text
    assert report.to_dict()["cuda_graphs"][0]["uncaptured_calls"] == 2
    assert report.unseen_expected() == [("add_rms_norm", "layers.9.norm", 1)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"families": {"rope": "triton"}}, "unknown fusion families"),
        ({"families": {"add_rms_norm": "cuda"}}, "lowering 'cuda'"),
        ({"default_lowering": "fast"}, "lowering 'fast'"),
        ({"verify_rtol": 0}, "verify_rtol"),
    ],
)
def test_bad_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fc.FusionConfig(**kwargs)


def test_backend_is_registered_as_an_entry_point():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")}
    assert names.get("fusion_compiler") == "fusion_compiler.backend:fusion_backend"
    assert "fusion_compiler" in torch._dynamo.list_backends(exclude_tags=())


def test_named_backend_compiles_and_reports():
    model = Stack().to(BF16)
    x = torch.randn(4, 32, dtype=BF16)
    with torch.no_grad():
        out = torch.compile(model, backend="fusion_compiler")(x)
        expected = model(x)
    assert fc.last_report().count() == 6
    assert (out.float() - expected.float()).norm() / expected.float().norm() < 1e-2


@pytest.mark.parametrize(
    "raw, path, layer",
    [
        ("L['self'].model.layers.0.input_layernorm", "model.layers.0.input_layernorm", 0),
        ("L['self']._modules['model']._modules['layers'][12].self_attn", "model.layers.12.self_attn", 12),
        ("L['self'].model.norm", "model.norm", None),
    ],
)
def test_module_paths_parse_from_nn_module_stack(raw, path, layer):
    assert normalize_module_path(raw) == path
    assert layer_of(path) == layer


def test_compile_returns_the_model_with_its_report():
    model = Stack().to(BF16)
    compiled = fc.compile(model, fc.FusionConfig(expected=EXPECTED, strict=True))
    with torch.no_grad():
        compiled(torch.randn(4, 32, dtype=BF16))
    assert compiled.fusion_report.count() == 6
    assert compiled.fusion_backend.compiles == 1


def test_a_miss_no_check_explains_still_says_what_the_site_is(monkeypatch):
    """Where neither the family's explain nor Inductor's failed match names a node, the reason
    still says which family's site this is and at which op (never an empty "no variant matched")."""
    import dataclasses

    from fusion_compiler.passes import fusion_pass
    from fusion_compiler.patterns import gqa_prologue

    graph = torch.fx.Graph()
    cache, positions, rows = (graph.placeholder(n) for n in ("cache", "positions", "rows"))
    anchor = graph.call_function(torch.ops.aten.index_put.default, (cache, [None, None, positions], rows))
    monkeypatch.setattr(fusion_pass, "failed_match_reason", lambda *args: None)
    family = dataclasses.replace(gqa_prologue.FAMILY, explain=lambda node: None)
    site = fusion_pass.FusionPass._miss(family, "triton", anchor, "model.layers.0.self_attn", None)
    assert site.status == "missed" and "no variant matched" not in site.reason
    assert site.reason.startswith("the model's code here is a gqa_prologue site (the index_put at index_put_default)"), site.reason
