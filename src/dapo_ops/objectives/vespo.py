"""VESPO: a gamma-shaped weight of the sequence importance ratio times the log-prob (TRL)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from dapo_ops._core._rules import masked
from dapo_ops.objectives.base import Objective, TokenInputs, check_positive

#: TRL clamps the sequence log-ratio to [log(1e-8), 20] before the gamma weight.
_LOG_W_MIN = math.log(1e-8)


@dataclasses.dataclass(frozen=True)
class VESPO(Objective):
    r"""VESPO: every token's policy gradient weighted by a gamma function of its sequence's
    importance ratio (TRL 1.16 ``loss_type="vespo"``).

    .. math::

        \log w_i = \mathrm{clamp}\Big(\sum_t m_{i,t}\log r_{i,t},\ \log 10^{-8},\ 20\Big),
        \qquad \phi_i = \exp(\lambda + k\log w_i - \lambda w_i),
        \qquad \ell_{i,t} = -\mathrm{sg}[\phi_i]\,A_{i,t}\log\pi_\theta(y_{i,t})

    with :math:`(k, \lambda) = (k_{pos}, \lambda_{pos})` where :math:`A \ge 0`, else
    :math:`(k_{neg}, \lambda_{neg})`. :math:`\phi(1) = 1`; it peaks at :math:`w = k/\lambda`
    and fades for sequences far off-policy on either side. Like CISPO, no token loses its
    gradient (``-phi A``); the value is not an objective estimate. The token log-ratios are
    clamped to ``+-log_ratio_clamp`` (20, as TRL) before the sum.

    Fields (TRL's defaults): ``k_pos=2.0``, ``lambda_pos=3.0``, ``k_neg=3.0``,
    ``lambda_neg=2.0``. TRL also folds vLLM's importance-sampling ratio into ``w``; pass
    ``is_weights`` to :func:`policy_loss` instead to multiply the loss by it.

    Paper: Shen et al. 2026, "VESPO: Variational Sequence-Level Soft Policy Optimization
    for Stable Off-Policy LLM Training" (arXiv:2602.10693).

    Example:
        >>> VESPO()
        VESPO(log_ratio_clamp=20.0, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)
    """

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "k_pos", "lambda_pos", "k_neg", "lambda_neg")

    def weight(self, x: TokenInputs) -> Tensor:
        """``phi`` per token (its sequence's), detached."""
        seq = masked(x.valid, x.clamped).sum(dim=-1, keepdim=True)
        log_w = seq.clamp(_LOG_W_MIN, 20.0)
        nonneg = x.adv >= 0
        k = torch.where(nonneg, x.adv.new_full((), self.k_pos), x.adv.new_full((), self.k_neg))
        lam = torch.where(
            nonneg, x.adv.new_full((), self.lambda_pos), x.adv.new_full((), self.lambda_neg)
        )
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0).detach()

    def term(self, x: TokenInputs) -> Tensor:
        return -self.weight(x) * x.adv * x.logp

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return weight * (-self.weight(x) * x.adv)
