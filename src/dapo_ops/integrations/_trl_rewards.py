"""DAPO's soft overlong punishment as a TRL reward function (a plain class, no TRL import).

Its own module so that :mod:`dapo_ops.integrations.trl` (which exports it) and
:mod:`dapo_ops.integrations.trl_sampling` (which recognises it as a shaping reward) both
import it without importing each other.

Example:
    >>> OverlongReward(max_len=6, cache_len=2)([[1, 2, 3], [1, 2, 3, 4, 5]])
    [0.0, -0.5]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dapo_ops.rewards.overlong import overlong_reward


class OverlongReward:
    """DAPO's soft overlong punishment as a TRL reward function (``reward_funcs=[...]``).

    Calls :func:`dapo_ops.overlong_reward` on ``len(ids)`` of each completion (TRL's
    completion ids end with the EOS token when there is one, so the EOS counts, as in
    dapo_ops). Equal to ``trl.rewards.get_soft_overlong_punishment(max_len, cache_len)``
    for ``factor=1``; ``factor`` scales the penalty (verl's ``penalty_factor``). A plain
    class, so it pickles for TRL's async reward workers.
    """

    __name__ = "overlong_reward"

    def __init__(self, max_len: int, cache_len: int, factor: float = 1.0) -> None:
        # Validate the options now rather than at the first reward call.
        overlong_reward(torch.zeros(0), max_len=max_len, cache_len=cache_len, factor=factor)
        self.max_len = max_len
        self.cache_len = cache_len
        self.factor = factor

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.long)
        penalty = overlong_reward(
            lengths, max_len=self.max_len, cache_len=self.cache_len, factor=self.factor
        )
        return [float(x) for x in penalty.tolist()]

    def __repr__(self) -> str:
        return (
            f"OverlongReward(max_len={self.max_len}, cache_len={self.cache_len}, "
            f"factor={self.factor})"
        )
