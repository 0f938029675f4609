"""Each technique's effect on the metric it targets, paired by seed, from ``runs.csv``.

Two rows of the ablation differ by one technique; with the same seed they start from the
same weights and draw from the same generator, so the per-seed difference is the
technique's effect on that seed. The table reports its mean ± std over seeds and on how
many seeds it goes the way the DAPO paper describes.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from dapo_ops.demo.ablation import DAPO_ROW, TECHNIQUES, ablation_rows, cumulative_rows
from dapo_ops.demo.report import METRICS, Table


@dataclass(frozen=True)
class Effect:
    """What the paper says a technique does: ``metric`` goes up (+1) or down (-1)."""

    technique: str
    metric: str
    direction: int
    claim: str


#: The metric each technique targets (the issue's list) and the paper's direction.
EFFECTS = (
    Effect("overlong_filter", "final_accuracy", +1, "accuracy up (no reward noise)"),
    Effect("clip_higher", "final_entropy", +1, "entropy kept up"),
    Effect("overlong_penalty", "final_length", -1, "shorter answers"),
    Effect("overlong_penalty", "final_accuracy", +1, "accuracy up"),
    Effect("token_level", "final_length", -1, "no length growth"),
    Effect("token_level", "final_entropy", -1, "no entropy growth"),
    Effect("dynamic_sampling", "samples_to_target", -1, "fewer answers to target"),
    Effect("dynamic_sampling", "steps_to_target", -1, "fewer steps to target"),
)


def comparisons(technique: str) -> dict[str, tuple[str, str]]:
    """``{"cumulative": (without, with), "leave-one-out": (without, with)}`` row names."""
    rows = cumulative_rows()
    cumulative = next(
        (a.name, b.name)
        for a, b in itertools.pairwise(rows)
        if b.techniques - a.techniques == {technique}
    )
    without = DAPO_ROW.techniques - {technique}
    name = next(r.name for r in ablation_rows() if r.techniques == without)
    return {"cumulative": cumulative, "leave-one-out": (name, DAPO_ROW.name)}


def paired(runs: Table, without: str, with_: str, key: str) -> list[float]:
    """Per-seed ``with - without`` of one metric (seeds where both have a value)."""
    a = {r["seed"]: r[key] for r in runs if r["row"] == without}
    b = {r["seed"]: r[key] for r in runs if r["row"] == with_}
    return [
        float(b[s]) - float(a[s]) for s in sorted(a, key=int) if a[s] != "" and b.get(s, "") != ""
    ]


def effect_cell(diffs: Sequence[float], effect: Effect, seeds: int) -> str:
    if not diffs:
        return "n/a"
    metric = next(m for m in METRICS if m.key == effect.metric)
    values = [d * metric.scale for d in diffs]
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    agree = sum(d * effect.direction > 0 for d in diffs)
    shown = f" of {len(diffs)}" if len(diffs) < seeds else ""
    return f"{mean:+.{metric.digits}f} ± {std:.{metric.digits}f} ({agree}/{seeds}{shown})"


def render_effects(runs: Table) -> str:
    """The paired table: technique, metric, the paper's direction, Δ in both comparisons."""
    seeds = len({r["seed"] for r in runs})
    lines = [
        "| technique | metric | paper | Δ cumulative (row - previous row) "
        "| Δ leave-one-out (DAPO - DAPO minus it) |",
        "|---|---|---|---|---|",
    ]
    for effect in EFFECTS:
        metric = next(m for m in METRICS if m.key == effect.metric)
        cells = []
        for without, with_ in comparisons(effect.technique).values():
            cells.append(effect_cell(paired(runs, without, with_, effect.metric), effect, seeds))
        label = TECHNIQUES[effect.technique]
        lines.append(f"| {label} | {metric.header} | {effect.claim} | {cells[0]} | {cells[1]} |")
    lines.append("")
    lines.append(
        f"Per-seed difference (with the technique minus without), mean ± std over {seeds} "
        f"seeds; *(k/{seeds})*: seeds on which it goes the paper's way (*of m*: only m "
        "seeds reached the target in both rows)."
    )
    return "\n".join(lines) + "\n"
