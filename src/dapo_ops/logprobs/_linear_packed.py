"""``cu_seqlens``: already packed inputs of :func:`dapo_ops.linear_policy_loss` (private).

The per-token inputs come as ``[1, total]`` (verl's remove-padding layout); they are laid
out in the ``[seqs, max_len]`` grid of :func:`dapo_ops.logprobs._packing.packed_map` for
the engine, and a stand-in of ``hidden``'s grid shape (an expanded 0-dim tensor: no
memory) takes the argument checks; the products then run on the packed rows.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dapo_ops._core._validate import InputError, shape_str
from dapo_ops.logprobs._packing import Packed, packed_hidden, packed_map, to_grid

#: The per-token options laid out in the grid with the per-token arguments.
PER_TOKEN_OPTIONS = ("ref_logp", "is_weights")


def _per_token(name: str, x: object, total: int) -> Tensor:
    if not isinstance(x, Tensor) or tuple(x.shape) != (1, total):
        got = shape_str(x) if isinstance(x, Tensor) else type(x).__name__
        raise InputError(
            f"{name} must have shape [1, total] = [1, {total}] with cu_seqlens (packed, as "
            f"hidden [1, total, d]), got {got}"
        )
    return x


def unpack(
    hidden: object, tokens: object, old_logp: object, advantages: object, mask: object,
    o: Any, cu_seqlens: object,
) -> tuple[Packed, Tensor, tuple[Any, ...], Any]:  # fmt: skip
    """``(packed, hidden's grid stand-in, (tokens, old_logp, advantages, mask) in the
    grid, the options with their per-token tensors in the grid)``."""
    hidden = packed_hidden(hidden)
    total = hidden.shape[1]
    packed = packed_map(cu_seqlens, total, hidden.device)
    seqs, width = packed.grid
    grid = [
        to_grid(_per_token(name, x, total), packed, fill)
        for name, x, fill in (("tokens", tokens, 0), ("old_logp", old_logp, 0.0))
    ]
    m = _per_token("mask", mask, total)
    grid_mask = to_grid(m, packed, False if m.dtype.is_floating_point is False else 0)
    adv: object = advantages
    if isinstance(advantages, Tensor) and tuple(advantages.shape) == (1, total):
        adv = to_grid(advantages, packed, 0.0)
    options = dict(o)
    for name in PER_TOKEN_OPTIONS:
        if options.get(name) is not None:
            options[name] = to_grid(_per_token(name, options[name], total), packed, 0.0)
    standin = hidden.new_zeros(()).expand(seqs, width, hidden.shape[2])
    return packed, standin, (grid[0], grid[1], adv, grid_mask), options
