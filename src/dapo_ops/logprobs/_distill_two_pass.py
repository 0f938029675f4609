r"""Logit distillation on the two-pass design (``linear_distill_loss(backend="two_pass")``).

Private. Pass 1 (:func:`pass1`) walks blocks of whole rows of the student's logits
(:func:`dapo_ops.logprobs._two_pass.blocks1`: kept whole, or a block at a time) and, with
the chunked path's own formulas (:func:`dapo_ops.logprobs._distill_terms.chunk_terms`),
gives each token's loss, its weight in the total (the aggregation's times
``is_weights``; 0 where ``loss_clamp`` cut the gradient) and what pass 2 needs to form
the gradient w.r.t. the logits from one entry at a time:

- whole-vocabulary kinds (``docs/distillation.md``): the student's and the teacher's
  log-sum-exp and one number per row, ``sum_v p_t`` (forward KL), the loss ``l`` (reverse
  KL) or ``KL(s||m)`` (JSD), so that ``G`` is an entrywise function of ``(s, t)``:
  ``p_s sum p_t - p_t``, ``p_s (s - t - l)``, ``(1 - beta) p_s (s - m - KL(s||m))``;
- over a support of ids (top-k, with or without a tail): every such ``G`` is ``p_s
  alpha`` off the ids and some value at each id, so pass 1 keeps ``alpha`` (the ratio of
  ``G``'s and ``p_s``'s sums off the ids: both of one sign, no cancellation) and the
  ids' values.

Pass 2 (:func:`pass2`, through :func:`dapo_ops.logprobs._two_pass.products2`) forms
``G`` over the kept logits or a vocabulary slice at a time, times each row's weight / T
(and the cap's ``1 - tanh^2``), then ``dh``, ``dW``, ``db`` by products. The row work is
ATen ops (no Triton kernel of its own yet).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dapo_ops.kernels.rows import compute_dtype
from dapo_ops.logprobs._distill_support import support_ids
from dapo_ops.logprobs._distill_terms import (
    DistillInputs,
    DistillSpec,
    _scale,
    _teacher_rows,
    chunk_terms,
    reference_loss,
    teacher_logp,
)
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR
from dapo_ops.logprobs._two_pass import TwoPassSpec, blocks1, logits_into, products2
from dapo_ops.logprobs._two_pass_loss import no_split_twice


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


def _row_numbers(spec: DistillSpec, lp: Tensor, tl: Tensor) -> tuple[Tensor, Tensor]:
    """``(l, row)``: the unclamped loss and the kind's number per row (whole vocabulary)."""
    s, t = lp.clamp(min=LOGP_FLOOR), tl.clamp(min=LOGP_FLOOR)
    ps = lp.exp()
    if spec.kind == "forward_kl":
        pt = t.exp()
        return (pt * (t - s)).sum(dim=1), pt.sum(dim=1)
    if spec.kind == "reverse_kl":
        loss = (ps * (s - t)).sum(dim=1)
        return loss, loss
    b = spec.beta
    m = torch.logaddexp(s + math.log1p(-b), t + math.log(b))
    ks = (ps * (s - m)).sum(dim=1)
    return b * (t.exp() * (t - m)).sum(dim=1) + (1 - b) * ks, ks


