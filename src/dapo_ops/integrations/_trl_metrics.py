"""TRL's generation metrics under dynamic sampling (:mod:`dapo_ops.integrations.trl_sampling`).

TRL appends its generation metrics once per call of ``_generate_and_score_completions``,
and its ``log`` averages the entries of a logging window without weights. With dynamic
sampling one generation is several such calls (rounds) of different sizes, and most of
their samples are not trained on. :class:`RoundLog` turns a generation's entries back
into one entry per metric:

- the reward figures (``reward``, ``reward_std``, ``frac_reward_zero_std``,
  ``rewards/<name>/mean``, ``rewards/<name>/std``) are those of the **kept batch**, the
  samples the step trains on, computed by TRL's formulas (NaN when no group was kept:
  TRL's ``log`` reports a window with no other value as ``None``);
- every other figure a round appended (``completions/*``, ``tools/*``, ``sampling/*``, a
  reward function's ``log_metric``) describes **every generated sample**: a mean weighted
  by each round's sample count (the ``*_terminated_length`` means by its terminated
  samples), a minimum (``.../min``, ``.../min_*``) or a maximum (``.../max``,
  ``.../max_*``) over the rounds. One round's entry is kept as TRL wrote it.

``num_tokens`` is TRL's running total (every generated token), assigned, not appended.
:func:`log_generation` adds the ``dynamic_sampling/*`` figures.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

from dapo_ops.integrations._trl_batch import SamplingReport, _advantages_and_std, _nanstd

logger = logging.getLogger("dapo_ops.integrations.trl_sampling")

_ASSIGNED = ("num_tokens",)
_TERMINATED = (
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


def kept_batch_metrics(trainer: Any, kept: Tensor) -> dict[str, float]:
    """TRL's reward figures of the kept rows ``kept [rows, funcs]`` (all processes, whole
    groups); NaN for every figure when ``rows == 0``."""
    names = list(trainer.reward_func_names)
    keys = ["reward", "reward_std", "frac_reward_zero_std"]
    keys += [f"rewards/{n}/{s}" for n in names for s in ("mean", "std")]
    if kept.shape[0] == 0:
        return dict.fromkeys(keys, math.nan)
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(kept[:, i]).item()
        out[f"rewards/{name}/std"] = _nanstd(kept[:, i]).item()
    weights = trainer.reward_weights.to(kept.device).unsqueeze(0)
    rewards = (kept * weights).nansum(dim=1)
    rewards[torch.isnan(kept).all(dim=1)] = torch.nan
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = _nanstd(rewards).item()
    _, std = _advantages_and_std(
        kept,
        trainer.reward_weights,
        trainer.num_generations,
        scale_rewards=trainer.scale_rewards,
        multi_objective_aggregation=trainer.multi_objective_aggregation,
    )
    out["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    return out


def _reduction(key: str) -> str:
    last = key.rsplit("/", 1)[-1]
    for kind in ("min", "max"):
        if last == kind or last.startswith(kind + "_"):
            return kind
    return "mean"


def combine_rounds(rounds: list[tuple[int, dict[str, list[float]]]]) -> dict[str, float]:
    """One value per metric from ``rounds``: ``(samples, {metric: entries})`` per round."""
    keys = list(dict.fromkeys(k for _, new in rounds for k in new))
    out: dict[str, float] = {}
    for key in keys:
        pairs = []
        for samples, new in rounds:
            weight = float(samples)
            if key in _TERMINATED:
                clipped = new.get("completions/clipped_ratio", [0.0])[-1]
                weight = float(round(samples * (1.0 - clipped)))
            pairs += [(weight, v) for v in new.get(key, [])]
        valid = [(w, v) for w, v in pairs if not math.isnan(v)]
        weighted = [(w, v) for w, v in valid if w > 0]
        if len(weighted) == 1 or (not weighted and valid):
            out[key] = (weighted or valid)[0][1]  # as TRL wrote it (its own edge value)
        elif not weighted:
            out[key] = math.nan
        elif _reduction(key) == "min":
            out[key] = min(v for _, v in weighted)
        elif _reduction(key) == "max":
            out[key] = max(v for _, v in weighted)
        else:
            out[key] = sum(w * v for w, v in weighted) / sum(w for w, _ in weighted)
    return out


class RoundLog:
    """Collects the entries each round adds to ``trainer._metrics["train"]``, then
    replaces them by one entry per metric (:func:`finish`)."""

    def __init__(self, trainer: Any) -> None:
        self._metrics: dict[str, list[float]] = trainer._metrics["train"]
        self._start = {k: len(v) for k, v in self._metrics.items()}
        self._before: dict[str, int] = {}
        self.rounds: list[tuple[int, dict[str, list[float]]]] = []

    def begin_round(self) -> None:
        self._before = {k: len(v) for k, v in self._metrics.items()}

    def end_round(self, samples: int) -> None:
        new = {
            k: list(v[self._before.get(k, 0) :])
            for k, v in self._metrics.items()
            if k not in _ASSIGNED and len(v) > self._before.get(k, 0)
        }
        self.rounds.append((samples, new))

    def finish(self, trainer: Any, kept: Tensor) -> None:
        """Drop the rounds' entries; append the combined figures and the kept batch's."""
        for key in {k for _, new in self.rounds for k in new}:
            del self._metrics[key][self._start.get(key, 0) :]
        figures = {**combine_rounds(self.rounds), **kept_batch_metrics(trainer, kept)}
        for key, value in figures.items():
            self._metrics[key].append(value)


def log_generation(trainer: Any, report: SamplingReport, *, generated_samples: int) -> None:
    """The ``dynamic_sampling/*`` figures of one generation, and the partial-batch warning."""
    kept_groups = sum(sum(v) for v in report.verdicts)
    groups = sum(len(v) for v in report.verdicts)
    kept_samples = report.kept_in_batch * trainer.num_generations
    metrics = trainer._metrics["train"]
    metrics["dynamic_sampling/kept_group_fraction"].append(kept_groups / groups)
    metrics["dynamic_sampling/generation_batches"].append(float(report.rounds))
    per_kept = generated_samples / kept_samples if kept_samples else math.nan
    metrics["dynamic_sampling/samples_per_kept_sample"].append(per_kept)
    metrics["dynamic_sampling/batch_fill"].append(report.kept_in_batch / report.target)
    partial = report.kept_in_batch < report.target
    metrics["dynamic_sampling/partial_batch"].append(float(partial))
    if partial and report.kept_in_batch and trainer.accelerator.is_main_process:
        logger.warning(
            "dynamic sampling: %d of %d groups kept after max_generation_batches=%d "
            "generation batches; training on the kept groups only (the rest of the batch "
            "is masked out)",
            report.kept_in_batch,
            report.target,
            report.rounds,
        )
