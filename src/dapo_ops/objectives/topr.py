"""TOPR: Tapered Off-Policy REINFORCE (Le Roux et al. 2025)."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import Tensor

from dapo_ops.objectives.base import Clipped, Objective, TokenInputs, check_field, check_number


@dataclasses.dataclass(frozen=True)
class TOPR(Objective):
    r"""TOPR: plain REINFORCE on positive samples, truncated-IS REINFORCE on negative ones.

    .. math::

        \ell_{i,t} = \begin{cases}
            -c_+\,A_{i,t}\,\log\pi_\theta(y_{i,t}) & A_{i,t} > 0 \\
            -c_-\,\mathrm{sg}\big[\mathrm{clip}(r_{i,t}, 0, 1)\big]\,A_{i,t}\,
                \log\pi_\theta(y_{i,t}) & A_{i,t} \le 0
        \end{cases}

    A positive sample is pushed up at full strength whatever its ratio (an SFT step on
    it); a negative one is pushed down with its importance ratio truncated at 1, so a
    token the policy has already made unlikely stops being pushed (the ratio tapers the
    gradient) and none is pushed harder than on-policy. Without a clip region no token
    loses its gradient. Like :class:`CISPO`, the value holds ``log pi`` (not an objective
    estimate); only its gradient ``-w A`` is.

    Le Roux et al. 2025, "Tapered Off-Policy REINFORCE" (arXiv:2503.14286). Peer: ROLL
    (its RLVR actor worker's loss, options ``postive_loss_coef`` and
    ``use_topr_neg_loss_coef``): it splits the samples by the sign of the raw *score* (``> 0`` positive); here by the
    sign of the advantage, which is the same split when the advantages are the scores
    (TOPR's baseline-free form) and where ``A = 0`` gives 0 either way. ROLL truncates the
    unclamped ratio, this the ratio of the log-ratio clamped at ``log_ratio_clamp``: they
    differ only below ``exp(-log_ratio_clamp)``.

    Fields: ``pos_coef=1.0`` and ``neg_coef=1.0`` (the two terms' weights, ROLL's
    coefficients; the paper weighs them equally).

    Example:
        >>> TOPR()
        TOPR(log_ratio_clamp=20.0, pos_coef=1.0, neg_coef=1.0)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    pos_coef: float = 1.0
    neg_coef: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("pos_coef", "neg_coef"):
            value = check_number(self, name)
            check_field(self, name, 0.0 <= value < math.inf, "must be finite and >= 0")

    def weight(self, x: TokenInputs) -> Tensor:
        """The detached weight: ``pos_coef`` where ``A > 0``, else ``neg_coef * min(r, 1)``."""
        taper = x.ratio.clamp(max=1.0).detach() * self.neg_coef
        return torch.where(x.adv > 0, torch.full_like(taper, self.pos_coef), taper)

    def term(self, x: TokenInputs) -> Tensor:
        return -self.weight(x) * x.adv * x.logp

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return weight * (-self.weight(x) * x.adv)

    def clipped(self, x: TokenInputs) -> Clipped:
        """Tokens of negative samples whose ratio is truncated at 1 (reported as ``high``)."""
        none = torch.zeros_like(x.valid)
        return Clipped(none, (x.adv <= 0) & (x.ratio > 1.0), none)
