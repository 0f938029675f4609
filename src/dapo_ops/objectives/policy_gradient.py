"""The plain policy gradient ``-A log pi`` (GPG; REINFORCE with a group baseline)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from torch import Tensor

from dapo_ops.objectives.base import Objective, TokenInputs


@dataclasses.dataclass(frozen=True)
class PolicyGradient(Objective):
    r"""The vanilla policy-gradient loss, no ratio, no clip.

    .. math::

        \ell_{i,t} = -A_{i,t}\,\log\pi_\theta(y_{i,t})

    The gradient is ``-A``: exactly on-policy REINFORCE (with the group-relative advantage:
    GPG, "GPG: A Simple and Strong Reinforcement Learning Baseline", 2025).
    ``old_logp`` does not enter the loss (pass ``logp.detach()``); the diagnostics still
    report its ratio. No fields beyond ``log_ratio_clamp`` (used by the diagnostics only).
    verl: ``loss_mode="gpg"``.

    Paper: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning" (arXiv:2504.02546).

    Example:
        >>> PolicyGradient()
        PolicyGradient(log_ratio_clamp=20.0)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    def term(self, x: TokenInputs) -> Tensor:
        return -x.adv * x.logp

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return (weight * x.adv.neg()).expand_as(x.logp)
