"""PPO's clipped value (critic) loss, aggregated like any per-token loss."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import AggregationMode, Normalizer, compute_dtype, masked, safe_divide
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_float,
    check_ndim,
    check_no_grad,
    check_same_shape,
)
from dapo_ops.engine.aggregation import token_level_aggregate

__all__ = ["ValueLoss", "value_loss"]


class ValueLoss(NamedTuple):
    """The critic's loss and the fraction of valid tokens where the clipped error won."""

    loss: Tensor  # 0-dim, differentiable in ``values``
    clip_frac: Tensor  # 0-dim, local token mean, no gradient


@checks_values
def value_loss(
    values: Float[Tensor, "batch seq"],
    old_values: Float[Tensor, "batch seq"],
    returns: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    clip: float | None = 0.5,
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
) -> ValueLoss:
    r"""PPO's clipped value loss: the larger of the plain and the clipped squared error.

    With :math:`v` the critic's new predictions, :math:`v^{old}` those of the rollout and
    :math:`R` the returns (e.g. from :func:`dapo_ops.gae_advantages`):

    .. math::

        \ell_{i,t} = \tfrac12 \max\Big((v - R)^2,\
            \big(\mathrm{clip}(v,\ v^{old} - c,\ v^{old} + c) - R\big)^2\Big)

    aggregated by :func:`dapo_ops.token_level_aggregate` (``mode``, ``normalizer``,
    ``max_len``: the same options and rules as the policy loss), so micro-batches and
    ranks add up exactly under a global normaliser. The max is pessimistic: a prediction
    that left the trust region ``[v^{old} - c, v^{old} + c]`` in the direction away from
    the return keeps its full error, while one that moved towards it stops getting a
    gradient past the region's edge. ``clip=None`` gives the plain ``(v - R)^2 / 2``.

    ``clip_frac`` is the share of valid tokens where the clipped error is the strictly
    larger one (verl's ``critic/vf_clipfrac``): a 0-dim tensor over this call's tokens,
    no host sync. A NaN or inf at a valid position propagates to ``loss``. Masked positions reach neither result nor the gradient, whatever they
    hold; ``old_values`` and ``returns`` are constants (refused when they require grad).

    Defaults: ``clip=0.5`` is verl 0.9.1's ``critic.cliprange_value``; ``token_mean`` its
    ``loss_agg_mode``. PPO (Schulman et al. 2017) as implemented in OpenAI baselines and
    TRL's ``PPOTrainer`` (``cliprange_value``). verl: ``core_algos.compute_value_loss``.

    Shapes: every tensor ``[batch, seq]``; returns two 0-dim tensors (float32, float64
    when any input is float64).

    Example:
        >>> v, old, ret = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 1.0]])
        >>> value_loss(v, old, ret, torch.tensor([[True, True]]), clip=0.5)
        ValueLoss(loss=tensor(0.8125), clip_frac=tensor(0.5000))
    """
    check_float("values", values)
    check_ndim("values", values, 2, "[batch, seq]")
    for name, t in (("old_values", old_values), ("returns", returns)):
        check_float(name, t)
        check_same_shape(name, t, "values", values)
        check_no_grad(name, t)
    valid = as_bool_mask("mask", mask, "values", values)
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < math.inf
    ):
        raise InputError(f"clip must be finite and > 0 (or None), got {clip!r}")
    dtype = compute_dtype(values, old_values, returns)
    v = masked(valid, values.to(dtype))
    ret = masked(valid, returns.to(dtype))
    plain = (v - ret).square()
    if clip is None:
        per_token, worse = plain, torch.zeros_like(valid)
    else:
        old = masked(valid, old_values.to(dtype))
        clipped = (torch.clamp(v, old - clip, old + clip) - ret).square()
        worse = ~(clipped <= plain)  # a NaN (in old_values) picks the clipped: it propagates
        per_token = torch.where(worse, clipped, plain)
    loss = 0.5 * token_level_aggregate(
        per_token, valid, mode=mode, normalizer=normalizer, max_len=max_len
    )
    frac = safe_divide((worse & valid).sum().to(dtype), valid.sum().to(dtype))
    return ValueLoss(loss, frac)
