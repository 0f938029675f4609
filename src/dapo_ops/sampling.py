"""Dynamic sampling (DAPO change 2): keep only groups whose task metric has spread."""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._groups import segment_count, segment_reduce, segments
from dapo_ops._validate import InputError, check_finite


def dynamic_sample_mask(
    metric: Float[Tensor, "groups samples"]
    | Integer[Tensor, "groups samples"]
    | Bool[Tensor, "groups samples"]
    | Float[Tensor, " batch"]
    | Integer[Tensor, " batch"]
    | Bool[Tensor, " batch"],
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
    if not isinstance(metric, Tensor):
        raise InputError(f"metric must be a torch.Tensor, got {type(metric).__name__}")
    if metric.dtype.is_complex:
        raise InputError(f"metric must be real, got {metric.dtype}")
    if not (atol >= 0.0 and math.isfinite(atol)):
        raise InputError(f"atol must be finite and >= 0, got {atol}")
    seg = segments("metric", metric, group_ids)
    values = seg.values.to(torch.float64)
    check_finite("metric", values)
    spread = segment_reduce(seg, values, "amax") - segment_reduce(seg, values, "amin")
    keep = (spread > atol) & (segment_count(seg, torch.float64) >= 2)
    if seg.dense_shape is None:
        return keep[seg.segment]
    return keep[: seg.dense_shape[0]]


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
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool or keep.ndim != 1:
        raise InputError("keep must be the 1-D bool tensor returned by dynamic_sample_mask")
    if group_ids is None:
        return keep.sum().float(), keep.new_tensor(keep.numel(), dtype=torch.float32)
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

    Example:
        >>> prompts_to_generate(96, 0.4, max_prompts=512)
        240
    """
    if groups_needed < 0:
        raise InputError(f"groups_needed must be >= 0, got {groups_needed}")
    if not 0.0 <= kept_fraction <= 1.0:
        raise InputError(f"kept_fraction must lie in [0, 1], got {kept_fraction}")
    if not 0.0 < min_fraction <= 1.0:
        raise InputError(f"min_fraction must lie in (0, 1], got {min_fraction}")
    if max_prompts < 1:
        raise InputError(f"max_prompts must be >= 1, got {max_prompts}")
    return min(math.ceil(groups_needed / max(kept_fraction, min_fraction)), max_prompts)
