r"""Padding that costs nothing: the lm-head work on the valid tokens only (private).

Two ways in, one :class:`RowMap` out: which rows of ``hidden.reshape(-1, d)`` the
products and row kernels run on (``src``) and where each lands in the ``[batch, seq]``
grid the engine works on (``dst``). The engine itself (objective, aggregation, the
normaliser) is unchanged and sees the grid.

- ``skip_padding`` (:func:`skip_padding_map`): ``[batch, seq]`` inputs; the valid rows,
  in order, gathered once (``src = dst``). Their count sizes the buffers: ``True``
  counts them (one host sync), an ``int`` is the caller's count (none; TRL's head gets
  it from the batch, verl's from ``attention_mask.sum()`` it already has). A count
  below the batch's valid tokens would leave tokens out: the loss is then NaN (no host
  sync to raise), and checked mode raises ``InputError``; a count above it costs work,
  not accuracy.
- ``cu_seqlens`` (:func:`packed_map`): inputs already packed as verl's remove-padding
  forward and flash-attention make them, ``hidden [1, total, d]`` and per-token inputs
  ``[1, total]``, with the sequence boundaries ``cu_seqlens [seqs + 1]`` (``0, l_0, l_0 +
  l_1, ..., total``). The per-token inputs are laid out in a ``[seqs, max_len]`` grid
  for the engine (sequence-level objectives and the seq-mean modes need whole
  sequences); the products run on the packed rows. Reading the boundaries is one host
  sync.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._validate import (
    InputError,
    check_float,
    check_tensor,
    is_compiling,
    shape_str,
)
from dapo_ops.logprobs._backends import refuse_compiled


class RowMap(NamedTuple):
    src: Tensor  # [n] int64: the rows of hidden.reshape(-1, d) that run
    dst: Tensor  # [n] int64: their positions in the flattened [batch, seq] grid
    short: Tensor | None  # 0-dim bool: the caller's count left valid tokens out


def check_skip_padding(skip_padding: object, valid: Tensor) -> int | None:
    """The count of rows to run (None: off)."""
    if skip_padding is False:
        return None
    if skip_padding is True:
        if is_compiling():
            raise InputError(
                "skip_padding=True counts the valid tokens on the host (one sync), which "
                "torch.compile(fullgraph=True) cannot trace: pass the count, "
                "skip_padding=int(mask.sum()), computed outside the compiled region"
            )
        return int(valid.sum())  # the count: one host sync
    if isinstance(skip_padding, bool) or not isinstance(skip_padding, int):
        raise InputError(
            f"skip_padding must be False, True (count the valid tokens: one host sync) or "
            f"the count of valid tokens as an int; got {skip_padding!r}"
        )
    if not 0 <= skip_padding <= valid.numel():
        raise InputError(
            f"skip_padding={skip_padding}: the count of valid tokens must be in [0, "
            f"{valid.numel()}] (batch x seq)"
        )
    return skip_padding


def skip_padding_map(valid: Tensor, count: int, exact: bool) -> RowMap:
    """The first ``count`` valid positions of ``valid [batch, seq]`` (valid first, each
    set in order; no host sync). ``exact``: the count was measured, not given."""
    flat = valid.reshape(-1)
    order = torch.argsort((~flat).to(torch.int8), stable=True)[:count]
    short = None if exact else flat.sum() > count  # checked mode raises for it
    return RowMap(order, order, short)


class Packed(NamedTuple):
    grid: tuple[int, int]  # (seqs, max_len)
    dst: Tensor  # [total] int64: each packed token's position in the flattened grid

    def lay_out(self, x: Tensor, fill: float | bool = 0) -> Tensor:
        """A packed ``[1, total]`` tensor in the grid (:func:`to_grid`)."""
        return to_grid(x, self, fill)

    def pack(self, x: Tensor) -> Tensor:
        """A grid tensor back to ``[1, total]`` (:func:`from_grid`)."""
        return from_grid(x, self)


def packed_hidden(hidden: object) -> Tensor:
    """``hidden`` checked as the packed ``[1, total, d]`` of ``cu_seqlens``."""
    check_float("hidden", hidden)  # type: ignore[arg-type]
    assert isinstance(hidden, Tensor)
    if hidden.ndim != 3 or hidden.shape[0] != 1:
        raise InputError(
            f"hidden must have shape [1, total, d] with cu_seqlens (the packed layout of "
            f"verl's remove-padding forward), got {shape_str(hidden)}"
        )
    return hidden


def packed_map(cu_seqlens: object, total: int, device: torch.device) -> Packed:
    """The grid of the sequences ``cu_seqlens`` delimits (one host read of it)."""
    refuse_compiled("cu_seqlens")
    check_tensor("cu_seqlens", cu_seqlens)
    assert isinstance(cu_seqlens, Tensor)
    cu = cu_seqlens
    if cu.ndim != 1 or cu.shape[0] < 2 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise InputError(
            f"cu_seqlens must be a 1-D integer tensor [seqs + 1] of sequence boundaries "
            f"(0, l_0, l_0 + l_1, ..., total), got {cu.dtype} {shape_str(cu)}"
        )
    bounds = cu.tolist()  # the boundaries: one host sync
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if bounds[0] != 0 or bounds[-1] != total or min(lengths) < 0:
        raise InputError(
            f"cu_seqlens must start at 0, never decrease and end at the packed token count "
            f"{total} (hidden's dim 1); got {bounds[:4]}{'...' if len(bounds) > 4 else ''} "
            f"ending at {bounds[-1]}"
        )
    width = max(max(lengths), 1)
    ids = torch.arange(total, device=device)
    cu_dev = cu.to(device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu_dev[1:], ids, right=True)
    return Packed((len(lengths), width), seq * width + ids - cu_dev[seq])


def to_grid(x: Tensor, packed: Packed, fill: float | bool = 0) -> Tensor:
    """A packed ``[1, total]`` tensor laid out in the ``[seqs, max_len]`` grid."""
    seqs, width = packed.grid
    out = x.new_full((seqs * width,), fill)
    return out.index_copy(0, packed.dst, x.reshape(-1)).view(seqs, width)


def from_grid(x: Tensor, packed: Packed) -> Tensor:
    """A ``[seqs, max_len]`` grid tensor back to the packed ``[1, total]`` layout."""
    return x.reshape(-1)[packed.dst].unsqueeze(0)
