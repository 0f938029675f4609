"""Token-level advantage estimators: returns over the valid tokens of each response.

:func:`gae_advantages` (PPO's critic-based GAE), :func:`reinforce_pp_advantages`
(REINFORCE++) and :func:`remax_advantages` (ReMax) take per-token rewards ``[batch, seq]``
and a mask and return ``(advantages, returns)``, 0 at masked positions; masked positions are
skipped by the recurrences, as verl's. :func:`masked_whiten` is the whitening verl applies.
No Python loop over samples: the recurrences loop over the ``seq`` positions, vectorised over
the batch. The outcome estimators (one score per sample) are in :mod:`dapo_ops.advantages.estimators`.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_bool,
    check_float,
    check_ndim,
    check_real,
    check_same_device,
    check_same_shape,
)


def _unit(name: str, value: object) -> float:
    """A discount-like option: a finite real in [0, 1]."""
    x = check_real(name, value)
    if not 0.0 <= x <= 1.0:
        raise InputError(f"{name} must lie in [0, 1], got {x}")
    return x


@checks_values
def masked_whiten(
    values: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
) -> Float[Tensor, "batch seq"]:
    r"""``(x - mean) / sqrt(var + 1e-8)`` over the valid entries (unbiased variance).

    The whitening verl applies to GAE and REINFORCE++ advantages; masked entries come out
    0. Fewer than two valid entries leave the centred values unscaled (verl raises).

    Example:
        >>> masked_whiten(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]]))
        tensor([[-0.7071,  0.7071,  0.0000]])
    """
    check_float("values", values)
    check_ndim("values", values, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "values", values)
    x = masked(valid, values.to(compute_dtype(values)))
    n = valid.sum().to(x.dtype)
    mean = x.sum() / torch.where(n == 0, 1.0, n)
    centred = masked(valid, x - mean)
    var = centred.square().sum() / torch.where(n > 1, n - 1, 1.0)
    scale = torch.where(n > 1, torch.rsqrt(var + 1e-8), 1.0)
    return centred * scale


def _token_inputs(name: str, rewards: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    check_float(name, rewards)
    check_ndim(name, rewards, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, name, rewards)
    return masked(valid, rewards.to(compute_dtype(rewards))), valid


@checks_values
def gae_advantages(
    rewards: Float[Tensor, "batch seq"],
    values: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Float[Tensor, "batch seq"], Float[Tensor, "batch seq"]]:
    r"""Generalised advantage estimation over the valid tokens: ``(advantages, returns)``.

    .. math::

        \delta_t = r_t + \gamma V_{t'} - V_t,\qquad A_t = \delta_t + \gamma\lambda A_{t'}

    with :math:`t'` the next *valid* position (masked positions are skipped, as verl's
    ``compute_gae_advantage_return``), :math:`V = 0` past the end; ``returns = A + V``;
    advantages whitened over the valid tokens when ``whiten`` (verl always whitens).
    Defaults ``gamma = lam = 1`` are verl's (``algorithm.gamma``, ``algorithm.lam``);
    both must lie in [0, 1].

    Paper: Schulman et al. 2015, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation" (arXiv:1506.02438).

    Example:
        >>> a, ret = gae_advantages(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2),
        ...                         torch.ones(1, 2, dtype=torch.bool), whiten=False)
        >>> a
        tensor([[1., 1.]])
    """
    gamma, lam = _unit("gamma", gamma), _unit("lam", lam)
    check_bool("whiten", whiten)
    r, valid = _token_inputs("rewards", rewards, mask)
    check_float("values", values)
    check_same_shape("values", values, "rewards", rewards)
    check_same_device("values", values, "rewards", rewards)
    v = masked(valid, values.to(r.dtype))
    next_value = r.new_zeros(r.shape[0])
    last = r.new_zeros(r.shape[0])
    out = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        m = valid[:, t]
        gae = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * last
        next_value = torch.where(m, v[:, t], next_value)
        last = torch.where(m, gae, last)
        out[:, t] = last
    returns = masked(valid, out + v)
    return (masked_whiten(out, valid) if whiten else masked(valid, out)), returns


@checks_values
def reinforce_pp_advantages(
    rewards: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    gamma: float = 1.0,
) -> tuple[Float[Tensor, "batch seq"], Float[Tensor, "batch seq"]]:
    r"""REINFORCE++: discounted returns over valid tokens, whitened over the batch.

    :math:`G_t = r_t + \gamma G_{t'}` (``t'`` the next valid position); advantages are
    ``masked_whiten(G)``. Returns ``(advantages, returns)``, 0 at masked positions.
    ``gamma`` in [0, 1], default 1 as verl's ``algorithm.gamma``. verl:
    ``adv_estimator="reinforce_plus_plus"``.

    Paper: Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both
    Prompt and Reward Models" (arXiv:2501.03262).

    Example:
        >>> adv, ret = reinforce_pp_advantages(torch.tensor([[0.0, 1.0]]), torch.tensor([[1, 1]]))
        >>> ret
        tensor([[1., 1.]])
    """
    gamma = _unit("gamma", gamma)
    r, valid = _token_inputs("rewards", rewards, mask)
    running = r.new_zeros(r.shape[0])
    returns = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        new = r[:, t] + gamma * running
        running = torch.where(valid[:, t], new, running)
        returns[:, t] = torch.where(valid[:, t], new, 0.0)
    return masked_whiten(returns, valid), returns


@checks_values
def remax_advantages(
    rewards: Float[Tensor, "batch seq"],
    baselines: Float[Tensor, " batch"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
) -> tuple[Float[Tensor, "batch seq"], Float[Tensor, "batch seq"]]:
    r"""ReMax: the reward-to-go minus the reward of a greedy rollout of the same prompt.

    ``returns[t] = sum_{t' >= t} m r``, ``advantages = returns - b_i`` on valid tokens
    (``baselines`` ``[batch]``: the greedy response's reward). Returns ``(advantages,
    returns)``. verl: ``adv_estimator="remax"``.

    Paper: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models" (arXiv:2310.10505).

    Example:
        >>> adv, ret = remax_advantages(torch.tensor([[0.0, 1.0]]), torch.tensor([0.25]),
        ...                             torch.tensor([[1, 1]]))
        >>> adv
        tensor([[0.7500, 0.7500]])
    """
    r, valid = _token_inputs("rewards", rewards, mask)
    check_float("baselines", baselines)
    check_same_device("baselines", baselines, "rewards", rewards)
    check_ndim("baselines", baselines, 1, "[batch]")
    if baselines.shape[0] != r.shape[0]:
        raise InputError(
            f"baselines must have shape [batch]=[{r.shape[0]}], got {list(baselines.shape)}"
        )
    returns = r.flip(-1).cumsum(dim=-1).flip(-1)
    advantages = masked(valid, returns - baselines.to(r.dtype)[:, None])
    return advantages, returns
