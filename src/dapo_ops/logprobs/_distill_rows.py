r"""Pass 1 of the two-pass distillation, one block of rows (private).

:func:`block_terms` takes a block of the student's scaled logits ``x`` (``[n, V_r]``: this
rank's columns, all of them without a split) and gives each row's loss and what pass 2
needs, in two rounds with the ranks' all-reduces between them (none without a split):

1. the student's log-sum-exp (and the teacher's, from its logits), and the ids of a
   top-k support (the top-k of every rank's top-k, gathered);
2. with those known: for the whole-vocabulary kinds the sums that make the loss and the
   kind's number per row (:data:`ROW_SUMS`); for a support of ids the student's logits
   at the ids (each from its rank) and its mass off the ids. The loss then comes from
   the chunked path's own formulas (:func:`dapo_ops.logprobs._distill_terms.chunk_terms`)
   on a *compact row*: the logits at the ids (a repeated id once) and one bucket
   ``log sum_{v not in ids} e^{x_v}``, whose softmax has the same log-probs at the ids
   and the same mass off them as the whole row. Its gradient gives the ids' values of
   ``G`` and ``alpha``, the bucket's gradient over the bucket's probability: ``G =
   p_s alpha`` off the ids.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from dapo_ops.kernels.distill import sums as kernel_sums
from dapo_ops.kernels.rows import RowMath, compute_dtype, finish, stats
from dapo_ops.logprobs._distill_terms import DistillInputs, DistillSpec, chunk_terms
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR
from dapo_ops.logprobs._two_pass import TwoPassSpec
from dapo_ops.logprobs._vocab_parallel import (
    VocabSplit,
    all_max,
    all_sum,
    gather_cols,
    merge_stats,
)


class BlockTerms(NamedTuple):
    loss: Tensor  # [n] after the clamps
    cut: Tensor | None  # [n] bool: the loss clamp cut the gradient (whole vocabulary)
    lse: Tensor  # [n]
    lse_t: Tensor | None
    row: Tensor | None
    ids: Tensor | None  # [n, k] global ids
    alpha: Tensor | None
    at_ids: Tensor | None
    smass: Tensor | None
    tmass: Tensor | None


def lse_of(x: Tensor, split: VocabSplit | None) -> Tensor:
    """The log-sum-exp over the whole vocabulary of rows split across the ranks."""
    m = all_max(x.amax(dim=1), split)
    ref = torch.where(m == -math.inf, 0.0, m)
    s0 = all_sum(torch.exp(x - ref.unsqueeze(1)).sum(dim=1), split)
    return ref + torch.log(s0)


def _topk(x: Tensor, k: int, split: VocabSplit | None) -> tuple[Tensor, Tensor]:
    """``(values, global ids)`` of the top-k of rows split across the ranks."""
    start = 0 if split is None else split.start
    vals, ids = x.topk(min(k, x.shape[1]), dim=1)
    if split is None:
        return vals, ids
    if vals.shape[1] < k:  # a slice narrower than k: pad, every rank sends [n, k]
        pad = k - vals.shape[1]
        vals = torch.cat([vals, vals.new_full((vals.shape[0], pad), -math.inf)], dim=1)
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], dim=1)
    vals, ids = gather_cols(vals, split), gather_cols(ids + start, split)
    top, at = vals.topk(k, dim=1)
    return top, ids.gather(1, at)


def _at(x: Tensor, ids: Tensor, split: VocabSplit | None) -> Tensor:
    """``x`` at global ``ids``, each from the rank that holds it."""
    start = 0 if split is None else split.start
    rel = ids - start
    here = (rel >= 0) & (rel < x.shape[1])
    return all_sum(torch.where(here, x.gather(1, torch.where(here, rel, 0)), 0.0), split)


def _full(spec: DistillSpec, x: Tensor, y: Tensor, lse: Tensor, lse_t: Tensor,
          split: VocabSplit | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(loss, row number)`` of a whole-vocabulary kind, from this rank's columns."""
    s = (x - lse.unsqueeze(1)).clamp(min=LOGP_FLOOR)
    t = (y - lse_t.unsqueeze(1)).clamp(min=LOGP_FLOOR)
    ps, pt = s.exp(), t.exp()
    if spec.kind == "forward_kl":
        sums = torch.stack([(pt * (t - s)).sum(dim=1), pt.sum(dim=1)])
    elif spec.kind == "reverse_kl":
        sums = (ps * (s - t)).sum(dim=1).unsqueeze(0).repeat(2, 1)
    else:
        b = spec.beta
        m = torch.logaddexp(s + math.log1p(-b), t + math.log(b))
        sums = torch.stack([(pt * (t - m)).sum(dim=1), (ps * (s - m)).sum(dim=1)])
    sums = all_sum(sums, split)
    if spec.kind == "jsd":
        return spec.beta * sums[0] + (1 - spec.beta) * sums[1], sums[1]
    return sums[0], sums[1]


def scaled(z: Tensor, softcap: float | None, temperature: float, cdt: torch.dtype) -> Tensor:
    """``x = cap(z) / T`` in ``cdt``."""
    x = z.to(cdt)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x / temperature


