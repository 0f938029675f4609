"""``python -m dapo_ops.demo``: train, write the CSV files, render the table and figure."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dapo_ops.demo import docs
from dapo_ops.demo.ablation import (
    DAPO_ROW,
    GRPO_ROW,
    TECHNIQUES,
    Job,
    Row,
    ablation_rows,
    run_jobs,
)
from dapo_ops.demo.expected import SEED0_FINAL_ACCURACY
from dapo_ops.demo.progress import Progress, duration, expected_seconds
from dapo_ops.demo.report import (
    CURVE_COLUMNS,
    RUN_COLUMNS,
    STEP_COLUMNS,
    curve_rows,
    run_rows,
    write_table,
)
from dapo_ops.demo.trainer import DemoConfig, RunResult


@dataclass(frozen=True)
class Command:
    """What one invocation does (the CLI's options, as a value)."""

    rows: tuple[Row, ...] = (DAPO_ROW, GRPO_ROW)
    seeds: tuple[int, ...] = (0,)
    config: DemoConfig = dataclasses.field(default_factory=DemoConfig)
    target: float = 0.9  # accuracy for "steps / answers to target"
    workers: int = 2
    out: Path = Path("demo_out")
    plot: bool = True
    progress: bool = True
    update_docs: bool = False  # rewrite README.md and docs/demo.md from out/runs.csv
    render_only: bool = False  # train nothing: render from the CSV files in out

    @property
    def jobs(self) -> list[Job]:
        return [
            Job(row, dataclasses.replace(self.config, seed=seed))
            for row in self.rows
            for seed in self.seeds
        ]


def train_all(cmd: Command) -> list[RunResult]:
    """Every (row, seed) run, in ``cmd.workers`` processes; results in job order."""
    jobs = cmd.jobs
    progress = Progress(len(jobs), cmd.config.sample_budget, enabled=cmd.progress)
    try:
        return run_jobs(jobs, cmd.workers, progress)
    finally:
        progress.close()


def write_outputs(cmd: Command, results: Sequence[RunResult]) -> list[Path]:
    """The CSV files, then the table and figure rendered from them; returns the paths."""
    jobs = cmd.jobs
    names = [job.row.name for job in jobs]
    cmd.out.mkdir(parents=True, exist_ok=True)
    runs, curves, steps = (cmd.out / n for n in ("runs.csv", "curves.csv", "steps.csv"))
    keys = [(job.row.name, job.row.label, job.cfg.seed) for job in jobs]
    write_table(runs, RUN_COLUMNS, run_rows(keys, results, cmd.target, cmd.config.sample_budget))
    write_table(curves, CURVE_COLUMNS, curve_rows(names, results, cmd.config.sample_budget))
    logs = [dataclasses.asdict(log) for result in results for log in result.logs]
    write_table(steps, STEP_COLUMNS, logs)
    return [runs, curves, steps, *docs.render_outputs(cmd.out, cmd.plot)]


def parse_args(argv: Sequence[str] | None = None) -> Command:
    default, config = Command(), DemoConfig()
    p = argparse.ArgumentParser(
        prog="python -m dapo_ops.demo",
        description="Train a tiny policy with DAPO and a GRPO baseline on CPU (or every row "
        "of the DAPO paper's ablation table with --ablation); write runs.csv, curves.csv, "
        "steps.csv, table.md and curves.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--ablation",
        action="store_true",
        help="every row of the ablation table (GRPO + each technique in turn, DAPO minus "
        "each technique) instead of DAPO vs GRPO",
    )
    p.add_argument("--seeds", type=int, default=len(default.seeds), help="seeds per row")
    p.add_argument("--seed", type=int, default=default.seeds[0], help="first seed")
    p.add_argument(
        "--budget", type=int, default=config.sample_budget, help="generated answers per run"
    )
    p.add_argument("--target", type=float, default=default.target, help="target accuracy")
    p.add_argument(
        "--workers",
        type=int,
        default=min(default.workers, os.cpu_count() or 1),
        help="worker processes (results do not depend on it)",
    )
    p.add_argument("--out", type=Path, default=default.out, help="output directory")
    techniques = p.add_argument_group(
        "DAPO's techniques (each --no-* switches one off in the DAPO run, not with --ablation)"
    )
    for key, label in TECHNIQUES.items():
        flag = "--no-" + key.replace("_", "-")
        techniques.add_argument(flag, action="store_true", help=f"DAPO without {label}")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="also rewrite the demo blocks of README.md and docs/demo.md from OUT/runs.csv",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="train nothing: re-render table.md, curves.png (and with --update-docs the "
        "docs) from the CSV files in OUT",
    )
    a = p.parse_args(argv)
    off = {key for key in TECHNIQUES if getattr(a, "no_" + key)}
    if a.ablation and off:
        p.error("--no-* flags choose the DAPO run of the comparison; --ablation runs them all")
    dapo = DAPO_ROW
    if off:
        name = "dapo_no_" + "_no_".join(sorted(off))
        label = "DAPO - " + ", ".join(TECHNIQUES[k] for k in sorted(off))
        dapo = Row(name, label, DAPO_ROW.techniques - off)
    return Command(
        rows=tuple(ablation_rows()) if a.ablation else (dapo, GRPO_ROW),
        seeds=tuple(range(a.seed, a.seed + a.seeds)),
        config=dataclasses.replace(config, sample_budget=a.budget),
        target=a.target,
        workers=a.workers,
        out=a.out,
        plot=not a.no_plot,
        progress=not a.quiet,
        update_docs=a.update_docs,
        render_only=a.render_only,
    )


