r"""Logit distillation from hidden states, one chunk of tokens at a time.

Private; :func:`dapo_ops.linear_distill_loss` checks its inputs and calls
:func:`forward_pass` (through :class:`LinearDistill`). For a chunk of tokens the student's
log-softmax :math:`s` (``[n, vocab]``, :class:`dapo_ops.logprobs._fused_linear.Chunks`), the
teacher's chunk, then :func:`chunk_terms`: each token's loss :math:`l` and its gradient
w.r.t. the scaled logits :math:`x = z / T`, through :math:`G = a - p_s \sum_v a_v` with
:math:`a = \partial l / \partial s` (``docs/distillation.md`` derives each):

- forward KL :math:`\sum_v p_t (t - s)`: :math:`G = p_s \sum_v p_t - p_t`;
- reverse KL :math:`\sum_v p_s (s - t)`: :math:`G = p_s (s - t - l)`;
- generalised JSD (mixture :math:`m = \log((1-\beta) p_s + \beta p_t)`):
  :math:`l = \beta\,KL(t\|m) + (1-\beta)\,KL(s\|m)`,
  :math:`G = (1-\beta)\,p_s (s - m - KL(s\|m))`;
- forward KL over the teacher's top-k ids (verl's ``forward_kl_topk``, or TRL's tail
  bucket or renormalisation): :mod:`dapo_ops.logprobs._distill_topk`; reverse KL and
  JSD over a support of ids: :mod:`dapo_ops.logprobs._distill_support`.

The chunk's ``grad_hidden`` and share of ``grad_weight`` are formed at once (3 matmuls in
all); backward scales them. Eager, every step runs in place over the two chunk
buffers (the student's, the teacher's) and two piece-sized scratch rows; under
``torch.compile`` the same steps are written functionally. :func:`reference_loss` is the
definition under autograd.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import clip
from dapo_ops.engine.aggregation import loss_scale
from dapo_ops.logprobs._distill_support import support_ids, support_reference, support_terms
from dapo_ops.logprobs._distill_topk import Terms, topk_reference, topk_terms
from dapo_ops.logprobs._fused_linear import (
    Chunks,
    chunks_for,
    grads_for,
    linear,
)
from dapo_ops.logprobs._grad_handover import grads_from_forward, keep_grads
from dapo_ops.logprobs._softcap import capped
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """Everything but the tensors."""

    kind: str  # "forward_kl", "reverse_kl", "jsd"
    beta: float  # the JSD's teacher weight (jsd only)
    temperature: float
    topk: int | None  # teacher logits reduced to their top-k (None: the whole vocabulary)
    logp_clamp: float | None  # top-k path: log-probs floored at this (verl's log_prob_min_clamp)
    loss_clamp: float | None  # every path: the token's loss clipped to +-this
    mode: str
    max_len: int | None
    chunk: int
    softcap: float | None = None  # the student's final-logit cap (the teacher's: the caller's)
    tail: str = "none"  # top-k path: "none" (verl), "bucket" or "renormalize" (TRL)
    support: str = "teacher"  # topk=k: whose top-k ids, "teacher", "student" or "union"


class DistillInputs(NamedTuple):
    """The checked tensors."""

    teacher: Tensor  # [batch, seq, vocab] logits or [batch, seq, k] top-k log-probs
    ids: Tensor | None  # [batch, seq, k] int64 (0 at masked positions), or None
    valid: Tensor  # [batch, seq] bool
    normalizer: Tensor | None  # 0-dim, or None: the local count
    is_weights: Tensor | None = None  # [batch, seq] constant weights on the tokens' losses
    grid: Any = None  # cu_seqlens: the sequences' grid of the packed [1, total] inputs


def _full_terms(spec: DistillSpec, lp: Tensor, t: Tensor, grad: bool) -> Terms:
    """The whole-vocabulary losses, written functionally (traced by ``torch.compile``)."""
    s = lp.clamp(min=LOGP_FLOOR)  # -inf logits: 0 * finite, no probability changes
    t = t.clamp(min=LOGP_FLOOR)
    ps, g = lp.exp(), None
    if spec.kind == "forward_kl":
        pt = t.exp()
        loss = (pt * (t - s)).sum(dim=1)
        g = ps * pt.sum(dim=1, keepdim=True) - pt if grad else None
    elif spec.kind == "reverse_kl":
        loss = (ps * (s - t)).sum(dim=1)
        g = ps * (s - t - loss.unsqueeze(1)) if grad else None
    else:
        b = spec.beta
        m = torch.logaddexp(s + math.log1p(-b), t + math.log(b))
        ks = (ps * (s - m)).sum(dim=1)
        loss = b * (t.exp() * (t - m)).sum(dim=1) + (1 - b) * ks
        g = (1 - b) * ps * (s - m - ks.unsqueeze(1)) if grad else None
    return Terms(loss, g, None, None)


def _full_terms_(spec: DistillSpec, s: Tensor, t: Tensor, sc: Tensor) -> Terms:
    """:func:`_full_terms` in place, the same values bit for bit: ``s``, ``t`` (the two
    chunk buffers) overwritten, one holding the gradient at the end; the steps that need
    three values at once run on pieces of rows through ``sc`` (``[2, piece, vocab]``)."""
    s, t = s.clamp_(min=LOGP_FLOOR), t.clamp_(min=LOGP_FLOOR)
    n, piece, b, kind = s.shape[0], sc.shape[1], spec.beta, spec.kind
    loss, kt = s.new_empty(n), s.new_empty(n)
    for i, e in [(i, min(i + piece, n)) for i in range(0, n, piece)]:
        sp, tp, x, y = s[i:e], t[i:e], sc[0, : e - i], sc[1, : e - i]
        if kind == "forward_kl":  # t: p_t, s: its log-softmax until the gradient
            torch.sum(torch.sub(tp, sp, out=x).mul_(tp.exp_()), dim=1, out=loss[i:e])
        elif kind == "reverse_kl":  # s: p_s, t: s - t, then the gradient
            d = torch.sub(sp, tp, out=tp)
            torch.sum(torch.mul(sp.exp_(), d, out=x), dim=1, out=loss[i:e])
        else:  # x: m, y: p_t (t - m) then p_s; t: t - m; s: s - m, then the gradient
            m = torch.logaddexp(torch.add(sp, math.log1p(-b), out=x), torch.add(tp, math.log(b), out=y), out=x)  # fmt: skip
            torch.sum(torch.exp(tp, out=y).mul_(tp.sub_(m)), dim=1, out=kt[i:e])
            ps = torch.exp(sp, out=y)
            ks = torch.sum(torch.mul(ps, sp.sub_(m), out=x), dim=1, out=loss[i:e])
            sp.sub_(ks.unsqueeze(1)).mul_(ps.mul_(1 - b))
    if kind == "forward_kl":
        return Terms(loss, s.exp_().mul_(t.sum(dim=1, keepdim=True)).sub_(t), None, None)
    if kind == "reverse_kl":
        return Terms(loss, t.sub_(loss.unsqueeze(1)).mul_(s), None, None)
    return Terms(b * kt + (1 - b) * loss, s, None, None)


def teacher_logp(spec: DistillSpec, teacher: Tensor, ids: Tensor | None, eager: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The teacher's chunk as log-probs: ``log_softmax(teacher / T)`` of its logits (over
    ``teacher`` itself when ``eager``), reduced to the top-k under ``spec.topk``; top-k
    log-probs (``ids`` given) as they are."""
    if ids is not None:
        return teacher, ids
    if not eager:
        t = torch.log_softmax(teacher / spec.temperature, dim=1)
    else:
        z = teacher if spec.temperature == 1.0 else teacher.div_(spec.temperature)
        cpu = z.device.type == "cpu"  # the CPU kernel reads each row before it writes it
        t = torch._log_softmax(z, 1, False, out=z) if cpu else torch.log_softmax(z, dim=1)
    return (t, None) if spec.topk is None or spec.support != "teacher" else t.topk(spec.topk)


