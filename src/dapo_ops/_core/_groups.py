"""Segment reductions over groups of samples, for both layouts, with no Python loop.

Dense layout: ``[groups, samples]``. Flat layout: ``[batch]`` values with a ``[batch]``
vector of integer group ids, which may be non-contiguous, unsorted and of uneven group
sizes (verl's ``uid``). Both are turned into a flat vector plus a dense segment index in
``[0, slots)``: no ``torch.unique`` (whose output size is data-dependent), so the
reductions trace under ``torch.compile``. The index is ``id - min(id)`` when the ids span
fewer than ``batch`` values (eager on CPU: one host read of the range, where there is no
device to wait for; never more slots than samples), else the rank of the id found by a stable sort (any
device, and while compiling; no host sync). :class:`Groups` reduces the dense layout
along its rows instead, with no index at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from einops import rearrange, repeat
from torch import Tensor

from dapo_ops._core._validate import (
    InputError,
    check_ndim,
    check_same_device,
    check_tensor,
    is_compiling,
    shape_str,
)


class Segments(NamedTuple):
    values: Tensor  # [batch], flat
    segment: Tensor  # [batch], int64 segment of each value, in [0, batch)
    num_slots: int  # size of per-segment buffers (an upper bound on the group count)
    dense_shape: tuple[int, int] | None  # [groups, samples] to restore, or None (flat)


def check_groups(name: str, values: Tensor, group_ids: Tensor | None) -> None:
    """The layout checks: ``values [groups, samples]``, or ``[batch]`` with integer
    ``group_ids [batch]`` on the same device."""
    check_tensor(name, values)
    if group_ids is None:
        if values.ndim != 2:
            raise InputError(
                f"{name} must have shape [groups, samples], or [batch] together with "
                f"group_ids [batch]; got {shape_str(values)} and no group_ids"
            )
        return
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


def segments(name: str, values: Tensor, group_ids: Tensor | None) -> Segments:
    """Flatten ``values`` and give each entry the index of its group."""
    check_groups(name, values, group_ids)
    if group_ids is None:
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
    index, slots = segment_index(group_ids)
    return Segments(values, index, slots, None)


def segment_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """A dense group index in ``[0, slots)`` for integer ids ``[batch]``, and ``slots``."""
    batch = group_ids.shape[0]
    if group_ids.device.type == "cpu" and not is_compiling() and batch:
        low, high = (int(v) for v in torch.aminmax(group_ids))
        if high - low < batch:  # the ids themselves, shifted: no sort, no more slots
            return (group_ids - low).to(torch.int64), high - low + 1
    order = torch.sort(group_ids, stable=True).indices
    sorted_ids = group_ids[order]
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    seg_sorted = torch.cumsum(starts, dim=0) - 1
    index = torch.empty_like(seg_sorted).scatter_(0, order, seg_sorted)
    return index, max(batch, 1)


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


class Groups(NamedTuple):
    """Either layout as groups of samples, for :func:`group_sum`, :func:`group_amax`,
    :func:`group_sizes` and :func:`group_each`. Dense ``[groups, samples]``: reductions
    along the rows (per-group values are ``[groups, 1]`` and broadcast back); flat: segment
    sums over the index of :func:`segment_index` (per-group values are ``[slots]``,
    gathered back)."""

    segment: Tensor | None  # [batch] group index of each sample, None for the dense layout
    num_slots: int


def groups_of(values: Tensor, group_ids: Tensor | None) -> Groups:
    """The :class:`Groups` of ``values`` (dense when ``group_ids`` is None), whose layout
    :func:`check_groups` accepted."""
    if group_ids is None:
        return Groups(None, values.shape[0])
    index, slots = segment_index(group_ids)
    return Groups(index, slots)


def group_sum(groups: Groups, x: Tensor) -> Tensor:
    """Sum of each group."""
    if groups.segment is None:
        return x.sum(dim=-1, keepdim=True)
    return x.new_zeros(groups.num_slots).index_add_(0, groups.segment, x)


def group_amax(groups: Groups, x: Tensor) -> Tensor:
    """Largest value of each group (0 for an empty group or slot)."""
    if groups.segment is None:
        return x.amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(x.shape[0], 1)
    out = x.new_zeros(groups.num_slots)
    return out.scatter_reduce_(0, groups.segment, x, "amax", include_self=False)


def group_sizes(groups: Groups, like: Tensor) -> Tensor | float:
    """Samples per group: a number for the dense layout (every row has as many), else per
    group in ``like``'s dtype."""
    if groups.segment is None:
        return float(like.shape[-1])
    return torch.bincount(groups.segment, minlength=groups.num_slots).to(like.dtype)


def group_each(groups: Groups, *per_group: Tensor) -> tuple[Tensor, ...]:
    """Per-group values back at each sample (one gather for all of them)."""
    if groups.segment is None:
        return per_group
    if len(per_group) == 1:
        return (per_group[0].index_select(0, groups.segment),)
    stacked = torch.stack(per_group, dim=-1).index_select(0, groups.segment)
    return tuple(stacked.unbind(dim=-1))
