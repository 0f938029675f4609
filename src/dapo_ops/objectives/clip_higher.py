"""Clip-Higher PPO (DAPO change 1): the clipped surrogate with decoupled bounds."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch
from torch import Tensor

from dapo_ops._core._rules import clip
from dapo_ops.objectives._clip_higher_cpu import cpu_terms
from dapo_ops.objectives.base import Clipped, Objective, TokenInputs, check_field, check_number


@dataclasses.dataclass(frozen=True)
class ClipHigher(Objective):
    r"""PPO's clipped surrogate with a higher upper bound (DAPO), optional dual clip.

    .. math::

        \ell_{i,t} = -\min\big(r_{i,t}A_{i,t},\;
            \mathrm{clip}(r_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})A_{i,t}\big),
        \qquad r_{i,t} = \exp(\log\pi_\theta - \log\pi_{old})

    computed as :math:`-A\,\mathrm{clamp}(r, lo_A, hi_A)` with :math:`[lo_A, hi_A] =
    [1-\varepsilon_{low}, c]` for :math:`A < 0` (``c = dual_clip``, or no bound) and
    :math:`[-\infty, 1+\varepsilon_{high}]` for :math:`A \ge 0`: the same values bit for
    bit, and the gradient ``-A r`` exactly where no bound (and no log-ratio clamp) acts,
    exactly 0 where one does. A bound acts only strictly beyond it: a ratio *on* a bound
    (``r = 1 + eps_high``, ``1 - eps_low``, ``c``; ``|log r| = log_ratio_clamp``) keeps
    ``-A r``, on every torch (docs/kinks.md).

    Fields (defaults from DAPO, Yu et al. 2025, sec. 3.1): ``eps_low=0.2``,
    ``eps_high=0.28`` (``eps_low == eps_high``: PPO, GRPO); ``dual_clip=None`` (dual-clip
    PPO, Ye et al. 2020: a negative-advantage token's loss is capped at ``c |A|``; verl's
    ``clip_ratio_c`` is 3.0); ``log_ratio_clamp=20`` (verl's). verl calls it
    ``loss_mode="vanilla"``, TRL ``loss_type="dapo"`` with ``epsilon``/``epsilon_high``.

    Papers: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale" (arXiv:2503.14476); Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms" (arXiv:1707.06347); the dual clip, Ye et al. 2020 (arXiv:1912.09729).

    Example:
        >>> ClipHigher()
        ClipHigher(log_ratio_clamp=20.0, eps_low=0.2, eps_high=0.28, dual_clip=None)
        >>> ClipHigher(eps_low=0.2, eps_high=0.2, dual_clip=3.0)  # PPO with dual clip
        ClipHigher(log_ratio_clamp=20.0, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    """

    token_local: ClassVar[bool] = True  # reads only its own token

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        low, high = check_number(self, "eps_low"), check_number(self, "eps_high")
        check_field(self, "eps_low", 0.0 <= low < 1.0, "must lie in [0, 1)")
        check_field(self, "eps_high", 0.0 <= high < math.inf, "must be finite and >= 0")
        if self.dual_clip is not None:
            cap = check_number(self, "dual_clip")
            check_field(self, "dual_clip", 1.0 < cap < math.inf, "must be finite and > 1 (or None)")

    def bounds(self, adv: Tensor) -> tuple[Tensor, Tensor]:
        """Per-element ``(lo_A, hi_A)`` in ``adv``'s dtype and shape (NaN counts as A >= 0)."""
        return clip_bounds(adv, self.eps_low, self.eps_high, self.dual_clip)

    def term(self, x: TokenInputs) -> Tensor:
        lo, hi = self.bounds(x.adv)
        return -x.adv * clip(x.ratio, lo, hi)

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        # (w * -A) * r where no clamp acts (NaN: none passes): the rounding order of
        # autograd through term(), so the fused gradient is bitwise the reference's
        lo, hi = self.bounds(x.adv)
        bounded = torch.minimum(torch.maximum(x.ratio, lo), hi)
        keep = (x.clamped == x.log_ratio) & (bounded == x.ratio)
        return torch.where(keep, (weight * x.adv.neg()) * x.ratio, 0.0)

    def clipped(self, x: TokenInputs) -> Clipped:
        negative = x.adv < 0
        low = negative & (x.ratio < 1.0 - self.eps_low)
        high = (x.adv > 0) & (x.ratio > 1.0 + self.eps_high)
        dual = (
            torch.zeros_like(x.valid)
            if self.dual_clip is None
            else negative & (x.ratio > self.dual_clip)
        )
        return Clipped(low, high, dual)

    #: The engine's eager CPU kernel for this objective: float-only ops on row blocks, the
    #: same values as :meth:`term` and :meth:`grad` (:mod:`dapo_ops.objectives._clip_higher_cpu`).
    cpu_terms = cpu_terms


def clip_bounds(
    adv: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """``(lo_A, hi_A)``: ``[1 - eps_low, dual_clip or inf]`` where ``A < 0``,
    ``[-inf, 1 + eps_high]`` elsewhere (``A >= 0``, NaN included)."""
    negative = adv < 0
    cap = math.inf if dual_clip is None else dual_clip
    if adv.dtype == torch.get_default_dtype():  # two Python numbers give that dtype
        return (
            torch.where(negative, 1.0 - eps_low, -math.inf),
            torch.where(negative, cap, 1.0 + eps_high),
        )
    lo = torch.where(negative, torch.full_like(adv, 1.0 - eps_low), -math.inf)
    hi = torch.where(negative, torch.full_like(adv, cap), torch.full_like(adv, 1.0 + eps_high))
    return lo, hi
