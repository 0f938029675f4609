"""Peer-style reference implementations of the steps before the loss, written for this
benchmark: group advantages, dynamic sampling, the overlong penalty, the normaliser.

The same rules as :mod:`benchmarks.references` (the versions mirrored are listed there):
op for op the peers' code paths, our own code, nothing imported from or copied out of
verl or TRL.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch import Tensor

# --------------------------------------------------------------------------------------
# Advantages, dynamic sampling, overlong penalty, normaliser
# --------------------------------------------------------------------------------------


def verl_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray[Any, Any],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> Tensor:
    """verl's GRPO advantage: a Python loop over samples and over the uid groups."""
    scores = token_level_rewards.sum(dim=-1)
    id2score: defaultdict[Any, list[Tensor]] = defaultdict(list)
    id2mean: dict[Any, Tensor] = {}
    id2std: dict[Any, Tensor] = {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask
    return scores


def trl_group_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: bool = True
) -> Tensor:
    """TRL's dense group advantage (fixed group size, contiguous groups)."""
    mean_grouped_rewards = rewards.view(-1, num_generations).mean(dim=1)
    std_grouped_rewards = rewards.view(-1, num_generations).std(dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    std_grouped_rewards = std_grouped_rewards.repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards:
        advantages = advantages / (std_grouped_rewards + 1e-4)
    return advantages


def verl_filter_groups(uids: np.ndarray[Any, Any], metric: np.ndarray[Any, Any]) -> list[int]:
    """verl DAPO's dynamic sampling: kept trajectory indices (groups with std > 0)."""
    prompt_uid2metric_vals: defaultdict[Any, list[Any]] = defaultdict(list)
    for uid, metric_val in zip(uids, metric, strict=True):
        prompt_uid2metric_vals[uid].append(metric_val)
    prompt_uid2metric_std = {}
    for prompt_uid, metric_vals in prompt_uid2metric_vals.items():
        prompt_uid2metric_std[prompt_uid] = np.std(metric_vals)
    kept_prompt_uids = [
        uid
        for uid, std in prompt_uid2metric_std.items()
        if std > 0 or len(prompt_uid2metric_vals[uid]) == 1
    ]
    kept_traj_idxs = []
    for idx, traj_from_prompt_uid in enumerate(uids):
        if traj_from_prompt_uid in kept_prompt_uids:  # list membership, as in verl
            kept_traj_idxs.append(idx)
    return kept_traj_idxs


def verl_overlong_penalty(
    valid_response_lengths: Tensor, max_resp_len: int, overlong_buffer_len: int, factor: float
) -> Tensor:
    """verl DAPO reward manager: the overlong-buffer penalty, one sample at a time."""
    rewards = torch.zeros(valid_response_lengths.shape[0], dtype=torch.float32)
    expected_len = max_resp_len - overlong_buffer_len
    for i in range(len(valid_response_lengths)):
        valid_response_length = valid_response_lengths[i]
        exceed_len = valid_response_length - expected_len
        overlong_reward = min(-exceed_len / overlong_buffer_len * factor, 0)
        rewards[i] = rewards[i] + overlong_reward  # type: ignore[operator]
    return rewards


def trl_soft_overlong_punishment(
    completion_lengths: list[int], max_completion_len: int, soft_punish_cache: int
) -> Tensor:
    """TRL's soft overlong reward function (a list comprehension over completions)."""
    rewards = []
    for completion_length in completion_lengths:
        if completion_length <= max_completion_len - soft_punish_cache:
            rewards.append(0.0)
        elif max_completion_len - soft_punish_cache < completion_length <= max_completion_len:
            rewards.append(
                (max_completion_len - soft_punish_cache - completion_length) / soft_punish_cache
            )
        else:
            rewards.append(-1.0)
    return torch.tensor(rewards, dtype=torch.float32)


def trl_num_items_in_batch(masks: list[Tensor]) -> int:
    """A trainer's token count over gradient-accumulation micro-batches (host int)."""
    return int(sum(int(m.sum().item()) for m in masks))
