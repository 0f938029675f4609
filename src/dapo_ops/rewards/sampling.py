"""Dynamic sampling (DAPO change 2): keep only groups whose task metric has spread."""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._groups import (
    Segments,
    segment_count,
    segment_reduce,
    segment_sum,
    segments,
)
from dapo_ops._core._validate import (
    InputError,
    check_finite,
    check_int,
    check_real,
    check_tensor,
    shape_str,
)

#: A task metric per sample, dense ``[groups, samples]`` or flat ``[batch]`` (with
#: ``group_ids``): float, integer or bool.
MetricTensor = (
    Float[Tensor, "groups samples"]
    | Integer[Tensor, "groups samples"]
    | Bool[Tensor, "groups samples"]
    | Float[Tensor, " batch"]
    | Integer[Tensor, " batch"]
    | Bool[Tensor, " batch"]
)


def dynamic_sample_mask(
    metric: MetricTensor,
    group_ids: Integer[Tensor, " batch"] | None = None,
    *,
    atol: float = 0.0,
) -> Bool[Tensor, " groups"] | Bool[Tensor, " batch"]:
    r"""Which groups DAPO keeps: those whose task metric is not the same for all samples.

    .. math::

        \text{keep}_g \iff \max_{i \in g} m_i - \min_{i \in g} m_i > \text{atol}

    For 0/1 accuracy this is DAPO's constraint ``0 < #correct < G``: an all-right or
    all-wrong group has zero advantage for every sample, so it gives no gradient while
    still counting in the batch.

    Pass the **task metric** (accuracy, or the correctness reward), not the shaped reward:
    once the overlong penalty is added, an all-wrong group whose answers differ in length
    has rewards with spread and would be kept although it carries no correctness signal.

    Rules: a one-sample group is dropped (it has no spread to learn from; its group
    advantage is 0). ``atol`` (default 0: exact) is the spread below which a continuous
    metric counts as constant.

    Exactness: integer and bool metrics are compared in int64, exactly at any magnitude
    (no rounding through a float, even near ``2**63``); float metrics in float64. A NaN or
    inf metric raises ``InputError`` (one host sync, skipped under ``torch.compile``).

    Layouts: dense ``metric [groups, samples]`` returns ``[groups]``, one verdict per
    group. Flat ``metric [batch]`` with ``group_ids [batch]`` (non-contiguous, uneven
    groups allowed) returns ``[batch]``: each sample carries its group's verdict, so
    ``batch[keep]`` keeps whole groups and no group order has to be agreed on.

    The share of groups kept, which sizes the next generation round, is
    ``keep.float().mean()`` in the dense layout; for both layouts see
    :func:`kept_group_fraction` and :func:`prompts_to_generate`.

    Example:
        >>> acc = torch.tensor([[1, 0, 1], [1, 1, 1], [0, 0, 0]])
        >>> dynamic_sample_mask(acc)
        tensor([ True, False, False])
    """
    _check_real_metric(metric)
    atol = check_real("atol", atol)
    if not atol >= 0.0:
        raise InputError(f"atol must be finite and >= 0, got {atol}")
    seg = segments("metric", metric, group_ids)
    if metric.dtype.is_floating_point:
        values = seg.values.to(torch.float64)  # exact for every float dtype
        check_finite("metric", values)
        spread = segment_reduce(seg, values, "amax") - segment_reduce(seg, values, "amin")
        varies = spread > atol  # an overflow to inf is a spread, too
    else:  # integers (and bool) stay integers: exact at any magnitude
        values = seg.values.to(torch.int64)
        varies = _int_spread_exceeds(
            segment_reduce(seg, values, "amax"), segment_reduce(seg, values, "amin"), atol
        )
    keep = varies & (segment_count(seg, torch.int64) >= 2)
    return _per_layout(seg, keep)


def difficulty_band_mask(
    metric: MetricTensor,
    group_ids: Integer[Tensor, " batch"] | None = None,
    *,
    low: float = 0.1,
    high: float = 0.95,
) -> Bool[Tensor, " groups"] | Bool[Tensor, " batch"]:
    r"""Which groups ROLL's difficulty filter keeps: those of mean metric strictly inside a band.

    .. math::

        \text{keep}_g \iff \text{low} < \frac{1}{|g|} \sum_{i \in g} m_i < \text{high}

    With 0/1 accuracy, a group's mean is its prompt's pass rate: the filter drops the
    prompts the policy already solves almost always (mean >= ``high``) or almost never
    (mean <= ``low``), a band around :func:`dynamic_sample_mask`'s rule, which is the
    band ``low=0, high=1`` for 0/1 metrics. Both bounds are exclusive, as in ROLL.

    Peer: ROLL ``difficulty_mask`` with ``difficulty_low_threshold`` /
    ``difficulty_high_threshold`` (``roll/pipeline/rlvr/utils.py``; the function's defaults
    ``low=0.1``, ``high=0.95`` are ours; ROLL's config defaults 0 and 1 turn it into
    dynamic sampling). ROLL skips the filter when a prompt has one sample; here a
    one-sample group's mean is its own metric, filtered like any other.

    Pass the **task metric** (accuracy), not the shaped reward, as for
    :func:`dynamic_sample_mask`. ``low < high``, both finite.

    Exactness: the mean is computed in float64 (exact sums for integer metrics whose group
    sums stay below ``2**53``, one rounding in the division), then compared with the
    bounds as given. A NaN or inf metric raises
    ``InputError`` (one host sync, skipped under ``torch.compile``).

    Layouts (as :func:`dynamic_sample_mask`): dense ``metric [groups, samples]`` returns
    ``[groups]``; flat ``metric [batch]`` with ``group_ids [batch]`` (uneven,
    non-contiguous groups allowed) returns ``[batch]``, each sample carrying its group's
    verdict. :func:`kept_group_fraction` counts the kept groups of either layout.

    Example:
        >>> acc = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 1], [0, 0, 0, 0]])
        >>> difficulty_band_mask(acc, low=0.1, high=0.95)
        tensor([ True, False,  True, False])
    """
    _check_real_metric(metric)
    low = check_real("low", low)
    high = check_real("high", high)
    if not low < high:
        raise InputError(f"low must be < high, got low={low}, high={high}")
    seg = segments("metric", metric, group_ids)
    values = seg.values.to(torch.float64)
    if metric.dtype.is_floating_point:
        check_finite("metric", values)
    count = segment_count(seg, torch.float64)
    mean = segment_sum(seg, values) / count.clamp(min=1.0)
    keep = (mean > low) & (mean < high) & (count >= 1)
    return _per_layout(seg, keep)


