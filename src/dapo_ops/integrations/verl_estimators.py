"""verl's optimal-token-baseline estimators, registered as ``dapo_ops_<adv_estimator>``.

:func:`compute_optimal_token_baseline_advantage` and
:func:`compute_tir_optimal_token_baseline_advantage` take verl 0.9.1's arguments
(``token_level_rewards``, ``response_mask``, ``index``, ``old_log_probs``,
``sum_pi_squared``, ``rollout_is_weights``, ``handle_zero_tail``, ``epsilon``) and
compute :func:`dapo_ops.optimal_token_baseline_advantages`; verl's functions read nothing
from the algorithm config, and neither do these. Tested against verl's own
(``tests/integration/test_verl_estimators.py``).

verl's trainer (``ray_trainer.compute_advantage``) hands ``old_log_probs`` and
``sum_pi_squared`` only to the estimators *named* ``optimal_token_baseline`` and
``tir_optimal_token_baseline``: under ``adv_estimator=dapo_ops_optimal_token_baseline``
it calls ours without them, which raises an ``InputError`` saying so. To run ours in a
verl trainer, ``register_estimators(replace_verl=True)`` also puts them under verl's two
names (and ``actor.calculate_sum_pi_squared=True``, as verl requires).

Example:
    >>> ESTIMATOR_NAMES["optimal_token_baseline"]
    'dapo_ops_optimal_token_baseline'
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.advantages.optimal_baseline import OTBAlign, optimal_token_baseline_advantages

#: verl ``adv_estimator`` -> the name ours is registered under.
ESTIMATOR_NAMES = {
    "optimal_token_baseline": "dapo_ops_optimal_token_baseline",
    "tir_optimal_token_baseline": "dapo_ops_tir_optimal_token_baseline",
}


def group_ids(index: Iterable[Hashable], rows: int, device: torch.device) -> Tensor:
    """verl's ``uid`` array (any hashable values) as integer group ids, in first-seen order."""
    lookup: dict[Hashable, int] = {}
    ids = [lookup.setdefault(uid, len(lookup)) for uid in index]
    if len(ids) != rows:
        raise InputError(f"index has {len(ids)} entries for {rows} responses")
    return torch.tensor(ids, dtype=torch.long, device=device)


def _otb(
    align: OTBAlign,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Iterable[Hashable],
    old_log_probs: Tensor | None,
    sum_pi_squared: Tensor | None,
    rollout_is_weights: Tensor | None,
    handle_zero_tail: bool,
    epsilon: float,
) -> tuple[Tensor, Tensor]:
    if old_log_probs is None or sum_pi_squared is None:
        raise InputError(
            "the optimal token baseline needs old_log_probs and sum_pi_squared; verl's "
            "trainer passes them only to the estimators named 'optimal_token_baseline' and "
            "'tir_optimal_token_baseline': register ours under those names with "
            "dapo_ops.integrations.verl_estimators.register_estimators(replace_verl=True) "
            "and set actor.calculate_sum_pi_squared=True"
        )
    ids = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    with torch.no_grad():
        adv, returns = optimal_token_baseline_advantages(
            token_level_rewards, old_log_probs, sum_pi_squared, mask, ids,
            is_weights=rollout_is_weights, align=align, zero_tail=bool(handle_zero_tail),
            eps=float(epsilon),
        )  # fmt: skip
    return adv.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


def compute_optimal_token_baseline_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Iterable[Hashable],
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``optimal_token_baseline``: :func:`dapo_ops.optimal_token_baseline_advantages`
    with ``align="position"``. Returns ``(advantages, returns)`` in the rewards' dtype."""
    return _otb(
        "position", token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
        rollout_is_weights, handle_zero_tail, epsilon,
    )  # fmt: skip


def compute_tir_optimal_token_baseline_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Iterable[Hashable],
    old_log_probs: Tensor | None = None,
    sum_pi_squared: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``tir_optimal_token_baseline``: :func:`dapo_ops.optimal_token_baseline_advantages`
    with ``align="response_token"``. Returns ``(advantages, returns)`` in the rewards' dtype."""
    return _otb(
        "response_token", token_level_rewards, response_mask, index, old_log_probs,
        sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon,
    )  # fmt: skip


ESTIMATORS = {
    "optimal_token_baseline": compute_optimal_token_baseline_advantage,
    "tir_optimal_token_baseline": compute_tir_optimal_token_baseline_advantage,
}


def register_estimators(*, replace_verl: bool = False) -> None:
    """Register ours as ``dapo_ops_<name>``; with ``replace_verl`` also under verl's own
    names (replacing verl's functions in its registry). Idempotent."""
    from verl.trainer.ppo import core_algos

    for name, fn in ESTIMATORS.items():
        targets = [ESTIMATOR_NAMES[name], *([name] if replace_verl else [])]
        for target in targets:
            # register_adv_est refuses a second function under a name
            core_algos.ADV_ESTIMATOR_REGISTRY.pop(target, None)
            core_algos.register_adv_est(target)(fn)
