"""OpenRLHF 0.11.2's per-token terms besides the objective: the train/rollout mismatch
correction (``is_correction_*``) as weights, and the KL estimate of its KL loss."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from dapo_ops._core._rules import LOG_RATIO_CLAMP, masked
from dapo_ops._core._validate import check_option
from dapo_ops.engine.kl import kl_penalty
from dapo_ops.integrations._openrlhf_options import PolicyLossOptions

#: OpenRLHF clamps both policies' probabilities to [1e-6, 1 - 1e-6] for its divergences.
_PROB_CLAMP = 1e-6


def _row_mean(values: Tensor, valid: Tensor) -> Tensor:
    """``[batch, 1]`` mean over the row's valid tokens; NaN for an empty row (OpenRLHF's
    ``masked_mean`` divides by 0 there, so the row fails every gate)."""
    n = valid.sum(dim=-1, keepdim=True).to(values.dtype)
    total = masked(valid, values).sum(dim=-1, keepdim=True)
    return torch.where(n > 0, total / torch.where(n > 0, n, 1.0), torch.nan)


def correction_weights(
    old_logp: Float[Tensor, "batch seq"],
    rollout_logp: Float[Tensor, "batch seq"],
    valid: Bool[Tensor, "batch seq"],
    options: PolicyLossOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""OpenRLHF's correction coefficients (detached ``is_weights``) and what they filter.

    A gate reads a statistic per token (``is_correction_level="token"``) or per sequence
    (``"seq"``: the mean over the row's valid tokens) of the pair
    :math:`(\pi_{old}, \pi_{rollout})`: the ratio :math:`\rho = \pi_{old}/\pi_{rollout}`
    (``gating="ratio"``; per sequence its geometric mean), the binary KL
    :math:`p\log\frac pq + (1-p)\log\frac{1-p}{1-q}` or the total variation :math:`|p - q|`
    of the sampled token's probabilities :math:`p = \pi_{rollout}`, :math:`q = \pi_{old}`
    (each clamped to ``[1e-6, 1 - 1e-6]``). With ``[low, high] = is_correction_threshold``:
    ``mode="mask"`` keeps the units inside the band with their per-token weight
    :math:`\rho` and zeroes the others; ``mode="clip"`` (token ratio only) weights each token
    by :math:`\mathrm{clamp}(\rho, low, high)`. Log-ratios are clamped to +-20 before ``exp``.

    Returns ``(weights [batch, seq], filtered, counted)``: the weights, the units outside
    the band (``[batch, seq]`` per token, ``[batch, 1]`` per sequence; an empty row counts
    as filtered, as in OpenRLHF) and the units OpenRLHF's ``is_filter_ratio`` averages over
    (the valid tokens, or every row).

    Example:
        >>> from dapo_ops.integrations._openrlhf_options import PolicyLossOptions
        >>> opts = PolicyLossOptions(is_correction_level="token", is_correction_threshold=(0.5, 2.0))
        >>> old = torch.log(torch.tensor([[0.5, 0.9]]))
        >>> roll = torch.log(torch.tensor([[0.1, 0.8]]))
        >>> w, filtered, _ = correction_weights(old, roll, torch.ones(1, 2, dtype=torch.bool), opts)
        >>> w, filtered
        (tensor([[0.0000, 1.1250]]), tensor([[ True, False]]))
    """
    low, high = options.is_correction_threshold
    seq_level = options.is_correction_level == "seq"
    old = masked(valid, old_logp.detach())
    roll = masked(valid, rollout_logp.detach())
    log_rho = (old - roll).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_rho = log_rho.exp()
    if options.is_correction_gating == "ratio":
        stat = _row_mean(log_rho, valid).exp() if seq_level else token_rho
    else:
        p = roll.exp().clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)
        q = old.exp().clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)
        if options.is_correction_gating == "binary_kl":
            stat = p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))
        else:
            stat = (p - q).abs()
        if seq_level:
            stat = _row_mean(stat, valid)
    if options.is_correction_mode == "clip":
        weights = stat.clamp(low, high)
        filtered = (stat < low) | (stat > high)
    else:
        keep = (stat >= low) & (stat <= high)
        weights = torch.where(keep, token_rho, 0.0)
        filtered = ~keep
    counted = torch.ones_like(filtered) if seq_level else valid
    return masked(valid, weights).detach(), filtered, counted


#: OpenRLHF clamps every KL estimate to [-10, 10] and its IS weight to at most 10.
_KL_CLAMP = 10.0
_KL_IS_CAP = 10.0


def openrlhf_kl(
    log_probs: Float[Tensor, "batch seq"],
    log_probs_base: Float[Tensor, "batch seq"],
    action_mask: Bool[Tensor, "batch seq"],
    *,
    kl_estimator: str = "k1",
    log_probs_old: Float[Tensor, "batch seq"] | None = None,
    unbiased_gradient: bool = False,
) -> Float[Tensor, "batch seq"]:
    r"""OpenRLHF 0.11.2's ``compute_approx_kl`` by :func:`dapo_ops.kl_penalty`: per token.

    :math:`\delta = \log\pi_\theta - \log\pi_{ref}`; ``k1`` :math:`\delta`, ``k2``
    :math:`\delta^2/2`, ``k3`` :math:`e^{-\delta} - 1 + \delta`, each clamped to
    ``[-10, 10]`` (``kl_penalty(..., clamp=10.0)``). ``unbiased_gradient=True`` keeps the
    value and takes the gradient :math:`w\,\delta` (k2's, ``straight_through=True``), with
    :math:`w = \min(\pi_\theta/\pi_{old}, 10)` detached when ``log_probs_old`` is given
    (1 otherwise). 0 at masked positions (OpenRLHF leaves them to its aggregation). Its
    actor adds ``kl_ctl`` times the token mean of it (:func:`dapo_ops.token_level_aggregate`
    with ``normalizer=batch_num_tokens / dp_size``), whatever the policy loss's aggregation.

    Example:
        >>> lp = torch.tensor([[-1.0, -30.0]])
        >>> openrlhf_kl(lp, torch.full((1, 2), -1.0), torch.ones(1, 2, dtype=torch.bool),
        ...             kl_estimator="k1")
        tensor([[  0., -10.]])
    """
    check_option("kl_estimator", kl_estimator, ("k1", "k2", "k3"))
    kl = kl_penalty(
        log_probs, log_probs_base, action_mask, estimator=kl_estimator, clamp=_KL_CLAMP,  # type: ignore[arg-type]
        straight_through=unbiased_gradient,
    )  # fmt: skip
    if not unbiased_gradient or log_probs_old is None:
        return kl
    log_w = (log_probs.detach().to(kl.dtype) - log_probs_old.to(kl.dtype)).clamp(
        max=LOG_RATIO_CLAMP
    )
    w = masked(action_mask != 0, log_w.exp().clamp(max=_KL_IS_CAP))
    return kl.detach() + w * (kl - kl.detach())
