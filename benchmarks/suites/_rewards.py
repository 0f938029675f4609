"""The reward-side cases: group advantages (dense, ragged), dynamic sampling, overlong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import dapo_ops as d
from benchmarks import references_rewards as ref_rewards
from benchmarks.harness import Case, Fn, Impl
from benchmarks.suites._peers import verl_version

VERL_LOOP = "verl-style per-sample loop (uid defaultdict)"
PLAIN_VIEW = "TRL-style view(-1, G) mean/std"


@dataclass
class RewardInputs:
    rewards: torch.Tensor  # [N] float32, flat
    ids: torch.Tensor  # [N] int64 group ids (ragged: shuffled, uneven sizes)
    uids: np.ndarray[Any, Any]  # the same ids as verl's uid strings
    dense: torch.Tensor  # [groups, G] (dense layout)
    lengths: torch.Tensor  # [N] int64
    group_size: int


def reward_inputs(n: int, groups: int, device: str, ragged: bool) -> RewardInputs:
    g = torch.Generator().manual_seed(n + groups + int(ragged))
    size = n // groups
    if ragged:  # group sizes 2 .. 2*size-2 (mean ~size), ids shuffled and non-contiguous
        sizes = torch.randint(2, 2 * size - 1, (groups * 2,), generator=g)
        sizes = sizes[: int(torch.searchsorted(sizes.cumsum(0), torch.tensor(n)))]
        rest = n - int(sizes.sum())
        if rest >= 2:  # one more group; never a one-sample group (peers differ there)
            sizes = torch.cat([sizes, torch.tensor([rest])])
        else:
            sizes[-1] += rest
        ids = torch.repeat_interleave(torch.arange(len(sizes)) * 7 + 3, sizes)
        ids = ids[torch.randperm(n, generator=g)]
    else:
        ids = torch.arange(groups).repeat_interleave(size)
    correct = (torch.rand(n, generator=g) < 0.5).float()
    lengths = torch.randint(1, 20_481, (n,), generator=g)
    rewards = correct + d.overlong_reward(lengths, max_len=20_480, cache_len=4096)
    uids = np.array([f"uid-{i}" for i in ids.tolist()], dtype=object)
    dense = rewards.view(groups, size) if not ragged else rewards
    return RewardInputs(
        rewards.to(device), ids.to(device), uids, dense.to(device), lengths.to(device), size
    )


def _verl_grpo(vectorized: bool) -> Impl:
    version = verl_version()
    label = "vectorized" if vectorized else "loop"
    fn_name = (
        "compute_grpo_vectorized_outcome_advantage"
        if vectorized
        else "compute_grpo_outcome_advantage"
    )
    if version is None:
        missing = "verl is not installed (pip install --no-deps verl==0.9.1)"
        return Impl(
            f"verl (not installed) GRPO advantage, {label}",
            "ref",
            lambda _: lambda: None,
            missing=missing,
        )

    def build(x: RewardInputs) -> Fn:
        from verl.trainer.ppo import core_algos  # type: ignore[import-not-found]

        fn, rewards = getattr(core_algos, fn_name), x.rewards.cpu()[:, None]
        mask = torch.ones_like(rewards)
        return lambda: fn(rewards.clone(), mask, x.uids)

    return Impl(f"verl {version} (installed) GRPO advantage, {label}", "ref", build)


def reward_cases(n: int, groups: int, device: str) -> list[Case]:
    label = f"{n // 1024}k samples / {groups // 1024}k groups"
    cases: list[Case] = []
    for ragged in (False, True):
        layout = "ragged" if ragged else "dense"

        def mk(ragged: bool = ragged) -> RewardInputs:
            return reward_inputs(n, groups, device, ragged)

        def ours(x: RewardInputs, ragged: bool = ragged) -> Fn:
            if ragged:
                return lambda: d.group_advantages(x.rewards, x.ids)
            return lambda: d.group_advantages(x.dense)

        def verl_loop(x: RewardInputs) -> Fn:
            rewards, mask = x.rewards.cpu()[:, None], torch.ones(x.rewards.numel(), 1)
            return lambda: ref_rewards.verl_grpo_outcome_advantage(rewards.clone(), mask, x.uids)

        impls = [
            Impl(f"dapo_ops group_advantages ({layout})", "ours", ours),
            Impl(VERL_LOOP, "ref", verl_loop),
            _verl_grpo(False),
            _verl_grpo(True),
        ]
        if not ragged:
            impls.append(
                Impl(
                    PLAIN_VIEW,
                    "ref",
                    lambda x: lambda: ref_rewards.trl_group_advantages(x.rewards, x.group_size),
                )
            )
        bytes_ = n * (4 + 4 + (8 if ragged else 0))
        cases.append(
            Case(
                f"group_advantages {layout}",
                label,
                mk,
                impls,
                floor_bytes=bytes_,
                basis_bytes=n * 12,
                main_ref=VERL_LOOP,
                elems=n,
            )
        )

        def dyn(x: RewardInputs, ragged: bool = ragged) -> Fn:
            return lambda: (
                d.dynamic_sample_mask(x.rewards, x.ids)
                if ragged
                else d.dynamic_sample_mask(x.dense)
            )

        def dyn_verl(x: RewardInputs) -> Fn:
            metric = x.rewards.cpu().numpy()
            return lambda: ref_rewards.verl_filter_groups(x.uids, metric)

        impls = [
            Impl(f"dapo_ops dynamic_sample_mask ({layout})", "ours", dyn),
            Impl("verl-style filter_groups loop", "ref", dyn_verl),
        ]
        cases.append(
            Case(
                f"dynamic_sample_mask {layout}",
                label,
                mk,
                impls,
                floor_bytes=n * (4 + (9 if ragged else 0)) + groups,
                basis_bytes=n * 12,
                main_ref="verl-style filter_groups loop",
                elems=n,
            )
        )

    def trl_overlong(x: RewardInputs) -> Fn:
        lengths = x.lengths.tolist()  # TRL receives completions as Python lists
        return lambda: ref_rewards.trl_soft_overlong_punishment(lengths, 20_480, 4096)

    verl_penalty = "verl-style per-sample penalty loop"
    impls = [
        Impl(
            "dapo_ops overlong_reward",
            "ours",
            lambda x: lambda: d.overlong_reward(x.lengths, max_len=20_480, cache_len=4096),
        ),
        Impl(
            verl_penalty,
            "ref",
            lambda x: lambda: ref_rewards.verl_overlong_penalty(x.lengths.cpu(), 20_480, 4096, 1.0),
        ),
        Impl("TRL-style list comprehension", "ref", trl_overlong),
    ]
    mk0 = lambda: reward_inputs(n, groups, device, False)  # noqa: E731
    cases.append(
        Case(
            "overlong_reward",
            f"{n // 1024}k samples",
            mk0,
            impls,
            floor_bytes=n * 12,
            basis_bytes=n * 8,
            main_ref=verl_penalty,
            elems=n,
        )
    )
    return cases
