r"""Logit distillation on the two-pass design (``linear_distill_loss(backend="two_pass")``).

Private. Pass 1 (:func:`pass1`) walks blocks of whole rows of the student's logits
(:func:`dapo_ops.logprobs._two_pass.blocks1`: kept whole, or a block at a time) and
:func:`dapo_ops.logprobs._distill_rows.block_terms` gives each token's loss, its weight in
the total (the aggregation's times ``is_weights``; 0 where ``loss_clamp`` cut the
gradient) and what pass 2 needs to form the gradient w.r.t. the logits one entry at a
time: for the whole-vocabulary kinds the two log-sum-exps and one number per row, so
that ``G`` is an entrywise function of ``(s, t)`` (``p_s sum p_t - p_t``, ``p_s (s - t -
l)``, ``(1 - beta) p_s (s - m - KL(s||m))``, ``docs/distillation.md``); over a support of
ids, ``alpha`` (``G = p_s alpha`` off the ids) and ``G`` at the ids.

Pass 2 (:func:`pass2`, through :func:`dapo_ops.logprobs._two_pass.products2`) forms
``G`` over the kept logits or a vocabulary slice at a time, times each row's weight / T
(and the cap's ``1 - tanh^2``), then ``dh``, ``dW``, ``db`` by products. The row work is
ATen ops (no Triton kernel of its own yet). With a split vocabulary (``vocab_group``)
the teacher's logits are split alike and its top-k ids are global; pass 2 is local.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dapo_ops.kernels.distill import grad_full_, params, probs_
from dapo_ops.kernels.rows import compute_dtype
from dapo_ops.logprobs._distill_rows import BlockTerms, block_terms
from dapo_ops.logprobs._distill_terms import DistillInputs, DistillSpec, _scale, reference_loss
from dapo_ops.logprobs._packing import RowMap
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR
from dapo_ops.logprobs._two_pass import (
    TORCH_ROWS_ELEMENTS,
    TwoPassSpec,
    blocks1,
    logits_into,
    products2,
)
from dapo_ops.logprobs._two_pass_loss import definition_grads


class DistillPass1(NamedTuple):
    total: Tensor  # 0-dim, the loss
    per_token: Tensor  # [N], after the clamps, 0 at masked positions
    smass: Tensor | None  # [N] top-k paths: the student's and the teacher's mass on the ids
    tmass: Tensor | None
    lse: Tensor  # [N] the student's log-sum-exp of x = cap(z) / T
    weight: Tensor  # [N] d total / d l: 0 at masked and clamped positions
    lse_t: Tensor | None  # [N] whole-vocabulary kinds: the teacher's log-sum-exp
    row: Tensor | None  # [N] and the kind's number per row
    ids: Tensor | None  # [N, k] support paths: the ids, alpha and G at the ids
    alpha: Tensor | None
    at_ids: Tensor | None
    logits: Tensor | None  # the kept [N, V] logits, or None


def scaled(z: Tensor, spec: DistillSpec, cdt: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``(x, t)``: ``x = cap(z) / T`` in ``cdt``, ``t = tanh(z / c)`` (None without a cap)."""
    x, t = z.to(cdt), None
    if spec.softcap is not None:
        t = torch.tanh(x / spec.softcap)
        x = t * spec.softcap
    return x / spec.temperature, t


def pass1(
    spec: DistillSpec, tp: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None,
    t: DistillInputs, grid_rows: Tensor,
) -> DistillPass1:  # fmt: skip
    """Pass 1 over the rows of ``h`` (``grid_rows``: their positions in the flattened
    ``[batch, seq]`` grid); with a split, every rank walks the same blocks of rows."""
    cdt = compute_dtype(h.dtype)
    weight = _scale(spec, t, cdt)[grid_rows]
    valid = t.valid.reshape(-1)[grid_rows]
    parts: list[BlockTerms] = []
    par = kernel_params(spec, tp, cdt, h.device)
    visit = functools.partial(_visit_terms, spec, t, grid_rows, tp, par, parts)
    logits = blocks1(tp, h, w, b, visit, uniform_rows(tp, w.shape[0]))
    cat = functools.partial(_cat_terms, parts)
    empty = h.new_zeros(0, dtype=cdt)
    loss = cat(0)
    per_token = empty if loss is None else torch.where(valid, loss, 0.0)
    total = (weight * per_token).sum()
    cut = cat(1)
    if cut is not None:  # a clipped loss has no gradient
        weight = torch.where(cut, 0.0, weight)
    lse = cat(2)
    return DistillPass1(
        total, per_token, cat(8), cat(9), empty if lse is None else lse, weight, cat(3),
        cat(4), cat(5), cat(6), cat(7), logits,
    )  # fmt: skip