def chunk_terms(
    spec: DistillSpec, lp: Tensor, t: Tensor, ids: Tensor | None, grad: bool, sc: Tensor | None
) -> Terms:
    """The tokens' losses and gradients for one chunk: ``lp`` the student's log-softmax
    ``[n, vocab]``, ``t`` the teacher's log-probs (:func:`teacher_logp`), finite. With
    ``sc`` (eager, the scratch of :func:`_full_terms_`; ``[0]`` for top-k) ``lp`` and a
    whole-vocabulary ``t`` are overwritten; without, left as they are."""
    eager = sc is not None
    if ids is not None and spec.kind != "forward_kl":
        terms = support_terms(spec.kind, spec.beta, spec.tail, lp, t, ids, grad, eager)
    elif ids is not None:
        terms = topk_terms(spec.logp_clamp, spec.tail, lp, t, ids, grad, eager)
    elif sc is not None:
        terms = _full_terms_(spec, lp, t, sc)
    else:
        terms = _full_terms(spec, lp, t, grad)
    if not grad:
        terms = terms._replace(grad=None)
    c = spec.loss_clamp
    if c is None:
        return terms
    keep = (terms.loss >= -c) & (terms.loss <= c)
    g = terms.grad
    if g is not None:
        g = g.masked_fill_(~keep.unsqueeze(1), 0.0) if eager else torch.where(keep.unsqueeze(1), g, 0.0)  # fmt: skip
    return terms._replace(loss=terms.loss.clamp(-c, c), grad=g)


