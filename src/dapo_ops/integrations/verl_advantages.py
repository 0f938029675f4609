"""verl's advantage estimators, each registered as ``dapo_ops_<adv_estimator>``.

Every function takes verl 0.9.1's arguments (``token_level_rewards``, ``response_mask``,
``index`` = the ``uid`` array, ``config`` = the algorithm config, and what the estimator
needs besides) and reads the same config fields as verl's own function, then computes
with dapo_ops (:func:`dapo_ops.group_advantages`, :mod:`dapo_ops.advantages.estimators`,
:mod:`dapo_ops.advantages.returns`): vectorised over samples (verl loops over them in Python for
most), no ``.item()``. The outcome estimators score a response by the sum of its
``token_level_rewards`` and return ``(advantages, returns)`` broadcast over
``response_mask``, as verl. Results equal verl's in float64
(``tests/integration/test_verl_estimators.py``), except where verl computes in float32
(``grpo_vectorized``'s group statistics, ``gdpo``'s components: then ours are the exact
values of the same formula). ``adv_estimator: dapo_ops_<name>`` in a verl config selects
them once :func:`dapo_ops.integrations.verl.register` ran.

``dapo_ops_grpo`` and ``dapo_ops_grpo_vectorized`` read ``norm_adv_by_std_in_grpo`` from
the algorithm config, which is what verl's trainer does for ``grpo`` (it passes the flag
to its function); through the registry verl's ``grpo_vectorized`` never sees the flag and
always scales by the std.

verl's trainer computes ``gae`` without its registry (``ray_trainer.compute_advantage``
special-cases it, passing ``values``, ``gamma``, ``lam``); ``dapo_ops_gae`` has
verl's signature for code that calls the function itself.

Example:
    >>> sorted(ESTIMATORS)[:3]
    ['gae', 'gdpo', 'gpg']
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dapo_ops._core._rules import masked
from dapo_ops._core._validate import InputError
from dapo_ops.advantages.estimators import (
    gdpo_advantages,
    gpg_advantages,
    opo_advantages,
    passk_advantages,
)
from dapo_ops.advantages.group import group_advantages
from dapo_ops.advantages.returns import (
    gae_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    remax_advantages,
)
from dapo_ops.integrations._verl_common import _config_value
from dapo_ops.integrations.verl_estimators import group_ids

Uids = Iterable[Hashable]


def _outcome(
    token_level_rewards: Tensor, response_mask: Tensor, index: Uids | None, name: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Scores ``[batch]``, the bool mask and integer group ids of verl's ``uid`` array."""
    if index is None:
        raise InputError(f"dapo_ops_{name} needs index (verl's uid array: the prompt groups)")
    scores = token_level_rewards.sum(dim=-1)
    ids = group_ids(index, scores.shape[0], scores.device)
    return scores, response_mask != 0, ids


