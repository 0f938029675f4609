"""Token and sequence selections that weight the loss: high-entropy tokens, off-policy rows.

Each returns a bool ``[batch, seq]`` selection inside ``mask``. Pass it as
``policy_loss(..., is_weights=selection.float())`` (times any IS weights) to keep the
aggregation's counts, as TRL does, or ``&`` it into the loss mask to renormalise over the
kept tokens instead. No host sync, except that under an initialised multi-rank process
group the entropy quantile gathers every rank's tokens (one read of the ranks' sizes).
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import masked
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_float,
    check_ndim,
    check_same_shape,
)


def _quantile(values: Tensor, valid: Tensor, q: float) -> Tensor:
    """``torch.quantile`` (linear interpolation) of the valid entries, with no host sync;
    ``+inf`` when there is none (nothing passes a ``>=`` test)."""
    flat = torch.where(valid, values, torch.inf).reshape(-1)
    ordered = torch.sort(flat).values
    n = valid.sum()
    pos = (n - 1).clamp(min=0).to(values.dtype) * q
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    frac = pos - lo.to(values.dtype)
    if ordered.numel() == 0:
        return values.new_full((), math.inf)
    # take, not ordered[lo]: indexing with a 0-dim tensor reads it on the host (a sync)
    a, b = ordered.take(lo), ordered.take(hi)
    value = a + (b - a) * frac
    return torch.where(n > 0, value, torch.inf)


def _gather_valid(values: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Every rank's values and validity, concatenated (padded to the longest rank)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values, valid
    flat, ok = values.reshape(-1), valid.reshape(-1)
    size = torch.tensor([flat.numel()], device=flat.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(int(s) for s in sizes))  # shapes must be known to gather
    pad = longest - flat.numel()
    flat = torch.nn.functional.pad(flat, (0, pad))
    ok = torch.nn.functional.pad(ok, (0, pad))
    all_v = [torch.empty_like(flat) for _ in sizes]
    all_ok = [torch.empty_like(ok) for _ in sizes]
    dist.all_gather(all_v, flat)
    dist.all_gather(all_ok, ok)
    return torch.cat(all_v), torch.cat(all_ok)


@checks_values
def high_entropy_mask(
    entropies: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    top_quantile: float,
) -> Bool[Tensor, "batch seq"]:
    r"""The valid tokens whose entropy is in the top ``top_quantile`` fraction.

    Keeps :math:`H_{i,t} \ge Q_{1-\rho}(H)` with :math:`Q` the linear-interpolation
    quantile of the valid tokens' entropies (over every rank of an initialised process
    group) and :math:`\rho` = ``top_quantile``: the "80/20" finding (Wang et al. 2025) that
    the policy gradient of the 20 % highest-entropy "forking" tokens carries the learning.
    TRL: ``top_entropy_quantile`` (its trainer multiplies the per-token loss by it).
    A NaN entropy at a valid token is left out: it does not enter the quantile and is never
    selected; +-inf entropies are the highest and lowest values.

    Shapes: ``[batch, seq]``; returns bool ``[batch, seq]``, False at masked positions.

    Example:
        >>> h = torch.tensor([[0.1, 2.0, 0.5, 3.0]])
        >>> high_entropy_mask(h, torch.ones(1, 4, dtype=torch.bool), top_quantile=0.5)
        tensor([[False,  True, False,  True]])
    """
    check_float("entropies", entropies)
    check_ndim("entropies", entropies, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "entropies", entropies)
    if isinstance(top_quantile, bool) or not isinstance(top_quantile, (int, float)):
        raise InputError(f"top_quantile must be a number in (0, 1], got {top_quantile!r}")
    if not 0.0 < top_quantile <= 1.0:
        raise InputError(f"top_quantile must lie in (0, 1], got {top_quantile}")
    values = entropies.detach().to(
        torch.float64 if entropies.dtype == torch.float64 else torch.float32
    )
    valid = valid & ~torch.isnan(values)  # a NaN entropy has no rank: left out
    everyone, ok = _gather_valid(masked(valid, values), valid)
    threshold = _quantile(everyone, ok, 1.0 - top_quantile)
    return (masked(valid, values) >= threshold) & valid


@checks_values
def off_policy_sequence_mask(
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"],
    logp: Float[Tensor, "batch seq"],
    sampling_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    threshold: float,
) -> Bool[Tensor, "batch seq"]:
    r"""Drop negative-advantage sequences that drifted too far from the sampling policy.

    Keeps row :math:`i` when :math:`A_i \ge 0` or :math:`\overline{\log\pi_{sampling} -
    \log\pi_\theta} \le \delta` (the mean over its valid tokens; a token whose log-prob is
    NaN counts 0, as in TRL). A NaN advantage is not :math:`\ge 0`, so its row is kept
    only when its drift is within ``threshold``, as in TRL. TRL: ``off_policy_mask_threshold``.

    Shapes: advantages ``[batch]`` or ``[batch, 1]``; the rest ``[batch, seq]``; returns
    bool ``[batch, seq]`` (whole rows), False at masked positions.

    Example:
        >>> lp = torch.log(torch.tensor([[0.1, 0.1], [0.1, 0.1]]))
        >>> off_policy_sequence_mask(torch.tensor([-1.0, 1.0]), lp, lp + 1.0,
        ...                          torch.ones(2, 2, dtype=torch.bool), threshold=0.5)
        tensor([[False, False],
                [ True,  True]])
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise InputError(f"threshold must be a number, got {threshold!r}")
    if math.isnan(threshold):
        raise InputError("threshold must not be NaN")
    adv, valid, dtype = policy_tensors(
        logp, sampling_logp, advantages, mask, names=("logp", "sampling_logp"), per_sequence=True
    )
    check_same_shape("sampling_logp", sampling_logp, "logp", logp)
    kl = torch.nan_to_num(sampling_logp.to(dtype) - logp.detach().to(dtype), nan=0.0)
    n = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)
    mean_kl = masked(valid, kl).sum(dim=-1, keepdim=True) / n
    keep = (adv.to(dtype) >= 0) | (mean_kl <= threshold)
    return keep.expand_as(valid) & valid
