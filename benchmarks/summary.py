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
                f"{_ms(_median(comp))}, {_median(comp) / floors[(loss.LOSS, size)]:.1f}x the "
                "copy-bandwidth floor."
            )
    return out


def render(data: dict[str, Any]) -> str:
    """The README block (markers included) for the results file."""
    runs: dict[str, dict[str, Any]] = data.get("runs", {})
    if not runs:
        body = ["No results yet: `python -m benchmarks.run` measures them."]
    else:
        metas = [rec["meta"] for suites in runs.values() for rec in suites.values()]
        dates = sorted({m["date"] for m in metas})
        machines = sorted({m["machine"] for m in metas})
        quick = any(m["quick"] for m in metas)
        body = [
            f"Measured by `python -m benchmarks.run` on {'; '.join(machines)}, "
            f"{dates[0]}{' to ' + dates[-1] if len(dates) > 1 else ''}"
            + (" (some suites in quick mode: smoke numbers, not results)" if quick else "")
            + " (medians; implementations interleaved). The issue's targets, each computed "
            "from those numbers:",
            "",
        ]
        if "loss" in runs.get("cpu", {}):
            body += _loss_lines(runs["cpu"]["loss"])
        for device, suites in runs.items():
            for name, record in suites.items():
                for t in report.suite_targets(name, record):
                    body.append(
                        f"- {device}, {t.name}: {t.measured} (target {t.limit}): {t.verdict}."
                    )
    return "\n".join([START, *body, END])


def readme_block(text: str) -> str:
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def main() -> int:
    data = report.load(JSON)
    text = README.read_text()
    README.write_text(text.replace(readme_block(text), render(data)))
    print(f"README.md performance block rewritten from {JSON.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
