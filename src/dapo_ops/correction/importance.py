"""Rollout correction: importance weights and rejection masks between rollout and trainer.

The rollout engine (vLLM, SGLang) samples with log-probs ``rollout_logp`` that differ
from the trainer's ``old_logp`` for the same weights (kernels, precision, a stale
policy), so the samples are off-policy even at the first update. Two corrections, as
detached tensors with no host sync: reweight (:func:`truncated_is_weights`) or drop
(:func:`rejection_mask`) tokens or sequences; :func:`offpolicy_metrics` measures the gap.
All use the log-ratio :math:`\\log\\rho = \\log\\pi_{old} - \\log\\pi_{rollout}`, clamped
to ``+-20`` before ``exp`` (verl's ``SAFETY_BOUND``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import LOG_RATIO_CLAMP, masked
from dapo_ops._core._validate import InputError, check_no_grad, check_option


def _log_rho(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(log rho, valid)``: the masked training/rollout log-ratio and the bool mask."""
    _, valid, dtype = policy_tensors(
        old_logp, rollout_logp, None, mask, names=("old_logp", "rollout_logp")
    )
    return masked(valid, old_logp.to(dtype) - rollout_logp.to(dtype)), valid


def _positive(name: str, value: float | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{name} must be a number, got {value!r}")
    if not 0 < value < math.inf:
        raise InputError(f"{name} must be finite and > 0, got {value}")


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    count = valid.sum().to(values.dtype)
    return masked(valid, values).sum() / torch.where(count == 0, 1.0, count)


@checks_values
def truncated_is_weights(
    old_logp: Float[Tensor, "batch seq"],
    rollout_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    level: Literal["token", "sequence"] = "token",
    cap: float = 2.0,
    lower: float | None = None,
    batch_normalize: bool = False,
) -> Float[Tensor, "batch seq"]:
    r"""Detached per-token importance weights correcting the rollout / trainer mismatch.

    - ``level="token"``: :math:`\rho_{i,t} = \pi_{old}/\pi_{rollout}` per token;
    - ``level="sequence"``: :math:`\rho_i = \prod_t \pi_{old}/\pi_{rollout}` (the log-sum
      clamped to +-20), the same for every token of the sequence.

    Truncated IS (TIS, Yao et al. 2025) caps the weight: :math:`w = \min(\rho, C)`. With
    ``lower`` (verl's two-sided threshold ``"lower_upper"``, "IcePop"), weights outside
    ``[lower, cap]`` are set to 0 instead (the token is dropped, not capped).
    ``batch_normalize=True`` divides by the weights' mean (over valid tokens; for
    ``"sequence"``, the mean over non-empty sequences of their per-sequence mean), over
    every rank of an initialised process group (all-reduce, no host sync), unless that
    mean is below 1e-8. The weights are detached and 0 at masked positions. Pass them as
    ``policy_loss(..., is_weights=w)``.

    Shapes: ``[batch, seq]``; returns ``[batch, seq]`` float32 (float64 for float64).

    Defaults: ``cap=2.0`` as in Yao et al. 2025 ("Your efficient RL framework secretly
    brings you off-policy RL training"). verl: ``rollout_is``, ``rollout_is_threshold``
    (``"lower_upper"`` for ``lower``), ``rollout_is_batch_normalize``.

    Example:
        >>> old = torch.log(torch.tensor([[0.5, 0.9]]))
        >>> roll = torch.log(torch.tensor([[0.25, 0.9]]))
        >>> truncated_is_weights(old, roll, torch.ones(1, 2, dtype=torch.bool))
        tensor([[2., 1.]])
    """
    check_option("level", level, ("token", "sequence"))
    _positive("cap", cap)
    _positive("lower", lower, optional=True)
    if lower is not None and lower > cap:
        raise InputError(f"lower must be <= cap, got lower={lower}, cap={cap}")
    if not isinstance(batch_normalize, bool):
        raise InputError(f"batch_normalize must be True or False, got {batch_normalize!r}")
    check_no_grad("old_logp", old_logp)  # the weights are constants of the objective
    check_no_grad("rollout_logp", rollout_logp)
    log_rho, valid = _log_rho(old_logp, rollout_logp, mask)
    if level == "sequence":
        log_rho = rearrange(log_rho.sum(dim=-1), "batch -> batch 1").expand_as(log_rho)
    rho = log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if lower is None:
        weight = rho.clamp(max=cap)
    else:
        weight = torch.where((rho >= lower) & (rho <= cap), rho, 0.0)
    weight = masked(valid, weight)
    if batch_normalize:
        weight = weight / _batch_mean(weight, valid, level)
    return weight.detach()


def _batch_mean(weight: Tensor, valid: Tensor, level: str) -> Tensor:
    """The normaliser of ``batch_normalize``: the mean weight, 1 when below 1e-8."""
    if level == "token":
        total, count = weight.sum(), valid.sum().to(weight.dtype)
    else:
        n = valid.sum(dim=-1).to(weight.dtype)
        per_seq = weight.sum(dim=-1) / torch.where(n == 0, 1.0, n)
        total, count = per_seq.sum(), (n > 0).sum().to(weight.dtype)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        both = torch.stack([total, count])
        dist.all_reduce(both)
        total, count = both.unbind()
    mean = total / torch.where(count == 0, 1.0, count)
    return torch.where(mean > 1e-8, mean, 1.0)


Statistic = Literal["k1", "k2", "k3"]
RejectionLevel = Literal["token", "seq_sum", "seq_mean", "seq_max"]


@checks_values
def rejection_mask(
    old_logp: Float[Tensor, "batch seq"],
    rollout_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    statistic: Statistic = "k1",
    level: RejectionLevel = "token",
    upper: float,
    lower: float | None = None,
) -> Bool[Tensor, "batch seq"]:
    r"""The tokens to keep after rejecting those (or the sequences) too far off-policy.

    With :math:`\delta = \log\pi_{old} - \log\pi_{rollout}` (clamped to +-20), a per-token
    divergence: ``k1`` :math:`= -\delta` (log rollout/old), ``k2`` :math:`= \delta^2/2`,
    ``k3`` :math:`= e^{\delta} - 1 - \delta`; reduced per ``level``: ``"token"`` (each
    token on its own), ``"seq_sum"``, ``"seq_mean"`` (geometric-mean ratio, for k1) or
    ``"seq_max"`` (k2 and k3) over the sequence's valid tokens, when a sequence is
    rejected as a whole. ``k1`` keeps :math:`\log(\text{lower}) \le s \le \log(\text{upper})`
    (``lower`` defaults to ``1 / upper``: thresholds are ratios); ``k2``/``k3`` keep
    :math:`s \le \text{upper}` (``lower`` is refused). Returns the bool mask of valid,
    kept tokens: use it as the loss mask (``mask & keep`` is ``keep``). Combine several
    criteria with ``&``, as verl's comma-separated ``rollout_rs``. A NaN log-prob at a
    valid token gives a NaN statistic, which no bound keeps: the token (for a sequence
    ``level``, its whole sequence) is rejected, never silently kept.

    Shapes: ``[batch, seq]``; returns bool ``[batch, seq]``.

    Defaults: none for ``upper`` (verl requires ``rollout_rs_threshold``). verl:
    ``rollout_rs="<level>_<statistic>"`` (``token_k1``, ``seq_mean_k3``, ...).

    Example:
        >>> old = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
        >>> roll = torch.log(torch.tensor([[0.25, 0.9, 0.21]]))
        >>> rejection_mask(old, roll, torch.ones(1, 3, dtype=torch.bool), upper=1.5)
        tensor([[False,  True,  True]])
    """
    check_option("statistic", statistic, ("k1", "k2", "k3"))
    check_option("level", level, ("token", "seq_sum", "seq_mean", "seq_max"))
    _positive("upper", upper)
    _positive("lower", lower, optional=True)
    if statistic == "k1":
        low = 1.0 / upper if lower is None else lower
        if low > upper:
            raise InputError(f"lower must be <= upper, got lower={low}, upper={upper}")
        bounds = (math.log(low), math.log(upper))
    elif lower is not None:
        raise InputError(f"lower applies to statistic='k1' only (got statistic={statistic!r})")
    if level == "seq_max" and statistic == "k1":
        raise InputError("level='seq_max' takes statistic 'k2' or 'k3' (k1 can be negative)")
    delta, valid = _log_rho(old_logp, rollout_logp, mask)
    delta = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if statistic == "k1":
        stat = -delta
    elif statistic == "k2":
        stat = 0.5 * delta.square()
    else:
        stat = torch.expm1(delta) - delta
    if level != "token":
        stat = rearrange(_reduce_rows(stat, valid, level), "batch -> batch 1")
    keep = (stat >= bounds[0]) & (stat <= bounds[1]) if statistic == "k1" else stat <= upper
    return keep.expand_as(valid) & valid


def _reduce_rows(stat: Tensor, valid: Tensor, level: str) -> Tensor:
    if level == "seq_max":
        top = torch.where(valid, stat, -math.inf).amax(dim=-1) if stat.shape[-1] else stat.sum(-1)
        return torch.where(valid.any(dim=-1), top, 0.0)
    total = masked(valid, stat).sum(dim=-1)
    if level == "seq_sum":
        return total
    n = valid.sum(dim=-1).to(stat.dtype)
    return total / torch.where(n == 0, 1.0, n)
