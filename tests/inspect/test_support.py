"""`fusion-compiler support` (fusion_compiler/inspect/support.py): the committed docs/SUPPORT.md
holds against a fresh run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_compiler.inspect import support

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "SUPPORT.md"
TABLE = """| model | add_rms_norm | moe_routing | stock Inductor err | ours err | gate |
|---|---|---|---|---|---|
| A | 5/5 | 2/2 | 7.0e-03 | 6.0e-03 | pass |
"""


def test_compare_flags_a_lost_match_and_an_error_past_the_threshold_only():
    assert support.compare(TABLE, TABLE) == []
    lost = TABLE.replace("| 2/2 |", "| 1/2 |")
    assert support.compare(TABLE, lost) == ["A: found/expected changed (committed, fresh): {'moe_routing': ((2, 2), (1, 2))}"]
    within = TABLE.replace("6.0e-03", "9.9e-03")  # under max(1.5 x 6e-3, 1e-2)
    assert support.compare(TABLE, within) == []
    (problem,) = support.compare(TABLE, TABLE.replace("6.0e-03", "2.0e-02"))
    assert problem.startswith("A: ours error 0.02 exceeds")


def test_the_committed_table_names_every_model():
    assert set(support.parse(COMMITTED.read_text())) == {label for label, _ in support.models()}


@pytest.mark.nightly  # every model of the matrix through inspect: 4 min alone on 2 CPU cores, 13 min shared
def test_support_matrix_matches_the_committed_one():
    fresh = support.markdown(support.run_all(), support.provenance())
    assert support.compare(COMMITTED.read_text(), fresh) == []
