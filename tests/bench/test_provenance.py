"""bench/common.py's ``provenance()``: every results JSON records the commit, the dirty flag, the
device and the torch / triton / transformers versions; FUSION_COMMIT / FUSION_DIRTY stand in
where the tree has no .git (the GPU machine's copy)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
_spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

FIELDS = {"commit", "dirty", "dirty_paths", "commit_source", "device", "torch", "triton", "transformers", "python"}
HAS_GIT = shutil.which("git") is not None


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("FUSION_COMMIT", raising=False)
    monkeypatch.delenv("FUSION_DIRTY", raising=False)


def test_fields_and_versions(no_env):
    p = common.provenance()
    assert set(p) == FIELDS
    assert p["torch"] == torch.__version__
    assert p["triton"] == importlib.metadata.version("triton")
    assert p["transformers"] == importlib.metadata.version("transformers")
    assert isinstance(p["device"], str) and p["device"]
    if torch.cuda.is_available():
        assert p["device"] == torch.cuda.get_device_name()
    assert common.provenance(device="cpu (smoke)")["device"] == "cpu (smoke)"
    json.dumps(p)  # serialisable as it stands


@pytest.mark.skipif(not HAS_GIT or not (common.REPO / ".git").exists(), reason="needs this checkout's .git")
def test_commit_is_this_checkouts_head(no_env):
    p = common.provenance()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.REPO, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    assert p["commit"] == head and re.fullmatch(r"[0-9a-f]{40}", head)
    assert p["commit_source"] == "git" and isinstance(p["dirty"], bool)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)  # fmt: skip


@pytest.mark.skipif(not HAS_GIT, reason="needs git")
def test_dirty_flag_in_a_scratch_repository(tmp_path, monkeypatch, no_env):
    (tmp_path / "fusion_compiler").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "fusion_compiler" / "k.py").write_text("A = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "one")
    monkeypatch.setattr(common, "REPO", tmp_path)
    # Even with the env vars set, git's answer wins where there is a .git.
    monkeypatch.setenv("FUSION_COMMIT", "f" * 40)
    monkeypatch.setenv("FUSION_DIRTY", "1")
    clean = common.provenance()
    assert clean["commit_source"] == "git" and clean["commit"] != "f" * 40
    assert clean["dirty"] is False and clean["dirty_paths"] == []

    (tmp_path / "notes.txt").write_text("untracked, outside the code\n")
    (tmp_path / "bench" / "results" / "r.json").write_text("{}\n")
    assert common.provenance()["dirty"] is False

    (tmp_path / "fusion_compiler" / "variant.py").write_text("B = 2\n")  # untracked code
    assert common.provenance()["dirty_paths"] == ["fusion_compiler/variant.py"]
    (tmp_path / "fusion_compiler" / "variant.py").unlink()

    (tmp_path / "fusion_compiler" / "k.py").write_text("A = 2\n")  # a tracked edit
    p = common.provenance()
    assert p["dirty"] is True and p["dirty_paths"] == ["fusion_compiler/k.py"]


@pytest.mark.parametrize("flag, dirty", [("0", False), ("1", True), ("true", True), (None, None), ("maybe", None)])
def test_env_vars_stand_in_without_git(tmp_path, monkeypatch, no_env, flag, dirty):
    monkeypatch.setattr(common, "REPO", tmp_path)  # a copy of the tree: no .git
    monkeypatch.setenv("FUSION_COMMIT", "abc1234")
    if flag is not None:
        monkeypatch.setenv("FUSION_DIRTY", flag)
    p = common.provenance()
    assert (p["commit"], p["dirty"], p["commit_source"]) == ("abc1234", dirty, "env")
    assert set(p) == FIELDS and p["torch"] == torch.__version__


def test_without_git_or_env_nothing_is_guessed(tmp_path, monkeypatch, no_env):
    monkeypatch.setattr(common, "REPO", tmp_path)
    p = common.provenance()
    assert (p["commit"], p["dirty"], p["commit_source"]) == ("unknown", None, "none")


def test_write_json_records_provenance(tmp_path, monkeypatch, no_env):
    monkeypatch.setattr(common, "REPO", tmp_path)
    monkeypatch.setenv("FUSION_COMMIT", "abc1234")
    monkeypatch.setenv("FUSION_DIRTY", "0")
    path = tmp_path / "r.json"
    common.write_json(str(path), {"rows": [1, 2]})
    written = json.loads(path.read_text())
    assert list(written) == ["provenance", "rows"] and written["rows"] == [1, 2]
    assert written["provenance"]["commit"] == "abc1234" and written["provenance"]["dirty"] is False
    own = common.provenance(device="cpu (smoke)")
    common.write_json(str(path), {"provenance": own, "rows": []})
    assert json.loads(path.read_text())["provenance"] == own


def test_every_bench_script_writes_json_through_write_json():
    """A results JSON written any other way would miss its provenance."""
    offenders = []
    for script in sorted([*BENCH.glob("*.py"), *BENCH.glob("diagnostics/*.py")]):
        if script.name == "common.py":
            continue
        text = script.read_text()
        if re.search(r"\bjson\.dump\b|\.write(_text)?\(\s*json\.dumps", text):
            offenders.append(script.name)
    assert offenders == [], f"write results through common.write_json: {offenders}"
