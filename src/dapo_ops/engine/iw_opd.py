r"""IW-OPD's prefix weights: on-policy distillation that weighs a token by how much of the
sequence's teacher-student disagreement is still ahead of it (TRL 1.16,
``experimental/iw_opd``, ``IWOPDTrainer._compute_iw_opd_loss``).

With the distillation advantage :math:`A_t = \log\pi_T - \log\pi_{rollout}`
(:func:`dapo_ops.distill_advantages` with ``TeacherKL(estimator="k1", clamp=None,
log_ratio_clamp=None)``) and :math:`a_t = m_t |A_t|`:

.. math::

    w_t = 1 + \gamma\Big(1 - \frac{\sum_{u<t} a_u}{\max(\sum_u a_u, \epsilon)}\Big)
    \in [1, 1 + \gamma]

so the first valid token weighs :math:`1 + \gamma` and the weight falls as the
disagreement is used up. The loss is the policy gradient with these as fixed weights:
``policy_loss(PolicyGradient(), logp, logp.detach(), A, mask, is_weights=w)``.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_float,
    check_ndim,
    check_real,
)

__all__ = ["iw_opd_weights"]


@checks_values
@torch.no_grad()
def iw_opd_weights(
    advantages: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    gamma: float = 0.5,
    eps: float = 1e-8,
) -> Float[Tensor, "batch seq"]:
    r"""IW-OPD's per-token weights :math:`w_t = 1 + \gamma(1 - \sum_{u<t}|A_u| /
    \max(\sum_u |A_u|, \epsilon))` over each row's valid tokens (module docstring).

    Masked positions count as :math:`|A| = 0` whatever they hold (NaN and inf
    included) and get weight 0; a row whose valid advantages are all 0 gets
    :math:`1 + \gamma` on every valid token. The weights are constants of the loss
    (computed without gradient), as TRL detaches them.

    Shapes: advantages and mask ``[batch, seq]``; returns ``[batch, seq]`` in float32
    (float64 for float64 advantages).

    Defaults: ``gamma=0.5``, ``eps=1e-8``: TRL 1.16's ``iw_opd_gamma`` and
    ``iw_opd_epsilon``.

    Example:
        >>> adv = torch.tensor([[2.0, -1.0, 1.0, 0.0]])
        >>> iw_opd_weights(adv, torch.tensor([[1, 1, 1, 0]]))
        tensor([[1.5000, 1.2500, 1.1250, 0.0000]])
    """
    check_float("advantages", advantages)
    check_ndim("advantages", advantages, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "advantages", advantages)
    gamma = check_real("gamma", gamma)
    eps = check_real("eps", eps)
    if not 0.0 <= gamma < math.inf:
        raise InputError(f"gamma must be finite and >= 0, got {gamma}")
    if not 0.0 < eps < math.inf:
        raise InputError(f"eps must be finite and > 0, got {eps}")
    a = masked(valid, advantages.to(compute_dtype(advantages)).abs())
    before = a.cumsum(dim=-1) - a  # TRL's exclusive prefix sum
    total = a.sum(dim=-1, keepdim=True).clamp_min(eps)
    return masked(valid, 1.0 + gamma * (1.0 - before / total))