def _support_numbers(lp: Tensor, g: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(alpha, G at the ids)`` of a support path's dense ``G``."""
    off = torch.ones_like(lp, dtype=torch.bool).scatter(1, ids, False)
    gsum = torch.where(off, g, 0.0).sum(dim=1)
    psum = torch.where(off, lp.exp(), 0.0).sum(dim=1)
    alpha = torch.where(psum > 0, gsum / torch.where(psum > 0, psum, 1.0), 0.0)
    return alpha, g.gather(1, ids)


def pass1(
    spec: DistillSpec, tp: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None, t: DistillInputs
) -> DistillPass1:
    cdt = compute_dtype(h.dtype)
    weight = _scale(spec, t, cdt)
    valid = t.valid.reshape(-1)
    full = t.ids is None and spec.topk is None
    out: dict[str, list[Tensor]] = {}

    def keep(name: str, x: Tensor | None) -> None:
        if x is not None:
            out.setdefault(name, []).append(x)

    def visit(z: Tensor, rows: slice) -> None:
        x, _ = scaled(z, spec, cdt)
        lp = torch.log_softmax(x, dim=1)
        keep("lse", torch.logsumexp(x, dim=1))
        teacher, ids = _teacher_rows(t, cdt, rows.start, rows.stop)
        tl, ids = teacher_logp(spec, teacher, ids, False)
        if spec.support != "teacher":
            tl, ids = support_ids(spec.support, spec.topk or 1, lp, tl)
        v = valid[rows]
        if full:
            loss, row = _row_numbers(spec, lp, tl)
            keep("lse_t", torch.logsumexp(teacher / spec.temperature, dim=1))
            keep("row", row)
            c = spec.loss_clamp
            cut = None if c is None else (loss < -c) | (loss > c)
            loss = loss if c is None else loss.clamp(-c, c)
            keep("cut", cut)
        else:
            assert ids is not None
            terms = chunk_terms(spec, lp, tl, ids, True, None)
            assert terms.grad is not None
            loss = terms.loss
            alpha, at_ids = _support_numbers(lp, terms.grad, ids)
            keep("ids", ids)
            keep("alpha", alpha)
            keep("at_ids", at_ids)
            keep("smass", terms.student_mass)
            keep("tmass", terms.teacher_mass)
        keep("loss", torch.where(v, loss, 0.0))

    logits = blocks1(tp, h, w, b, visit)

    def cat(name: str) -> Tensor | None:
        return torch.cat(out[name]) if name in out else None

    empty = h.new_zeros(0, dtype=cdt)
    per_token = cat("loss")
    per_token = empty if per_token is None else per_token
    total = (weight * per_token).sum()
    cut = cat("cut")
    if cut is not None:  # a clipped loss has no gradient
        weight = torch.where(cut, 0.0, weight)
    lse = cat("lse")
    return DistillPass1(
        total, per_token, cat("smass"), cat("tmass"),
        empty if lse is None else lse, weight, cat("lse_t"), cat("row"), cat("ids"),
        cat("alpha"), cat("at_ids"), logits,
    )  # fmt: skip


def _entries(
    spec: DistillSpec, p1: DistillPass1, t: DistillInputs, s: Tensor, rows: slice, col0: int
) -> Tensor:
    """``G`` w.r.t. ``x`` of a block from the student's log-probs ``s`` there (unfloored)."""
    ps = s.exp()
    if p1.ids is not None:
        assert p1.alpha is not None and p1.at_ids is not None
        g = ps * p1.alpha[rows].unsqueeze(1)
        width = s.shape[1]
        rel = p1.ids[rows] - col0
        inside = (rel >= 0) & (rel < width)
        idx = torch.where(inside, rel, width)
        pad = g.new_zeros(g.shape[0], width + 1)
        vals = pad.scatter(1, idx, torch.where(inside, p1.at_ids[rows], 0.0))
        hit = torch.zeros_like(pad, dtype=torch.bool).scatter(1, idx, inside)
        return torch.where(hit[:, :width], vals[:, :width], g)
    assert p1.lse_t is not None and p1.row is not None
    k = t.teacher.shape[-1]
    v = t.valid.reshape(-1, 1)[rows]
    raw = t.teacher.reshape(-1, k)[rows, col0 : col0 + s.shape[1]]
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


def pass2(
    spec: DistillSpec, tp: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None,
    t: DistillInputs, p1: DistillPass1, scale: Tensor, need: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """``(dh, dW, db)`` of ``scale * total`` (``scale`` the incoming gradient, 0-dim)."""
    cdt = compute_dtype(h.dtype)
    coef = p1.weight * scale.to(cdt) / spec.temperature
    valid = t.valid.reshape(-1, 1)

    def row_grad(z: Tensor, rows: slice, col0: int) -> None:
        x, tanh = scaled(z, spec, cdt)
        g = _entries(spec, p1, t, x - p1.lse[rows].unsqueeze(1), rows, col0)
        g = g * coef[rows].unsqueeze(1)
        if tanh is not None:
            g = g * (1.0 - tanh * tanh)
        z.copy_(torch.where(valid[rows], g, 0.0))

    return products2(tp, h, w, b, p1.logits, row_grad, need)


class TwoPassDistill(torch.autograd.Function):
    """``(loss, per-token loss, student mass, teacher mass)``: pass 1 in forward, pass 2 in
    backward; ``create_graph=True`` differentiates the definition."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, spec: DistillSpec,
        t: DistillInputs, tp: TwoPassSpec,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        valid = t.valid.reshape(-1, 1)
        h = torch.where(valid, hidden.reshape(-1, hidden.shape[-1]), 0.0)
        p1 = pass1(spec, tp, h, weight, bias, t)
        # ctx keeps what pass 2 needs, never an output: that would close a cycle through
        # the graph, which Python's collector cannot see (the kept logits would leak)
        none = p1.lse.new_zeros(0)
        kept = p1._replace(total=none, per_token=none, smass=None, tmass=None)
        ctx.spec, ctx.inputs, ctx.tp, ctx.p1 = spec, t, tp, kept
        ctx.save_for_backward(hidden, weight, bias, h)
        shape = t.valid.shape
        extra = [p1.per_token.new_zeros(0) if x is None else x.view(shape) for x in (p1.smass, p1.tmass)]  # fmt: skip
        per_token = p1.per_token.view(shape)
        ctx.mark_non_differentiable(per_token, *extra)
        return p1.total, per_token, extra[0], extra[1]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, h = ctx.saved_tensors
        need: tuple[bool, bool, bool] = tuple(bool(n) for n in ctx.needs_input_grad[:3])  # type: ignore[assignment]
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition
            no_split_twice(ctx.tp)
            wanted = [x for x, n in zip((hidden, weight, bias), need, strict=True) if n]
            with torch.enable_grad():
                loss = reference_loss(ctx.spec, hidden, weight, bias, ctx.inputs)
                got = iter(torch.autograd.grad(loss, wanted, grad_out, create_graph=True))
            return (*(next(got) if n else None for n in need), None, None, None)
        p1: DistillPass1 = ctx.p1
        if ctx.tp.keep and p1.logits is None:  # a second backward: form the logits again
            p1 = p1._replace(logits=logits_into(h.new_empty(h.shape[0], weight.shape[0]), h, weight, bias))  # fmt: skip
        ctx.p1 = p1._replace(logits=None)
        gh, gw, gb = pass2(ctx.spec, ctx.tp, h, weight, bias, ctx.inputs, p1, grad_out, need)
        return (None if gh is None else gh.view(hidden.shape), gw, gb, None, None, None)