def _scale(spec: DistillSpec, t: DistillInputs, dtype: torch.dtype) -> Tensor:
    """Each token's weight ``w`` in the loss ``sum w l`` (0 at masked positions): the
    aggregation's, times ``is_weights``."""
    den = "local" if t.normalizer is None else t.normalizer
    valid = t.valid if t.grid is None else t.grid.lay_out(t.valid, False)  # sequences: the grid
    scale = loss_scale(valid, mode=spec.mode, normalizer=den, max_len=spec.max_len, dtype=dtype)  # type: ignore[arg-type]  # fmt: skip
    if t.grid is not None:  # back to the packed tokens
        scale = t.grid.pack(scale.expand(valid.shape))
    if t.is_weights is not None:
        scale = scale * t.is_weights.to(dtype)
    return torch.where(t.valid, scale.expand(t.valid.shape), 0.0).reshape(-1)


def _teacher_rows(
    t: DistillInputs, cdt: torch.dtype, s: int, e: int
) -> tuple[Tensor, Tensor | None]:
    k = t.teacher.shape[-1]
    v = t.valid.reshape(-1, 1)[s:e]
    teacher = torch.where(v, t.teacher.reshape(-1, k)[s:e].to(cdt), 0.0)
    return teacher, None if t.ids is None else t.ids.reshape(-1, k)[s:e]


def _whole(parts: list[Tensor], batch: int, seq: int) -> Tensor | None:
    return torch.cat(parts).view(batch, seq) if parts else None


def _weighted(chunks: Chunks, g: Tensor, w: Tensor) -> Tensor:
    """``g * w`` per row, taken through the cap (if any), in the dtype of the matmuls; in
    place when eager."""
    if chunks.functional:
        g = chunks.uncap(g * w.unsqueeze(1))
        return g.to(chunks.nbuf.dtype) if chunks.narrow else g
    g = chunks.uncap(g.mul_(w.unsqueeze(1)))
    return chunks.nbuf[: g.shape[0]].copy_(g) if chunks.narrow else g


def forward_pass(
    spec: DistillSpec,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    t: DistillInputs,
    need: tuple[bool, bool, bool],
) -> tuple[Tensor, Terms, tuple[Tensor | None, ...]]:
    """(loss, the per-token ``Terms`` ``[batch, seq]`` without gradient, the gradients)."""
    batch, seq = t.valid.shape
    flat = hidden.reshape(batch * seq, hidden.shape[-1])
    chunks = chunks_for(flat, weight, bias, spec.chunk, spec.temperature, None, spec.softcap)
    cdt, valid = chunks.cdt, t.valid.reshape(-1, 1)
    w = _scale(spec, t, cdt)
    grads = grads_for(chunks, flat, need) if any(need) else None
    total, losses, smass, tmass = flat.new_zeros((), dtype=cdt), [], [], []
    eager, full = not chunks.functional, t.ids is None and spec.topk is None
    sc = chunks.buf.new_empty(2, chunks.piece, chunks.vocab) if eager and full else None
    sc = chunks.buf.new_empty(0, 0, 0) if eager and sc is None else sc
    for s, e in chunks.spans():
        h = torch.where(valid[s:e], flat[s:e], 0.0)  # masked rows reach nothing
        tl, ids = teacher_logp(
            spec, *_teacher_rows(t, cdt, s, e), eager
        )  # before lp: 1 buffer less
        lp = chunks.log_softmax(h)
        if spec.support != "teacher":  # the ids from the student's chunk
            tl, ids = support_ids(spec.support, spec.topk or 1, lp, tl)
        terms = chunk_terms(spec, lp, tl, ids, grads is not None, sc)
        loss = torch.where(valid[s:e, 0], terms.loss, 0.0)
        total = total + (w[s:e] * loss).sum()
        losses.append(loss)
        if terms.student_mass is not None and terms.teacher_mass is not None:
            smass.append(terms.student_mass)
            tmass.append(terms.teacher_mass)
        if grads is not None and terms.grad is not None:
            grads.add(_weighted(chunks, terms.grad, w[s:e] / spec.temperature), h, s, e)
        del tl, lp, terms  # this chunk's buffers go before the next chunk's come
    chunks.release()
    gh, gw, gb = (None, None, None) if grads is None else grads.result()
    if need[0] and gh is None:
        gh = torch.zeros_like(flat)
    per_token = _whole(losses, batch, seq)
    out = Terms(flat.new_zeros(batch, seq, dtype=cdt) if per_token is None else per_token,
                None, _whole(smass, batch, seq), _whole(tmass, batch, seq))  # fmt: skip
    return total, out, (None if gh is None else gh.view(hidden.shape), gw, gb)


