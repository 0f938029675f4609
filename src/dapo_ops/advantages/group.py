"""Group-relative advantages (GRPO / DAPO / Dr. GRPO / RLOO), for dense and ragged groups."""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float, Integer
from torch import Tensor

from dapo_ops._core._groups import (
    check_groups,
    group_amax,
    group_each,
    group_sizes,
    group_sum,
    groups_of,
)
from dapo_ops._core._validate import (
    InputError,
    check_bool,
    check_finite,
    check_float,
    check_option,
    check_real,
    is_compiling,
)

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
    over groups or samples, and no host sync but the finiteness check (and, eagerly on
    CPU, a read of the ids' range: ids spanning fewer values than samples index the
    groups directly, without a sort).

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
    unbiased std and gives a one-sample group ``R / (1 + eps)`` with ``1 + eps`` rounded
    to float32 (we give 0; ``singleton="score"`` gives ``R / (1 + eps)`` in the rewards'
    precision, and the verl twin ``dapo_ops_grpo`` verl's float32 divisor); TRL adds ``1e-4``;
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

    Papers: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), GRPO's group advantage;
    Yu et al. 2025, "DAPO" (arXiv:2503.14476); Liu et al. 2025, "Understanding R1-Zero-Like
    Training: A Critical Perspective" (arXiv:2503.20783), Dr. GRPO's ``scale="none"``;
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (arXiv:2402.14740), the leave-one-out baseline.

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
    check_groups("rewards", rewards, group_ids)
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    x = rewards.to(torch.float64)
    if x.numel() == 0:
        return x.new_zeros(x.shape, dtype=out_dtype)
    groups = groups_of(x, group_ids)
    max_abs = group_amax(groups, x.abs())  # NaN and inf propagate to it
    # Each group is divided by a power of two near its largest |R| (exact: no rounding),
    # so that no sum or square can overflow or underflow, even for float64 rewards near
    # 1e308 or 1e-308; the advantage is a ratio, in which the scale cancels exactly.
    # Eagerly, when every group's largest |R| lies in [2^-300, 2^300] (or is 0), the
    # scaling changes no bit and is skipped: one host read, also the finiteness check.
    g_scale: Tensor | None = None
    if is_compiling() or not _moderate(max_abs.detach()):
        if not is_compiling():
            check_finite("rewards", rewards)  # raises if a reward is NaN or inf
        g_scale = pow2_scale(max_abs)
    count = group_sizes(groups, x)  # a number for the dense layout, else per group
    y = x if g_scale is None else x * group_each(groups, 1.0 / g_scale)[0]  # exact
    (mean,) = group_each(groups, group_sum(groups, y) / _at_least_one(count))
    centered = y - mean
    var = group_sum(groups, centered * centered) / _at_least_one(count - 1 if unbiased else count)
    if x.requires_grad:  # sqrt's derivative at 0 is inf: 0 * inf would be a NaN gradient
        group_std = torch.where(var > 0, torch.where(var > 0, var, 1.0).sqrt(), 0.0)
    else:
        group_std = var.sqrt()
    unit_max = max_abs if g_scale is None else max_abs / g_scale
    degenerate = group_std <= ZERO_STD_RTOL * unit_max
    too_few = count < 2
    if isinstance(too_few, Tensor) or too_few:
        degenerate = degenerate | too_few
    single = count == 1
    if singleton == "score":  # verl: a lone sample has mean 0 and std 1
        degenerate = degenerate & ~single if isinstance(single, Tensor) else degenerate & False
    # the advantage is the residual (in units of the group's scale) times a per-group
    # factor, 0 for a group without signal
    unit = 1.0 if g_scale is None else g_scale
    if scale == "group":
        den = group_std if eps == 0.0 else group_std + eps / unit
        factor: Tensor | float = 1.0 / torch.where(den == 0, 1.0, den)
        lone_den: Tensor | float = 1.0 + eps
    elif scale == "batch":
        b_scale = 1.0 if g_scale is None else pow2_scale(max_abs.amax())
        xb = x / b_scale
        batch_centered = xb - xb.sum() / x.numel()
        batch_dof = max(x.numel() - 1, 1) if unbiased else x.numel()
        batch_std = ((batch_centered * batch_centered).sum() / batch_dof).sqrt()
        b_den = batch_std + eps / b_scale  # batch std 0 => residuals 0
        b_den = torch.where(b_den == 0, 1.0, b_den)
        factor = (unit / b_scale) / b_den
        lone_den = b_scale * b_den  # a power of two times b_den: exact
    else:
        factor = unit  # R - b itself (inf only if it is)
        lone_den = 1.0
    if baseline == "leave_one_out":  # R_i - mean_{j != i} R_j = n / (n - 1) (R_i - mean)
        factor = factor * (count / _at_least_one(count - 1))
    if not isinstance(factor, Tensor):  # a Python number would make a float32 where
        factor = x.new_full((), factor)  # filled on the device: no copy from the host
    (factor_each,) = group_each(groups, torch.where(degenerate, 0.0, factor))
    advantages = centered * factor_each
    if singleton == "score" and isinstance(single, Tensor):
        (lone_flag,) = group_each(groups, single)
        advantages = torch.where(lone_flag, x / lone_den, advantages)
    elif singleton == "score" and single:  # dense, one sample per group
        advantages = x / lone_den
    # + 0.0: a group without signal gives +0.0 (not -0.0 = negative residual * 0)
    return advantages.to(out_dtype).add_(0.0)


def _moderate(max_abs: Tensor) -> bool:
    """Every group's largest |R| finite and in [2^-300, 2^300] or 0 (one host read)."""
    low, high = (float(v) for v in torch.aminmax(torch.where(max_abs == 0, 1.0, max_abs)))
    return low >= 2.0**-300 and high <= 2.0**300


def _at_least_one(count: Tensor | float) -> Tensor | float:
    return count.clamp(min=1) if isinstance(count, Tensor) else max(count, 1.0)
