"""Per-token KL penalty against a reference policy (k1, k2, k3 estimators)."""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._validate import check_option
from dapo_ops.surrogate import LOG_RATIO_CLAMP, token_terms

KLEstimator = Literal["k1", "k2", "k3"]


def kl_penalty(
    logp: Float[Tensor, "batch seq"],
    ref_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"] | None = None,
    *,
    estimator: KLEstimator = "k3",
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> Float[Tensor, "batch seq"]:
    r"""Per-token estimate of :math:`KL(\pi_\theta \,\|\, \pi_{ref})` on tokens sampled from the policy.

    With :math:`\delta = \log\pi_\theta - \log\pi_{ref}` (clamped to ``+-log_ratio_clamp``):

    - ``k1`` = :math:`\delta` (unbiased, can be negative);
    - ``k2`` = :math:`\delta^2 / 2` (>= 0, low variance, biased);
    - ``k3`` = :math:`e^{-\delta} + \delta - 1` (>= 0, unbiased, low variance; GRPO's
      "low-variance KL": ``pi_ref/pi - log(pi_ref/pi) - 1``).

    All three are exactly 0 where ``logp == ref_logp``. Add ``beta * kl`` to the per-token
    loss (``token_level_loss(..., ref_logp=..., kl_beta=beta)`` does it). DAPO and
    Dr. GRPO use ``beta = 0``: then no reference forward pass is needed at all.

    Shapes: ``[batch, seq]`` inputs; returns ``[batch, seq]``, 0 at masked positions.

    Defaults: ``k3`` as GRPO (DeepSeekMath) and verl's ``kl_loss_type="low_var_kl"``.

    Example:
        >>> kl_penalty(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -1.0]]))
        tensor([[0.0000, 0.7183]])
    """
    check_option("estimator", estimator, ("k1", "k2", "k3"))
    valid, delta, _, _ = token_terms(
        logp,
        ref_logp,
        None,
        mask,
        log_ratio_clamp=log_ratio_clamp,
        names=("logp", "ref_logp"),
    )
    if estimator == "k1":
        kl = delta
    elif estimator == "k2":
        kl = 0.5 * delta * delta
    else:
        kl = torch.expm1(-delta) + delta
    return torch.where(valid, kl, torch.zeros_like(kl))
