"""README's performance figures, rendered from the committed benchmark results.

    python -m benchmarks.run              # measures; writes docs/benchmarks.{md,json,png}
    python -m benchmarks.summary          # rewrites README.md's block from docs/benchmarks.json

Every number in README.md's "Performance" section sits between the two markers below and
is produced here from ``docs/benchmarks.json`` (the raw results ``benchmarks.run``
wrote); ``tests/test_benchmarks_docs.py`` fails when the block, or docs/benchmarks.md,
differs from what this JSON renders, or when the harness's cases and implementations
no longer match the JSON (a changed harness must be re-run).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JSON = ROOT / "docs" / "benchmarks.json"
README = ROOT / "README.md"
START = "<!-- benchmarks:start (python -m benchmarks.summary writes this block) -->"
END = "<!-- benchmarks:end -->"

LOSS = "token_level_loss fwd+bwd"
BACK_TO_BACK = "token_level_loss fwd+bwd, back-to-back"
EAGER = "dapo_ops token_level_loss (default, eager)"
COMPILED = "dapo_ops token_level_loss(compiled=True)"
VERL = "verl-style step"


def _median(r: dict[str, Any]) -> float:
    return float(statistics.median(r["times"]))


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} µs"


def _find(results: list[dict[str, Any]], op: str, size: str, prefix: str) -> dict[str, Any]:
    for r in results:
        if r["op"] == op and r["size"] == size and r["impl"].startswith(prefix) and r["times"]:
            return r
    raise KeyError(f"no result for {op!r} {size!r} {prefix!r} in {JSON.name}")


def floors(data: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Seconds the copy-bandwidth floor allows per (op, size), from the harness's cases."""
    from benchmarks.run import make_cases

    args = data["args"]
    cases = make_cases(args["quick"], args["device"])
    return {(c.op, c.size): c.floor_bytes / data["bandwidth"] for c in cases}


def render(data: dict[str, Any]) -> str:
    """The README block (markers included) for one benchmark run's JSON."""
    res, args = data["results"], data["args"]
    floor = floors(data)
    lines = [
        START,
        f"Measured by `python -m benchmarks.run` on {args['machine']}, {args['date']} "
        "(fp32, fwd+bwd, medians; implementations interleaved, so each call starts with "
        "cold caches):",
        "",
    ]
    for size in ("512x8192", "64x4096"):
        eager, comp = _find(res, LOSS, size, EAGER), _find(res, LOSS, size, COMPILED)
        verl = _find(res, LOSS, size, VERL)
        lines.append(
            f"- `token_level_loss` at {size}: {_ms(_median(eager))} against "
            f"{_ms(_median(verl))} for the verl 0.9.1-style step "
            f"({_median(verl) / _median(eager):.1f}x); with `compiled=True` "
            f"{_ms(_median(comp))}, {_median(comp) / floor[(LOSS, size)]:.1f}x the "
            "copy-bandwidth floor."
        )
    warm_e, warm_v = (
        _find(res, BACK_TO_BACK, "64x4096", EAGER),
        _find(res, BACK_TO_BACK, "64x4096", VERL),
    )
    warm_c = _find(res, BACK_TO_BACK, "64x4096", COMPILED)
    lines.append(
        f"- Back-to-back (warm caches) at 64x4096: {_median(warm_v) / _median(warm_e):.1f}x "
        f"the verl-style step eager, {_median(warm_c) / floor[(BACK_TO_BACK, '64x4096')]:.1f}x "
        "the floor compiled."
    )
    ours = [
        r["mem_extra"] / r["input_bytes"]
        for r in res
        if r["op"] == LOSS
        and r["impl"] in (EAGER, COMPILED)
        and r["mem_extra"]
        and r["input_bytes"]
    ]
    theirs = [
        r["mem_extra"] / r["input_bytes"]
        for r in res
        if r["op"] == LOSS and r["impl"].startswith(VERL) and r["mem_extra"] and r["input_bytes"]
    ]
    lines.append(
        f"- Extra peak memory of `token_level_loss`: {min(ours):.2f}-{max(ours):.2f}x its "
        f"inputs; the verl-style step's: {min(theirs):.1f}-{max(theirs):.1f}x."
    )
    ragged = _find(res, "group_advantages ragged", "16k samples / 1k groups", "dapo_ops")
    loop = _find(res, "group_advantages ragged", "16k samples / 1k groups", "verl-style")
    lines.append(
        f"- Ragged `group_advantages` at 16k samples: {_median(loop) / _median(ragged):.0f}x "
        "faster than the per-group Python loop."
    )
    lines.append(END)
    return "\n".join(lines)


def readme_block(text: str) -> str:
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]


def main() -> int:
    data = json.loads(JSON.read_text())
    text = README.read_text()
    README.write_text(text.replace(readme_block(text), render(data)))
    print(f"README.md performance block rewritten from {JSON.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
