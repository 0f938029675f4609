"""The summary on top of the benchmark page: our default path's speed-up over each peer."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.harness import Result


def _x(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        return "n/a"
    return f"{v:.2f}x" if v < 10 else f"{v:.1f}x" if v < 100 else f"{v:.0f}x"


#: Peer families of the summary table: (label, test on an implementation's name).
PEERS: tuple[tuple[str, Any], ...] = (
    ("naive PyTorch", lambda impl: impl.startswith("naive")),
    ("verl 0.9.1 (its functions, or op-for-op mirrors)", lambda impl: "verl" in impl),
    (
        "TRL (its functions, or op-for-op mirrors)",
        lambda impl: "TRL" in impl or impl.startswith("trl"),
    ),
    ("Liger-Kernel", lambda impl: "Liger" in impl),
    ("cut-cross-entropy", lambda impl: "cut-cross-entropy" in impl),
)


def glance(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The summary on top: per device and peer, our default path's time over the peer's,
    median and range over the cases where both ran (each case's first ``ours`` row)."""
    rows = []
    for device, suites in runs.items():
        for label, is_peer in PEERS:
            ratios, suite_names = [], []
            for name, record in suites.items():
                results = [r for r in [Result(**r) for r in record["results"]] if r.times]
                for op, size in dict.fromkeys((r.op, r.size) for r in results):
                    case = [r for r in results if (r.op, r.size) == (op, size)]
                    ours = next((r for r in case if r.role == "ours"), None)
                    theirs = [r for r in case if r.role == "ref" and is_peer(r.impl)]
                    if ours is None or not theirs:
                        continue
                    ratios += [t.median / ours.median for t in theirs]
                    suite_names.append(name)
            if ratios:
                ratios.sort()
                mid = (
                    ratios[len(ratios) // 2]
                    if len(ratios) % 2
                    else (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2
                )
                where = ", ".join(dict.fromkeys(suite_names))
                rows.append(
                    f"| {device} | {label} | {len(ratios)} ({where}) | {_x(mid)} | "
                    f"{_x(ratios[0])} to {_x(ratios[-1])} |"
                )
    if not rows:
        return []
    return [
        "",
        "## At a glance",
        "",
        "Speed-up of our default path over each peer: the peer's median time over ours, per "
        "case where both ran (above 1: faster than the peer; below 1: slower). The detail, "
        "case by case, is in the sections below.",
        "",
        "| device | against | comparisons (suites) | speed-up, median | range |",
        "|---|---|---|---|---|",
        *rows,
    ]
