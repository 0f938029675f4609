"""Advantages: group-relative (GRPO, DAPO, Dr. GRPO), verl's other outcome estimators, token-level returns (GAE, REINFORCE++, ReMax), the optimal baseline.

This package's face: it only re-exports; the code lives in its modules. ``__all__`` is the
stage's public API (the ``dapo_ops`` face exports it); the other names re-exported here
were names of the 0.1.0 module ``dapo_ops.advantages`` and stay importable from it."""

from dapo_ops.advantages.estimators import (
    gdpo_advantages,
    gpg_advantages,
    maxrl_advantages,
    opo_advantages,
    passk_advantages,
)
from dapo_ops.advantages.group import ZERO_STD_RTOL as ZERO_STD_RTOL  # 0.1.0 module name
from dapo_ops.advantages.group import group_advantages
from dapo_ops.advantages.group import pow2_scale as pow2_scale  # 0.1.0 module name
from dapo_ops.advantages.optimal_baseline import optimal_token_baseline_advantages
from dapo_ops.advantages.returns import (
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    remax_advantages,
)

__all__ = [
    "gae_advantages",
    "gdpo_advantages",
    "gpg_advantages",
    "group_advantages",
    "masked_whiten",
    "maxrl_advantages",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "passk_advantages",
    "reinforce_pp_advantages",
    "remax_advantages",
]
