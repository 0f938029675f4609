"""CISPO: clip the importance-sampling weight, not the update (MiniMax-M1, 2025)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import Tensor

from dapo_ops.objectives.base import Clipped, Objective, TokenInputs, check_field, check_number


@dataclasses.dataclass(frozen=True)
class CISPO(Objective):
    r"""CISPO: a detached, clipped importance weight times the log-prob.

    .. math::

        \ell_{i,t} = -\,\mathrm{sg}\big[\mathrm{clip}(r_{i,t}, 1-\varepsilon_{low},
            1+\varepsilon_{high})\big]\,A_{i,t}\,\log\pi_\theta(y_{i,t})

    No token loses its gradient: ``d l / d logp = -w A`` with ``w`` the clipped weight,
    so its size is at most ``(1 + eps_high) |A|``. The loss *value* is not an objective
    estimate (it contains ``log pi``, as in verl's and TRL's CISPO); only its gradient is.

    Fields: ``eps_high=0.28`` (cap ``1.28``: DAPO's upper bound, as verl's CISPO uses
    ``1 + clip_ratio_high``); ``eps_low=1.0`` (floor ``0``: MiniMax-M1 imposes no lower
    bound and tunes only the upper one). Aggregate with ``token_mean``, as the paper.

    Paper: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with
    Lightning Attention" (arXiv:2506.13585).

    Example:
        >>> CISPO()
        CISPO(log_ratio_clamp=20.0, eps_low=1.0, eps_high=0.28)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    eps_low: float = 1.0
    eps_high: float = 0.28

    def __post_init__(self) -> None:
        super().__post_init__()
        low, high = check_number(self, "eps_low"), check_number(self, "eps_high")
        check_field(self, "eps_low", 0.0 <= low <= 1.0, "must lie in [0, 1] (floor 1 - eps_low)")
        check_field(self, "eps_high", 0.0 <= high < float("inf"), "must be finite and >= 0")

    def weight(self, x: TokenInputs) -> Tensor:
        """The detached importance weight ``clip(r, 1 - eps_low, 1 + eps_high)``."""
        return x.ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high).detach()

    def term(self, x: TokenInputs) -> Tensor:
        return -self.weight(x) * x.adv * x.logp

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return weight * (-self.weight(x) * x.adv)

    def clipped(self, x: TokenInputs) -> Clipped:
        low = x.ratio < 1.0 - self.eps_low
        return Clipped(low, x.ratio > 1.0 + self.eps_high, torch.zeros_like(x.valid))