def _clamped(spec: DistillSpec, loss: Tensor, lse: Tensor, lse_t: Tensor, row: Tensor) -> BlockTerms:  # fmt: skip
    """A whole-vocabulary block's terms, ``loss_clamp`` applied (its gradient cut beyond)."""
    c = spec.loss_clamp
    cut = None if c is None else (loss < -c) | (loss > c)
    loss = loss if c is None else loss.clamp(-c, c)
    return BlockTerms(loss, cut, lse, lse_t, row, None, None, None, None, None)


def _compact(x_ids: Tensor, ids: Tensor, off: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """``(log-softmax of the compact row [n, k + 1], the ids' columns in it)``: a repeated
    id keeps its first slot (the others -inf), the last column the mass off the ids."""
    k = ids.shape[1]
    same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [n, k, k]: slot j's id at slot i
    first = same.to(torch.int8).argmax(dim=2)  # the first slot holding each id
    slots = torch.arange(k, device=ids.device)
    x_ded = torch.where(first == slots, x_ids, -math.inf)
    bucket = torch.where(off > 0, torch.log(torch.where(off > 0, off, 1.0)) + lse, -math.inf)
    return torch.log_softmax(torch.cat([x_ded, bucket.unsqueeze(1)], dim=1), dim=1), first


def _lse_kernel(z: Tensor, rm: RowMath, split: VocabSplit | None) -> Tensor:
    """The log-sum-exp of ``cap(z) / T`` over every rank's columns, by the stats kernel."""
    none = torch.full((z.shape[0],), -1, dtype=torch.int64, device=z.device)
    pieces = stats(z, none, None, rm, "triton")
    if split is not None:
        pieces = merge_stats(pieces, split)
    return finish(pieces)[2]


def block_terms(
    spec: DistillSpec, z: Tensor, t: DistillInputs, grid_rows: Tensor, tp: TwoPassSpec,
    par: Tensor | None,
) -> BlockTerms:  # fmt: skip
    """The pass-1 results of the rows ``grid_rows`` (positions in the flattened grid) from
    their raw logits ``z``; ``par`` the distillation kernels' parameters under
    ``backend="triton"`` (None: the ATen functions)."""
    split, cdt = tp.split, compute_dtype(z.dtype)
    k_all = t.teacher.shape[-1]
    valid = t.valid.reshape(-1)[grid_rows].unsqueeze(1)
    teacher = torch.where(valid, t.teacher.reshape(-1, k_all)[grid_rows].to(cdt), 0.0)
    full = t.ids is None and spec.topk is None
    if full and par is not None:  # the whole vocabulary on the kernels: no [n, V] temporary
        lse = _lse_kernel(z, tp.rows, split)
        lse_t = _lse_kernel(teacher, RowMath(spec.temperature), split)
        sums = all_sum(kernel_sums(z, teacher, lse, lse_t, spec.kind, par, spec.softcap is not None), split)  # fmt: skip
        loss = spec.beta * sums[0] + (1 - spec.beta) * sums[1] if spec.kind == "jsd" else sums[0]
        return _clamped(spec, loss, lse, lse_t, sums[1])
    x = scaled(z, spec.softcap, spec.temperature, cdt)
    lse = lse_of(x, split) if par is None else _lse_kernel(z, tp.rows, split)
    if full:  # the whole vocabulary
        y = teacher / spec.temperature
        lse_t = lse_of(y, split)
        loss, row = _full(spec, x, y, lse, lse_t, split)
        return _clamped(spec, loss, lse, lse_t, row)
    if t.ids is not None:  # the teacher's top-k log-probs at global ids, as given
        tl, ids = teacher, t.ids.reshape(-1, k_all)[grid_rows]
    else:  # the teacher's logits reduced to the ids of a top-k support
        y = teacher / spec.temperature
        lse_t = lse_of(y, split)
        k = spec.topk or 1
        if spec.support == "student":
            ids = _topk(x, k, split)[1]
            tl = _at(y, ids, split) - lse_t.unsqueeze(1)
        else:
            top, ids = _topk(y, k, split)
            tl = top - lse_t.unsqueeze(1)
            if spec.support == "union":  # the student's top-k not among them, as padding
                sids = _topk(x, k, split)[1]
                dup = (sids.unsqueeze(2) == ids.unsqueeze(1)).any(dim=2)
                st = torch.where(dup, -math.inf, _at(y, sids, split) - lse_t.unsqueeze(1))
                tl, ids = torch.cat([tl, st], dim=1), torch.cat([ids, sids], dim=1)
    x_ids = _at(x, ids, split)
    start = 0 if split is None else split.start
    width = x.shape[1]
    rel = ids - start
    here = (rel >= 0) & (rel < width)
    off_ids = torch.ones(x.shape[0], width + 1, dtype=torch.bool, device=x.device)
    off_ids = off_ids.scatter(1, torch.where(here, rel, width), False)[:, :width]
    off = all_sum(torch.where(off_ids, torch.exp(x - lse.unsqueeze(1)), 0.0).sum(dim=1), split)
    lp, cols = _compact(x_ids, ids, off, lse)
    terms = chunk_terms(spec, lp, tl, cols, True, None)
    assert terms.grad is not None
    p_off = lp[:, -1].exp()
    g_off = terms.grad[:, -1]
    alpha = torch.where(p_off > 0, g_off / torch.where(p_off > 0, p_off, 1.0), 0.0)
    at_ids = terms.grad.gather(1, cols)
    return BlockTerms(terms.loss, None, lse, None, None, ids, alpha, at_ids,
                      terms.student_mass, terms.teacher_mass)  # fmt: skip
