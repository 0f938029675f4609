"""README's performance figures, rendered from the committed benchmark results.

    python -m benchmarks.run              # measures; writes docs/benchmarks.{md,json}
    python -m benchmarks.summary          # rewrites README.md's block from docs/benchmarks.json

Every number in README.md's "Performance" section sits between the two markers below and
is produced here from ``docs/benchmarks.json``; ``tests/test_benchmarks_docs.py`` fails
when the block, or docs/benchmarks.md, differs from what the JSON renders, or when the
suites' cases and implementations no longer match the JSON (a changed suite must be
re-run).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "docs" / "benchmarks.json"
README = ROOT / "README.md"
START = "<!-- benchmarks:start (python -m benchmarks.summary writes this block) -->"
END = "<!-- benchmarks:end -->"


def _median(r: dict[str, Any]) -> float:
    return float(statistics.median(r["times"]))


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} µs"


def _loss_lines(record: dict[str, Any]) -> list[str]:
    """Headline figures of the loss suite: eager vs verl's step, compiled vs the floor."""
    from benchmarks.suites import loss

    res, bw = record["results"], record["meta"].get("bandwidth")
    floors = {(c["op"], c["size"]): c["floor_bytes"] / bw for c in record["cases"] if bw}
    out = []
    for size in ("512x8192", "64x4096"):
        get = {
            r["impl"]: r for r in res if r["op"] == loss.LOSS and r["size"] == size and r["times"]
        }
        eager, comp, verl = get.get(loss.EAGER), get.get(loss.COMPILED), get.get(loss.VERL_STEP)
        if eager and comp and verl and (loss.LOSS, size) in floors:
            out.append(
                f"- `token_level_loss` fwd+bwd at {size}: {_ms(_median(eager))} against "
                f"{_ms(_median(verl))} for the verl 0.9.1-style step "
                f"({_median(verl) / _median(eager):.1f}x); with `compiled=True` "
                f"{_ms(_median(comp))}, {_median(comp) / floors[(loss.LOSS, size)]:.3g}x the "
                "copy-bandwidth floor."
            )
    return out


def _linear_lines(record: dict[str, Any]) -> list[str]:
    """Headline figures of the linear suite: linear_policy_loss's time over naive's and
    Liger's, per case."""
    from benchmarks.suites import _linear_peers, linear

    parts = []
    for c in record["cases"]:
        get = {
            r["impl"]: r
            for r in record["results"]
            if (r["op"], r["size"]) == (c["op"], c["size"]) and r["times"]
        }
        ours, naive = get.get(linear.LINEAR), get.get(linear.NAIVE)
        liger = next(
            (r for k, r in get.items() if k.startswith(_linear_peers.LIGER) and "eager" in k), None
        )
        if ours and naive:
            part = f"{c['op'].split(', ')[-1]} {c['size']} {_median(ours) / _median(naive):.2f}x"
            if liger:
                part += f" ({_median(ours) / _median(liger):.2f}x Liger's)"
            parts.append(part)
    if not parts:
        return []
    return [
        "- `linear_policy_loss` fwd+bwd time over the naive path's (tokens x d x vocab): "
        + "; ".join(parts)
        + "."
    ]


def render(data: dict[str, Any]) -> str:
    """The README block (markers included) for the results file: per device, the machine,
    the headline figures and a count of the targets met (each target, with the reason for
    a miss, is on the benchmark page)."""
    runs: dict[str, dict[str, Any]] = data.get("runs", {})
    if not runs:
        return "\n".join([START, "No results yet: `python -m benchmarks.run` measures them.", END])
    body = [
        "Medians, implementations interleaved; every figure below is computed from "
        "`docs/benchmarks.json`, and each of the issue's targets is listed with its "
        "measured value (and the reason for a miss) on the [benchmark page](docs/benchmarks.md).",
    ]
    for device, suites in runs.items():
        metas = [rec["meta"] for rec in suites.values()]
        dates = sorted({m["date"] for m in metas})
        quick = any(m["quick"] for m in metas)
        body += [
            "",
            f"**{device}**: {'; '.join(sorted({m['machine'] for m in metas}))}; torch "
            f"{', '.join(sorted({m['torch'] for m in metas}))}; "
            f"{dates[0]}{' to ' + dates[-1] if len(dates) > 1 else ''}"
            + (" (some suites in quick mode: smoke numbers, not results)" if quick else "")
            + ".",
            "",
        ]
        if "loss" in suites:
            body += _loss_lines(suites["loss"])
        if "linear" in suites:
            body += _linear_lines(suites["linear"])
        targets = [
            t for name, rec in suites.items() for t in report.suite_targets(name, rec, device)
        ]
        limited = [t for t in targets if not t.recorded]
        met = sum(1 for t in limited if t.met)
        missed = [t.name for t in limited if t.met is False]
        waiting = sum(1 for t in limited if t.met is None)
        line = f"- Targets: {met} of {len(limited)} met"
        line += f" ({waiting} not measured yet)" if waiting else ""
        line += (
            f", {len(targets) - len(limited)} figures recorded"
            if len(targets) > len(limited)
            else ""
        )
        line += f"; not met: {'; '.join(missed)}." if missed else "."
        body.append(line)
    return "\n".join([START, *body, END])


def readme_block(text: str) -> str:
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def main() -> int:
    data = report.load(JSON)
    text = README.read_text()
    README.write_text(text.replace(readme_block(text), render(data)))
    print(f"README.md performance block rewritten from {JSON.relative_to(ROOT)}")
    from tools import pypi_readme  # the package index's copy of README.md follows it

    return pypi_readme.main([])


if __name__ == "__main__":
    sys.exit(main())
