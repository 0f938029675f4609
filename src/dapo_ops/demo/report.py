"""Progress bar, CSV and figure of the demo (tqdm and matplotlib are optional)."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo_ops.demo.task import Task
from dapo_ops.demo.trainer import CSV_COLUMNS, DemoConfig, StepLog


class Progress:
    """A tqdm bar when tqdm is installed, else a carriage-return text line on stderr."""

    def __init__(self, name: str, cfg: DemoConfig, enabled: bool = True) -> None:
        self.name, self.enabled = name, enabled
        self.by_samples = cfg.budget == "samples"
        self.total = cfg.sample_budget if self.by_samples else cfg.steps
        self.done = 0
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                unit = "answer" if self.by_samples else "step"
                self.bar = tqdm(total=self.total, desc=name, unit=unit, dynamic_ncols=True)

    def __call__(self, log: StepLog) -> None:
        if not self.enabled:
            return
        done = log.samples if self.by_samples else log.step
        status = f"acc {log.accuracy:.2f}, len {log.mean_response_length:.1f}"
        if self.bar is not None:
            self.bar.update(done - self.done)
            self.bar.set_postfix_str(status, refresh=False)
        else:
            sys.stderr.write(f"\r{self.name}: {done}/{self.total} {status}   ")
            sys.stderr.flush()
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


def write_csv(path: Path, logs: Sequence[StepLog]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for log in logs:
            row = dataclasses.astuple(log)
            writer.writerow(f"{v:.6g}" if isinstance(v, float) else v for v in row)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average: the raw curves of a tiny RL run are noisy."""
    out: list[float] = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot(path: Path, runs: dict[str, list[StepLog]], task: Task, by_samples: bool = False) -> bool:
    """The comparison figure; returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [
        ("accuracy", "accuracy (sampled answers)"),
        ("mean_response_length", "mean response length (tokens)"),
        ("entropy", "policy entropy (nats / token)"),
        ("clip_frac", "clip fraction: high (solid), low (dashed)"),
        ("kept_group_fraction", "groups with accuracy spread"),
        ("answers", "answers generated per step"),
    ]
    colors = {"dapo": "tab:red", "grpo": "tab:blue"}
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5), sharex=True)
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        for name, logs in runs.items():
            x = [log.samples / 1000 if by_samples else log.step for log in logs]
            color = colors.get(name)
            window = max(1, len(logs) // 25)
            if key == "clip_frac":
                high = smooth([log.clip_frac_high for log in logs], window)
                low = smooth([log.clip_frac_low for log in logs], window)
                ax.plot(x, high, color=color, label=name)
                ax.plot(x, low, color=color, ls="--")
                continue
            if key == "answers":
                cumulative = [0] + [log.samples for log in logs]
                y = [float(b - a) for a, b in itertools.pairwise(cumulative)]
                ax.set_yscale("log")
            else:
                y = [float(getattr(log, key)) for log in logs]
            ax.plot(x, y, color=color, alpha=0.25, lw=0.8)
            ax.plot(x, smooth(y, window), color=color, label=name)
        if key == "mean_response_length":
            expected = task.max_len - task.cache_len
            ax.axhline(expected, color="gray", ls=":", lw=1)
            ax.annotate(
                "overlong penalty starts",
                (0.02, expected),
                xycoords=("axes fraction", "data"),
                xytext=(0, 3),
                textcoords="offset points",
                fontsize=8,
                color="gray",
            )
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("generated answers (thousands)" if by_samples else "training step")
    axes[0, 0].legend()
    same = "number of generated answers" if by_samples else "batch shape and steps"
    fig.suptitle(f"DAPO vs GRPO on a digit-sum task (same seed, same {same})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def summarize(logs: Sequence[StepLog], k: int = 10) -> tuple[float, float]:
    """Mean accuracy over the first and over the last ``k`` steps."""
    first, last = logs[:k], logs[-k:]
    return sum(x.accuracy for x in first) / len(first), sum(x.accuracy for x in last) / len(last)
