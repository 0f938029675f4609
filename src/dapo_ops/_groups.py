"""Segment reductions over groups of samples, for both layouts, with no Python loop.

Dense layout: ``[groups, samples]``. Flat layout: ``[batch]`` values with a ``[batch]``
vector of integer group ids, which may be non-contiguous, unsorted and of uneven group
sizes (verl's ``uid``). Both are turned into a flat vector plus a dense segment index in
``[0, batch)``, found by a stable sort: no ``torch.unique`` (whose output size is
data-dependent), so the reductions need no host sync and trace under ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import rearrange, repeat
from torch import Tensor

from dapo_ops._validate import (
    InputError,
    check_ndim,
    check_same_device,
    check_tensor,
    shape_str,
)


class Segments(NamedTuple):
    values: Tensor  # [batch], flat
    segment: Tensor  # [batch], int64 segment of each value, in [0, batch)
    num_slots: int  # size of per-segment buffers (an upper bound on the group count)
    dense_shape: tuple[int, int] | None  # [groups, samples] to restore, or None (flat)


def segments(name: str, values: Tensor, group_ids: Tensor | None) -> Segments:
    """Flatten ``values`` and give each entry the index of its group."""
    check_tensor(name, values)
    if group_ids is None:
        if values.ndim != 2:
            raise InputError(
                f"{name} must have shape [groups, samples], or [batch] together with "
                f"group_ids [batch]; got {shape_str(values)} and no group_ids"
            )
        groups, samples = values.shape
        if samples == 0:
            empty = values.new_zeros(0)
            index = torch.zeros(0, dtype=torch.int64, device=values.device)
            return Segments(empty, index, max(groups, 1), (groups, samples))
        index = repeat(
            torch.arange(groups, device=values.device),
            "groups -> (groups samples)",
            samples=samples,
        )
        flat = rearrange(values, "groups samples -> (groups samples)")
        return Segments(flat, index, max(groups, 1), (groups, samples))
    check_tensor("group_ids", group_ids)
    check_same_device("group_ids", group_ids, name, values)
    check_ndim(name, values, 1, "[batch] when group_ids is given")
    if group_ids.shape != values.shape:
        raise InputError(
            f"group_ids has shape {shape_str(group_ids)} but {name} has shape "
            f"{shape_str(values)}; they must match"
        )
    if (
        group_ids.dtype.is_floating_point
        or group_ids.dtype.is_complex
        or group_ids.dtype == torch.bool
    ):
        raise InputError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    batch = values.shape[0]
    order = torch.sort(group_ids, stable=True).indices
    sorted_ids = group_ids[order]
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    seg_sorted = torch.cumsum(starts, dim=0) - 1
    index = torch.empty_like(seg_sorted).scatter_(0, order, seg_sorted)
    return Segments(values, index, max(batch, 1), None)


def restore(seg: Segments, flat: Tensor) -> Tensor:
    """Per-entry values back in the caller's layout."""
    if seg.dense_shape is None:
        return flat
    if seg.dense_shape[1] == 0:
        return flat.new_zeros(seg.dense_shape)
    return rearrange(flat, "(groups samples) -> groups samples", samples=seg.dense_shape[1])


def segment_sum(seg: Segments, x: Tensor) -> Tensor:
    return x.new_zeros(seg.num_slots).index_add_(0, seg.segment, x)


def segment_count(seg: Segments, dtype: torch.dtype) -> Tensor:
    ones = torch.ones_like(seg.segment, dtype=dtype)
    return segment_sum(seg, ones)


def segment_reduce(seg: Segments, x: Tensor, reduce: str) -> Tensor:
    """``amax`` or ``amin`` of each segment (0 for empty slots)."""
    return x.new_zeros(seg.num_slots).scatter_reduce(0, seg.segment, x, reduce, include_self=False)
