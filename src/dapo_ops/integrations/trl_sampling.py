"""Dynamic sampling (DAPO change 2) inside ``trl.GRPOTrainer``: ``DapoGRPOTrainer(dynamic_sampling=True)``.

One training generation of :class:`~dapo_ops.integrations.trl.DapoGRPOTrainer` with
``dynamic_sampling=True`` runs these steps (evaluation is never filtered):

1. TRL generates and scores its generation batch as usual (``B`` rows on each of ``P``
   processes, ``target = B * P / G`` groups of ``G = num_generations`` samples).
2. Every process gathers the batch (rewards, ids, masks, log-probs), so each holds the
   same global batch; :func:`dapo_ops.dynamic_sample_mask` decides on the **raw** column
   of ``sampling_metric`` (one reward function's output, not the weighted sum, so the
   overlong penalty cannot keep an all-wrong group alive); the main process's verdict is
   broadcast, so every process keeps the same groups (gather, then decide once).
3. While fewer than ``target`` groups are kept and fewer than ``max_generation_batches``
   batches were generated, another round of :func:`dapo_ops.prompts_to_generate` prompts
   (at most ``target``; rounded up to a multiple of ``P / gcd(P, G)`` so every process
   gets whole rows) is drawn from ``train_dataset`` by an own sampler (its own
   ``torch.Generator`` seeded with ``args.seed + 1``, so the trainer's epoch order is
   unchanged; every process draws the same prompts) and generated and scored by TRL.
4. The batch is the first ``target`` kept groups in generation order (surplus discarded,
   as verl does). Advantages are recomputed by TRL's own formula (:func:`trl_advantages`:
   ``scale_rewards``, ``multi_objective_aggregation``) on the kept groups only;
   ``num_items_in_batch`` counts the kept tokens.
5. **At the cap** (``max_generation_batches`` batches and still fewer than ``target``
   groups), the step trains on what was kept: the batch keeps TRL's shape, and the
   missing groups are filled with dropped groups whose ``completion_mask`` is all zero
   and advantage 0, so they add no token, no count and no gradient (with the
   ``grpo``/``dr_grpo``/``sapo``/``luspo`` loss types, which divide by rows, they still
   count as rows). ``dynamic_sampling/partial_batch`` is logged as 1 and a warning is
   logged.
6. **No group kept** (``empty_batch``): the batch is only such rows, never an empty
   batch. ``"skip"`` (the default): every optimiser step with no loss token on any
   process is not taken: weights, optimiser state (Adam's moments and step count), the
   learning-rate schedule and TRL's adaptive entropy controller are left as they were,
   the step still counts towards ``max_steps``, and a warning names the kept fraction
   (:mod:`~dapo_ops.integrations._trl_skip`). ``"raise"``: ``ValueError`` at the
   generation, as verl's recipe raises at its cap.

Metrics (through TRL's logger, once per generation): ``dynamic_sampling/kept_group_fraction``
(kept groups / generated groups, over every round), ``dynamic_sampling/generation_batches``
(rounds used), ``dynamic_sampling/samples_per_kept_sample`` (generated samples / kept
samples trained on; NaN when none was kept, which TRL's ``log`` drops: ``None`` in the
logs when no other value is in the logging window), ``dynamic_sampling/batch_fill``
(kept groups in the batch / ``target``), ``dynamic_sampling/partial_batch``; once per
optimiser step with ``"skip"``, ``dynamic_sampling/skipped_step`` (1 when skipped).
TRL's reward figures (``reward``, ``reward_std``, ``frac_reward_zero_std``,
``rewards/<name>/mean``, ``rewards/<name>/std``) are those of the kept batch; its other
generation figures (``completions/*``, ...) cover every generated sample, each round
weighted by its sample count (:mod:`~dapo_ops.integrations._trl_metrics`). The
completions table (``log_completions``) lists every generated sample with the advantage
TRL gave it in its round.

``sampling_metric`` naming a shaping reward (an :class:`~dapo_ops.integrations.trl.OverlongReward`
or a reward function named like ``*overlong*``) warns (``UserWarning``): its spread comes
from the lengths and keeps all-right and all-wrong groups.

Limits: a map-style ``train_dataset`` (an ``IterableDataset`` is refused); text inputs
(multimodal keys raise); the metric must be defined for every completion (a reward
function returning ``None`` for the metric raises). Rows moved into a batch whose prompt
padding is wider than their round's keep the old / reference log-probs computed in their
round: for rotary-position models (Llama, Qwen, ...) the padding changes these only by
rounding. TRL's vLLM paths run the same code but are not tested here. Every process holds
the gathered rounds of one generation in memory. The extra-prompt sampler is not saved in
checkpoints: a resumed run draws its extra prompts afresh.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError, check_bool, check_int
from dapo_ops.integrations._trl_batch import (
    SamplingReport,
    assemble,
    gather_round,
    token_count,
    trl_advantages,
)
from dapo_ops.integrations._trl_metrics import RoundLog, log_generation
from dapo_ops.integrations._trl_rewards import OverlongReward
from dapo_ops.integrations._trl_skip import EmptyStepGuard
from dapo_ops.rewards.sampling import dynamic_sample_mask, prompts_to_generate

logger = logging.getLogger(__name__)  # its warnings: _trl_metrics, _trl_skip

#: default ``max_generation_batches`` (the generation batch included), as DAPO's verl scripts
DEFAULT_MAX_GENERATION_BATCHES = 10
#: the values of ``empty_batch``: what a generation that keeps no group does
EMPTY_BATCH_CHOICES = ("skip", "raise")


@dataclass
class DynamicSampling:
    """The validated options of ``DapoGRPOTrainer(dynamic_sampling=True, ...)``; see the module."""

    max_generation_batches: int
    sampling_metric: str
    empty_batch: str = "skip"
    column: int = -1
    guard: EmptyStepGuard = field(default_factory=EmptyStepGuard)
    _order: list[int] = field(default_factory=list)
    _generator: torch.Generator | None = None
    _dataset: Any = None

    @staticmethod
    def from_options(
        dynamic_sampling: object,
        max_generation_batches: object,
        sampling_metric: object,
        empty_batch: object = None,
    ) -> DynamicSampling | None:
        """Validate the constructor options; ``None`` when dynamic sampling is off.

        An option given with ``dynamic_sampling=False`` raises: it would be ignored.
        """
        if not check_bool("dynamic_sampling", dynamic_sampling):
            for name, value in [
                ("max_generation_batches", max_generation_batches),
                ("sampling_metric", sampling_metric),
                ("empty_batch", empty_batch),
            ]:
                if value is not None:
                    raise InputError(
                        f"{name}={value!r} is given but dynamic_sampling=False would ignore "
                        "it; pass dynamic_sampling=True"
                    )
            return None
        cap = DEFAULT_MAX_GENERATION_BATCHES
        if max_generation_batches is not None:
            cap = check_int("max_generation_batches", max_generation_batches, low=1)
        metric = "accuracy" if sampling_metric is None else sampling_metric
        if not isinstance(metric, str):
            raise InputError(
                f"sampling_metric must be a reward function's name (str), got {metric!r}"
            )
        empty = "skip" if empty_batch is None else empty_batch
        if not isinstance(empty, str) or empty not in EMPTY_BATCH_CHOICES:
            raise InputError(f"empty_batch must be 'skip' or 'raise', got {empty!r}")
        return DynamicSampling(
            max_generation_batches=cap, sampling_metric=metric, empty_batch=empty
        )

    def bind(self, trainer: Any) -> DynamicSampling:
        """Resolve ``sampling_metric`` to a reward column and check the dataset; once, at init.

        ``"accuracy"`` names the reward function called ``accuracy``, else TRL's
        ``accuracy_reward``; any other value must be one of ``trainer.reward_func_names``.
        """
        names = list(trainer.reward_func_names)
        wanted = [self.sampling_metric]
        if self.sampling_metric == "accuracy":
            wanted.append("accuracy_reward")
        found = [n for n in wanted if n in names]
        if not found:
            raise InputError(
                f"sampling_metric={self.sampling_metric!r} names no reward function; the "
                f"reward functions are {names} (\"accuracy\" also finds 'accuracy_reward')"
            )
        self.column = names.index(found[0])
        if _is_shaped(trainer.reward_funcs[self.column], found[0]):
            warnings.warn(
                f"sampling_metric={self.sampling_metric!r} names the overlong reward, a "
                "shaping term: it varies with the completion lengths, so it keeps groups "
                "whose answers are all right or all wrong; name the task's accuracy reward",
                UserWarning,
                stacklevel=4,
            )
        dataset = trainer.train_dataset
        if (
            dataset is None
            or not hasattr(dataset, "__len__")
            or isinstance(dataset, torch.utils.data.IterableDataset)
        ):
            raise InputError(
                "dynamic_sampling=True draws extra prompts by index: train_dataset must be a "
                f"map-style dataset, got {type(dataset).__name__}"
            )
        if {"image", "images"} & set(getattr(dataset, "column_names", None) or ()):
            raise InputError("dynamic_sampling=True supports text prompts only (images found)")
        import datasets

        if isinstance(dataset, datasets.Dataset):  # the columns TRL's own dataloader keeps
            dataset = trainer._remove_unused_columns(dataset, description="training")
        self._dataset = dataset
        self._generator = torch.Generator().manual_seed(int(trainer.args.seed) + 1)
        return self

    def _extra_inputs(self, trainer: Any, prompts: int) -> list[Any]:
        """This process's rows of ``prompts`` new prompts, each repeated ``G`` times."""
        while len(self._order) < prompts:
            perm = torch.randperm(len(self._dataset), generator=self._generator)
            self._order += perm.tolist()
        chosen, self._order = self._order[:prompts], self._order[prompts:]
        rows = [i for i in chosen for _ in range(trainer.num_generations)]
        acc = trainer.accelerator
        per_process = len(rows) // acc.num_processes
        local = rows[acc.process_index * per_process : (acc.process_index + 1) * per_process]
        return list(trainer.data_collator([self._dataset[i] for i in local]))

    def generate(self, trainer: Any, inputs: list[Any], score: Any) -> dict[str, Any]:
        """One training generation with dynamic sampling; ``score`` is TRL's
        ``_generate_and_score_completions``. Returns this process's rows, as TRL does."""
        acc, g = trainer.accelerator, trainer.num_generations
        local_rows = len(inputs)
        target = local_rows * acc.num_processes // g
        step = acc.num_processes // math.gcd(acc.num_processes, g)
        rounds: list[dict[str, Tensor]] = []
        verdicts: list[Tensor] = []
        log = RoundLog(trainer)
        while True:
            log.begin_round()
            out = score(inputs)
            rounds.append(gather_round(trainer, out))
            log.end_round(samples=int(rounds[-1]["rewards"].shape[0]))
            verdicts.append(self._verdict(trainer, rounds[-1]["rewards"]))
            kept = int(sum(int(v.sum()) for v in verdicts))
            generated = sum(v.numel() for v in verdicts)
            if kept >= target or len(rounds) >= self.max_generation_batches:
                break
            n = prompts_to_generate(target - kept, kept / generated, max_prompts=target)
            inputs = self._extra_inputs(trainer, min(-(-n // step) * step, target))
        batch, report = assemble(trainer, rounds, verdicts, target)
        trainer.last_dynamic_sampling = report
        if report.kept_in_batch == 0 and self.empty_batch == "raise":
            raise ValueError(
                f"dynamic sampling kept no group: 0 of {generated} generated groups in "
                f"{report.rounds} generation batches (max_generation_batches="
                f"{self.max_generation_batches}) had spread in sampling_metric="
                f"{self.sampling_metric!r}; empty_batch='raise'"
            )
        chosen = report.selected[: report.kept_in_batch]
        kept_rows = [rounds[r]["rewards"][i * g : (i + 1) * g] for r, i in chosen]
        log.finish(trainer, torch.cat(kept_rows) if kept_rows else rounds[0]["rewards"][:0])
        log_generation(trainer, report, generated_samples=generated * g)
        rank = acc.process_index
        local = {k: v[rank * local_rows : (rank + 1) * local_rows] for k, v in batch.items()}
        local["num_items_in_batch"] = token_count(
            batch
        )  # TRL's: the generation batch, all processes
        return local

    def _verdict(self, trainer: Any, rewards: Tensor) -> Tensor:
        from accelerate.utils import broadcast

        metric = rewards[:, self.column]
        if bool(torch.isnan(metric).any()):
            raise ValueError(
                f"sampling_metric={self.sampling_metric!r}: the reward function returned None "
                "for some completions; dynamic sampling needs the metric of every completion"
            )
        keep = dynamic_sample_mask(metric.view(-1, trainer.num_generations))
        decided: Tensor = broadcast(keep.contiguous(), from_process=0)  # the main process's
        return decided


def _is_shaped(func: Any, name: str) -> bool:
    """A shaping reward, not a task metric: dapo_ops' :class:`~dapo_ops.integrations.trl.OverlongReward`
    (also behind ``functools.wraps`` or ``functools.partial``), or a reward function whose
    name contains "overlong" (TRL's ``soft_overlong_punishment_reward`` among them)."""
    inner = func
    while isinstance(inner, functools.partial):
        inner = inner.func
    inner = inspect.unwrap(inner) if callable(inner) else inner
    return isinstance(inner, OverlongReward) or "overlong" in name.lower()


__all__ = [
    "DEFAULT_MAX_GENERATION_BATCHES",
    "EMPTY_BATCH_CHOICES",
    "DynamicSampling",
    "SamplingReport",
    "trl_advantages",
]
