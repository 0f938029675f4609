"""Rewards and sampling: overlong and truncation shaping, dynamic sampling and difficulty
bands, PF-PPO resampling.

This package's face: it only re-exports; the code lives in its modules."""

from dapo_ops.rewards.overlong import overlong_filter, overlong_reward, truncation_penalty
from dapo_ops.rewards.pf_ppo import pf_ppo_resample, pf_ppo_weights
from dapo_ops.rewards.sampling import (
    difficulty_band_mask,
    dynamic_sample_mask,
    kept_group_fraction,
    prompts_to_generate,
)

__all__ = [
    "difficulty_band_mask",
    "dynamic_sample_mask",
    "kept_group_fraction",
    "overlong_filter",
    "overlong_reward",
    "pf_ppo_resample",
    "pf_ppo_weights",
    "prompts_to_generate",
    "truncation_penalty",
]
