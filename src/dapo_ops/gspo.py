"""GSPO: the sequence-level importance ratio and its clipped loss (Zheng et al. 2025)."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._validate import InputError, check_clip_range, shape_str
from dapo_ops.aggregation import safe_divide
from dapo_ops.surrogate import LOG_RATIO_CLAMP, clipped_objective, token_terms

#: GSPO's sequence ratio is a geometric mean, so its log is clamped tighter than a token
#: ratio's (verl clamps it at 10 as well): exp(10) = 2.2e4 bounds every ratio.
SEQUENCE_LOG_RATIO_CLAMP = 10.0


def gspo_sequence_ratio(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
) -> Float[Tensor, " batch"]:
    r"""GSPO's sequence importance ratio: the geometric mean of the token ratios.

    .. math::

        s_i = \Big(\frac{\pi_\theta(y_i|x)}{\pi_{old}(y_i|x)}\Big)^{1/|y_i|}
            = \exp\Big(\frac{1}{|y_i|}\sum_{t} m_{i,t}\,(\log\pi_\theta - \log\pi_{old})\Big)

    over valid tokens; 1 for a sequence with no valid token. The mean log-ratio is clamped
    to +-10 before ``exp``. Differentiable (the gradient is ``s_i / |y_i|`` per token).

    Shapes: ``[batch, seq]`` inputs; returns ``[batch]`` float32 (float64 for float64).

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.2]]))
        >>> old = lp - torch.log(torch.tensor([[4.0, 1.0]]))  # token ratios 4 and 1
        >>> gspo_sequence_ratio(lp, old, torch.ones(1, 2, dtype=torch.bool))
        tensor([2.])
    """
    valid, log_ratio, _, _ = token_terms(logp, old_logp, None, mask)
    n = valid.sum(dim=-1).to(log_ratio.dtype)
    mean = safe_divide(log_ratio.sum(dim=-1), n)
    return mean.clamp(-SEQUENCE_LOG_RATIO_CLAMP, SEQUENCE_LOG_RATIO_CLAMP).exp()


def gspo_surrogate(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> Float[Tensor, "batch seq"]:
    r"""GSPO loss per token, in the "GSPO-token" form that plugs into any aggregation.

    .. math::

        s_{i,t} = \mathrm{sg}[s_i]\cdot\frac{\pi_\theta(y_{i,t})}{\mathrm{sg}[\pi_\theta(y_{i,t})]},
        \qquad \ell_{i,t} = -\min\big(s_{i,t}A_i,\ \mathrm{clip}(s_{i,t}, 1-\varepsilon_{low},
        1+\varepsilon_{high})A_i\big)

    Every valid token of sequence ``i`` carries the value of the sequence loss
    :math:`-\min(s_iA_i, \mathrm{clip}(s_i)A_i)` and gradient :math:`s_i A_i` (0 when the
    sequence is clipped), so ``token_level_aggregate(..., mode="seq_mean_token_mean")``
    gives exactly GSPO's objective and gradient; ``token_mean`` gives its length-weighted
    variant. When all token ratios of a sequence are equal, this equals the token-level
    PPO loss of :func:`clip_higher_surrogate` with the same clip range.

    Shapes: logp, old_logp, mask ``[batch, seq]``; advantages ``[batch]`` or ``[batch, 1]``
    (one per sequence: GSPO's ratio is per sequence). Returns ``[batch, seq]``, 0 at
    masked positions.

    Defaults: ``eps_low=3e-4, eps_high=4e-4`` from the GSPO paper (sequence ratios live
    much closer to 1 than token ratios). verl: ``policy_loss.loss_mode="gspo"``.

    Example:
        >>> lp = torch.zeros(1, 3)
        >>> gspo_surrogate(lp, lp, torch.tensor([2.0]), torch.tensor([[1, 1, 0]]))
        tensor([[-2., -2.,  0.]])
    """
    check_clip_range(eps_low, eps_high, None)
    if advantages.ndim == 2 and advantages.shape[1] != 1:
        raise InputError(
            "advantages must be per sequence for GSPO ([batch] or [batch, 1]); got "
            f"{shape_str(advantages)}"
        )
    valid, log_ratio, _, adv = token_terms(
        logp, old_logp, advantages, mask, log_ratio_clamp=LOG_RATIO_CLAMP
    )
    n = valid.sum(dim=-1, keepdim=True).to(log_ratio.dtype)
    log_s = safe_divide(log_ratio.sum(dim=-1, keepdim=True), n)
    log_s = log_s.clamp(-SEQUENCE_LOG_RATIO_CLAMP, SEQUENCE_LOG_RATIO_CLAMP)
    # value s_i on every token; gradient d s_{i,t} / d logp_{i,t} = s_i
    live = torch.where(valid, logp.to(log_ratio.dtype), torch.zeros_like(log_ratio))
    ratio = torch.exp(log_s.detach() + live - live.detach())
    loss = clipped_objective(ratio, adv, eps_low=eps_low, eps_high=eps_high, dual_clip=None)
    return torch.where(valid, loss, torch.zeros_like(loss))
