r"""The forward KL over the teacher's top-k ids, one chunk of tokens (private).

:func:`topk_terms` gives each token's loss and its gradient w.r.t. the scaled logits
:math:`x = z / T`, from the student's log-softmax :math:`s` (``[n, vocab]``) and the
teacher's log-probs :math:`t` at the ids :math:`K` (``[n, k]``). With :math:`F =
\sum_K p_t (t - s)`, :math:`P_t = \sum_K p_t`, :math:`P_s = \sum_K p_s`, by ``tail``
(``docs/distillation.md`` derives each):

- ``"none"`` (verl's ``forward_kl_topk``): :math:`\max(0, F)`, log-probs floored at
  ``log_prob_min_clamp``; :math:`G = a - p_s \sum a` with :math:`a = -p_t` at the ids;
- ``"bucket"`` (TRL's tail bucket): :math:`F + q_t (\log q_t - L)` with :math:`q_t = 1 -
  P_t` and :math:`L = \log(1 - P_s)` the student's log-mass outside :math:`K` (a
  log-sum-exp over those ids: no cancellation as :math:`P_s \to 1`, floored at
  ``LOGP_FLOOR``); :math:`G = (P_t + q_t) p_s - p_t` on :math:`K`, :math:`r (P_t e^L + q_t
  (e^L - 1))` elsewhere, :math:`r = p_s e^{-L}` the student's tail renormalised;
- ``"renormalize"`` (TRL without the bucket): the KL of the two distributions
  renormalised on :math:`K`, :math:`F / P_t - \log P_t + \log P_s`; :math:`G = p_s / P_s
  - p_t / P_t` on :math:`K`, 0 elsewhere.

On the two tail paths a slot whose teacher log-prob is ``-inf`` is padding: not in
:math:`K`; the student's log-probs at the ids are floored at ``LOGP_FLOOR``.
:func:`topk_reference` is the same under autograd.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import clip
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR

TOPK_TAILS: tuple[str, ...] = ("none", "bucket", "renormalize")


class Terms(NamedTuple):
    loss: Tensor  # [n], the tokens' losses (after the clamps)
    grad: Tensor | None  # [n, vocab]: d loss_i / d x, x = logits / T
    student_mass: Tensor | None  # [n] top-k only: sum of the student's probs at the ids
    teacher_mass: Tensor | None


def _verl_terms(
    c: float | None, s: Tensor, tl: Tensor, ids: Tensor, grad: bool, eager: bool
) -> Terms:
    """verl's ``forward_kl_topk`` (``s`` overwritten by the gradient when ``eager``)."""
    sk = s.gather(1, ids)
    smass, tmass = sk.exp().sum(dim=1), tl.exp().sum(dim=1)
    skc, tlc = (sk, tl) if c is None else (sk.clamp(min=c), tl.clamp(min=c))
    pt = tlc.exp()
    loss = torch.where(pt > 0, pt * (tlc - skc), 0.0).sum(dim=1)
    keep = loss >= 0  # the clamp at 0: top-k masses do not sum to 1
    loss = loss.clamp(min=0.0)
    if not grad:
        return Terms(loss, None, smass, tmass)
    a = torch.where(keep.unsqueeze(1), -pt, 0.0)  # d loss / d s at the ids
    if c is not None:
        a = torch.where(sk >= c, a, 0.0)
    if eager:
        g = s.exp_().mul_(-a.sum(dim=1, keepdim=True)).scatter_add_(1, ids, a)
    else:
        g = (s.exp() * -a.sum(dim=1, keepdim=True)).scatter_add(1, ids, a)
    return Terms(loss, g, smass, tmass)


def outside_mass(s: Tensor, ids: Tensor, inside: Tensor, eager: bool) -> tuple[Tensor, Tensor]:
    """``L``, the log of the student's mass outside the ids (``-inf`` where there is none),
    and ``r = p_s e^{-L}`` there (0 on the ids; ``s`` overwritten when ``eager``)."""
    drop = torch.zeros(ids.shape, dtype=s.dtype, device=s.device).masked_fill(inside, -math.inf)
    out = s.scatter_add_(1, ids, drop) if eager else s.scatter_add(1, ids, drop)
    m = out.amax(dim=1, keepdim=True)
    m = torch.where(m > -math.inf, m, 0.0)
    r = out.sub_(m).exp_() if eager else (out - m).exp()
    total = r.sum(dim=1, keepdim=True)
    r = r.div_(total.clamp(min=torch.finfo(r.dtype).tiny)) if eager else r / total.clamp(min=torch.finfo(r.dtype).tiny)  # fmt: skip
    return (m + total.log()).squeeze(1), r


