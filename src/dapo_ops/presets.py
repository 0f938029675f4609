"""Objective presets: DAPO and the objectives users run it against, as frozen configs.

A preset is plain data plus two methods that call the library's functions with it; a
user switches objective by switching preset (or derives one with :meth:`replace`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._validate import InputError
from dapo_ops.advantages import group_advantages
from dapo_ops.aggregation import AggregationMode, token_level_aggregate
from dapo_ops.cispo import cispo_surrogate
from dapo_ops.gspo import gspo_surrogate
from dapo_ops.kl import KLEstimator, kl_penalty
from dapo_ops.loss import token_level_loss
from dapo_ops.surrogate import clip_higher_surrogate

Surrogate = Literal["ppo", "gspo", "cispo"]


@dataclasses.dataclass(frozen=True)
class ObjectivePreset:
    """Every knob that differs between DAPO, GRPO, Dr. GRPO, GSPO and CISPO.

    ``surrogate``: ``"ppo"`` (:func:`clip_higher_surrogate`), ``"gspo"``
    (:func:`gspo_surrogate`) or ``"cispo"`` (:func:`cispo_surrogate` with
    ``floor = 1 - eps_low`` and ``cap = 1 + eps_high``). ``overlong_penalty``,
    ``overlong_filter`` and ``dynamic_sampling`` tell the host loop which of
    :func:`overlong_reward`, :func:`overlong_filter` and :func:`dynamic_sample_mask` to
    run. ``verl`` and ``trl`` give the matching option names of those trainers.
    """

    name: str
    paper: str
    surrogate: Surrogate
    eps_low: float
    eps_high: float
    mode: AggregationMode
    advantage_scale: Literal["group", "batch", "none"]
    dual_clip: float | None = None
    advantage_baseline: Literal["mean", "leave_one_out"] = "mean"
    advantage_eps: float = 0.0
    kl_beta: float = 0.0
    kl_estimator: KLEstimator = "k3"
    overlong_penalty: bool = False
    overlong_filter: bool = False
    dynamic_sampling: bool = False
    verl: Mapping[str, object] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    trl: Mapping[str, object] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def replace(self, **changes: object) -> ObjectivePreset:
        """A copy with some fields changed, e.g. ``DAPO.replace(dual_clip=3.0)``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def advantages(
        self,
        rewards: Float[Tensor, "groups samples"] | Float[Tensor, " batch"],
        group_ids: Integer[Tensor, " batch"] | None = None,
    ) -> Float[Tensor, "groups samples"] | Float[Tensor, " batch"]:
        """:func:`group_advantages` with this preset's scaling, baseline and epsilon."""
        return group_advantages(
            rewards,
            group_ids,
            scale=self.advantage_scale,
            baseline=self.advantage_baseline,
            eps=self.advantage_eps,
        )

    def per_token_loss(
        self,
        logp: Float[Tensor, "batch seq"],
        old_logp: Float[Tensor, "batch seq"],
        advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
        mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
        *,
        ref_logp: Float[Tensor, "batch seq"] | None = None,
    ) -> Float[Tensor, "batch seq"]:
        """The preset's surrogate plus ``kl_beta`` times its KL penalty, per token."""
        if self.surrogate == "gspo":
            loss = gspo_surrogate(
                logp, old_logp, advantages, mask, eps_low=self.eps_low, eps_high=self.eps_high
            )
        elif self.surrogate == "cispo":
            loss = cispo_surrogate(
                logp,
                old_logp,
                advantages,
                mask,
                floor=max(0.0, 1.0 - self.eps_low),
                cap=1.0 + self.eps_high,
            )
        else:
            loss = clip_higher_surrogate(
                logp,
                old_logp,
                advantages,
                mask,
                eps_low=self.eps_low,
                eps_high=self.eps_high,
                dual_clip=self.dual_clip,
            )
        if self.kl_beta > 0:
            if ref_logp is None:
                raise InputError(f"preset {self.name!r} has kl_beta={self.kl_beta}: pass ref_logp")
            loss = loss + self.kl_beta * kl_penalty(
                logp, ref_logp, mask, estimator=self.kl_estimator
            )
        return loss

    def loss(
        self,
        logp: Float[Tensor, "batch seq"],
        old_logp: Float[Tensor, "batch seq"],
        advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
        mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
        *,
        ref_logp: Float[Tensor, "batch seq"] | None = None,
        normalizer: Float[Tensor, ""] | Integer[Tensor, ""] | int | float | None = None,
        max_len: int | None = None,
    ) -> Float[Tensor, ""]:
        """:meth:`per_token_loss` aggregated with the preset's mode (scalar, float32).

        PPO-style presets go through :func:`token_level_loss`, so they get its fused fast
        path whenever ``kl_beta == 0`` (DAPO, Dr. GRPO); GSPO and CISPO compose.
        """
        if self.surrogate == "ppo":
            if self.kl_beta > 0 and ref_logp is None:
                raise InputError(f"preset {self.name!r} has kl_beta={self.kl_beta}: pass ref_logp")
            return token_level_loss(
                logp,
                old_logp,
                advantages,
                mask,
                eps_low=self.eps_low,
                eps_high=self.eps_high,
                dual_clip=self.dual_clip,
                mode=self.mode,
                normalizer=normalizer,
                max_len=max_len,
                ref_logp=ref_logp if self.kl_beta > 0 else None,
                kl_beta=self.kl_beta,
                kl_estimator=self.kl_estimator,
            )
        per_token = self.per_token_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp)
        return token_level_aggregate(
            per_token, mask, mode=self.mode, normalizer=normalizer, max_len=max_len
        )


