"""SAPO: soft, temperature-controlled gates instead of a hard clip (arXiv 2511.20347)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from dapo_ops.objectives.base import Objective, TokenInputs, check_positive


@dataclasses.dataclass(frozen=True)
class SAPO(Objective):
    r"""Soft Adaptive Policy Optimization: a sigmoid gate of the ratio replaces the clip.

    .. math::

        \ell_{i,t} = -A_{i,t}\,\frac{4}{\tau}\,\sigma\big(\tau\,(r_{i,t} - 1)\big),\qquad
        \tau = \tau_{pos}\ (A > 0),\ \tau_{neg}\ (A \le 0)

    The gate's slope at ``r = 1`` is 1, so near the old policy the gradient is PPO's
    ``-A r``; away from it the gradient ``-A r\, 4\sigma(1-\sigma)`` fades smoothly instead
    of dropping to 0 at a bound. No token is "clipped".

    Fields (defaults from the SAPO paper, arXiv 2511.20347, and verl 0.9.1's
    ``tau_pos``/``tau_neg``): ``tau_pos=1.0``, ``tau_neg=1.05`` (a faster fade for negative
    advantages). verl: ``loss_mode="sapo"`` (which always aggregates with
    ``seq-mean-token-mean``: use ``mode="seq_mean_token_mean"``); TRL: ``loss_type="sapo"``
    with ``sapo_temperature_pos``/``_neg`` (TRL does not clamp the log-ratio; ours and
    verl's clamp it to +-20).

    Paper: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347).

    Example:
        >>> SAPO()
        SAPO(log_ratio_clamp=20.0, tau_pos=1.0, tau_neg=1.05)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "tau_pos", "tau_neg")

    def _gate(self, x: TokenInputs) -> tuple[Tensor, Tensor]:
        """``(tau, sigma(tau (r - 1)))`` per token."""
        pos, neg = x.ratio.new_full((), self.tau_pos), x.ratio.new_full((), self.tau_neg)
        tau = torch.where(x.adv > 0, pos, neg)  # in the compute dtype (two Python floats
        # would give the default dtype: 1.05 rounded to float32); new_full fills on the
        # device (new_tensor would copy from the host: a sync on CUDA)
        return tau, torch.sigmoid(tau * (x.ratio - 1.0))

    def term(self, x: TokenInputs) -> Tensor:
        tau, gate = self._gate(x)
        return -(gate * (4.0 / tau)) * x.adv

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        _, gate = self._gate(x)
        slope = (4.0 * gate * (1.0 - gate)) * x.ratio  # d/dlogp of (4/tau) sigma(tau (r - 1))
        keep = x.clamped == x.log_ratio
        return torch.where(keep, (weight * x.adv.neg()) * slope, 0.0)
