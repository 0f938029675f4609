"""DPPO-Binary: a divergence trust region on the sampled token's probability (arXiv 2602.04879)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch
from torch import Tensor

from dapo_ops._core._validate import check_option
from dapo_ops.objectives.base import Clipped, Objective, TokenInputs, check_positive


@dataclasses.dataclass(frozen=True)
class DPPO(Objective):
    r"""DPPO-Binary: keep a token's gradient while a divergence of its probability stays small.

    .. math::

        \ell_{i,t} = -A_{i,t}\,\mathrm{sg}\big[\min(r_{i,t}, C)\big]\,\log\pi_\theta(y_{i,t})
            \cdot \mathrm{sg}\big[v_{i,t}\big]

    with ``p = pi_theta(y)``, ``q = pi_old(y)`` and the trust-region indicator ``v``:

    - ``divergence="tv"``: :math:`v = [p - q \le \delta_{high}]` for ``A > 0``,
      :math:`[p - q \ge -\delta_{low}]` otherwise (total variation of the binary
      distribution {y, not y});
    - ``divergence="kl"``: :math:`v = [D \le \delta_{high}] \lor [p \le q]` for ``A > 0``,
      :math:`[D \le \delta_{low}] \lor [p \ge q]` otherwise, with the binary KL
      :math:`D = q\log(q/p) + (1-q)\log\frac{1-q+10^{-8}}{1-p+10^{-8}}`.

    The gradient ``-A min(r, C) v`` is a truncated-IS policy gradient on the tokens inside
    the region, 0 outside. Fields (defaults from verl 0.9.1, ``loss_mode="dppo_tv"`` /
    ``"dppo_kl"``, which reads ``clip_ratio_low``/``clip_ratio_high`` as the thresholds
    and ``clip_ratio_c`` as ``C``): ``delta_low=0.2``, ``delta_high=0.2``,
    ``is_cap=20.0``. The clipped count of the diagnostics is the tokens outside the region.

    Paper: Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning"
    (arXiv:2602.04879).

    Example:
        >>> DPPO(divergence="kl")
        DPPO(log_ratio_clamp=20.0, divergence='kl', delta_low=0.2, delta_high=0.2, is_cap=20.0)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    divergence: Literal["tv", "kl"] = "tv"
    delta_low: float = 0.2
    delta_high: float = 0.2
    is_cap: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_option("DPPO.divergence", self.divergence, ("tv", "kl"))
        check_positive(self, "delta_low", "delta_high", "is_cap")

    def inside(self, x: TokenInputs) -> Tensor:
        """The trust-region indicator ``v`` (bool, detached)."""
        p, q = x.logp.detach().exp(), x.old_logp.exp()
        if self.divergence == "tv":
            up, down = (p - q) <= self.delta_high, (p - q) >= -self.delta_low
        else:
            binary_kl = q * (x.old_logp - x.logp.detach()) + (1 - q) * torch.log(
                (1.0 - q + 1e-8) / (1.0 - p + 1e-8)
            )
            up = (binary_kl <= self.delta_high) | (p <= q)
            down = (binary_kl <= self.delta_low) | (p >= q)
        return torch.where(x.adv > 0, up, down)

    def _weight(self, x: TokenInputs) -> Tensor:
        return torch.where(self.inside(x), x.ratio.clamp(max=self.is_cap), 0.0).detach()

    def term(self, x: TokenInputs) -> Tensor:
        return -x.adv * self._weight(x) * x.logp

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return weight * (-x.adv * self._weight(x))

    def clipped(self, x: TokenInputs) -> Clipped:
        outside = ~self.inside(x)
        return Clipped(outside & (x.adv <= 0), outside & (x.adv > 0), torch.zeros_like(x.valid))
