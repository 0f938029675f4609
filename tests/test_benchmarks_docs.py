"""The published performance figures are the committed benchmark results, rendered.

``python -m benchmarks.run [suite...]`` measures and writes docs/benchmarks.json (raw
results, one record per device and suite) and docs/benchmarks.md; ``python -m
benchmarks.summary`` renders README.md's figures from the JSON. Nothing here times
anything: these tests only notice staleness.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("benchmarks.run", reason="run from the repository root")

from benchmarks import report, summary  # noqa: E402
from benchmarks.pending import PENDING, PENDING_SUITES, pending, stable  # noqa: E402
from benchmarks.suites import SUITES  # noqa: E402

DATA = report.load(ROOT / "docs" / "benchmarks.json")


def _peer_row(impl: str) -> bool:
    """Rows of a peer's own function: named after the version installed where the suite
    ran (or '(not installed)'), so they depend on the environment and are left out."""
    return "installed)" in impl


def test_readme_figures_are_rendered_from_the_results() -> None:
    text = (ROOT / "README.md").read_text()
    assert summary.readme_block(text) == summary.render(DATA), (
        "stale: run python -m benchmarks.summary"
    )


def test_benchmark_page_is_rendered_from_the_results() -> None:
    assert (ROOT / "docs" / "benchmarks.md").read_text() == report.render(DATA), (
        "stale: run python -m benchmarks.run --from-json docs/benchmarks.json"
    )


def test_every_suite_has_cpu_results() -> None:
    missing = sorted(set(SUITES) - set(DATA["runs"].get("cpu", {})))
    assert not missing, f"not measured: run python -m benchmarks.run {' '.join(missing)}"


@pytest.mark.parametrize(
    "device,suite",
    [(dev, name) for dev, suites in DATA["runs"].items() for name in suites],
)
def test_results_cover_the_current_suite(device: str, suite: str) -> None:
    """A case or implementation added, renamed or removed in a suite since its results
    were measured makes them stale: re-run ``python -m benchmarks.run <suite>``."""
    record = DATA["runs"][device][suite]
    assert suite in SUITES, f"results of a suite that no longer exists: {suite}"
    cases = SUITES[suite].make_cases(record["meta"]["quick"], device)
    harness = {(c.op, c.size, i.name) for c in cases for i in c.impls if not _peer_row(i.name)}
    measured = {
        (r["op"], r["size"], r["impl"]) for r in record["results"] if not _peer_row(r["impl"])
    }
    # rows the page lists as not measured yet on this device (benchmarks.pending.PENDING, with why)
    waiting = {row for row in harness - measured if pending(device, row[2], row[1])}
    held = [r for r in record["results"] if pending(device, r["impl"], r["size"])]
    assert not held, (
        "measured now: remove them from benchmarks.pending.PENDING; or rows of code "
        f"replaced since they ran: python -m benchmarks.run --drop-stale {device}",
        sorted({(r["op"], r["size"], r["impl"]) for r in held}),
    )
    harness -= waiting
    assert harness == measured, {
        "not measured": sorted(harness - measured),
        "no longer in the suite": sorted(measured - harness),
    }


def test_every_missed_target_gives_its_reason() -> None:
    """The issue asks for each target "met or not, with the reason": a miss without one
    fails here (the reason lives beside the target, in benchmarks/suites/*.py)."""
    silent = [
        f"{device} {name}: {t.name}"
        for device, suites in DATA["runs"].items()
        for name, record in suites.items()
        for t in report.suite_targets(name, record, device)
        if t.met is False and not t.reason
    ]
    assert not silent, "missed targets without a reason:\n" + "\n".join(silent)


def test_pending_suites_have_no_record() -> None:
    """A suite listed as not measured on a device (PENDING_SUITES) that has a record there
    now is measured: its entry goes."""
    for device, entries in PENDING_SUITES.items():
        for name, _ in entries:
            assert name in SUITES, f"PENDING_SUITES names an unknown suite: {name}"
            assert name not in DATA["runs"].get(device, {}), (
                f"measured now: remove {name!r} from benchmarks.pending.PENDING_SUITES[{device!r}]"
            )


def test_every_pending_entry_names_a_row() -> None:
    """An entry of PENDING that matches no row of any suite on its device is dead."""
    for device, entries in PENDING.items():
        rows = [
            (i.name, c.size)
            for suite in SUITES.values()
            for c in suite.make_cases(False, device)
            for i in c.impls
        ]
        for text, _ in entries:
            assert any(text in impl or text == size for impl, size in rows), text


def test_no_gpu_row_without_a_figure_or_its_reason() -> None:
    """Every row of every suite on a device with records is on the page: with the figures
    its record holds, or as not measured with why (pending), or as a peer's row."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for device, suites in DATA["runs"].items():
        for name, record in suites.items():
            held = {(r["op"], r["size"], stable(r["impl"])) for r in record["results"]}
            for c in SUITES[name].make_cases(record["meta"]["quick"], device):
                for i in c.impls:
                    if (c.op, c.size, stable(i.name)) in held or _peer_row(i.name):
                        continue
                    why = pending(device, i.name, c.size)
                    assert why, f"{device} {name}: {c.op} {c.size} {i.name}: no figure, no reason"
                    assert f"| {c.op} {c.size} | **{stable(i.name)}** | not measured" in page or (
                        f"| {c.op} {c.size} | {stable(i.name)} | not measured" in page
                    )
