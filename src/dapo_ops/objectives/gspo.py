"""GSPO: the sequence-level importance ratio and its clipped loss (Zheng et al. 2025)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from dapo_ops._core._rules import clip, masked
from dapo_ops.objectives.base import Clipped, Objective, TokenInputs, check_field, check_number
from dapo_ops.objectives.clip_higher import clip_bounds


@dataclasses.dataclass(frozen=True)
class GSPO(Objective):
    r"""GSPO in its "GSPO-token" form: a sequence ratio on every token of the sequence.

    .. math::

        s_i = \exp\Big(\frac{1}{|y_i|}\sum_t m_{i,t}\,\log r_{i,t}\Big),\qquad
        \ell_{i,t} = -\min\big(s_{i,t}A_i,\ \mathrm{clip}(s_{i,t}, 1-\varepsilon_{low},
            1+\varepsilon_{high})A_i\big),\qquad
        s_{i,t} = \mathrm{sg}[s_i]\,\frac{\pi_\theta(y_{i,t})}{\mathrm{sg}[\pi_\theta(y_{i,t})]}

    Every valid token of sequence ``i`` carries the value of the sequence loss and the
    gradient ``-A_i s_i`` (0 when the sequence is clipped), so ``mode="seq_mean_token_mean"``
    gives exactly GSPO's objective and gradient. Advantages are per sequence, or per token
    (``[batch, seq]``, the paper's GSPO-token): then token ``t`` uses its own ``A_{i,t}``
    in place of ``A_i`` (value, clip side and gradient ``-A_{i,t} s_i``), as verl 0.9.1's
    ``gspo`` does.

    Fields: ``eps_low=3e-4, eps_high=4e-4`` from the GSPO paper (sequence ratios stay much
    closer to 1 than token ratios); ``seq_log_ratio_clamp=10``: ours clamps the mean
    log-ratio to ``+-10`` (token log-ratios first to ``+-log_ratio_clamp``) and lets the
    gradient through as ``-A s`` with the clamped ``s``. ``verl_clamp=True`` reproduces
    verl 0.9.1's ``loss_mode="gspo"`` instead: no token clamp, the clamp only from above
    (``max=10``, no lower bound), applied to the per-token log-ratio of the GSPO-token
    form, where it cuts the gradient (0 beyond ``s > e^10``).

    Paper: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).

    Example:
        >>> GSPO()
        GSPO(log_ratio_clamp=20.0, eps_low=0.0003, eps_high=0.0004, seq_log_ratio_clamp=10.0, verl_clamp=False)
    """

    level = "sequence"
    token_advantages = True

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    seq_log_ratio_clamp: float = 10.0
    verl_clamp: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        low, high = check_number(self, "eps_low"), check_number(self, "eps_high")
        check_field(self, "eps_low", 0.0 <= low < 1.0, "must lie in [0, 1)")
        check_field(self, "eps_high", 0.0 <= high < math.inf, "must be finite and >= 0")
        clamp = check_number(self, "seq_log_ratio_clamp")
        check_field(self, "seq_log_ratio_clamp", 0.0 < clamp < math.inf, "must be finite and > 0")
        check_field(self, "verl_clamp", isinstance(self.verl_clamp, bool), "must be a bool")

    def mean_log_ratio(self, x: TokenInputs) -> Tensor:
        """``log s_i`` as ``[batch, 1]`` (0 for a row with no valid token), before the
        upper clamp when ``verl_clamp``; differentiable."""
        token = x.log_ratio if self.verl_clamp else x.clamped
        n = x.valid.sum(dim=-1, keepdim=True).to(token.dtype)
        total = masked(x.valid, token).sum(dim=-1, keepdim=True)
        mean = total / torch.where(n == 0, torch.ones_like(n), n)
        if not self.verl_clamp:
            mean = clip(mean, -self.seq_log_ratio_clamp, self.seq_log_ratio_clamp)
        return mean

    def seq_log_ratio(self, x: TokenInputs) -> Tensor:
        """:meth:`mean_log_ratio`, detached: GSPO's ``sg[s_i]``."""
        return self.mean_log_ratio(x).detach()

    def _ratio(self, x: TokenInputs) -> tuple[Tensor, Tensor]:
        """``(s_{i,t}, s_i)``: value s_i, gradient d s_{i,t} / d logp_{i,t} = s_i."""
        log_s = self.seq_log_ratio(x)
        live = x.logp - x.logp.detach()  # 0, with gradient 1
        if self.verl_clamp:
            s = log_s.clamp(max=self.seq_log_ratio_clamp).exp()
            return torch.exp(clip(live + log_s, high=self.seq_log_ratio_clamp)), s
        s = log_s.exp()
        return s * torch.exp(live), s

    def term(self, x: TokenInputs) -> Tensor:
        lo, hi = clip_bounds(x.adv, self.eps_low, self.eps_high, None)
        return -x.adv * clip(self._ratio(x)[0], lo, hi)

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        log_s = self.seq_log_ratio(x)
        _, s = self._ratio(x)
        lo, hi = clip_bounds(x.adv, self.eps_low, self.eps_high, None)
        keep = torch.clamp(s, lo, hi) == s
        if self.verl_clamp:  # the upper clamp cuts the gradient where it acts
            keep = keep & (log_s <= self.seq_log_ratio_clamp)
        return torch.where(keep, (weight * x.adv.neg()) * s, 0.0)

    def clipped(self, x: TokenInputs) -> Clipped:
        s = self._ratio(x)[1]
        low = (x.adv < 0) & (s < 1.0 - self.eps_low) & x.valid
        high = (x.adv > 0) & (s > 1.0 + self.eps_high) & x.valid
        return Clipped(low, high, torch.zeros_like(x.valid))