def reference_loss(
    spec: DistillSpec, hidden: Tensor, weight: Tensor, bias: Tensor | None, t: DistillInputs
) -> Tensor:
    """The definition under autograd: the whole ``[tokens, vocab]`` logits (the naive
    path's memory); differentiated for ``create_graph=True``."""
    batch, seq = t.valid.shape
    cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    valid = t.valid.reshape(-1, 1)
    flat = torch.where(valid, hidden.reshape(batch * seq, -1), 0.0)
    z = linear(flat, weight, bias).to(cdt)
    z = z if spec.softcap is None else capped(z, spec.softcap)[0]
    s = torch.log_softmax(z / spec.temperature, dim=1)
    teacher, ids = _teacher_rows(t, cdt, 0, batch * seq)
    if ids is not None or spec.topk is not None:
        if ids is None:
            tall, k = torch.log_softmax(teacher / spec.temperature, dim=1), spec.topk or 1
            teacher, ids = tall.topk(k) if spec.support == "teacher" else support_ids(spec.support, k, s, tall)  # fmt: skip
        if spec.kind == "forward_kl":
            loss = topk_reference(spec.logp_clamp, spec.tail, s, teacher, ids)
        else:
            loss = support_reference(spec.kind, spec.beta, spec.tail, s, teacher, ids)
    else:
        sf = clip(s, LOGP_FLOOR)
        tf = torch.log_softmax(teacher / spec.temperature, dim=1).clamp(min=LOGP_FLOOR)
        b = spec.beta
        if spec.kind == "forward_kl":
            loss = (tf.exp() * (tf - sf)).sum(dim=1)
        elif spec.kind == "reverse_kl":
            loss = (sf.exp() * (sf - tf)).sum(dim=1)
        else:
            m = torch.logaddexp(sf + math.log1p(-b), tf + math.log(b))
            loss = b * (tf.exp() * (tf - m)).sum(1) + (1 - b) * (sf.exp() * (sf - m)).sum(1)
    if spec.loss_clamp is not None:
        loss = clip(loss, -spec.loss_clamp, spec.loss_clamp)
    return (_scale(spec, t, cdt) * torch.where(valid[:, 0], loss, 0.0)).sum()


class LinearDistill(torch.autograd.Function):
    """``(loss, per-token loss, student mass, teacher mass)``; the gradients are formed in
    forward and handed over (eager) or saved (under ``torch.compile``)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, spec: DistillSpec,
        t: DistillInputs,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        need = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        loss, terms, grads = forward_pass(spec, hidden, weight, bias, t, need)  # type: ignore[arg-type]
        ctx.spec, ctx.inputs, ctx.need = spec, t, need
        keep_grads(ctx, hidden, weight, bias, grads)
        extra = [  # two tensors: one output twice is not traceable
            terms.loss.new_zeros(0) if x is None else x
            for x in (terms.student_mass, terms.teacher_mass)
        ]
        ctx.mark_non_differentiable(terms.loss, *extra)
        return loss, terms.loss, extra[0], extra[1]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return grads_from_forward(
            ctx,
            grad_out,
            lambda h, w, b: reference_loss(ctx.spec, h, w, b, ctx.inputs),
            lambda h, w, b: forward_pass(ctx.spec, h, w, b, ctx.inputs, ctx.need)[2],
        )
