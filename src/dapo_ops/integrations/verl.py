"""verl integration: dapo_ops' policy loss and GRPO advantage through verl's own registries.

- :func:`compute_policy_loss` has the signature of verl's ``PolicyLossFn`` and is
  registered as ``actor_rollout_ref.actor.policy_loss.loss_mode=dapo_ops``. It reads the
  actor config as verl's ``vanilla`` loss does (``clip_ratio_low`` / ``clip_ratio_high``,
  falling back to ``clip_ratio``; ``clip_ratio_c`` as the dual clip; ``loss_agg_mode``;
  ``global_batch_info`` for the global token / sequence counts and the dp size;
  ``loss_scale_factor``) and returns the same metrics.
- :func:`compute_grpo_outcome_advantage` has the signature of verl's advantage estimators
  and is registered as ``algorithm.adv_estimator=dapo_ops_grpo``: verl's GRPO advantage
  (``eps=1e-6`` on the unbiased std, a one-sample group keeps its raw score,
  ``norm_adv_by_std_in_grpo``) computed by :func:`dapo_ops.group_advantages`, except
  that a group whose spread is float rounding gets exactly 0.
- :mod:`dapo_ops.integrations.verl_losses` states every other verl ``loss_mode`` that has
  an objective here (``sapo``, ``dppo_tv``, ``gspo``, ...) and registers each as
  ``dapo_ops_<loss_mode>``; :mod:`dapo_ops.integrations.verl_estimators` registers the
  optimal-token-baseline estimators as ``dapo_ops_optimal_token_baseline`` and
  ``dapo_ops_tir_optimal_token_baseline``.
- :func:`register` puts all of them into verl's registries. A verl run needs no line of
  ours: the installed package declares :mod:`dapo_ops.integrations.verl_plugin` under
  verl's ``verl.plugins`` entry points, which verl loads in every process that imports it
  (Ray workers included), and that registers everything once
  ``verl.trainer.ppo.core_algos`` is imported. Importing this module does the same, in
  either order (now if ``core_algos`` is loaded, else right after it is), so
  ``VERL_USE_EXTERNAL_MODULES=dapo_ops.integrations.verl`` is the fallback where entry
  points are off (``VERL_USE_EXTERNAL_PLUGINS=none``).

Importing this module does not import verl (nor does ``import dapo_ops``). Tested against
verl 0.9.1 (``tests/integration/test_verl.py``): equal to verl's ``vanilla`` loss (value,
gradient, metrics) for every ``loss_agg_mode``, with and without global batch info and
rollout IS weights, and to ``compute_grpo_outcome_advantage`` on ragged uid layouts.

Example:
    >>> verl_aggregation("token-mean", {"dp_size": 2, "batch_num_tokens": 30})
    ('token_mean', tensor(15., dtype=torch.float64), None)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dapo_ops._validate import InputError
from dapo_ops.integrations._verl_common import (
    VERL_AGG_MODES,
    _config_value,
    ppo_kl,
    verl_aggregation,
)
from dapo_ops.integrations.verl_advantages import (
    compute_grpo_outcome_advantage,
    register_advantages,
)
from dapo_ops.integrations.verl_estimators import register_estimators
from dapo_ops.integrations.verl_losses import register_all
from dapo_ops.integrations.verl_plugin import register_when_ready
from dapo_ops.loss import token_level_loss

#: The names this module registers under in verl.
LOSS_NAME = "dapo_ops"
ADV_ESTIMATOR_NAME = "dapo_ops_grpo"


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """verl ``PolicyLossFn``: the Clip-Higher (dual-clip) PPO loss by :func:`dapo_ops.token_level_loss`.

    Same arguments and result as verl's ``compute_policy_loss_vanilla``: ``[bs,
    response_length]`` tensors, ``response_mask`` 0/1 (any dtype), ``config`` the actor
    config; returns ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl",
    "actor/pg_clipfrac_lower"})``. Fully masked rows and all-masked micro-batches give 0,
    not NaN; masked positions may hold anything.
    """
    if config is None:
        raise InputError("compute_policy_loss needs verl's actor config (config=...)")
    clip_ratio = _config_value(config, "clip_ratio", 0.2)
    eps_low = float(_config_value(config, "clip_ratio_low", clip_ratio))
    eps_high = float(_config_value(config, "clip_ratio_high", clip_ratio))
    dual_clip = float(_config_value(config, "clip_ratio_c", 3.0))
    mode, normalizer, max_len = verl_aggregation(
        loss_agg_mode,
        _config_value(config, "global_batch_info", {}),
        _config_value(config, "loss_scale_factor", None),
    )
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    loss, diag = token_level_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        mode=mode,
        normalizer=normalizer,
        dual_clip=dual_clip,
        max_len=max_len,
        is_weights=rollout_is_weights,
        return_diagnostics=True,
    )
    metrics = {
        "actor/pg_clipfrac": float(diag.clip_frac_low + diag.clip_frac_high),
        "actor/ppo_kl": ppo_kl(log_prob, old_log_prob, mask),
        "actor/pg_clipfrac_lower": float(diag.clip_frac_dual),
    }
    return loss, metrics


def register(loss_name: str = LOSS_NAME, adv_estimator_name: str = ADV_ESTIMATOR_NAME) -> None:
    """Register :func:`compute_policy_loss`, :func:`compute_grpo_outcome_advantage` and the
    other ``dapo_ops_*`` losses and estimators in verl.

    Idempotent (a second call replaces the entries). Imports ``verl.trainer.ppo.core_algos``;
    importing this module calls it as soon as that is loaded
    (:func:`~dapo_ops.integrations.verl_plugin.register_when_ready`).
    """
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss(loss_name)(compute_policy_loss)
    register_all()
    register_advantages()
    register_estimators()
    # register_adv_est refuses a second function under a name (a reloaded module's).
    core_algos.ADV_ESTIMATOR_REGISTRY.pop(adv_estimator_name, None)
    core_algos.register_adv_est(adv_estimator_name)(compute_grpo_outcome_advantage)


__all__ = [
    "ADV_ESTIMATOR_NAME",
    "LOSS_NAME",
    "VERL_AGG_MODES",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "ppo_kl",
    "register",
    "verl_aggregation",
]

# Now if verl.trainer.ppo.core_algos is loaded, else right after its first import.
register_when_ready(register)
