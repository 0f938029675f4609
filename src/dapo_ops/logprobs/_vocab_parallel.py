r"""A vocabulary split across tensor-parallel ranks (``vocab_group=``), Megatron's layout.

Private. With ``vocab_group`` a process group of ``P`` ranks, rank ``r`` passes the same
``hidden`` (and per-token inputs) as every other rank and the rows ``[start_r, start_r +
V_r)`` of the output layer (``weight [V_r, d]``, ``bias [V_r]``): contiguous slices in
rank order, of any sizes (vocab 32003 over 3 ranks: 10668, 10668, 10667), as Megatron's
column-parallel output layer holds them. Token ids stay global.

- :func:`split_vocab` runs before anything else: one exchange of every rank's slice size
  and the call's shapes, dtypes and options (``all_gather_object``), then the call's own
  checks with the global vocabulary, then one exchange of their verdicts: every rank
  raises the same ``InputError`` or none does (a rank that raised alone would leave the
  others waiting in a collective).
- :func:`merge_stats` combines pass 1's per-row pieces ``(m, s0, s1, x_y)`` of every
  rank's columns: an all-reduce (max) of ``m``, then one (sum) of ``[3, N]``: the rescaled
  ``s0``, ``s1`` and ``x_y`` (0 on every rank but the chosen id's). Never a ``[N, V]``
  tensor; every rank then holds the same log-probs and entropies, so the engine computes
  the same ``d loss / d logp`` everywhere.
- pass 2 is local: the rank's rows of ``dW`` and ``db``, and ``dh`` as the rank's
  partial sum ``G_r W_r``: the input gradient that Megatron's column-parallel layer
  all-reduces in its backward (``copy_to_tensor_model_parallel_region``), as its
  ``vocab_parallel_cross_entropy`` and verl's ``linear_cross_entropy(...,
  dist_process_group)`` expect. Outside Megatron, sum the ranks' ``hidden.grad``
  (``dist.all_reduce``) before the optimiser step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.logprobs._backends import refuse_compiled

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """This rank's place in the split: its first global id and the global vocabulary."""

    group: Any
    start: int
    size: int
    vocab: int
    rank: int
    widest: int  # the largest slice (blocks sized by it are alike on every rank)


def check_group(group: object) -> Any:
    """``group`` as a process group of an initialised ``torch.distributed`` (refused
    under torch.compile: every call with a group comes here first)."""
    import torch.distributed as dist

    refuse_compiled("vocab_group")

    if not (dist.is_available() and dist.is_initialized()):
        raise InputError(
            "vocab_group needs torch.distributed initialised (dist.init_process_group) and "
            "a process group of the ranks that split the vocabulary"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise InputError(
            f"vocab_group must be a torch.distributed ProcessGroup (e.g. Megatron's "
            f"tensor-parallel group, or dist.group.WORLD), got {type(group).__name__}"
        )
    return group


def tp_only_normalizer(group: object, normalizer: object) -> object:
    """``"local"`` for ``normalizer=None`` when ``group`` spans every rank: the ranks then
    split one batch's vocabulary, and its own token count is the step's (the refusal of
    the local count under ``torch.distributed`` is for data-parallel ranks)."""
    import torch.distributed as dist

    g = check_group(group)
    if normalizer is None and dist.get_world_size(g) == dist.get_world_size():
        return "local"
    return normalizer


def _shape(x: object) -> object:
    if isinstance(x, Tensor):
        return (tuple(x.shape), str(x.dtype))
    return None if x is None else type(x).__name__


def split_vocab(
    group: object, weight: object, agreed: dict[str, object], prepare: Callable[[int], T]
) -> tuple[T, VocabSplit]:
    """``prepare(global vocab)`` on every rank, or the same ``InputError`` on every rank.

    ``agreed``: what every rank must pass alike (shapes, dtypes, options), by name."""
    import torch.distributed as dist

    g = check_group(group)
    rank, world = dist.get_rank(g), dist.get_world_size(g)
    size = int(weight.shape[0]) if isinstance(weight, Tensor) and weight.ndim == 2 else 0
    meta = {k: _shape(v) if isinstance(v, Tensor) or v is None else repr(v) for k, v in agreed.items()}  # fmt: skip
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (size, meta), group=g)
    sizes = [s for s, _ in gathered]
    problem = None
    differ = sorted(k for k in meta if any(m[k] != meta[k] for _, m in gathered))
    if any(s < 1 for s in sizes):
        problem = (
            f"weight must be this rank's slice [vocab_r, d] of the output layer, vocab_r >= 1 "
            f"on every rank of vocab_group; rows per rank: {sizes}"
        )
    elif differ:
        values = {k: [m[k] for _, m in gathered] for k in differ}
        problem = f"the ranks of vocab_group must pass the same {', '.join(differ)}; per rank: {values}"  # fmt: skip
    result: T | None = None
    if problem is None:
        try:
            result = prepare(sum(sizes))
        except InputError as e:
            problem = f"rank {rank}: {e}"
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, problem, group=g)
    errors = list(dict.fromkeys(v for v in verdicts if v))
    if errors:
        raise InputError("; ".join(errors))
    assert result is not None
    return result, VocabSplit(g, sum(sizes[:rank]), size, sum(sizes), rank, max(sizes))


def merge_stats(pieces: Tensor, split: VocabSplit) -> Tensor:
    """Every rank's ``[4, N]`` pass-1 pieces merged into those of the whole rows (two
    all-reduces of ``[N]`` and ``[3, N]``)."""
    import torch.distributed as dist

    m = pieces[0].clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=split.group)
    ref = torch.where(m == -math.inf, 0.0, m)
    dm = torch.where(pieces[0] == -math.inf, 0.0, pieces[0] - ref)
    scale = torch.exp(dm)
    rest = torch.stack([scale * pieces[1], scale * (pieces[2] + pieces[1] * dm), pieces[3]])
    dist.all_reduce(rest, group=split.group)
    return torch.cat([m.unsqueeze(0), rest])


def all_sum(x: Tensor, split: VocabSplit | None) -> Tensor:
    """``x`` summed over the ranks (in place), or ``x`` without a split."""
    if split is not None:
        import torch.distributed as dist

        dist.all_reduce(x, group=split.group)
    return x


def all_max(x: Tensor, split: VocabSplit | None) -> Tensor:
    """``x``'s entrywise maximum over the ranks (in place), or ``x`` without a split."""
    if split is not None:
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=split.group)
    return x


def gather_cols(x: Tensor, split: VocabSplit) -> Tensor:
    """Every rank's ``[n, k]`` side by side, ``[n, world * k]`` in rank order."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(split.group))]
    dist.all_gather(parts, x.contiguous(), group=split.group)
    return torch.cat(parts, dim=1)