def announce(cmd: Command) -> str:
    """What the command is about to do, printed before the first step (the bar sits at 0 %
    while the worker processes start: each imports torch and builds the base model)."""
    rows = ", ".join(dict.fromkeys(row.label for row in cmd.rows))
    seeds = (
        f"seed {cmd.seeds[0]}" if len(cmd.seeds) == 1 else f"seeds {cmd.seeds[0]}-{cmd.seeds[-1]}"
    )
    workers = min(cmd.workers, len(cmd.jobs))
    seconds = expected_seconds(len(cmd.jobs), workers, cmd.config.sample_budget)
    return (
        f"Training {len(cmd.jobs)} run(s) ({rows}; {seeds}), {cmd.config.sample_budget:,} "
        f"generated answers each, in {workers} worker process(es).\n"
        f"Expected time: about {duration(seconds)} on an idle 2-core machine (up to three "
        "times that under load; docs/demo.md gives the measured runs).\n"
        "Before the first step each worker imports torch and fits the base model by supervised "
        "learning: the progress bar appears after a few seconds, with the first step."
    )


def expectation(cmd: Command) -> str | None:
    """For the default comparison: the published seed-0 results to compare with, else None."""
    default = Command()
    if (cmd.rows, cmd.seeds, cmd.config) != (default.rows, default.seeds, default.config):
        return None
    acc = SEED0_FINAL_ACCURACY
    return (
        f"Expected: DAPO above GRPO. The published run of this command gave final accuracy "
        f"{acc['dapo']:.2f} (DAPO) and {acc['grpo']:.2f} (GRPO); the same bits here unless "
        "this machine's torch kernels round differently. One seed; the mean over 5 seeds: "
        "python -m dapo_ops.demo --ablation --seeds 5 (50 runs)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    cmd = parse_args(argv)
    start = time.perf_counter()
    if cmd.render_only:
        written = docs.render_outputs(cmd.out, cmd.plot)
    else:
        print(announce(cmd), flush=True)
        written = write_outputs(cmd, train_all(cmd))
    if cmd.update_docs:
        written += docs.update_docs(cmd.out)
    print(docs.summary(cmd.out))
    note = None if cmd.render_only else expectation(cmd)
    if note:
        print(note)
    print(f"wrote {', '.join(map(str, written))} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
