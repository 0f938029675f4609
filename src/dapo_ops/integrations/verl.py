"""verl integration: dapo_ops' policy loss and GRPO advantage through verl's own registries.

- :func:`compute_policy_loss` has the signature of verl's ``PolicyLossFn`` and is
  registered as ``actor_rollout_ref.actor.policy_loss.loss_mode=dapo_ops``. It reads the
  actor config as verl's ``vanilla`` loss does (``clip_ratio_low`` / ``clip_ratio_high``,
  falling back to ``clip_ratio``; ``clip_ratio_c`` as the dual clip; ``loss_agg_mode``;
  ``global_batch_info`` for the global token / sequence counts, the dp size and
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

from dapo_ops.integrations._verl_common import VERL_AGG_MODES, ppo_kl, verl_aggregation
from dapo_ops.integrations.verl_advantages import (
    compute_grpo_outcome_advantage,
    register_advantages,
)
from dapo_ops.integrations.verl_distill import register_distillation
from dapo_ops.integrations.verl_estimators import register_estimators
from dapo_ops.integrations.verl_losses import policy_loss_fn, register_all
from dapo_ops.integrations.verl_plugin import DISTILL_LOSSES, after_import, register_when_ready

#: The names this module registers under in verl.
LOSS_NAME = "dapo_ops"
ADV_ESTIMATOR_NAME = "dapo_ops_grpo"


#: verl ``PolicyLossFn`` registered as ``loss_mode=dapo_ops``: verl's ``vanilla`` loss (the
#: Clip-Higher, dual-clip PPO loss), the ``vanilla`` row of
#: :data:`dapo_ops.integrations.verl_losses.TWINS`. Same arguments and result as verl's
#: ``compute_policy_loss_vanilla`` (``[bs, response_length]`` tensors, ``response_mask``
#: 0/1 of any dtype, ``config`` the actor config; returns ``(pg_loss, {"actor/pg_clipfrac",
#: "actor/ppo_kl", "actor/pg_clipfrac_lower"})``). Fully masked rows and all-masked
#: micro-batches give 0, not NaN; masked positions may hold anything.
compute_policy_loss = policy_loss_fn("vanilla", "compute_policy_loss")


def register(loss_name: str = LOSS_NAME, adv_estimator_name: str = ADV_ESTIMATOR_NAME) -> None:
    """Register :func:`compute_policy_loss`, :func:`compute_grpo_outcome_advantage` and the
    other ``dapo_ops_*`` losses and estimators in verl, and the distillation losses of
    :mod:`dapo_ops.integrations.verl_distill` where verl's distillation package imports.

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
    # The dapo_ops_<name> distillation losses, in a registry verl imports later (or never:
    # its distillation package needs Pillow), so when that module has loaded.
    after_import(DISTILL_LOSSES, register_distillation)


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
