"""verl's optimal-token-baseline estimators, registered as ``dapo_ops_<adv_estimator>``.

:func:`compute_optimal_token_baseline_advantage` and
:func:`compute_tir_optimal_token_baseline_advantage` take verl 0.9.1's arguments
(``token_level_rewards``, ``response_mask``, ``index``, ``old_log_probs``,
``sum_pi_squared``, ``rollout_is_weights``, ``handle_zero_tail``, ``epsilon``) and
compute :func:`dapo_ops.optimal_token_baseline_advantages` (``align="position"`` and
``"response_token"``), rows of the same table as :mod:`dapo_ops.integrations.verl_advantages`;
verl's functions read nothing from the algorithm config, and neither do these. Tested against verl's own
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

from collections.abc import Callable

from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.advantages.optimal_baseline import OTBAlign, optimal_token_baseline_advantages
from dapo_ops.integrations._verl_twin_table import (
    REQUIRED,
    Args,
    Row,
    group_ids,
    register,
    twin,
)

__all__ = ["ESTIMATORS", "ESTIMATOR_NAMES", "group_ids", "register_estimators"]

#: verl ``adv_estimator`` -> the name ours is registered under.
ESTIMATOR_NAMES = {
    "optimal_token_baseline": "dapo_ops_optimal_token_baseline",
    "tir_optimal_token_baseline": "dapo_ops_tir_optimal_token_baseline",
}

#: verl's parameters of both (``index`` required, as verl's).
_PARAMS = (
    ("token_level_rewards", REQUIRED),
    ("response_mask", REQUIRED),
    ("index", REQUIRED),
    ("old_log_probs", None),
    ("sum_pi_squared", None),
    ("rollout_is_weights", None),
    ("handle_zero_tail", True),
    ("epsilon", 1e-8),
)


def _otb(align: OTBAlign) -> Callable[[Args], tuple[Tensor, Tensor]]:
    def compute(a: Args) -> tuple[Tensor, Tensor]:
        if a["old_log_probs"] is None or a["sum_pi_squared"] is None:
            raise InputError(
                "the optimal token baseline needs old_log_probs and sum_pi_squared; verl's "
                "trainer passes them only to the estimators named 'optimal_token_baseline' and "
                "'tir_optimal_token_baseline': register ours under those names with "
                "dapo_ops.integrations.verl_estimators.register_estimators(replace_verl=True) "
                "and set actor.calculate_sum_pi_squared=True"
            )
        return optimal_token_baseline_advantages(
            a["token_level_rewards"], a["old_log_probs"], a["sum_pi_squared"], a.valid, a.ids,
            is_weights=a["rollout_is_weights"], align=align,
            zero_tail=bool(a["handle_zero_tail"]), eps=float(a["epsilon"]),
        )  # fmt: skip

    return compute


#: verl ``adv_estimator`` -> its row (the table of :mod:`dapo_ops.integrations.verl_advantages`).
ROWS = {
    "optimal_token_baseline": Row(
        _PARAMS, _otb("position"), "tokens", 'align="position".', config=False
    ),
    "tir_optimal_token_baseline": Row(
        _PARAMS, _otb("response_token"), "tokens", 'align="response_token".', config=False
    ),
}
ESTIMATORS = {name: twin(name, row) for name, row in ROWS.items()}
compute_optimal_token_baseline_advantage = ESTIMATORS["optimal_token_baseline"]
compute_tir_optimal_token_baseline_advantage = ESTIMATORS["tir_optimal_token_baseline"]


def register_estimators(*, replace_verl: bool = False) -> None:
    """Register ours as ``dapo_ops_<name>``; with ``replace_verl`` also under verl's own
    names (replacing verl's functions in its registry). Idempotent."""
    register({ESTIMATOR_NAMES[name]: fn for name, fn in ESTIMATORS.items()})
    if replace_verl:
        register(ESTIMATORS)