def _spread(adv: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """One advantage per response, broadcast over its valid tokens: ``(adv, adv)``."""
    out = masked(valid, adv[:, None].expand(valid.shape))
    return out, out


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Iterable[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl advantage estimator: GRPO outcome advantage via :func:`dapo_ops.group_advantages`.

    ``scores = token_level_rewards.sum(-1)`` grouped by ``index`` (verl's ``uid`` array,
    any hashable values); ``(score - mean) / (std + epsilon)`` with the unbiased std, or
    ``score - mean`` when ``norm_adv_by_std_in_grpo`` is off (read from ``config``, the
    algorithm config, when given); a one-sample group keeps its raw score, as in verl.
    Returns ``(advantages, returns)``, both the advantage broadcast over ``response_mask``.
    """
    if config is not None:
        norm_adv_by_std_in_grpo = bool(
            _config_value(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
        )
    scores = token_level_rewards.sum(dim=-1)
    lookup: dict[Hashable, int] = {}
    ids = [lookup.setdefault(uid, len(lookup)) for uid in index]
    if len(ids) != scores.shape[0]:
        raise InputError(f"index has {len(ids)} entries for {scores.shape[0]} responses")
    group_ids = torch.tensor(ids, dtype=torch.long, device=scores.device)
    with torch.no_grad():
        adv = group_advantages(
            scores,
            group_ids,
            scale="group" if norm_adv_by_std_in_grpo else "none",
            eps=epsilon,
            singleton="score",
        )
        adv = adv.to(scores.dtype).unsqueeze(-1) * response_mask
    return adv, adv


def compute_gae_advantage_return(
    token_level_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: Any, lam: Any
) -> tuple[Tensor, Tensor]:
    """verl's ``gae``: :func:`dapo_ops.gae_advantages` (whitened advantages, returns)."""
    return gae_advantages(
        token_level_rewards, values, response_mask != 0, gamma=float(gamma), lam=float(lam)
    )


def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Uids | None = None,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``rloo``: the score minus the mean of the group's other scores; a one-sample
    group keeps its score."""
    scores, valid, ids = _outcome(token_level_rewards, response_mask, index, "rloo")
    adv = group_advantages(scores, ids, scale="none", baseline="leave_one_out", singleton="score")
    return _spread(adv, valid)


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Uids | None = None,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``rloo_vectorized``: as ``rloo``, but a one-sample group gets 0."""
    scores, valid, ids = _outcome(token_level_rewards, response_mask, index, "rloo_vectorized")
    adv = group_advantages(scores, ids, scale="none", baseline="leave_one_out", singleton="zero")
    return _spread(adv, valid)


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Uids | None = None,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``reinforce_plus_plus_baseline``: the group-centred score (a one-sample group
    keeps its score), broadcast over the response and whitened over the batch's tokens."""
    scores, valid, ids = _outcome(
        token_level_rewards, response_mask, index, "reinforce_plus_plus_baseline"
    )
    centred = group_advantages(scores, ids, scale="none", singleton="score")
    adv = masked(valid, masked_whiten(masked(valid, centred[:, None].expand(valid.shape)), valid))
    return adv, adv


def compute_opo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Uids | None = None,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``opo``: the score minus the length-weighted group mean."""
    scores, valid, ids = _outcome(token_level_rewards, response_mask, index, "opo")
    return _spread(opo_advantages(scores, valid.sum(dim=-1), ids), valid)


def compute_gpg_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Uids | None = None,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``gpg``: :func:`dapo_ops.gpg_advantages` (verl recomputes ``alpha`` from the
    batch and ignores the argument; so does this)."""
    scores, valid, ids = _outcome(token_level_rewards, response_mask, index, "gpg")
    return _spread(gpg_advantages(scores, ids, f_norm=float(f_norm)), valid)


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Uids | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``grpo_passk``: :func:`dapo_ops.passk_advantages`, the std scaling read from
    ``config.norm_adv_by_std_in_grpo`` (as verl, which requires the config)."""
    if config is None:
        raise InputError("dapo_ops_grpo_passk needs verl's algorithm config (config=...)")
    scale = bool(_config_value(config, "norm_adv_by_std_in_grpo", True))
    scores, valid, ids = _outcome(token_level_rewards, response_mask, index, "grpo_passk")
    return _spread(passk_advantages(scores, ids, scale=scale, eps=float(epsilon)), valid)


def compute_gdpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Uids | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    non_tensor_batch: dict[str, Any] | None = None,
    batch: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``gdpo``: each component of ``config.gdpo_reward_keys`` (read from
    ``non_tensor_batch`` as float32, as verl) GRPO-normalised within its group, weighted by
    ``config.gdpo_reward_weights`` and whitened over the batch's tokens
    (:func:`dapo_ops.gdpo_advantages`); without the config and batches, the score alone."""
    scores, valid, ids = _outcome(token_level_rewards, response_mask, index, "gdpo")
    weights = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = _config_value(config, "gdpo_reward_keys", None)
        if not keys:
            raise InputError("dapo_ops_gdpo needs algorithm.gdpo_reward_keys (the components)")
        missing = [k for k in keys if k not in non_tensor_batch]
        if missing:
            raise InputError(f"gdpo_reward_keys {missing} are not in non_tensor_batch")
        columns = [np.asarray(non_tensor_batch[k], dtype=np.float32) for k in keys]
        components = torch.tensor(np.stack(columns, axis=1), device=scores.device)
        given = _config_value(config, "gdpo_reward_weights", None)
        if given is not None:
            weights = torch.tensor(list(given), dtype=torch.float32, device=scores.device)
    else:
        components = scores[:, None]
    adv = gdpo_advantages(
        components, ids, valid, weights=weights, scale=bool(norm_adv_by_std_in_grpo),
        eps=float(epsilon),
    )  # fmt: skip
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Tensor, response_mask: Tensor, config: Any = None, **kwargs: Any
) -> tuple[Tensor, Tensor]:
    """verl's ``reinforce_plus_plus``: discounted returns (``config.gamma``), whitened."""
    if config is None:
        raise InputError("dapo_ops_reinforce_plus_plus needs verl's algorithm config (gamma)")
    gamma = float(_config_value(config, "gamma", 1.0))
    return reinforce_pp_advantages(token_level_rewards, response_mask != 0, gamma=gamma)


def compute_remax_outcome_advantage(
    token_level_rewards: Tensor,
    reward_baselines: Tensor,
    response_mask: Tensor,
    config: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """verl's ``remax``: the reward-to-go minus the greedy rollout's reward."""
    return remax_advantages(token_level_rewards, reward_baselines, response_mask != 0)


#: verl ``adv_estimator`` -> ours, registered as ``dapo_ops_<name>``.
ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_vectorized": compute_grpo_outcome_advantage,
    "gdpo": compute_gdpo_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
}


def register_advantages() -> None:
    """Register every function of :data:`ESTIMATORS` as ``dapo_ops_<name>``. Idempotent."""
    from verl.trainer.ppo import core_algos

    for name, fn in ESTIMATORS.items():
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(f"dapo_ops_{name}", None)
        core_algos.register_adv_est(f"dapo_ops_{name}")(fn)
