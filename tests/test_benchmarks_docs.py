"""The published performance figures are the committed benchmark results, rendered.

``python -m benchmarks.run`` measures and writes docs/benchmarks.json (raw results),
docs/benchmarks.md and the plot; ``python -m benchmarks.summary`` renders README.md's
figures from the JSON. Nothing here times anything: these tests only notice staleness.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("benchmarks.run", reason="run from the repository root")

from benchmarks import run, summary  # noqa: E402

DATA = json.loads((ROOT / "docs" / "benchmarks.json").read_text())


def test_readme_figures_are_rendered_from_the_results() -> None:
    text = (ROOT / "README.md").read_text()
    assert summary.readme_block(text) == summary.render(DATA), (
        "stale: run python -m benchmarks.summary"
    )


def test_benchmark_page_is_rendered_from_the_results() -> None:
    md, _, _ = run.render_json(DATA)
    assert (ROOT / "docs" / "benchmarks.md").read_text() == md, (
        "stale: run python -m benchmarks.run --from-json docs/benchmarks.json"
    )


def test_results_cover_the_current_harness() -> None:
    """A case or implementation added, renamed or removed in benchmarks/run.py since the
    results were measured makes them stale: re-run ``python -m benchmarks.run``. (Rows of
    installed peers depend on the environment and are left out of the comparison.)"""
    args = DATA["args"]
    harness = {
        (c.op, c.size, impl.name)
        for c in run.make_cases(args["quick"], args["device"])
        for impl in c.impls
        if "(installed)" not in impl.name
    }
    measured = {(r["op"], r["size"], r["impl"]) for r in DATA["results"]}
    measured = {key for key in measured if "(installed)" not in key[2]}
    assert harness == measured, {
        "not measured": sorted(harness - measured),
        "no longer in the harness": sorted(measured - harness),
    }
