"""KL in the reward (PPO-RLHF): the rewards minus ``beta`` times a per-token KL estimate,
and the adaptive KL controller that moves ``beta`` towards a target KL.

The alternative to :class:`dapo_ops.KLPenalty` (KL in the *loss*, GRPO's): here the
penalty is paid through the returns and the advantages, before the policy loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import compute_dtype, masked, safe_divide
from dapo_ops._core._validate import (
    InputError,
    check_float,
    check_no_grad,
    check_real,
    check_same_shape,
    check_scalar,
)
from dapo_ops.engine.kl import KLEstimator, kl_penalty

__all__ = ["KLReward", "adaptive_kl_coef", "kl_reward"]


class KLReward(NamedTuple):
    """The penalised rewards, the per-token KL estimate and its batch mean."""

    rewards: Tensor  # [batch, seq]: scores - coef * kl at valid tokens, 0 elsewhere
    kl: Tensor  # [batch, seq]: the estimate, 0 at masked tokens
    kl_mean: Tensor  # 0-dim: the mean over rows of each row's token mean


@checks_values
def kl_reward(
    token_scores: Float[Tensor, "batch seq"],
    logp: Float[Tensor, "batch seq"],
    ref_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    coef: float | Float[Tensor, ""],
    estimator: KLEstimator = "k1",
    clamp: float | None = None,
) -> KLReward:
    r"""Token rewards with the KL to the reference policy subtracted (KL in the reward).

    .. math::

        r_{i,t} = s_{i,t} - \beta\,k(\log\pi_{old}(y_{i,t}) - \log\pi_{ref}(y_{i,t}))

    with :math:`k` the estimator of :func:`dapo_ops.kl_penalty` (``k1`` = the log-ratio,
    ``k2``, ``k3``, ``abs``; ``clamp`` bounds it, ``clamp=10`` with ``k3`` being verl's
    ``low_var_kl``) on the rollout policy's log-probs ``logp`` (a constant here: the
    penalty shapes the rewards, it is not differentiated). Feed ``rewards`` to a token-level
    estimator (:func:`dapo_ops.gae_advantages`, :func:`dapo_ops.reinforce_pp_advantages`).

    ``kl_mean`` is the mean over the batch's rows of each row's token mean (a row with no
    valid token counts as 0, as verl's ``actor/reward_kl_penalty``): the "current KL" to
    hand to :func:`adaptive_kl_coef`. A 0-dim tensor: no host sync.

    ``coef``: a finite number or a 0-dim tensor (no recompilation when it changes; a host
    tensor is read as a scalar, not copied to the device).
    Masked positions of ``rewards`` and ``kl`` are 0, whatever the inputs hold there.

    Defaults: ``k1`` (verl 0.9.1's ``algorithm.kl_penalty="kl"``; Ziegler et al. 2019,
    "Fine-Tuning Language Models from Human Preferences"). verl: ``ray_trainer.
    apply_kl_penalty`` with ``algorithm.use_kl_in_reward=True``.

    Shapes: every tensor ``[batch, seq]``; float32 results (float64 for float64 inputs).

    Example:
        >>> s = torch.tensor([[0.0, 1.0]])
        >>> kl_reward(s, torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, -1.5]]),
        ...           torch.tensor([[True, True]]), coef=0.1).rewards
        tensor([[-0.1000,  0.9500]])
    """
    check_no_grad("logp", logp)
    kl = kl_penalty(logp, ref_logp, mask, estimator=estimator, clamp=clamp)
    check_float("token_scores", token_scores)
    check_same_shape("token_scores", token_scores, "logp", logp)
    c = check_scalar("coef", coef)
    valid = mask if mask.dtype == torch.bool else mask != 0
    dtype = compute_dtype(token_scores, kl, *([c] if isinstance(c, Tensor) else []))
    kl = kl.to(dtype)
    beta: Tensor | float = c
    if isinstance(c, Tensor):  # a host scalar stays there: no blocking copy to the device
        beta = c.to(dtype=dtype) if c.device.type == "cpu" else c.to(kl.device, dtype)
    rewards = masked(valid, token_scores.to(dtype) - beta * kl)
    rows = safe_divide(kl.sum(dim=-1), valid.sum(dim=-1).to(dtype))
    # a Python count, not a tensor made from it: that would be a copy to the device
    return KLReward(rewards, kl, rows.sum() / max(rows.shape[0], 1))


def adaptive_kl_coef(
    coef: float | Float[Tensor, ""],
    current_kl: float | Float[Tensor, ""],
    *,
    n_steps: int,
    target: float = 0.1,
    horizon: int = 10000,
) -> float | Tensor:
    r"""One update of the adaptive KL coefficient (Ziegler et al. 2019, sec. 2.2).

    .. math::

        e = \mathrm{clip}\Big(\frac{KL}{KL_{target}} - 1,\ -0.2,\ 0.2\Big),\qquad
        \beta \leftarrow \beta\,\big(1 + e\,n / H\big)

    with ``n = n_steps`` the samples of the step just measured and ``H = horizon``: the
    coefficient grows while the KL is above the target and shrinks below it, by at most
    ``0.2 n / H`` per update. A *fixed* controller is no update: keep ``coef``.

    ``coef`` and ``current_kl``: Python numbers (then a float is returned) or 0-dim
    tensors that do not require grad (then a tensor, no host sync). A NaN KL is refused as
    a number; as a tensor it makes the result NaN (never silent).

    Defaults: verl 0.9.1's ``algorithm.kl_ctrl`` (``target_kl=0.1``, ``horizon=10000``).
    verl: ``core_algos.AdaptiveKLController.update``.

    Example:
        >>> adaptive_kl_coef(0.5, 0.3, n_steps=1000, target=0.1, horizon=10000)  # KL too high: * 1.02
        0.51
    """
    c = check_scalar("coef", coef)
    kl = check_scalar("current_kl", current_kl)
    t = check_real("target", target)
    if t <= 0:
        raise InputError(f"target must be > 0, got {t}")
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
        raise InputError(f"n_steps must be an int >= 0, got {n_steps!r}")
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon <= 0:
        raise InputError(f"horizon must be an int > 0, got {horizon!r}")
    if not isinstance(c, Tensor) and not isinstance(kl, Tensor):
        err = min(max(kl / t - 1.0, -0.2), 0.2)
        return c * (1.0 + err * n_steps / horizon)
    ref = c if isinstance(c, Tensor) else kl
    assert isinstance(ref, Tensor)
    dtype = compute_dtype(*(x for x in (c, kl) if isinstance(x, Tensor)))
    ct = torch.as_tensor(c, dtype=dtype, device=ref.device)
    kt = torch.as_tensor(kl, dtype=dtype, device=ref.device)
    err_t = (kt / t - 1.0).clamp(-0.2, 0.2)  # clamp keeps a NaN KL NaN
    return ct * (1.0 + err_t * n_steps / horizon)
