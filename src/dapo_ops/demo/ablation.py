"""The rows of the ablation table and the runs behind them (in worker processes).

A row is a set of DAPO techniques on top of the GRPO baseline; each technique is one
field of the preset (:func:`dapo_preset`), so a row differs from its neighbour by exactly
one thing. The rows follow the DAPO paper's Table 1: cumulative from GRPO to DAPO, then
DAPO minus each technique.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from dapo_ops import ObjectivePreset
from dapo_ops.demo.trainer import DemoConfig, RunResult, StepLog, train
from dapo_ops.objectives import ClipHigher
from dapo_ops.presets import DAPO, GRPO

#: The techniques in the order the paper's table adds them, with their row labels.
TECHNIQUES: dict[str, str] = {
    "overlong_filter": "overlong filtering",
    "clip_higher": "Clip-Higher",
    "overlong_penalty": "soft overlong punishment",
    "token_level": "token-level loss",
    "dynamic_sampling": "dynamic sampling",
}


def dapo_preset(
    *,
    overlong_filter: bool = True,
    clip_higher: bool = True,
    overlong_penalty: bool = True,
    token_level: bool = True,
    dynamic_sampling: bool = True,
) -> ObjectivePreset:
    """DAPO as in the last row of the paper's table, any technique switched back to GRPO.

    :data:`dapo_ops.presets.DAPO` (Clip-Higher, soft overlong punishment, token-level
    loss, dynamic sampling) plus overlong filtering, which the paper's table adds first
    and the preset leaves off (as verl's recipe does). Each switch sets one field to
    :data:`dapo_ops.presets.GRPO`'s value; with every switch off it is GRPO without its KL
    term (DAPO has none, so no reference model).
    """
    switches = (overlong_filter, clip_higher, overlong_penalty, token_level, dynamic_sampling)
    clip = DAPO.objective
    assert isinstance(clip, ClipHigher)
    return DAPO.replace(
        name="dapo" if all(switches) else "grpo" if not any(switches) else "dapo_ablated",
        objective=clip if clip_higher else clip.replace(eps_high=clip.eps_low),
        mode=DAPO.mode if token_level else GRPO.mode,
        dynamic_sampling=dynamic_sampling,
        overlong_penalty=overlong_penalty,
        overlong_filter=overlong_filter,
    )


@dataclass(frozen=True)
class Row:
    """One row of the table: a name (CSV key), a label and the techniques it uses."""

    name: str
    label: str
    techniques: frozenset[str]

    @property
    def preset(self) -> ObjectivePreset:
        return dapo_preset(**{t: t in self.techniques for t in TECHNIQUES})


GRPO_ROW = Row("grpo", "GRPO", frozenset())
DAPO_ROW = Row("dapo", "DAPO (all five)", frozenset(TECHNIQUES))


def cumulative_rows() -> list[Row]:
    """GRPO, then one technique added per row in the paper's order, ending at DAPO."""
    rows, used = [GRPO_ROW], frozenset[str]()
    for key, label in list(TECHNIQUES.items())[:-1]:
        used = used | {key}
        rows.append(Row(f"plus_{key}", f"+ {label}", used))
    return [
        *rows,
        dataclasses.replace(DAPO_ROW, label=f"+ {TECHNIQUES['dynamic_sampling']} = DAPO"),
    ]


def leave_one_out_rows() -> list[Row]:
    """DAPO minus each technique (minus dynamic sampling is also a cumulative row)."""
    return [
        Row(f"no_{key}", f"DAPO - {label}", DAPO_ROW.techniques - {key})
        for key, label in TECHNIQUES.items()
    ]


def ablation_rows() -> list[Row]:
    """Every distinct row of the table, cumulative first (runs are keyed by techniques)."""
    rows: list[Row] = []
    for row in cumulative_rows() + leave_one_out_rows():
        if all(r.techniques != row.techniques for r in rows):
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------ running
@dataclass(frozen=True)
class Job:
    row: Row
    cfg: DemoConfig


def run_job(job: Job, on_step: Callable[[StepLog], None] | None = None) -> RunResult:
    """One run, single-threaded (bitwise reproducible whatever ran before in the process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(job.cfg, job.row.preset, job.row.name, on_step)
    finally:
        torch.set_num_threads(threads)


def _forward(report: Callable[[int, int], None], index: int, log: StepLog) -> None:
    report(index, log.samples)


def _ignore(index: int, samples: int) -> None:
    pass


#: In a worker process: the queue its progress goes to (set once, when it starts).
_progress_queue: Any = None


def _start_worker(progress: Any) -> None:
    global _progress_queue
    _progress_queue = progress


def _worker(job: Job, index: int) -> RunResult:
    return run_job(job, functools.partial(_forward, _put, index))


def _put(index: int, samples: int) -> None:
    _progress_queue.put((index, samples))


def run_jobs(
    jobs: Sequence[Job],
    workers: int,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[RunResult]:
    """Every job, in ``workers`` processes (in this one for ``workers=1``), in job order.

    Each run is seeded and single-threaded, so the results do not depend on ``workers``.
    ``on_progress(job_index, answers_so_far)`` is called after each training step, and
    with the job's whole budget when it is done.
    """
    report = on_progress or _ignore
    if workers <= 1 or len(jobs) <= 1:
        results = []
        for i, job in enumerate(jobs):
            results.append(run_job(job, functools.partial(_forward, report, i)))
            report(i, job.cfg.sample_budget)
        return results
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited state
    updates = ctx.Queue()
    with ProcessPoolExecutor(
        min(workers, len(jobs)), mp_context=ctx, initializer=_start_worker, initargs=(updates,)
    ) as pool:
        futures = [pool.submit(_worker, job, i) for i, job in enumerate(jobs)]
        pending = set(range(len(jobs)))
        while pending:
            with contextlib.suppress(queue.Empty):
                report(*updates.get(timeout=0.2))
            for i in [i for i in pending if futures[i].done()]:
                pending.discard(i)
                report(i, jobs[i].cfg.sample_budget)
        return [f.result() for f in futures]
