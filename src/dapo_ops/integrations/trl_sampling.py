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
   logged. With no group kept at all the batch is only such rows: loss 0, never an empty
   batch (verl's recipe raises instead).

Metrics (through TRL's logger, once per generation): ``dynamic_sampling/kept_group_fraction``
(kept groups / generated groups, over every round), ``dynamic_sampling/generation_batches``
(rounds used), ``dynamic_sampling/samples_per_kept_sample`` (generated samples / kept
samples trained on; NaN, which TRL's logger skips, when none was kept),
``dynamic_sampling/batch_fill`` (kept groups in the batch / ``target``),
``dynamic_sampling/partial_batch``. TRL's own reward and completion metrics are logged
for every round.

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

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from dapo_ops._validate import InputError, check_bool, check_int
from dapo_ops.sampling import dynamic_sample_mask, prompts_to_generate

logger = logging.getLogger(__name__)

#: default ``max_generation_batches`` (the generation batch included), as DAPO's verl scripts
DEFAULT_MAX_GENERATION_BATCHES = 10
# Per-row tensors TRL returns, padded on the left (prompt) or right (completion), and
# the pad value of each ("pad": the tokenizer's pad id).
_LEFT: dict[str, Any] = {"prompt_ids": "pad", "prompt_mask": 0}
_RIGHT: dict[str, Any] = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 1.0,
    "tool_mask": 1,
}
_RECOMPUTED = ("advantages", "num_items_in_batch")


def _nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """TRL's ``nanstd``: the unbiased std ignoring NaN (NaN below two values), same operations."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.nan)
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def trl_advantages(
    rewards_per_func: Float[Tensor, "rows funcs"],
    reward_weights: Float[Tensor, " funcs"],
    num_generations: int,
    *,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
) -> Float[Tensor, " rows"]:
    """TRL 1.16's GRPO advantages: the same operations in the same order, without TRL.

    ``rewards_per_func [rows, funcs]`` (NaN where a function returned ``None``), rows in
    consecutive groups of ``num_generations``; ``reward_weights [funcs]``. Returns
    ``[rows]``: ``(r - mean_g) / (std_g + 1e-4)`` of the weighted sum ``r`` (unbiased
    std; ``scale_rewards="batch"``: the batch's std; ``"none"``: not divided), or with
    ``multi_objective_aggregation="normalize_then_sum"`` each function normalised per
    group, weighted, summed and normalised over the batch; unscorable rows (every
    function NaN) get 0. Bitwise TRL's own on the same rows
    (``tests/integration/test_trl_sampling.py``).

    Example:
        >>> trl_advantages(torch.tensor([[1.0], [0.0], [1.0], [1.0]]), torch.ones(1), 2)
        tensor([ 0.7070, -0.7070,  0.0000,  0.0000])
    """
    g = num_generations
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    if multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        if scale_rewards in ("group", "none"):
            std = torch.zeros_like(rewards)
            if g > 1:
                std = _nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        elif scale_rewards == "batch":
            std = (
                _nanstd(rewards).expand_as(rewards)
                if rewards.numel() > 1
                else torch.zeros_like(rewards)
            )
        else:
            raise InputError(
                f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}"
            )
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    elif multi_objective_aggregation == "normalize_then_sum":
        funcs = rewards_per_func.shape[1]
        grouped = rewards_per_func.view(-1, g, funcs)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = _nanstd(grouped, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean_k)
        rewards = ((((grouped - mean_k) / (std_k + 1e-4)).view(-1, funcs)) * weights).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = (
            _nanstd(rewards).expand_as(rewards)
            if rewards.numel() > 1
            else torch.zeros_like(rewards)
        )
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise InputError(
            "multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', "
            f"got {multi_objective_aggregation!r}"
        )
    return torch.nan_to_num(advantages, nan=0.0)


@dataclass(frozen=True)
class SamplingReport:
    """What the last training generation did (``DapoGRPOTrainer.last_dynamic_sampling``).

    ``verdicts[r]``: the kept verdict of each group of round ``r`` (global order);
    ``selected``: ``(round, group)`` of each group in the batch, kept ones first, then
    the masked fillers of a partial batch; ``target``: groups in a full batch.
    """

    verdicts: tuple[tuple[bool, ...], ...]
    selected: tuple[tuple[int, int], ...]
    kept_in_batch: int
    target: int

    @property
    def rounds(self) -> int:
        return len(self.verdicts)


@dataclass
class DynamicSampling:
    """The validated options of ``DapoGRPOTrainer(dynamic_sampling=True, ...)``; see the module."""

    max_generation_batches: int
    sampling_metric: str
    column: int = -1
    _order: list[int] = field(default_factory=list)
    _generator: torch.Generator | None = None
    _dataset: Any = None

    @staticmethod
    def from_options(
        dynamic_sampling: object, max_generation_batches: object, sampling_metric: object
    ) -> DynamicSampling | None:
        """Validate the constructor options; ``None`` when dynamic sampling is off.

        An option given with ``dynamic_sampling=False`` raises: it would be ignored.
        """
        if not check_bool("dynamic_sampling", dynamic_sampling):
            for name, value in [
                ("max_generation_batches", max_generation_batches),
                ("sampling_metric", sampling_metric),
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
        return DynamicSampling(max_generation_batches=cap, sampling_metric=metric)

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
        while True:
            out = score(inputs)
            rounds.append(_gather_round(trainer, out))
            verdicts.append(self._verdict(trainer, rounds[-1]["rewards"]))
            kept = int(sum(int(v.sum()) for v in verdicts))
            generated = sum(v.numel() for v in verdicts)
            if kept >= target or len(rounds) >= self.max_generation_batches:
                break
            n = prompts_to_generate(target - kept, kept / generated, max_prompts=target)
            inputs = self._extra_inputs(trainer, min(-(-n // step) * step, target))
        batch, report = _assemble(trainer, rounds, verdicts, target)
        trainer.last_dynamic_sampling = report
        _log(trainer, report, generated_samples=generated * g)
        rank = acc.process_index
        local = {k: v[rank * local_rows : (rank + 1) * local_rows] for k, v in batch.items()}
        local["num_items_in_batch"] = _tokens(batch)  # TRL's: the generation batch, all processes
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


def _tokens(batch: dict[str, Tensor]) -> Tensor:
    mask = batch["completion_mask"]
    return (mask * batch["tool_mask"] if "tool_mask" in batch else mask).sum()


def _gather_round(trainer: Any, out: dict[str, Any]) -> dict[str, Tensor]:
    """The round's per-row tensors of every process (padded to one width), and its rewards."""
    unknown = set(out) - set(_LEFT) - set(_RIGHT) - set(_RECOMPUTED)
    if unknown:
        raise ValueError(
            f"dynamic_sampling=True supports text inputs only; TRL returned {sorted(unknown)}"
        )
    acc = trainer.accelerator
    gathered = {"rewards": trainer._dapo_rewards}
    for key, value in out.items():
        if key in _RECOMPUTED or value is None:
            continue
        pad = {**_LEFT, **_RIGHT}[key]
        pad = trainer._tokenizer.pad_token_id if pad == "pad" else pad
        value = acc.pad_across_processes(value, dim=1, pad_index=pad, pad_first=key in _LEFT)
        gathered[key] = acc.gather(value)
    return gathered


def _concat(trainer: Any, rounds: list[dict[str, Tensor]], key: str) -> Tensor:
    """``rounds[*][key]`` concatenated along rows, re-padded to the widest round."""
    if key == "rewards":
        return torch.cat([r[key] for r in rounds])
    width = max(r[key].shape[1] for r in rounds)
    pad = {**_LEFT, **_RIGHT}[key]
    pad = trainer._tokenizer.pad_token_id if pad == "pad" else pad
    parts = []
    for r in rounds:
        extra = width - r[key].shape[1]
        parts.append(F.pad(r[key], (extra, 0) if key in _LEFT else (0, extra), value=pad))
    return torch.cat(parts)


def _assemble(
    trainer: Any, rounds: list[dict[str, Tensor]], verdicts: list[Tensor], target: int
) -> tuple[dict[str, Tensor], SamplingReport]:
    """The global batch: the first ``target`` kept groups, then masked fillers if short."""
    g = trainer.num_generations
    flat = torch.cat(verdicts).tolist()
    where = [(r, i) for r, v in enumerate(verdicts) for i in range(v.numel())]
    kept = [j for j, k in enumerate(flat) if k][:target]
    fillers = [j for j, k in enumerate(flat) if not k][: target - len(kept)]
    groups = torch.tensor(kept + fillers, dtype=torch.long)
    rows = (groups.unsqueeze(1) * g + torch.arange(g)).reshape(-1)
    batch = {k: _concat(trainer, rounds, k)[rows.to(rounds[0][k].device)] for k in rounds[0]}
    rewards = batch.pop("rewards")
    n_kept = len(kept) * g
    advantages = torch.zeros(rows.numel(), dtype=torch.float32, device=rewards.device)
    if kept:
        advantages[:n_kept] = trl_advantages(
            rewards[:n_kept],
            trainer.reward_weights,
            g,
            scale_rewards=trainer.scale_rewards,
            multi_objective_aggregation=trainer.multi_objective_aggregation,
        )
    batch["advantages"] = advantages
    batch["completion_mask"][n_kept:] = 0  # fillers: no token, no count, no gradient
    # drop prompt columns that only the discarded rows needed
    prompt_mask = batch["prompt_mask"]
    width = int(prompt_mask.sum(dim=1).max()) if prompt_mask.numel() else 0
    multiple = getattr(trainer, "pad_to_multiple_of", None)
    if multiple:
        width = -(-width // multiple) * multiple
    cut = max(prompt_mask.shape[1] - width, 0)
    for key in _LEFT:
        batch[key] = batch[key][:, cut:]
    report = SamplingReport(
        verdicts=tuple(tuple(bool(x) for x in v.tolist()) for v in verdicts),
        selected=tuple(where[j] for j in kept + fillers),
        kept_in_batch=len(kept),
        target=target,
    )
    return batch, report


def _log(trainer: Any, report: SamplingReport, *, generated_samples: int) -> None:
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
    if partial and trainer.accelerator.is_main_process:
        logger.warning(
            "dynamic sampling: %d of %d groups kept after max_generation_batches=%d "
            "generation batches; training on the kept groups only (the rest of the batch "
            "is masked out)",
            report.kept_in_batch,
            report.target,
            report.rounds,
        )


__all__ = ["DEFAULT_MAX_GENERATION_BATCHES", "DynamicSampling", "SamplingReport", "trl_advantages"]
