"""GMPO: the geometric mean of sign-clipped token ratios per sequence (verl ``geo_mean``)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dapo_ops._core._rules import masked
from dapo_ops.objectives.base import Clipped, Objective, TokenInputs, check_positive


@dataclasses.dataclass(frozen=True)
class GMPO(Objective):
    r"""Geometric-Mean Policy Optimization: PPO's clip on the log-ratio, then a per-sequence
    geometric mean (GMPO, arXiv 2507.20673).

    .. math::

        m_{i,t} = \mathrm{sgn}(A_i)\min\big(\mathrm{sgn}(A_i)\log r_{i,t},\;
            \mathrm{sgn}(A_i)\,\mathrm{clip}(\log r_{i,t}, -\varepsilon_{low}, \varepsilon_{high})\big),
        \qquad \ell_i = -A_i \exp\Big(\frac{1}{|y_i|}\sum_t m_{i,t}\Big)

    Written, like GSPO, in a per-token form whose every valid token carries the sequence
    loss and the gradient ``-A_i s_i [m_{i,t} = log r_{i,t}]`` (0 where the log-ratio clip
    acts), so ``mode="seq_mean_token_mean"`` gives GMPO's objective and gradient over the
    non-empty sequences. verl 0.9.1 (``loss_mode="geo_mean"``) instead averages over every
    row, empty ones included (``normalizer=batch`` reproduces that). Advantages are per
    sequence, or per token (``[batch, seq]``) as verl takes them: then the clip side of
    token ``t`` follows ``sgn(A_{i,t})`` and the sequence's weight ``A_i`` is the mean of
    ``A_{i,t}`` over its valid tokens (verl's ``geo_mean``, to its ``+1e-8`` divisor).

    Fields (GMPO paper and verl: the clip range is on the *log*-ratio): ``eps_low=0.4``,
    ``eps_high=0.4`` (the paper's ``(e^-0.4, e^0.4)``).

    Paper: Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673).

    Example:
        >>> GMPO()
        GMPO(log_ratio_clamp=20.0, eps_low=0.4, eps_high=0.4)
    """

    level = "sequence"
    token_advantages = True

    eps_low: float = 0.4
    eps_high: float = 0.4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, "eps_low", "eps_high", zero_ok=True)

    def _token_log_ratio(self, x: TokenInputs) -> Tensor:
        """``m``: ``min(lr, eps_high)`` for ``A > 0``, ``max(lr, -eps_low)`` for ``A < 0``,
        0 for ``A == 0`` (each token by its own advantage's sign), with its gradient
        selected explicitly: 1 where ``m = lr`` (a log-ratio *on* its bound included: the
        kink convention, docs/kinks.md), 0 where the bound acts or ``A == 0``. verl's
        ``sgn(A) min(sgn(A) lr, sgn(A) clip(lr))`` has the same values; its gradient on a
        bound is ``torch.minimum``'s half plus the clamp's share (1 up to torch 2.13,
        1/2 from 2.14)."""
        lr, sign = x.log_ratio, torch.sign(x.adv)
        pos = torch.where(lr > self.eps_high, lr.new_full((), self.eps_high), lr)
        neg = torch.where(lr < -self.eps_low, lr.new_full((), -self.eps_low), lr)
        return torch.where(sign > 0, pos, torch.where(sign < 0, neg, sign * lr))

    def _seq_ratio(self, x: TokenInputs) -> Tensor:
        m = masked(x.valid, self._token_log_ratio(x))
        n = x.valid.sum(dim=-1, keepdim=True).to(m.dtype)
        return torch.exp(m.sum(dim=-1, keepdim=True) / torch.where(n == 0, 1.0, n)).detach()

    def _seq_adv(self, x: TokenInputs) -> Tensor:
        """``A_i``: the advantage, or for ``[batch, seq]`` ones their mean over the valid
        tokens of the row (0 for an empty row)."""
        if x.adv.shape[-1] == 1:
            return x.adv
        n = x.valid.sum(dim=-1, keepdim=True).to(x.adv.dtype)
        return masked(x.valid, x.adv).sum(dim=-1, keepdim=True) / torch.where(n == 0, 1.0, n)

    def term(self, x: TokenInputs) -> Tensor:
        m = self._token_log_ratio(x)
        return -self._seq_adv(x) * self._seq_ratio(x) * torch.exp(m - m.detach())

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        # unclipped (on a bound included) and A != 0: where term()'s m carries lr's gradient
        unclipped = (self._token_log_ratio(x) == x.log_ratio) & (x.adv != 0)
        return torch.where(unclipped, (weight * self._seq_adv(x).neg()) * self._seq_ratio(x), 0.0)

    def clipped(self, x: TokenInputs) -> Clipped:
        clip = x.log_ratio != x.log_ratio.clamp(-self.eps_low, self.eps_high)
        return Clipped(clip & (x.adv < 0), clip & (x.adv > 0), torch.zeros_like(x.valid))
