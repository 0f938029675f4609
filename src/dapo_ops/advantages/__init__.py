"""Advantages: group-relative (GRPO, DAPO, Dr. GRPO), verl's other outcome estimators, token-level returns (GAE, REINFORCE++, ReMax), the optimal baseline.

This package's face: it only re-exports; the code lives in its modules."""

from dapo_ops.advantages.estimators import (
    gdpo_advantages,
    gpg_advantages,
    maxrl_advantages,
    opo_advantages,
    passk_advantages,
)
from dapo_ops.advantages.group import ZERO_STD_RTOL, group_advantages, pow2_scale
from dapo_ops.advantages.optimal_baseline import optimal_token_baseline_advantages
from dapo_ops.advantages.returns import (
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    remax_advantages,
)

__all__ = [
    "ZERO_STD_RTOL",
    "gae_advantages",
    "gdpo_advantages",
    "gpg_advantages",
    "group_advantages",
    "masked_whiten",
    "maxrl_advantages",
    "opo_advantages",
    "optimal_token_baseline_advantages",
    "passk_advantages",
    "pow2_scale",
    "reinforce_pp_advantages",
    "remax_advantages",
]
