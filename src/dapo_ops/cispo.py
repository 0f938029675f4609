"""CISPO: clip the importance weight, not the update (MiniMax-M1, 2025)."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._validate import InputError
from dapo_ops.surrogate import LOG_RATIO_CLAMP, token_terms


def cispo_surrogate(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"] | None = None,
    *,
    cap: float = 1.28,
    floor: float = 0.0,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> Float[Tensor, "batch seq"]:
    r"""Per-token CISPO loss: a detached, clipped importance weight times the log-prob.

    .. math::

        \ell_{i,t} = -\,\mathrm{sg}\big[\mathrm{clip}(r_{i,t}, \text{floor}, \text{cap})\big]
                     \,A_{i,t}\,\log\pi_\theta(y_{i,t})

    Unlike PPO's clip, no token loses its gradient: the gradient w.r.t. ``logp`` is
    ``-w A`` with ``w = clip(r, floor, cap)``, so its size is at most ``cap * |A|``.
    The loss *value* is not an objective estimate (it contains ``log pi``); only its
    gradient is meaningful. Aggregate with ``token_mean`` as in the paper.

    Shapes and masking as :func:`clip_higher_surrogate`; returns ``[batch, seq]``, 0 at
    masked positions.

    Defaults: MiniMax-M1 imposes no lower bound (``floor=0``) and tunes only the upper
    one; ``cap=1.28`` is ``1 + 0.28``, DAPO's ``eps_high`` (verl's CISPO uses
    ``1 + clip_ratio_high`` too).

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.9]]))
        >>> old = torch.log(torch.tensor([[0.5, 0.3]]))
        >>> cispo_surrogate(lp, old, torch.tensor([1.0]))  # weights 1 and min(3, 1.28)
        tensor([[0.6931, 0.1349]])
    """
    if not (0.0 <= floor <= 1.0 <= cap):
        raise InputError(f"need 0 <= floor <= 1 <= cap; got floor={floor}, cap={cap}")
    valid, _, ratio, adv = token_terms(
        logp, old_logp, advantages, mask, log_ratio_clamp=log_ratio_clamp
    )
    weight = ratio.clamp(floor, cap).detach()
    live = torch.where(valid, logp.to(ratio.dtype), torch.zeros_like(ratio))
    loss = -weight * adv * live
    return torch.where(valid, loss, torch.zeros_like(loss))