DAPO = ObjectivePreset(
    name="dapo",
    paper="Yu et al. 2025, DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    surrogate="ppo",
    eps_low=0.2,
    eps_high=0.28,
    mode="token_mean",
    advantage_scale="group",
    overlong_penalty=True,
    dynamic_sampling=True,
    verl={
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "loss_agg_mode": "token-mean",
        "use_kl_loss": False,
        "algorithm.filter_groups.enable": True,
        "reward_model.overlong_buffer.enable": True,
    },
    trl={"epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "dapo", "beta": 0.0},
)

GRPO = ObjectivePreset(
    name="grpo",
    paper="Shao et al. 2024, DeepSeekMath (GRPO)",
    surrogate="ppo",
    eps_low=0.2,
    eps_high=0.2,
    mode="seq_mean_token_mean",
    advantage_scale="group",
    kl_beta=0.04,
    kl_estimator="k3",
    verl={
        "clip_ratio": 0.2,
        "loss_agg_mode": "seq-mean-token-mean",
        "use_kl_loss": True,
        "kl_loss_coef": 0.04,
        "kl_loss_type": "low_var_kl",
    },
    trl={"epsilon": 0.2, "loss_type": "grpo", "beta": 0.04},
)

DR_GRPO = ObjectivePreset(
    name="dr_grpo",
    paper="Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO)",
    surrogate="ppo",
    eps_low=0.2,
    eps_high=0.2,
    mode="seq_mean_token_sum_norm",
    advantage_scale="none",
    verl={
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "algorithm.norm_adv_by_std_in_grpo": False,
        "use_kl_loss": False,
    },
    trl={"loss_type": "dr_grpo", "scale_rewards": "none", "beta": 0.0},
)

GSPO = ObjectivePreset(
    name="gspo",
    paper="Zheng et al. 2025, Group Sequence Policy Optimization",
    surrogate="gspo",
    eps_low=3e-4,
    eps_high=4e-4,
    mode="seq_mean_token_mean",
    advantage_scale="group",
    verl={
        "policy_loss.loss_mode": "gspo",
        "clip_ratio_low": 3e-4,
        "clip_ratio_high": 4e-4,
        "loss_agg_mode": "seq-mean-token-mean",
    },
    trl={"importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
)

CISPO = ObjectivePreset(
    name="cispo",
    paper="MiniMax 2025, MiniMax-M1 (CISPO)",
    surrogate="cispo",
    eps_low=1.0,
    eps_high=0.28,
    mode="token_mean",
    advantage_scale="group",
    verl={"policy_loss.loss_mode": "cispo", "loss_agg_mode": "token-mean"},
    trl={"loss_type": "cispo"},
)

PRESETS: Mapping[str, ObjectivePreset] = MappingProxyType(
    {p.name: p for p in (DAPO, GRPO, DR_GRPO, GSPO, CISPO)}
)
