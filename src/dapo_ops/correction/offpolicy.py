"""How far the rollout engine's samples are from the trainer's policy: the figures verl logs."""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import LOG_RATIO_CLAMP, masked
from dapo_ops._core._validate import check_float, check_same_device, check_same_shape


class OffPolicyMetrics(NamedTuple):
    """0-dim tensors (detached, no host sync); sequence means are over non-empty rows."""

    kl: Tensor  # mean over tokens of log pi_rollout - log pi_old (k1 of KL(rollout || old))
    k3_kl: Tensor  # mean over tokens of rho - 1 - log rho
    training_ppl: Tensor  # mean over sequences of exp(-mean_t log pi_old)
    training_log_ppl: Tensor  # mean over sequences of -mean_t log pi_old
    rollout_ppl: Tensor
    rollout_log_ppl: Tensor
    log_ppl_diff: Tensor  # mean over sequences of mean_t (log pi_rollout - log pi_old)
    log_ppl_abs_diff: Tensor
    log_ppl_diff_max: Tensor
    log_ppl_diff_min: Tensor
    ppl_ratio: Tensor  # mean over sequences of exp(log_ppl_diff_i)
    chi2_token: Tensor  # mean over tokens of rho^2, minus 1
    chi2_seq: Tensor  # mean over sequences of (prod_t rho)^2, minus 1
    is_ess: Tensor  # effective sample size fraction of the IS weights (if given), else 1


@checks_values
def offpolicy_metrics(
    old_logp: Float[Tensor, "batch seq"],
    rollout_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    is_weights: Float[Tensor, "batch seq"] | None = None,
) -> OffPolicyMetrics:
    r"""The off-policy gap between rollout and trainer, as verl's rollout-correction logs it.

    With :math:`\rho = \pi_{old}/\pi_{rollout}` per token (log clamped to +-20 where
    exponentiated): token means of k1 (``kl``), k3 and :math:`\rho^2 - 1` (``chi2_token``);
    per-sequence perplexities :math:`\exp(-\overline{\log\pi})` of both policies, their log
    difference and ratio; :math:`\overline{(\prod_t\rho)^2} - 1` (``chi2_seq``). With
    ``is_weights`` (e.g. from :func:`truncated_is_weights`), ``is_ess`` is the effective
    sample size fraction :math:`1 / \overline{(w/\bar w)^2}` over valid tokens (1 when all
    weights are equal). Sequence means run over sequences with at least one valid token
    (verl also counts empty rows, as perplexity 1); an all-masked batch gives 0s.

    Shapes: ``[batch, seq]``; returns an :class:`OffPolicyMetrics` of 0-dim tensors.

    Example:
        >>> old = torch.log(torch.tensor([[0.5, 0.9]]))
        >>> m = offpolicy_metrics(old, old, torch.ones(1, 2, dtype=torch.bool))
        >>> float(m.kl), float(m.chi2_token), float(m.ppl_ratio)
        (0.0, 0.0, 1.0)
    """
    _, valid, dtype = policy_tensors(
        old_logp, rollout_logp, None, mask, names=("old_logp", "rollout_logp")
    )
    if is_weights is not None:
        check_float("is_weights", is_weights)
        check_same_shape("is_weights", is_weights, "old_logp", old_logp)
        check_same_device("is_weights", is_weights, "old_logp", old_logp)
    with torch.no_grad():
        old, roll = masked(valid, old_logp.to(dtype)), masked(valid, rollout_logp.to(dtype))
        log_rho = old - roll
        safe = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        n = valid.sum(dim=-1).to(dtype)
        rows = n > 0
        n_rows = rows.sum().to(dtype)

        def token_mean(x: Tensor) -> Tensor:
            return _token_mean(x, valid)

        def row_mean(x: Tensor) -> Tensor:
            return masked(rows, x).sum() / torch.where(n_rows == 0, 1.0, n_rows)

        per_row = torch.where(rows, n, 1.0)
        mean_old, mean_roll = old.sum(dim=-1) / per_row, roll.sum(dim=-1) / per_row
        diff = mean_roll - mean_old
        seq_log_rho = log_rho.sum(dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        zero = diff.new_zeros(())
        return OffPolicyMetrics(
            kl=token_mean(-log_rho),
            k3_kl=token_mean(torch.expm1(log_rho) - log_rho),
            training_ppl=row_mean(torch.exp(-mean_old)),
            training_log_ppl=row_mean(-mean_old),
            rollout_ppl=row_mean(torch.exp(-mean_roll)),
            rollout_log_ppl=row_mean(-mean_roll),
            log_ppl_diff=row_mean(diff),
            log_ppl_abs_diff=row_mean(diff.abs()),
            log_ppl_diff_max=_extreme(diff, rows, "amax"),
            log_ppl_diff_min=_extreme(diff, rows, "amin"),
            ppl_ratio=row_mean(torch.exp(diff)),
            chi2_token=torch.where(valid.any(), token_mean(torch.exp(2.0 * safe)) - 1.0, zero),
            chi2_seq=torch.where(rows.any(), row_mean(torch.exp(2.0 * seq_log_rho)) - 1.0, zero),
            is_ess=_ess(is_weights, valid, dtype),
        )


def _extreme(values: Tensor, rows: Tensor, reduce: str) -> Tensor:
    """amax/amin over the rows that have valid tokens; 0 when there are none."""
    if values.numel() == 0:
        return values.new_zeros(())
    fill = -torch.inf if reduce == "amax" else torch.inf
    top = getattr(torch.where(rows, values, fill), reduce)()
    return torch.where(rows.any(), top, 0.0)


def _token_mean(x: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum().to(x.dtype)
    return masked(valid, x).sum() / torch.where(count == 0, 1.0, count)


def _ess(weights: Tensor | None, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """``1 / mean((w / mean w)^2)`` over valid tokens; 1 without weights or valid tokens."""
    if weights is None:
        return torch.ones((), dtype=dtype, device=valid.device)
    w = masked(valid, weights.detach().to(dtype))
    mean = _token_mean(w, valid)
    second = _token_mean((w / torch.where(mean == 0, 1.0, mean)).square(), valid)
    return torch.where(second == 0, 1.0, 1.0 / second)
