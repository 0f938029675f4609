"""The demo's progress bar: tqdm when installed, else a carriage-return line on stderr."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Generated answers over every run of the command (runs may go on in parallel)."""

    def __init__(self, runs: int, budget: int, enabled: bool = True) -> None:
        self.enabled, self.runs, self.budget = enabled, runs, budget
        self.total = runs * budget
        self.done: dict[int, int] = {}
        self.shown = 0
        self.last_line = 0.0
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=self.total, unit="answer", unit_scale=True, smoothing=0.05)

    def __call__(self, run: int, samples: int) -> None:
        """Run ``run`` has generated ``samples`` answers so far."""
        if not self.enabled:
            return
        self.done[run] = max(samples, self.done.get(run, 0))  # updates may come late
        done = sum(self.done.values())
        finished = sum(s >= self.budget for s in self.done.values())
        status = f"{finished}/{self.runs} runs"
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
