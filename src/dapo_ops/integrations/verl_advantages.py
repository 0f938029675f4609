"""verl's advantage estimators, each registered as ``dapo_ops_<adv_estimator>``, from one table.

:data:`ROWS` holds one row per verl 0.9.1 ``adv_estimator``: verl's parameters (names,
defaults, order), the dapo_ops computation they feed with the config fields verl reads,
and how the result is laid over ``response_mask``; one generic body
(:func:`dapo_ops.integrations._verl_twin_table.twin`) makes each row a function with
verl's signature (:data:`ESTIMATORS`). Adding a twin is adding a row. All are vectorised
over samples (verl loops over them in Python for most), no ``.item()``, no autograd, and
return ``(advantages, returns)`` in the rewards' dtype, 0 at masked positions.

The outcome estimators score a response by the sum of its ``token_level_rewards`` and
group by ``index`` (verl's ``uid`` array, any hashable values). Results equal verl's in
float64 to rounding on every input: ragged groups, one-sample groups, equal-score groups,
empty rows (``tests/integration/test_verl_advantage_grid.py``, 1e-10 relative). A
one-sample group has verl's mean 0 and std ``torch.tensor(1.0)``, a float32: ``grpo``
(and ``grpo_vectorized``, ``gdpo``) give it ``score / float32(1 + epsilon)``
(``1 + 1e-6`` rounds to ``1.00000095367431640625``), the raw score unscaled; ``rloo``,
``reinforce_plus_plus_baseline``, ``opo`` and ``gpg`` keep its raw score, as the baseline
0 of verl's loops; ``rloo_vectorized`` gives it 0. Where verl itself computes in float32
ours are the exact values of the same formula: ``grpo_vectorized``'s group statistics
(float32 in verl even for float64 scores), ``gdpo``'s components (verl reads them as
float32). An ``opo`` group whose responses are all empty gets 0 (verl: NaN, 0 / 0).

Config: ``grpo`` and ``grpo_vectorized`` read ``norm_adv_by_std_in_grpo`` from the
algorithm config when it is given (else the argument), which is what verl's trainer does
for ``grpo`` (it passes the flag to its function); through the registry verl's
``grpo_vectorized`` never sees the flag and always scales by the std. ``grpo_passk``
reads it from the config, which it requires, as verl; ``gdpo`` from the argument only
(verl passes it on to its ``grpo``), its components and weights from
``gdpo_reward_keys``/``gdpo_reward_weights``; ``reinforce_plus_plus`` reads ``gamma``;
``gpg`` takes ``f_norm`` and, as verl, recomputes ``alpha`` (``batch / #nonzero scores``,
a float32 division) whatever is passed. verl's trainer computes ``gae`` without its
registry (``ray_trainer.compute_advantage`` passes ``values``, ``gamma``, ``lam``);
``dapo_ops_gae`` has verl's signature for code that calls it itself. ``adv_estimator:
dapo_ops_<name>`` in a verl config selects them once
:func:`dapo_ops.integrations.verl.register` ran.

Example:
    >>> sorted(ESTIMATORS)[:3]
    ['gae', 'gdpo', 'gpg']
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.advantages.estimators import opo_advantages, passk_advantages
from dapo_ops.advantages.returns import gae_advantages, reinforce_pp_advantages, remax_advantages
from dapo_ops.integrations._verl_twin_table import (
    OUTCOME,
    REQUIRED,
    Args,
    Row,
    group_stats,
    grpo,
    register,
    twin,
    verl_whiten,
)

_NORM = (("norm_adv_by_std_in_grpo", True),)


def _grpo(a: Args) -> Tensor:
    scale = a.config("norm_adv_by_std_in_grpo", a["norm_adv_by_std_in_grpo"])
    return grpo(a.scores, a.ids, eps=float(a["epsilon"]), scale=bool(scale))


def _leave_one_out(a: Args, lone: float) -> Tensor:
    """``s - mean of the others`` = ``n / (n - 1) (s - mean)``; ``lone`` times ``s`` alone."""
    scores = a.scores
    mean, _, count = group_stats(scores, a.ids)
    x = scores.to(mean.dtype)
    return torch.where(count > 1, (x - mean) * count / (count - 1).clamp(min=1), lone * x)


def _centred(a: Args) -> Tensor:
    scores = a.scores
    mean, _, _ = group_stats(scores, a.ids)
    return scores.to(mean.dtype) - mean


def _gpg(a: Args) -> Tensor:
    scores = a.scores
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)  # float32, as verl's
    return alpha * _centred(a) / float(a["f_norm"])


def _opo(a: Args) -> Tensor:
    return opo_advantages(a.scores, a.valid.sum(dim=-1), a.ids)


def _passk(a: Args) -> Tensor:
    scale = bool(a.config("norm_adv_by_std_in_grpo", True, required=True))
    return passk_advantages(a.scores, a.ids, scale=scale, eps=float(a["epsilon"]))


def _gdpo(a: Args) -> Tensor:
    """Each component GRPO-normalised in its group, weighted (float32 weights, as verl)."""
    ids, device = a.ids, a.valid.device
    components, weights = [a.scores], None
    if a["config"] is not None and a["non_tensor_batch"] is not None and a["batch"] is not None:
        keys, table = a.config("gdpo_reward_keys", None), a["non_tensor_batch"]
        if not keys:
            raise InputError("dapo_ops_gdpo needs algorithm.gdpo_reward_keys (the components)")
        if missing := [k for k in keys if k not in table]:
            raise InputError(f"gdpo_reward_keys {missing} are not in non_tensor_batch")
        components = [torch.tensor(np.asarray(table[k], dtype=np.float32)).to(device) for k in keys]
        if (given := a.config("gdpo_reward_weights", None)) is not None:
            weights = torch.tensor(list(given), dtype=torch.float32, device=device)
    if weights is None:
        weights = torch.ones(len(components), dtype=torch.float32, device=device)
    scale, eps = bool(a["norm_adv_by_std_in_grpo"]), float(a["epsilon"])
    total = weights[0] * grpo(components[0], ids, eps=eps, scale=scale)
    for w, c in zip(weights[1:], components[1:], strict=True):
        total = total + w * grpo(c, ids, eps=eps, scale=scale)
    return total


def _gae(a: Args) -> tuple[Tensor, Tensor]:
    adv, returns = gae_advantages(
        a["token_level_rewards"], a["values"], a.valid, gamma=float(a["gamma"]),
        lam=float(a["lam"]), whiten=False,
    )  # fmt: skip
    return verl_whiten(adv, a.valid), returns


def _reinforce_pp(a: Args) -> tuple[Tensor, Tensor]:
    gamma = float(a.config("gamma", 1.0, required=True))
    _, returns = reinforce_pp_advantages(a["token_level_rewards"], a.valid, gamma=gamma)
    return verl_whiten(returns, a.valid), returns


def _remax(a: Args) -> tuple[Tensor, Tensor]:
    return remax_advantages(a["token_level_rewards"], a["reward_baselines"], a.valid)


_T, _M = ("token_level_rewards", REQUIRED), ("response_mask", REQUIRED)

#: verl ``adv_estimator`` -> its row: verl's parameters, our computation, the spread.
ROWS: dict[str, Row] = {
    "gae": Row(
        (_T, ("values", REQUIRED), _M, ("gamma", REQUIRED), ("lam", REQUIRED)),
        _gae, "tokens", "dapo_ops.gae_advantages, whitened as verl.", config=False,
    ),
    "grpo": Row((*OUTCOME, *_NORM), _grpo, doc="(s - mean) / (std + epsilon) per uid group."),
    "grpo_vectorized": Row((*OUTCOME, *_NORM), _grpo, doc="as grpo, exact group statistics."),
    "gdpo": Row(
        (*OUTCOME, *_NORM, ("non_tensor_batch", None), ("batch", None)),
        _gdpo, "whiten", "GRPO per reward component, weighted, whitened.",
    ),
    "grpo_passk": Row((*OUTCOME, *_NORM), _passk, doc="dapo_ops.passk_advantages."),
    "reinforce_plus_plus": Row((_T, _M), _reinforce_pp, "tokens", "returns, whitened."),
    "reinforce_plus_plus_baseline": Row(OUTCOME, _centred, "whiten", "centred score, whitened."),
    "rloo": Row(OUTCOME, lambda a: _leave_one_out(a, 1.0), doc="leave-one-out baseline."),
    "rloo_vectorized": Row(OUTCOME, lambda a: _leave_one_out(a, 0.0), doc="as rloo; alone: 0."),
    "opo": Row(OUTCOME, _opo, doc="dapo_ops.opo_advantages."),
    "remax": Row((_T, ("reward_baselines", REQUIRED), _M), _remax, "tokens", "remax_advantages."),
    "gpg": Row((*OUTCOME, ("f_norm", 1.0), ("alpha", 1.0)), _gpg, doc="alpha (s - mean) / f_norm."),
}  # fmt: skip

#: verl ``adv_estimator`` -> ours (registered as ``dapo_ops_<name>``).
ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    name: twin(name, row) for name, row in ROWS.items()
}
compute_grpo_outcome_advantage = ESTIMATORS["grpo"]


def register_advantages() -> None:
    """Register every function of :data:`ESTIMATORS` as ``dapo_ops_<name>``. Idempotent."""
    register({f"dapo_ops_{name}": fn for name, fn in ESTIMATORS.items()})
