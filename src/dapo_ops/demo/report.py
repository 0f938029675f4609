"""The demo's results as files: per-run summaries, curves over seeds, the markdown table.

Everything published is rendered from the CSV files (never from the runs in memory), so
the committed numbers and what a reader re-renders from them cannot differ.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dapo_ops.demo.trainer import RunResult, StepLog

Table = list[dict[str, str]]


@dataclass(frozen=True)
class Metric:
    """One summary column: its CSV key, table header and display scale / precision."""

    key: str
    header: str
    scale: float = 1.0
    digits: int = 2


#: Per-run summary columns of ``runs.csv`` and the ablation table, in table order.
METRICS = (
    Metric("final_accuracy", "final accuracy"),
    Metric("steps_to_target", "steps to target", digits=0),
    Metric("samples_to_target", "answers to target (k)", scale=1e-3, digits=1),
    Metric("final_entropy", "final entropy (nats)"),
    Metric("entropy_mean", "mean entropy (nats)"),
    Metric("final_length", "final length (tokens)", digits=1),
    Metric("final_truncated", "final truncated %", scale=100, digits=1),
    Metric("clip_frac_low", "clip low %", scale=100, digits=1),
    Metric("clip_frac_high", "clip high %", scale=100, digits=1),
    Metric("kept_group_fraction", "kept groups %", scale=100, digits=0),
)
#: Per-step curves of ``curves.csv`` and the figure (mean and std over seeds).
CURVES = (
    "accuracy",
    "entropy",
    "response_length",
    "truncated_fraction",
    "clip_frac_low",
    "clip_frac_high",
    "kept_group_fraction",
)
STEP_COLUMNS = tuple(f.name for f in dataclasses.fields(StepLog))


def summarize(result: RunResult, target: float) -> dict[str, float | None]:
    """The summary metrics of one run (``None``: target accuracy never reached)."""
    logs, final = result.logs, result.final
    hit = next((log for log in logs if log.accuracy >= target), None)

    def mean(key: str) -> float:
        return statistics.fmean(getattr(log, key) for log in logs)

    return {
        "final_accuracy": final.accuracy,
        "steps_to_target": None if hit is None else float(hit.step),
        "samples_to_target": None if hit is None else float(hit.samples),
        "final_entropy": final.entropy,
        "entropy_mean": mean("entropy"),
        "final_length": final.response_length,
        "final_truncated": final.truncated_fraction,
        "clip_frac_low": mean("clip_frac_low"),
        "clip_frac_high": mean("clip_frac_high"),
        "kept_group_fraction": mean("kept_group_fraction"),
        "steps": float(len(logs)),
    }


def fmt(value: float | int | str | None) -> str:
    """CSV text: 6 significant digits for floats (the reproducibility precision)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_table(path: Path, columns: Sequence[str], rows: Iterable[Mapping[str, object]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(fmt(row[c]) for c in columns)  # type: ignore[arg-type]


def read_table(path: Path) -> Table:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def run_rows(
    rows: Sequence[tuple[str, str, int]], results: Sequence[RunResult], target: float, budget: int
) -> list[dict[str, object]]:
    """``runs.csv``: one line per ``(row name, label, seed)`` and its run."""
    return [
        {"row": name, "label": label, "seed": seed, "target": target, "budget": budget}
        | summarize(result, target)
        for (name, label, seed), result in zip(rows, results, strict=True)
    ]


RUN_COLUMNS = ("row", "label", "seed", "target", "budget", "steps", *(m.key for m in METRICS))


def curve_rows(
    names: Sequence[str], results: Sequence[RunResult], budget: int, points: int = 48
) -> list[dict[str, object]]:
    """``curves.csv``: each row's metrics on a grid of generated answers, over seeds.

    A run's value at ``x`` answers is its last step's log at or before ``x`` (runs with
    dynamic sampling take uneven steps); mean and sample std over the seeds.
    """
    out: list[dict[str, object]] = []
    for name in dict.fromkeys(names):
        runs = [r.logs for n, r in zip(names, results, strict=True) if n == name]
        for k in range(1, points + 1):
            x = budget * k // points
            row: dict[str, object] = {"row": name, "samples": x}
            for key in CURVES:
                values = [_at(logs, x, key) for logs in runs]
                present = [v for v in values if v is not None]
                row[f"{key}_mean"] = statistics.fmean(present) if present else None
                row[f"{key}_std"] = _std(present) if present else None
            out.append(row)
    return out


CURVE_COLUMNS = ("row", "samples", *(f"{k}_{s}" for k in CURVES for s in ("mean", "std")))


def _at(logs: Sequence[StepLog], samples: int, key: str) -> float | None:
    before = [log for log in logs if log.samples <= samples]
    return float(getattr(before[-1], key)) if before else None


def _std(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


# ----------------------------------------------------------------------------- rendering
def cell(values: Sequence[str], metric: Metric) -> str:
    """``mean ± std`` over seeds of one CSV column (the value alone for one seed);
    ``(k/n)`` when only k of n seeds have one (e.g. reached the target)."""
    present = [float(v) * metric.scale for v in values if v != ""]
    if not present:
        return "never"
    mean = statistics.fmean(present)
    text = f"{mean:.{metric.digits}f}"
    if len(values) > 1:
        text += f" ± {_std(present):.{metric.digits}f}"
    if len(present) < len(values):
        text += f" ({len(present)}/{len(values)})"
    return text


def render_table(
    runs: Table,
    rows: Sequence[tuple[str, str]],
    target: float,
    metrics: Sequence[Metric] = METRICS,
) -> str:
    """The markdown table: one line per ``(label, csv row name)``, mean ± std over seeds.

    A label whose name starts with ``"--"`` is a section line (e.g. the leave-one-out rows).
    """
    seeds = sorted({int(r["seed"]) for r in runs})
    headers = [m.header.replace("target", f"{target:g}") for m in metrics]
    lines = [
        "| " + " | ".join(["row", *headers]) + " |",
        "|---" * (len(metrics) + 1) + "|",
    ]
    for label, name in rows:
        if name.startswith("--"):
            lines.append(f"| *{label}* |" + " |" * len(metrics))
            continue
        mine = [r for r in runs if r["row"] == name]
        cells = [cell([r[m.key] for r in mine], m) for m in metrics]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    n = len(seeds)
    body = "\n".join(lines)
    lines.append("")
    if n == 1:
        never = "; *never*: the target accuracy was not reached" if "| never" in body else ""
        lines.append(f"Seed {seeds[0]}{never}.")
    else:
        partial = f" ({seeds[0]}-{seeds[-1]})"
        if f"/{n})" in body:
            partial += (
                f"; *(k/{n})*: only k seeds reached the target accuracy (mean and std over those)"
            )
        lines.append(f"Mean ± std over {n} seeds{partial}.")
    return "\n".join(lines) + "\n"