def _check_real_metric(metric: Tensor) -> None:
    check_tensor("metric", metric)
    if metric.dtype.is_complex:
        raise InputError(f"metric must be real, got {metric.dtype}")


def _per_layout(seg: Segments, keep: Tensor) -> Tensor:
    """One verdict per group (dense layout), or each sample its group's (flat layout)."""
    if seg.dense_shape is None:
        return keep[seg.segment]
    return keep[: seg.dense_shape[0]]


def _int_spread_exceeds(hi: Tensor, lo: Tensor, atol: float) -> Tensor:
    """``hi - lo > atol`` for int64 ``hi >= lo``, exact: no rounding through a float.

    ``hi - lo`` wraps (to a negative int64) exactly when the true spread is ``>= 2**63``;
    such a spread exceeds every ``atol`` below ``2**63``. Otherwise, for an integer
    spread, ``spread > atol`` is ``spread > floor(atol)``, compared in int64.
    """
    spread = hi - lo
    wrapped = spread < 0
    if atol >= 2.0**63:  # only a wrapped spread can exceed it: compare in float64
        return wrapped & (spread.to(torch.float64) + 2.0**64 > atol)
    return wrapped | (spread > math.floor(atol))


@checks_values
def kept_group_fraction(
    keep: Bool[Tensor, " groups"] | Bool[Tensor, " batch"],
    group_ids: Integer[Tensor, " batch"] | None = None,
) -> Float[Tensor, ""]:
    """Fraction of groups kept by :func:`dynamic_sample_mask`, as a 0-dim float32 tensor.

    Dense verdicts ``[groups]``: their mean. Flat per-sample verdicts ``[batch]`` need the
    same ``group_ids``, so that every group counts once whatever its size.

    Example:
        >>> kept_group_fraction(torch.tensor([True, False, False, True]))
        tensor(0.5000)
    """
    kept, total = kept_group_counts(keep, group_ids)
    return kept / total.clamp(min=1)


def kept_group_counts(
    keep: Tensor, group_ids: Tensor | None
) -> tuple[Float[Tensor, ""], Float[Tensor, ""]]:
    """(kept groups, groups) as 0-dim float32 tensors, for either layout of ``keep``."""
    check_tensor("keep", keep)
    if keep.dtype != torch.bool or keep.ndim != 1:
        raise InputError(
            f"keep must be the 1-D bool tensor returned by dynamic_sample_mask, got "
            f"{keep.dtype} of shape {shape_str(keep)}"
        )
    if group_ids is None:
        return keep.sum().float(), keep.new_full((), keep.numel(), dtype=torch.float32)
    seg = segments("keep", keep, group_ids)
    present = segment_count(seg, torch.float32) > 0
    kept = segment_reduce(seg, keep.float(), "amax")
    return kept.sum(), present.sum().float()


def prompts_to_generate(
    groups_needed: int, kept_fraction: float, *, min_fraction: float = 0.05, max_prompts: int
) -> int:
    """How many prompts the next generation round should sample (host-side arithmetic).

    ``ceil(groups_needed / max(kept_fraction, min_fraction))``, capped at ``max_prompts``:
    DAPO keeps sampling until the batch holds ``groups_needed`` more groups with spread.
    ``kept_fraction`` is the running estimate (e.g. ``float(kept_group_fraction(keep))``
    of the last round, converted once per round on the host); ``min_fraction`` bounds the
    over-sampling when nearly every group was dropped.

    ``groups_needed`` (an int >= 0) and ``max_prompts`` (an int >= 1) must be ints;
    ``kept_fraction`` in [0, 1] and ``min_fraction`` in (0, 1] finite reals. Anything else
    (NaN or inf included) raises ``InputError`` naming the argument.

    Example:
        >>> prompts_to_generate(96, 0.4, max_prompts=512)
        240
    """
    groups_needed = check_int("groups_needed", groups_needed, low=0)
    kept_fraction = check_real("kept_fraction", kept_fraction)
    if not 0.0 <= kept_fraction <= 1.0:
        raise InputError(f"kept_fraction must lie in [0, 1], got {kept_fraction}")
    min_fraction = check_real("min_fraction", min_fraction)
    if not 0.0 < min_fraction <= 1.0:
        raise InputError(f"min_fraction must lie in (0, 1], got {min_fraction}")
    max_prompts = check_int("max_prompts", max_prompts, low=1)
    return min(math.ceil(groups_needed / max(kept_fraction, min_fraction)), max_prompts)