# Module functions bound by functools.partial, not closures (see _two_pass._visit_stats).
def _visit_terms(
    spec: DistillSpec, t: DistillInputs, grid_rows: Tensor, tp: TwoPassSpec,
    par: Tensor | None, parts: list[BlockTerms], z: Tensor, rows: slice,
) -> None:  # fmt: skip
    parts.append(block_terms(spec, z, t, grid_rows[rows], tp, par))


def _cat_terms(parts: list[BlockTerms], i: int) -> Tensor | None:
    """Field ``i`` of every block's terms, concatenated (None where no block has it)."""
    got: list[Tensor] = []
    for part in parts:
        x = part[i]
        if x is not None:
            got.append(x)
    return torch.cat(got) if got else None


def uniform_rows(tp: TwoPassSpec, width: int) -> int | None:
    """Rows per block alike on every rank of a split (its collectives run per block),
    from the global vocabulary: a rank's block is its share of the whole budget on the
    kernels (a few hundred rows: a few dozen blocks of all-reduces at the 7B scale), of
    ``TORCH_ROWS_ELEMENTS`` with the ATen rows."""
    if tp.split is None:
        return None
    whole = tp.whole_budget if tp.impl == "triton" else min(tp.whole_budget, TORCH_ROWS_ELEMENTS)
    return max(1, whole // max(tp.split.vocab, 1))


def _entries(
    spec: DistillSpec, p1: DistillPass1, t: DistillInputs, s: Tensor, rows: slice,
    grid_rows: Tensor, col0: int, id0: int,
) -> Tensor:  # fmt: skip
    """``G`` w.r.t. ``x`` of a block from the student's log-probs ``s`` there (unfloored):
    ``rows`` of the run, at ``grid_rows``; columns from the rank's ``col0``, global id
    ``id0 + col0``."""
    ps = s.exp()
    if p1.ids is not None:
        assert p1.alpha is not None and p1.at_ids is not None
        g = ps * p1.alpha[rows].unsqueeze(1)
        width = s.shape[1]
        rel = p1.ids[rows] - (id0 + col0)
        inside = (rel >= 0) & (rel < width)
        idx = torch.where(inside, rel, width)
        pad = g.new_zeros(g.shape[0], width + 1)
        vals = pad.scatter(1, idx, torch.where(inside, p1.at_ids[rows], 0.0))
        hit = torch.zeros_like(pad, dtype=torch.bool).scatter(1, idx, inside)
        return torch.where(hit[:, :width], vals[:, :width], g)
    assert p1.lse_t is not None and p1.row is not None
    k = t.teacher.shape[-1]
    v = t.valid.reshape(-1, 1)[grid_rows]
    raw = t.teacher.reshape(-1, k)[grid_rows, col0 : col0 + s.shape[1]]
    tl = torch.where(v, raw.to(s.dtype), 0.0) / spec.temperature - p1.lse_t[rows].unsqueeze(1)
    sf, tf = s.clamp(min=LOGP_FLOOR), tl.clamp(min=LOGP_FLOOR)
    row = p1.row[rows].unsqueeze(1)
    if spec.kind == "forward_kl":
        return ps * row - tf.exp()
    if spec.kind == "reverse_kl":
        return ps * (sf - tf - row)
    b = spec.beta
    m = torch.logaddexp(sf + math.log1p(-b), tf + math.log(b))
    return (1 - b) * ps * (sf - m - row)


def kernel_params(spec: DistillSpec, tp: TwoPassSpec, cdt: torch.dtype, device: torch.device) -> Tensor | None:  # fmt: skip
    """The distillation kernels' parameters under ``backend="triton"``, else None."""
    if tp.impl != "triton":
        return None
    return params(tp.rows, spec.beta, LOGP_FLOOR, cdt, device)


def _teacher_block(t: DistillInputs, grid_rows: Tensor, rows: slice, cols: slice) -> Tensor:
    """The teacher's logits of a block (a view when the rows run in order)."""
    k = t.teacher.shape[-1]
    flat = t.teacher.reshape(-1, k)
    if grid_rows.shape[0] == flat.shape[0]:  # every row runs, in order: a view, no copy
        return flat[rows, cols]
    return flat[grid_rows[rows]][:, cols]


def _kernel_grad_(
    spec: DistillSpec, p1: DistillPass1, t: DistillInputs, z: Tensor, par: Tensor,
    coef: Tensor, rows: slice, grid_rows: Tensor, col0: int, id0: int,
) -> None:  # fmt: skip
    """Pass 2 of a block on the kernels, in place over ``z``."""
    cap = spec.softcap is not None
    if p1.ids is None:
        assert p1.lse_t is not None and p1.row is not None
        y = _teacher_block(t, grid_rows, rows, slice(col0, col0 + z.shape[1]))
        valid = t.valid.reshape(-1)[grid_rows[rows]]
        stats3 = (p1.lse[rows], p1.lse_t[rows], p1.row[rows])
        grad_full_(z, y, z, par, stats3, coef[rows], valid, spec.kind, cap)
        return
    assert p1.alpha is not None and p1.at_ids is not None
    width = z.shape[1]
    rel = p1.ids[rows] - (id0 + col0)
    inside = (rel >= 0) & (rel < width)
    idx = torch.where(inside, rel, 0)
    at = p1.at_ids[rows] * coef[rows].unsqueeze(1)
    if spec.softcap is not None:  # the cap's slope at the ids, read before z is overwritten
        tz = torch.tanh(z.gather(1, idx).to(at.dtype) / spec.softcap)
        at = at * (1.0 - tz * tz)
    probs_(z, z, par, p1.lse[rows], p1.alpha[rows] * coef[rows], cap)
    pad = torch.cat([z, z.new_zeros(z.shape[0], 1)], dim=1)
    pad.scatter_(1, torch.where(inside, rel, width), torch.where(inside, at, 0.0).to(z.dtype))
    z.copy_(pad[:, :width])


def pass2(
    spec: DistillSpec, tp: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None,
    t: DistillInputs, p1: DistillPass1, grid_rows: Tensor, scale: Tensor,
    need: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """``(dh, dW, db)`` of ``scale * total`` (``scale`` the incoming gradient, 0-dim)."""
    cdt = compute_dtype(h.dtype)
    coef = p1.weight * scale.to(cdt) / spec.temperature
    valid = t.valid.reshape(-1, 1)[grid_rows]
    id0 = 0 if tp.split is None else tp.split.start

    par = kernel_params(spec, tp, cdt, h.device)
    rows = _RowGrad(spec, p1, t, par, coef, valid, grid_rows, id0, cdt)
    return products2(tp, h, w, b, p1.logits, functools.partial(_row_grad, rows), need)


class _RowGrad(NamedTuple):
    """What pass 2's slices share."""

    spec: DistillSpec
    p1: DistillPass1
    t: DistillInputs
    par: Tensor | None
    coef: Tensor
    valid: Tensor
    grid_rows: Tensor
    id0: int
    cdt: torch.dtype


def _row_grad(r: _RowGrad, z: Tensor, rows: slice, col0: int) -> None:
    """Pass 2 on a slice: the logits' gradient over ``z``, in place."""
    if r.par is not None:
        _kernel_grad_(r.spec, r.p1, r.t, z, r.par, r.coef, rows, r.grid_rows, col0, r.id0)
        return
    x, tanh = scaled(z, r.spec, r.cdt)
    s = x - r.p1.lse[rows].unsqueeze(1)
    g = _entries(r.spec, r.p1, r.t, s, rows, r.grid_rows[rows], col0, r.id0)
    g = g * r.coef[rows].unsqueeze(1)
    if tanh is not None:
        g = g * (1.0 - tanh * tanh)
    z.copy_(torch.where(r.valid[rows], g, 0.0))


def _on_grid(shape: torch.Size, grid_rows: Tensor | None, x: Tensor) -> Tensor:
    """Per-row values in the ``[batch, seq]`` grid (0 off ``grid_rows``; all rows: None)."""
    if grid_rows is None:
        return x.view(shape).clone()
    return x.new_zeros(shape.numel()).index_copy(0, grid_rows, x).view(shape)


class TwoPassDistill(torch.autograd.Function):
    """``(loss, per-token loss, student mass, teacher mass)``: pass 1 in forward, pass 2 in
    backward; ``create_graph=True`` differentiates the definition. With a
    :class:`RowMap` the passes run on its rows; the per-token results fill the grid."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, spec: DistillSpec,
        t: DistillInputs, tp: TwoPassSpec, rm: RowMap | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        flat = hidden.reshape(-1, hidden.shape[-1])
        size, shape = t.valid.numel(), t.valid.shape
        grid_rows = torch.arange(size, device=flat.device) if rm is None else rm.dst
        src = flat if rm is None else flat[rm.src]
        h = torch.where(t.valid.reshape(-1)[grid_rows].unsqueeze(1), src, 0.0)
        p1 = pass1(spec, tp, h, weight, bias, t, grid_rows)
        total = p1.total
        if rm is not None and rm.short is not None:  # the caller's count left tokens out
            total = torch.where(rm.short, torch.nan, total)
        # ctx keeps what pass 2 needs, never an output: that would close a cycle through
        # the graph, which Python's collector cannot see (the kept logits would leak)
        none = p1.lse.new_zeros(0)
        kept = p1._replace(total=none, per_token=none, smass=None, tmass=None)
        ctx.spec, ctx.inputs, ctx.tp, ctx.p1, ctx.rm, ctx.grid_rows = (
            spec,
            t,
            tp,
            kept,
            rm,
            grid_rows,
        )
        ctx.save_for_backward(hidden, weight, bias, h)
        grid = functools.partial(_on_grid, shape, None if rm is None else grid_rows)
        # one empty tensor per missing output: torch.compile cannot wire one tensor
        # returned twice into the backward graph
        extra = [p1.per_token.new_zeros(0) if x is None else grid(x) for x in (p1.smass, p1.tmass)]
        per_token = grid(p1.per_token)
        ctx.mark_non_differentiable(per_token, *extra)
        return total.clone(), per_token, extra[0], extra[1]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, h = ctx.saved_tensors
        need: tuple[bool, bool, bool] = tuple(bool(n) for n in ctx.needs_input_grad[:3])  # type: ignore[assignment]
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition

            def reference() -> Tensor:
                return reference_loss(ctx.spec, hidden, weight, bias, ctx.inputs)

            return definition_grads(ctx, (hidden, weight, bias), need, reference, grad_out, 4)
        p1: DistillPass1 = ctx.p1
        if ctx.tp.keep and p1.logits is None:  # a second backward: form the logits again
            p1 = p1._replace(logits=logits_into(h.new_empty(h.shape[0], weight.shape[0]), h, weight, bias))  # fmt: skip
        ctx.p1 = p1._replace(logits=None)
        gh, gw, gb = pass2(ctx.spec, ctx.tp, h, weight, bias, ctx.inputs, p1, ctx.grid_rows, grad_out, need)  # fmt: skip
        if gh is not None and ctx.rm is not None:
            flat = hidden.reshape(-1, hidden.shape[-1])
            gh = flat.new_zeros(flat.shape).index_copy(0, ctx.rm.src, gh)
        return (None if gh is None else gh.view(hidden.shape), gw, gb, None, None, None, None)
