"""KL penalty against a reference policy: the estimators, as a value the engine composes."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import LOG_RATIO_CLAMP, clip, magnitude, masked
from dapo_ops._core._validate import InputError, check_no_grad, check_option
from dapo_ops.objectives.base import check_field, check_positive

KLEstimator = Literal["k1", "k2", "k3", "abs"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")


@dataclasses.dataclass(frozen=True)
class KLPenalty:
    r"""``beta`` times a per-token estimate of :math:`KL(\pi_\theta\,\|\,\pi_{ref})`.

    With :math:`\delta = \log\pi_\theta - \log\pi_{ref}` clamped to ``+-log_ratio_clamp``:
    ``k1`` = :math:`\delta` (unbiased, can be negative); ``k2`` = :math:`\delta^2/2`
    (>= 0, biased, low variance); ``k3`` = :math:`e^{-\delta} + \delta - 1` (>= 0,
    unbiased, low variance: GRPO's and verl's ``low_var_kl``); ``abs`` = :math:`|\delta|`
    (verl's ``abs``; gradient ``sign(delta)``, 0 at 0). All are 0 where ``logp == ref_logp``.
    ``clamp`` bounds the estimate to ``[-clamp, clamp]`` (its gradient is 0 where it acts
    beyond a bound; on a bound, as on the log-ratio clamp's, it passes: docs/kinks.md):
    verl's ``low_var_kl`` clamps
    to ``[-10, 10]`` (``clamp=10.0`` reproduces it); ours does not by default, since
    k3 >= 0 grows only linearly in ``delta`` and ``log_ratio_clamp`` keeps it finite.

    ``straight_through=True`` keeps the estimate's *value* but takes the gradient of k2,
    :math:`\delta` (of the raw, unclamped log-ratio), which is the unbiased estimate of
    the KL's gradient where k1's and k3's gradients are not (Schulman 2020): verl's
    ``k1+``/``k3+``/``low_var_kl+``.

    Pass it as ``policy_loss(..., ref_logp=ref, kl=KLPenalty(beta=0.04))``.
    Defaults: ``beta=0.04, estimator="k3"`` from GRPO (DeepSeekMath; TRL's ``beta``,
    verl's ``kl_loss_coef`` and ``kl_loss_type="low_var_kl"``). DAPO uses no KL term.

    Example:
        >>> KLPenalty(beta=0.04)
        KLPenalty(beta=0.04, estimator='k3', clamp=None, log_ratio_clamp=20.0, straight_through=False)
    """

    beta: float = 0.04
    estimator: KLEstimator = "k3"
    clamp: float | None = None
    log_ratio_clamp: float = LOG_RATIO_CLAMP
    straight_through: bool = False

    def __post_init__(self) -> None:
        check_positive(self, "beta")
        check_option("KLPenalty.estimator", self.estimator, KL_ESTIMATORS)
        check_positive(self, "clamp", none_ok=True)
        check_positive(self, "log_ratio_clamp")
        check_field(
            self, "straight_through", isinstance(self.straight_through, bool), "must be a bool"
        )

    def estimate(self, delta: Tensor) -> Tensor:
        """The per-token estimate (before ``beta``) of the clamped log-ratio ``delta``."""
        kl = self._unclamped(delta)
        return kl if self.clamp is None else clip(kl, -self.clamp, self.clamp)

    def _unclamped(self, delta: Tensor) -> Tensor:
        if self.estimator == "k1":
            return delta
        if self.estimator == "k2":
            return 0.5 * delta * delta
        if self.estimator == "abs":
            return magnitude(delta)
        return torch.expm1(-delta) + delta

    def penalty(self, raw: Tensor, delta: Tensor) -> Tensor:
        """The per-token estimate (before ``beta``) under autograd, from the raw and the
        clamped log-ratio: the straight-through form when ``straight_through``."""
        value = self.estimate(delta)
        if not self.straight_through:
            return value
        k2 = 0.5 * raw.square()
        return k2 - k2.detach() + value.detach()

    def grad(self, raw: Tensor, delta: Tensor, weight: Tensor) -> Tensor:
        """``weight * beta * d penalty / d logp`` from the raw and the clamped log-ratio."""
        if self.straight_through:
            return (weight * self.beta) * raw
        if self.estimator == "k1":
            slope = torch.ones_like(delta)
        elif self.estimator == "k2":
            slope = delta
        elif self.estimator == "abs":
            slope = torch.sign(delta)
        else:
            slope = -torch.expm1(-delta)
        keep = raw == delta
        if self.clamp is not None:  # the kink convention: the gradient passes on the bounds
            keep = keep & (self._unclamped(delta).abs() <= self.clamp)
        return torch.where(keep, (weight * self.beta) * slope, 0.0)


@checks_values
def kl_penalty(
    logp: Float[Tensor, "batch seq"],
    ref_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"] | None = None,
    *,
    estimator: KLEstimator = "k3",
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    clamp: float | None = None,
    straight_through: bool = False,
) -> Float[Tensor, "batch seq"]:
    r"""Per-token estimate of :math:`KL(\pi_\theta \,\|\, \pi_{ref})` on sampled tokens.

    :meth:`KLPenalty.penalty` (``k1``, ``k2``, ``k3`` or ``abs``; see :class:`KLPenalty`) of
    :math:`\delta = \log\pi_\theta - \log\pi_{ref}` clamped to ``+-log_ratio_clamp``,
    optionally clamped to ``[-clamp, clamp]`` (verl's ``low_var_kl``: ``clamp=10``), with
    k2's gradient when ``straight_through`` (verl's ``k3+``). Differentiable in ``logp``. ``policy_loss(..., kl=KLPenalty(beta))`` adds ``beta``
    times it to the per-token loss.

    Shapes: ``[batch, seq]`` inputs; returns ``[batch, seq]``, 0 at masked positions.

    Defaults: ``k3`` as GRPO (DeepSeekMath) and verl's ``kl_loss_type="low_var_kl"``.

    Example:
        >>> kl_penalty(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -1.0]]))
        tensor([[0.0000, 0.7183]])
    """
    check_option("estimator", estimator, KL_ESTIMATORS)
    if not (isinstance(log_ratio_clamp, (int, float)) and 0 < log_ratio_clamp < math.inf):
        raise InputError(f"log_ratio_clamp must be finite and > 0, got {log_ratio_clamp!r}")
    penalty = KLPenalty(1.0, estimator, clamp, log_ratio_clamp, straight_through)
    _, valid, dtype = policy_tensors(logp, ref_logp, None, mask, names=("logp", "ref_logp"))
    check_no_grad("ref_logp", ref_logp)
    raw = masked(valid, logp.to(dtype) - ref_logp.to(dtype))
    kl = penalty.penalty(raw, clip(raw, -log_ratio_clamp, log_ratio_clamp))
    return masked(valid, kl)
