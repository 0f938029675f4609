"""verl's policy losses, each as a dapo_ops objective, registered as ``dapo_ops_<name>``.

:func:`verl_objective` reads verl's actor config exactly as verl 0.9.1's own loss
function of that ``loss_mode`` does and returns the objective value that states its
formula; :func:`policy_loss_fn` wraps it in verl's ``PolicyLossFn`` signature (the
aggregation from ``loss_agg_mode`` and ``global_batch_info``, rollout IS weights, verl's
metric names). Switching ``policy_loss.loss_mode: sapo`` to ``dapo_ops_sapo`` changes the
implementation, not the numbers (``tests/integration/test_verl_objectives.py``). The
modes that also select tokens (``clip_cov``, ``kl_cov``) are in
:mod:`dapo_ops.integrations.verl_composed`, ``bypass_mode`` in
:mod:`dapo_ops.integrations.verl_bypass`.

Example:
    >>> verl_objective("sapo", {"tau_pos": 1.0, "tau_neg": 1.05})
    SAPO(log_ratio_clamp=20.0, tau_pos=1.0, tau_neg=1.05)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.engine.policy import policy_loss_with_diagnostics
from dapo_ops.integrations._verl_common import _config_value, ppo_kl, verl_aggregation
from dapo_ops.objectives import (
    CISPO,
    DPPO,
    DRO,
    GMPO,
    GSPO,
    SAPO,
    ClipHigher,
    Objective,
    PolicyGradient,
    RatioSurrogate,
)

#: verl ``loss_mode`` -> the aggregation verl forces whatever ``loss_agg_mode`` says.
FORCED_AGG = {"sapo": "seq-mean-token-mean"}


def _clip_range(config: Any) -> tuple[float, float]:
    clip_ratio = _config_value(config, "clip_ratio", 0.2)
    low = float(_config_value(config, "clip_ratio_low", clip_ratio))
    return low, float(_config_value(config, "clip_ratio_high", clip_ratio))


def _policy_loss_option(config: Any, name: str, default: Any) -> Any:
    return _config_value(_config_value(config, "policy_loss", None), name, default)


def verl_objective(loss_mode: str, config: Any) -> Objective:
    """The objective of verl's ``loss_mode`` with the options verl reads from ``config``."""
    low, high = _clip_range(config)
    if loss_mode == "vanilla":
        return ClipHigher(
            eps_low=low, eps_high=high, dual_clip=float(_config_value(config, "clip_ratio_c", 3.0))
        )
    if loss_mode in ("dppo_tv", "dppo_kl"):
        cap = float(_config_value(config, "clip_ratio_c", 20.0))
        return DPPO(divergence=loss_mode[-2:], delta_low=low, delta_high=high, is_cap=cap)  # type: ignore[arg-type]
    if loss_mode == "gspo":
        return GSPO(eps_low=low, eps_high=high, verl_clamp=True)
    if loss_mode == "sapo":
        tau_pos = float(_config_value(config, "tau_pos", 1.0))
        return SAPO(tau_pos=tau_pos, tau_neg=float(_config_value(config, "tau_neg", 1.05)))
    if loss_mode == "gpg":
        return PolicyGradient()
    if loss_mode == "geo_mean":
        return GMPO(eps_low=low, eps_high=high)
    if loss_mode == "dro":
        beta = _policy_loss_option(config, "dro_beta", None)
        if beta is None:
            raise InputError("loss_mode='dro' needs policy_loss.dro_beta > 0 (verl has no default)")
        return DRO(beta=float(beta))
    if loss_mode == "cispo":
        return CISPO(eps_low=low, eps_high=high)
    if loss_mode == "clip_cov":  # with clip_cov_mask's selection (verl_composed)
        return ClipHigher(eps_low=low, eps_high=high)
    if loss_mode == "kl_cov":  # with kl_cov_mask's |log r| penalty (verl_composed)
        return RatioSurrogate()
    if loss_mode == "bypass_mode":  # with rollout correction's weights and mask (verl_bypass)
        correction = _policy_loss_option(config, "rollout_correction", None)
        if _config_value(correction, "loss_type", "ppo_clip") == "reinforce":
            return PolicyGradient()
        return verl_objective("vanilla", config)
    raise InputError(f"verl loss_mode {loss_mode!r} has no dapo_ops objective; see VERL_LOSS_MODES")


#: The verl ``loss_mode`` values that :func:`verl_objective` reproduces.
VERL_LOSS_MODES = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "geo_mean",
    "dro",
    "cispo",
    "clip_cov",
    "kl_cov",
    "bypass_mode",
)


def policy_loss_fn(loss_mode: str) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    """A verl ``PolicyLossFn`` computing verl's ``loss_mode`` with dapo_ops."""
    if loss_mode not in VERL_LOSS_MODES:
        raise InputError(f"loss_mode must be one of {VERL_LOSS_MODES}, got {loss_mode!r}")
    from dapo_ops.integrations.verl_bypass import bypass_loss  # they import verl.py
    from dapo_ops.integrations.verl_composed import COMPOSED

    if loss_mode == "bypass_mode":
        return bypass_loss
    if loss_mode in COMPOSED:
        return COMPOSED[loss_mode]

    def compute(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if config is None:
            raise InputError(f"dapo_ops_{loss_mode} needs verl's actor config (config=...)")
        objective = verl_objective(loss_mode, config)
        agg = FORCED_AGG.get(loss_mode, loss_agg_mode)
        mode, normalizer, max_len = verl_aggregation(
            agg,
            _config_value(config, "global_batch_info", {}),
            _config_value(config, "loss_scale_factor", None),
        )
        mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
        adv = advantages
        if objective.level == "sequence":  # verl's GSPO and geo_mean take token advantages
            n = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(advantages.dtype)
            adv = torch.where(mask, advantages, 0.0).sum(dim=-1, keepdim=True) / n
        if loss_mode == "geo_mean":  # verl: the mean over every row, empty ones included
            mode, normalizer = "seq_mean_token_mean", float(mask.shape[0])
        loss, diag = policy_loss_with_diagnostics(
            objective, log_prob, old_log_prob, adv, mask,
            mode=mode, normalizer=normalizer, max_len=max_len, is_weights=rollout_is_weights,
        )  # fmt: skip
        metrics = {
            "actor/pg_clipfrac": float(diag.clip_frac_low + diag.clip_frac_high),
            "actor/ppo_kl": ppo_kl(log_prob, old_log_prob, mask),
            "actor/pg_clipfrac_lower": float(diag.clip_frac_dual),
        }
        return loss, metrics

    compute.__name__ = compute.__qualname__ = f"compute_policy_loss_dapo_ops_{loss_mode}"
    return compute


def register_all() -> None:
    """Register ``dapo_ops_<loss_mode>`` in verl for every mode of :data:`VERL_LOSS_MODES`."""
    from verl.trainer.ppo import core_algos

    for loss_mode in VERL_LOSS_MODES:
        core_algos.register_policy_loss(f"dapo_ops_{loss_mode}")(policy_loss_fn(loss_mode))