def _tail_terms(tail: str, s: Tensor, tl: Tensor, ids: Tensor, grad: bool, eager: bool) -> Terms:
    inside = tl > -math.inf
    sk = s.gather(1, ids).clamp(min=LOGP_FLOOR)
    lpt = torch.logsumexp(tl, dim=1)
    lps = torch.logsumexp(torch.where(inside, sk, -math.inf), dim=1)
    pt_all, tmass, smass = tl.exp(), lpt.exp(), lps.exp()
    if tail == "renormalize":
        has = lpt > -math.inf  # no slot at all: 0, no gradient
        lpt0, lps0 = torch.where(has, lpt, 0.0).unsqueeze(1), torch.where(has, lps, 0.0).unsqueeze(1)  # fmt: skip
        ptn = torch.where(inside & has.unsqueeze(1), (tl - lpt0).exp(), 0.0)
        loss = torch.where(ptn > 0, ptn * (tl - lpt0 - sk + lps0), 0.0).sum(dim=1)
        if not grad:
            return Terms(loss, None, smass, tmass)
        gk = torch.where(inside & has.unsqueeze(1), (sk - lps0).exp() - ptn, 0.0)
        g = s.zero_() if eager else torch.zeros_like(s)
        g = g.scatter_add_(1, ids, gk) if eager else g.scatter_add(1, ids, gk)
        return Terms(loss, g, smass, tmass)
    f = torch.where(inside & (pt_all > 0), pt_all * (tl - sk), 0.0).sum(dim=1)
    qt = (-torch.expm1(lpt)).clamp(min=0.0)  # 1 - P_t; 0 when P_t >= 1
    lt, r = outside_mass(s, ids, inside, eager)
    loss = f + torch.where(qt > 0, qt * (torch.where(qt > 0, qt, 1.0).log() - lt.clamp(min=LOGP_FLOOR)), 0.0)  # fmt: skip
    if not grad:
        return Terms(loss, None, smass, tmass)
    live = torch.where(lt >= LOGP_FLOOR, qt, 0.0)  # the floored log has no gradient
    coef = tmass * lt.exp() + live * torch.expm1(lt)
    g = r.mul_(coef.unsqueeze(1)) if eager else r * coef.unsqueeze(1)
    gk = torch.where(inside, (tmass + live).unsqueeze(1) * sk.exp() - pt_all, 0.0)
    g = g.scatter_add_(1, ids, gk) if eager else g.scatter_add(1, ids, gk)
    return Terms(loss, g, smass, tmass)


def topk_terms(
    c: float | None, tail: str, s: Tensor, tl: Tensor, ids: Tensor, grad: bool, eager: bool
) -> Terms:
    """The top-k losses of one chunk (``c`` the log-prob floor, ``"none"`` only)."""
    if tail == "none":
        return _verl_terms(c, s, tl, ids, grad, eager)
    return _tail_terms(tail, s, tl, ids, grad, eager)


def topk_reference(c: float | None, tail: str, s: Tensor, tl: Tensor, ids: Tensor) -> Tensor:
    """:func:`topk_terms`'s losses under autograd (``s`` the whole log-softmax)."""
    sk = s.gather(1, ids)
    if tail == "none":
        skc, tlc = (sk, tl) if c is None else (clip(sk, c), tl.clamp(min=c))
        pt = tlc.exp()
        return clip(torch.where(pt > 0, pt * (tlc - skc), 0.0).sum(dim=1), 0.0)
    inside, sk = tl > -math.inf, clip(sk, LOGP_FLOOR)
    lpt = torch.logsumexp(tl, dim=1, keepdim=True)
    has = inside.any(dim=1, keepdim=True)
    lps = torch.logsumexp(torch.where(has, torch.where(inside, sk, -math.inf), 0.0), 1, True)
    if tail == "renormalize":
        ptn = torch.where(inside & has, (tl - torch.where(has, lpt, 0.0)).exp(), 0.0)
        return torch.where(ptn > 0, ptn * (tl - lpt - sk + lps), 0.0).sum(dim=1)
    pt = tl.exp()
    f = torch.where(inside & (pt > 0), pt * (tl - sk), 0.0).sum(dim=1)
    hit = torch.zeros_like(s).scatter_add(1, ids, inside.to(s.dtype)) > 0
    rest = (~hit & (s > -math.inf)).any(dim=1, keepdim=True)  # some mass outside the ids
    lt = torch.logsumexp(torch.where(rest, torch.where(hit, -math.inf, s), 0.0), dim=1)
    lt = clip(torch.where(rest.squeeze(1), lt, -math.inf), LOGP_FLOOR)
    qt = (-torch.expm1(lpt.squeeze(1))).clamp(min=0.0)
    return f + torch.where(qt > 0, qt * (torch.where(qt > 0, qt, 1.0).log() - lt), 0.0)
