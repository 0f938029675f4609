"""The batch side of :mod:`dapo_ops.integrations.trl_sampling`: TRL's advantages, gathering
the rounds of one generation, and assembling the kept groups into TRL's batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from dapo_ops._core._validate import InputError

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
    return _advantages_and_std(
        rewards_per_func,
        reward_weights,
        num_generations,
        scale_rewards=scale_rewards,
        multi_objective_aggregation=multi_objective_aggregation,
    )[0]


def _advantages_and_std(
    rewards_per_func: Tensor,
    reward_weights: Tensor,
    num_generations: int,
    *,
    scale_rewards: str,
    multi_objective_aggregation: str,
) -> tuple[Tensor, Tensor]:
    """:func:`trl_advantages` and the std each row's advantage is (with ``"none"``: would
    be) divided by; TRL logs the share of rows where it is 0 as ``frac_reward_zero_std``."""
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
    return torch.nan_to_num(advantages, nan=0.0), std


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


def token_count(batch: dict[str, Tensor]) -> Tensor:
    mask = batch["completion_mask"]
    return (mask * batch["tool_mask"] if "tool_mask" in batch else mask).sum()


def gather_round(trainer: Any, out: dict[str, Any]) -> dict[str, Tensor]:
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


def assemble(
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


__all__ = ["SamplingReport", "trl_advantages"]
