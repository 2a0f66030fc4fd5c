"""`fusion-compiler support`: every model of `support_models` through `inspect` on CPU at tiny
widths, as one Markdown table (docs/SUPPORT.md): found/expected per family, error against eager
of stock Inductor and ours, and the numerics gate's verdict (inspect/gate.py).

The table is also what the nightly tier checks a fresh run against (`compare`): found/expected
exactly, errors by the gate's threshold."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable

from ..stages import FAMILY, GRAPH_PASS, of_kind
from . import gate
from .support_models import models

COMMAND = "fusion-compiler support --out docs/SUPPORT.md"
# Stages that report sites, in pipeline order: the table's columns.
COLUMNS = tuple(s.name for s in of_kind(FAMILY) + of_kind(GRAPH_PASS))
ERRORS = ("stock Inductor", "ours")


def _adapter(source: str | dict):
    from ..model_adapters import adapter_from_hf_config, get_adapter

    if isinstance(source, str):
        return get_adapter(source)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(source, f)
        return adapter_from_hf_config(path)


def run_all(progress: Callable = lambda label: contextlib.nullcontext([]), only: list[str] | None = None) -> list[dict]:
    """One row per model: its label, inspect's result (a failure to build or compile: the error)."""
    from .run import inspect_model

    rows = []
    for label, source in models():
        if only and label not in only:
            continue
        adapter = _adapter(source)
        try:
            result = inspect_model(adapter, "tiny", adapter.default_layers, "cpu", progress=progress,
                                   compile_timing=False)
        except Exception as e:  # noqa: BLE001 - a model that fails is a row that says so
            rows.append({"model": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            continue
        rows.append({"model": label, "result": result})
    return rows


def counts(result: dict) -> dict[str, tuple[int, int]]:
    """Family -> (found, expected) summed over the layers and outside them."""
    total: dict[str, list[int]] = {}
    for matches in [row["matches"] for row in result["per_layer"]] + [result["outside_layers"]["matches"]]:
        for family, m in matches.items():
            cell = total.setdefault(family, [0, 0])
            cell[0] += m["found"]
            cell[1] += m["expected"]
    return {family: (f, e) for family, (f, e) in total.items() if f or e}


def _short_verdict(numerics: dict) -> str:
    """The gate's verdict in a cell: pass, the tie (or eager off float64), or the stages named."""
    explained = {"routing near-tie": "routing near-tie", "eager bf16": "eager off float64"}
    if not numerics["fired"]:
        return "pass"
    if len(numerics["responsible"]) == 1 and numerics["responsible"][0] in explained:
        return explained[numerics["responsible"][0]]
    return "FAIL: " + (", ".join(numerics["responsible"]) or "no single stage")


def _misses(result: dict) -> list[str]:
    seen = Counter()
    for row in result["per_layer"] + [result["outside_layers"]]:
        for miss in row["misses"]:
            seen[(miss["family"], miss["reason"].splitlines()[0][:200])] += 1
    return [f"{family} ×{n}: {reason}" for (family, reason), n in seen.items()]


def markdown(rows: list[dict], provenance: str) -> str:
    """The table, then per model the gate's verdict in words and its misses."""
    head = ["model", *COLUMNS, *(f"{e} err" for e in ERRORS), "gate"]
    lines = [
        "# Support matrix",
        "",
        "Every model through `fusion-compiler inspect` on CPU at tiny widths (bf16, random weights, batch 1, "
        "16 tokens of context): sites found/expected per family, summed over the layers and outside them "
        "(– : none of either); relative error of the decode step's logits against eager for stock Inductor and "
        "ours; the numerics gate (`max(1.5 × stock, 1e-2)`, docs/USAGE.md). Regenerate: `" + COMMAND + "`.",
        "",
        provenance,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    notes = []
    for row in rows:
        if "error" in row:
            lines.append("| " + " | ".join([row["model"], *["?"] * len(COLUMNS), "–", "–", row["error"]]) + " |")
            continue
        result = row["result"]
        numerics = result["numerics_gate"]
        cells = counts(result)
        lines.append("| " + " | ".join([
            row["model"],
            *(f"{cells[c][0]}/{cells[c][1]}" if c in cells else "–" for c in COLUMNS),
            f"{numerics['stock']:.1e}", f"{numerics['ours']:.1e}", _short_verdict(numerics),
        ]) + " |")
        notes.append(f"- **{row['model']}** ({result['model']}, {result['layers']} layers): gate {numerics['verdict']}")
        notes.extend(f"  - miss {m}" for m in _misses(result))
    return "\n".join(lines + ["", "## Per model", "", *notes, ""])


def provenance() -> str:
    from .run import versions

    v = versions()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__), check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", ""
    return (f"Made by `{COMMAND}` at commit {commit}{' (with local changes)' if dirty else ''}; "
            f"torch {v['torch']}, transformers {v['transformers']}, python {v['python']}.")


def parse(text: str) -> dict[str, dict]:
    """The committed table back: model -> {"counts": {family: (found, expected)}, "errors": {...}, "gate"}."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for line in lines[1:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        out[cells["model"]] = {
            "counts": {c: tuple(int(x) for x in cells[c].split("/")) for c in COLUMNS if "/" in cells.get(c, "")},
            "errors": {e: float(cells[f"{e} err"]) if cells[f"{e} err"] != "–" else None for e in ERRORS},
            "gate": cells["gate"],
        }
    return out


def compare(committed: str, fresh: str) -> list[str]:
    """What a fresh table lost against the committed one: any count that changed, a model that
    appeared or went, and an error that grew past the gate's threshold over the committed one."""
    old, new = parse(committed), parse(fresh)
    problems = [f"{m}: in the committed table, not in the fresh one" for m in old.keys() - new.keys()]
    problems += [f"{m}: in the fresh table, not in the committed one" for m in new.keys() - old.keys()]
    for model in old.keys() & new.keys():
        a, b = old[model], new[model]
        if a["counts"] != b["counts"]:
            changed = {c: (a["counts"].get(c), b["counts"].get(c)) for c in COLUMNS
                       if a["counts"].get(c) != b["counts"].get(c)}
            problems.append(f"{model}: found/expected changed (committed, fresh): {changed}")
        for e in ERRORS:
            if a["errors"][e] is not None and (b["errors"][e] is None or b["errors"][e] > gate.threshold(a["errors"][e])):
                problems.append(f"{model}: {e} error {b['errors'][e]} exceeds the committed "
                                f"{a['errors'][e]:.1e}'s threshold {gate.threshold(a['errors'][e]):.1e}")
    return problems
