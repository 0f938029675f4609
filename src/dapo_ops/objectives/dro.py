"""DRO: the policy gradient with a quadratic log-ratio penalty (verl's ``loss_mode="dro"``)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from dapo_ops.objectives.base import Objective, TokenInputs, check_positive


@dataclasses.dataclass(frozen=True)
class DRO(Objective):
    r"""Direct Reward Optimization's per-token loss: policy gradient minus a trust region.

    .. math::

        \ell_{i,t} = -\Big(A_{i,t}\,\log\pi_\theta(y_{i,t})
            - \frac{\beta}{2}\,\big(\log\pi_\theta - \log\pi_{old}\big)^2\Big)

    The gradient is ``-A + beta * log r``: the quadratic pulls the policy back towards the
    behaviour policy instead of clipping. verl 0.9.1 (``loss_mode="dro"``) requires
    ``policy_loss.dro_beta > 0`` and has no default; ``beta=1.0`` is ours (no paper value).
    The log-ratio is not clamped in the penalty (as verl); ``log_ratio_clamp`` bounds only
    the ratio the diagnostics report.

    Papers: Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large
    Language Models Alignment" (arXiv:2405.19107), which introduced Direct Reward
    Optimisation; the quadratic log-ratio penalty as in Kimi Team 2025, "Kimi k1.5: Scaling
    Reinforcement Learning with LLMs" (arXiv:2501.12599).

    Example:
        >>> DRO(beta=0.5)
        DRO(log_ratio_clamp=20.0, beta=0.5)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    beta: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "beta")

    def term(self, x: TokenInputs) -> Tensor:
        return -(x.logp * x.adv - (0.5 * self.beta) * x.log_ratio.square())

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return weight * (self.beta * x.log_ratio - x.adv)
