"""The demo's progress bar: tqdm when installed, else a carriage-return line on stderr."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

#: Wall times measured on the idle 2-core development machine (docs/demo.md, 2026-11-26),
#: both at the default budget of 16,384 answers per run, in 2 worker processes: the
#: default comparison ``python -m dapo_ops.demo`` (2 runs: 1 round of 2 runs at once) in
#: 17 s and ``--ablation --seeds 5`` (50 runs: 25 rounds) in 166 s.
MEASURED_ROUNDS_SECONDS = ((1, 17.0), (25, 166.0))
MEASURED_BUDGET = 16_384
MEASURED_CORES = 2


def expected_seconds(runs: int, workers: int, budget: int) -> float:
    """The wall time a command should take on an idle 2-core machine: a fixed start-up
    (imports, the base model's fit) plus one round per ``min(workers, 2)`` runs, each
    round's time scaled by the budget; the straight line through the two measured runs."""
    (r1, t1), (r2, t2) = MEASURED_ROUNDS_SECONDS
    per_round = (t2 - t1) / (r2 - r1)
    fixed = t1 - r1 * per_round
    rounds = math.ceil(runs / max(1, min(workers, MEASURED_CORES)))
    return fixed + rounds * per_round * budget / MEASURED_BUDGET


def duration(seconds: float) -> str:
    """``17 s``, ``2 min 46 s``, ``1 h 5 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Progress:
    """Generated answers over every run of the command (runs may go on in parallel).

    The bar starts at the first reported step, not at the start of the command: before it
    the workers import torch and fit the base model (several seconds in which no answer is
    generated), and a rate measured from the start would count that set-up as sampling
    time, putting the first estimates of the time left off by up to two orders of
    magnitude. From the first step on, the rate is that of sampling alone.
    """

    def __init__(self, runs: int, budget: int, enabled: bool = True) -> None:
        self.enabled, self.runs, self.budget = enabled, runs, budget
        self.total = runs * budget
        self.done: dict[int, int] = {}
        self.shown = 0
        self.last_line = 0.0
        self.bar: Any = None
        self.tqdm: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.tqdm = tqdm

    def __call__(self, run: int, samples: int) -> None:
        """Run ``run`` has generated ``samples`` answers so far."""
        if not self.enabled:
            return
        self.done[run] = max(samples, self.done.get(run, 0))  # updates may come late
        done = sum(self.done.values())
        finished = sum(s >= self.budget for s in self.done.values())
        status = f"{finished}/{self.runs} runs"
        if self.tqdm is not None and self.bar is None:  # the first step: the clock starts
            self.bar = self.tqdm(
                total=self.total, initial=done, unit="answer", unit_scale=True, smoothing=0.05
            )
            self.shown = done
        if self.bar is not None:
            self.bar.update(done - self.shown)
            self.bar.set_postfix_str(status, refresh=False)
        elif time.monotonic() - self.last_line > 0.5 or done == self.total:
            sys.stderr.write(f"\r{done}/{self.total} answers, {status}   ")
            sys.stderr.flush()
            self.last_line = time.monotonic()
        self.shown = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")
