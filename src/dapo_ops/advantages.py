"""Group-relative advantages (GRPO / DAPO / Dr. GRPO / RLOO), for dense and ragged groups."""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from dapo_ops._groups import restore, segment_count, segment_reduce, segment_sum, segments
from dapo_ops._validate import (
    InputError,
    check_bool,
    check_finite,
    check_float,
    check_option,
    check_real,
)
from dapo_ops.aggregation import safe_divide

#: A group (or batch) whose reward std is at most this fraction of its largest |reward| is
#: treated as zero-variance: its spread is float rounding, not signal (~8 float32 ulps).
ZERO_STD_RTOL = 1e-6


def pow2_scale(m: Tensor) -> Tensor:
    """The power of two ``2**floor(log2(m))`` of non-negative float64 ``m`` (``m / it`` in
    [1, 2)), or ``2**-1022`` for zero and subnormal ``m``: read off the exponent bits, so
    division by it is exact and compiles (no frexp, no log2)."""
    bits = m.view(torch.int64) & 0x7FF0000000000000
    scale = bits.view(torch.float64)
    return torch.where(scale == 0, 2.0**-1022, scale)


def group_advantages(
    rewards: Float[Tensor, "groups samples"] | Float[Tensor, " batch"],
    group_ids: Integer[Tensor, " batch"] | None = None,
    *,
    scale: Literal["group", "batch", "none"] = "group",
    baseline: Literal["mean", "leave_one_out"] = "mean",
    eps: float = 0.0,
    unbiased: bool = True,
    singleton: Literal["zero", "score"] = "zero",
) -> Float[Tensor, "groups samples"] | Float[Tensor, " batch"]:
    r"""Advantage of every sample relative to the other samples of its prompt's group.

    .. math::

        A_i = \frac{R_i - b_i}{s + \varepsilon}, \qquad
        b_i = \begin{cases} \bar R_g & \text{baseline="mean" (GRPO, DAPO)} \\
              \frac{1}{n_g-1}\sum_{j\ne i} R_j & \text{baseline="leave_one_out" (RLOO)}
              \end{cases}

    and :math:`s` is the group's reward std (``scale="group"``, GRPO/DAPO), the std of all
    rewards of the batch (``scale="batch"``, "group mean, batch std" as in Lite PPO), or 1
    (``scale="none"``, Dr. GRPO and RLOO). The std is the unbiased one (``n - 1``) unless
    ``unbiased=False``.

    Layouts: dense ``rewards [groups, samples]``; or flat ``rewards [batch]`` with
    ``group_ids [batch]`` (integers; groups may be non-contiguous, unsorted and of
    different sizes). The output has the layout of ``rewards``. Vectorised: no Python loop
    over groups or samples, and no host sync but the finiteness check.

    Boundary cases, all giving advantage exactly 0 (never NaN or inf): a one-sample group;
    a group whose rewards are all equal; a group whose std is float rounding, i.e. at most
    ``1e-6`` times its largest ``|R|`` (peers divide such a std, e.g. ``3e-8``, by
    ``std + 1e-6`` and turn rounding noise into advantages of order 0.03-1). Statistics are
    accumulated in float64, so equal rewards give an exactly zero spread. Because such
    groups are handled exactly, ``eps`` defaults to 0, and ``group``/``batch`` scaling is
    invariant to ``rewards * a + b`` for ``a > 0`` up to float rounding (no epsilon
    skews it); only a spread within the rounding tolerance of the rewards' magnitude can
    flip a group between "constant" and "spread" under a large shift ``b``.

    Differences from peers (see docs/advantages.md): verl adds ``eps=1e-6`` to the
    unbiased std and gives a one-sample group its raw score as advantage (we give 0;
    ``singleton="score"`` reproduces verl: ``R / (1 + eps)``); TRL adds ``1e-4``;
    OpenRLHF ``1e-9``; all accumulate in float32. Pass ``eps`` to reproduce them.

    Range: each group is divided by a power of two near its largest ``|R|`` before any
    sum or square (exact, so results are unchanged), hence float64 rewards of any
    magnitude up to ``1.7e308`` give the right advantages, never an overflowed variance.
    With ``scale="none"`` the advantage is ``R_i - b_i`` itself, ``inf`` only where that
    difference exceeds the output dtype's range.

    Dtypes: float32 output (float64 for float64 input). Non-finite rewards raise
    ``InputError`` (one host sync, skipped under ``torch.compile``); ``rewards`` and
    ``group_ids`` must be on one device. The result is differentiable in ``rewards``
    (they are a constant of the policy objective: detach them before the loss).

    Example:
        >>> group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
        tensor([[ 0.8660, -0.8660, -0.8660,  0.8660],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
        >>> group_advantages(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([7, 7, 3]))
        tensor([ 0.7071, -0.7071,  0.0000])
    """
    check_float("rewards", rewards)
    check_option("scale", scale, ("group", "batch", "none"))
    check_option("baseline", baseline, ("mean", "leave_one_out"))
    check_option("singleton", singleton, ("zero", "score"))
    eps = check_real("eps", eps)
    if not eps >= 0.0:
        raise InputError(f"eps must be finite and >= 0, got {eps}")
    check_bool("unbiased", unbiased)
    seg = segments("rewards", rewards, group_ids)
    check_finite("rewards", rewards)
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32

    x = seg.values.to(torch.float64)
    count = segment_count(seg, torch.float64)
    max_abs = segment_reduce(seg, x.abs(), "amax")
    # Each group is divided by a power of two near its largest |R| (exact: no rounding),
    # so that no sum or square can overflow, even for float64 rewards near 1e308; the
    # advantage is a ratio, in which the scale cancels exactly.
    g_scale = pow2_scale(max_abs)
    y = x / g_scale[seg.segment]
    mean = segment_sum(seg, y) / count.clamp(min=1)
    centered = y - mean[seg.segment]
    dof = count - 1 if unbiased else count
    group_std = (segment_sum(seg, centered * centered) / dof.clamp(min=1)).sqrt()
    single = count == 1
    degenerate = (count < 2) | (group_std <= ZERO_STD_RTOL * (max_abs / g_scale))
    if singleton == "score":  # verl: a lone sample has mean 0 and std 1
        degenerate = degenerate & ~single
    score = single[seg.segment] if singleton == "score" else None

    if baseline == "mean":
        residual = centered
    else:  # R_i - mean_{j != i} R_j = n / (n - 1) * (R_i - mean); exact 0 for equal rewards
        n = count[seg.segment]
        residual = centered * (n / (n - 1).clamp(min=1))
    # residual and group_std are in units of the group's scale

    if scale == "group":
        advantages = safe_divide(residual, (group_std + eps / g_scale)[seg.segment])
        lone = x / (1.0 + eps)
    elif scale == "batch":
        b_scale = pow2_scale(max_abs.amax() if max_abs.numel() else max_abs.new_zeros(()))
        xb = x / b_scale
        batch_centered = xb - xb.sum() / max(x.numel(), 1)
        batch_dof = max(x.numel() - 1, 1) if unbiased else max(x.numel(), 1)
        batch_std = ((batch_centered * batch_centered).sum() / batch_dof).sqrt()
        den = batch_std + eps / b_scale  # batch std 0 => residuals 0
        advantages = safe_divide(residual * (g_scale / b_scale)[seg.segment], den)
        lone = safe_divide(xb, den)
    else:
        advantages = residual * g_scale[seg.segment]  # R - b itself (inf only if it is)
        lone = x
    if score is not None:
        advantages = torch.where(score, lone, advantages)
    advantages = torch.where(degenerate[seg.segment], torch.zeros_like(advantages), advantages)
    return restore(seg, advantages.to(out_dtype))
