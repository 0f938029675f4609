"""The unclipped importance-ratio surrogate ``-A r`` (TRPO's, PPO's L^CPI)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from dapo_ops.objectives.base import Objective, TokenInputs


@dataclasses.dataclass(frozen=True)
class RatioSurrogate(Objective):
    r"""The importance-ratio surrogate with no clip.

    .. math::

        \ell_{i,t} = -r_{i,t}A_{i,t},\qquad r_{i,t} = \exp(\log\pi_\theta - \log\pi_{old})

    The surrogate whose gradient at :math:`\pi_\theta = \pi_{old}` is the policy gradient
    (Kakade & Langford 2002; TRPO, Schulman et al. 2015; PPO's :math:`L^{CPI}`, Schulman et
    al. 2017, eq. 6); nothing bounds the step. verl's ``kl_cov`` loss is this term plus a
    :math:`|\log r|` penalty on the tokens :func:`dapo_ops.kl_cov_mask` selects
    (``policy_loss(RatioSurrogate(), ..., kl=KLPenalty(coef, "abs"), ref_logp=old_logp,
    kl_weights=selection)``). The gradient is ``-A r`` where the log-ratio clamp does not
    act, 0 where it does. No fields beyond ``log_ratio_clamp`` (default 20, as verl's clamp
    elsewhere; verl's ``kl_cov`` itself does not clamp).

    Papers: Schulman et al. 2015, "Trust Region Policy Optimization" (arXiv:1502.05477);
    the selection of verl's ``kl_cov``, Cui et al. 2025, "The Entropy Mechanism of
    Reinforcement Learning for Reasoning Language Models" (arXiv:2505.22617).

    Example:
        >>> RatioSurrogate()
        RatioSurrogate(log_ratio_clamp=20.0)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    def term(self, x: TokenInputs) -> Tensor:
        return -x.adv * x.ratio

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        # (w * -A) * r: autograd's rounding order through term(), as ClipHigher's
        keep = x.clamped == x.log_ratio
        return torch.where(keep, (weight * x.adv.neg()) * x.ratio, 0.0)
