"""``python -m dapo_ops.demo``: train both methods, write the outputs, print a summary."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dapo_ops.demo.report import Progress, plot, summarize, write_csv
from dapo_ops.demo.trainer import GRPO_BASELINE, DemoConfig, StepLog, dapo_preset, train


def train_all(cfg: DemoConfig) -> dict[str, list[StepLog]]:
    """Train each method of ``cfg.methods`` in turn, from the same initial weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    try:
        runs: dict[str, list[StepLog]] = {}
        for name in cfg.methods:
            preset = cfg.dapo if name == "dapo" else GRPO_BASELINE
            progress = Progress(name, cfg, enabled=cfg.progress)
            try:
                runs[name] = train(cfg, preset, progress)
            finally:
                progress.close()
    finally:
        torch.set_num_threads(threads)
    return runs


def write_outputs(cfg: DemoConfig, runs: dict[str, list[StepLog]]) -> list[Path]:
    """``metrics.csv`` and, with matplotlib, ``dapo_vs_grpo.png``; returns what was written."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    written = [cfg.out / "metrics.csv"]
    write_csv(written[0], [log for logs in runs.values() for log in logs])
    png = cfg.out / "dapo_vs_grpo.png"
    if cfg.plot:
        if plot(png, runs, cfg.task, by_samples=cfg.budget == "samples"):
            written.append(png)
        else:
            print(
                "matplotlib is not installed: no figure (pip install 'dapo_ops[demo]')",
                file=sys.stderr,
            )
    return written


def run(cfg: DemoConfig) -> dict[str, list[StepLog]]:
    """Train, write the CSV (and PNG) into ``cfg.out``, return the logs by method name."""
    runs = train_all(cfg)
    write_outputs(cfg, runs)
    return runs


def parse_args(argv: Sequence[str] | None = None) -> DemoConfig:
    default = DemoConfig()
    p = argparse.ArgumentParser(
        prog="python -m dapo_ops.demo",
        description="Train a tiny policy with DAPO and a GRPO baseline on CPU; "
        "write metrics.csv and dapo_vs_grpo.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=default.steps, help="training steps per run")
    p.add_argument("--seed", type=int, default=default.seed, help="random seed")
    p.add_argument("--out", type=Path, default=default.out, help="output directory")
    p.add_argument("--group-size", type=int, default=default.group_size, help="answers per prompt")
    p.add_argument(
        "--method", choices=("both", "dapo", "grpo"), default="both", help="which runs to train"
    )
    p.add_argument(
        "--budget",
        choices=("steps", "samples"),
        default=default.budget,
        help="samples: equal generated answers (steps x prompts x group size, GRPO's count; "
        "DAPO then takes fewer steps); steps: equal training steps",
    )
    ablations = p.add_argument_group("DAPO ablations (each --no-* switches one DAPO component off)")
    ablations.add_argument("--no-clip-higher", action="store_true", help="eps_high = eps_low = 0.2")
    ablations.add_argument("--no-dynamic-sampling", action="store_true", help="train on all groups")
    ablations.add_argument(
        "--no-token-level", action="store_true", help="GRPO's seq_mean_token_mean aggregation"
    )
    ablations.add_argument("--no-overlong", action="store_true", help="no soft overlong penalty")
    ablations.add_argument(
        "--overlong-filter", action="store_true", help="also mask the loss of truncated answers"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    return dataclasses.replace(
        default,
        steps=a.steps,
        seed=a.seed,
        out=a.out,
        group_size=a.group_size,
        budget=a.budget,
        methods=("dapo", "grpo") if a.method == "both" else (a.method,),
        dapo=dapo_preset(
            clip_higher=not a.no_clip_higher,
            dynamic_sampling=not a.no_dynamic_sampling,
            token_level=not a.no_token_level,
            overlong=not a.no_overlong,
            overlong_filtering=a.overlong_filter,
        ),
        progress=not a.quiet,
        plot=not a.no_plot,
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    start = time.perf_counter()
    runs = train_all(cfg)
    written = write_outputs(cfg, runs)
    for name, logs in runs.items():
        first, last = summarize(logs)
        print(
            f"{name}: {len(logs)} steps, {logs[-1].samples} answers generated; accuracy "
            f"{first:.2f} -> {last:.2f}, length {logs[0].mean_response_length:.1f} -> "
            f"{logs[-1].mean_response_length:.1f}, entropy {logs[0].entropy:.2f} -> "
            f"{logs[-1].entropy:.2f}"
        )
    print(f"wrote {', '.join(map(str, written))} in {time.perf_counter() - start:.0f} s")
    return 0
