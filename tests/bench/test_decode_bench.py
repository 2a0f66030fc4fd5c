"""bench/decode.py's logic on CPU (--smoke, tiny widths): both sources build, every mode runs
and agrees with eager, our backend fuses every expected site, and the per-layer row holds the
floors. The timing and graph paths run on the GPU only (bench/BENCHMARKS.md)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import decode  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows():
    return decode.main(["--smoke", "--models", "minimax-m2.5", "--batches", "2"])


# The smoke run (`rows`, about 40 s on 2 CPU cores) is nightly.
@pytest.mark.nightly
def test_both_sources_one_row_each(rows):
    assert [(r["source"], r["model"], r["kind"], r["batch"]) for r in rows] == [
        ("reference", "minimax-m2.5", "moe", 2), ("hf", "minimax-m2.5", "moe", 2)]  # fmt: skip


@pytest.mark.nightly
def test_every_mode_agrees_with_eager_and_fuses_every_site(rows):
    for row in rows:
        for stack in row["stacks"].values():
            modes = stack["modes"]
            assert set(modes) == set(decode.SMOKE_MODES)
            for mode, result in modes.items():
                assert "error" not in result, (row["source"], mode, result["error"])
                if mode != "eager":
                    assert result["vs_eager"]["out_rel_err"] < 2e-2, (row["source"], mode, result["vs_eager"])
            fused = modes["fusion_compiler"]
            assert fused["missing_expected"] == [], fused["matches"]
            assert "gqa_prologue" in fused["matches"] and "moe_routing" in fused["matches"]
        if row["source"] == "reference":  # the caches it wrote, against eager's
            assert row["stacks"]["two"]["modes"]["fusion_compiler"]["vs_eager"]["state_rel_err"] < 2e-2


@pytest.mark.nightly
def test_floors_count_one_layer(rows):
    reference, hf = rows
    # The reference runs its routed experts: a batch of 2 reads up to 2 * top_k of them.
    assert reference["floor"]["weight_bytes"] > hf["floor"]["weight_bytes"] > 0
    assert reference["floor"]["state_bytes"] > 0 and hf["floor"]["state_bytes"] > 0
    assert "weight_us" not in reference["floor"]  # no bandwidth measured on CPU: no µs


def test_layer_pairs_keep_hf_qwen_runnable():
    pairs = decode.layer_pairs("hf", "qwen3.5")
    assert all("full_attention" in small for _, small in pairs.values())
    assert decode.layer_pairs("reference", "qwen3.5")["linear_attention"] == (("linear_attention",) * 2, ("linear_attention",))
