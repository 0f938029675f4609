r"""Reverse KL and JSD over a support of ids, one chunk of tokens (private).

On the ids :math:`K` (a ``-inf`` teacher log-prob marks a padding slot, not in :math:`K`)
both models give a distribution over :math:`n` points: with ``tail="bucket"`` the ids
plus one bucket for the rest (:math:`a = (s_K, L)`, :math:`L = \log(1 - P_s)` the
student's log-mass off :math:`K`; :math:`b = (t_K, \log(1 - P_t))`), with
``"renormalize"`` the ids only (:math:`a = s_K - \log P_s`, :math:`b = t_K - \log
P_t`). Every log-prob is floored at ``LOGP_FLOOR`` (no gradient below). The divergence
:math:`D(a, b)` and :math:`u = \partial D / \partial a` (``a`` taken as free):

- ``"reverse_kl"``: :math:`D = \sum e^a (a - b)`, :math:`u = e^a (a - b + 1)`;
- ``"jsd"``: :math:`m = \log((1-\beta) e^a + \beta e^b)`, :math:`D = \beta \sum e^b (b -
  m) + (1-\beta) \sum e^a (a - m)`, :math:`u = (1-\beta) e^a (a - m)`.

Chained to the scaled logits :math:`x` (:math:`\partial s_j / \partial x = e_j - p_s`,
:math:`\partial L / \partial x = r - p_s` with :math:`r` the student's distribution off
:math:`K`, :math:`\partial \log P_s / \partial x = \rho - p_s` with :math:`\rho` the
student's renormalised on :math:`K`):

- bucket: :math:`G = u_K + u_L r - p_s S`, :math:`S = \sum_K u + u_L`;
- renormalize: with :math:`w = u - \rho \sum_K u` on the unfloored ids,
  :math:`G = w - p_s \sum_K w` (the last term 0 unless some id is floored).

:func:`support_ids` picks the ids inside a chunk (the student's top-k, or the union of
both models' top-k). :func:`support_reference` is the loss under autograd.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dapo_ops._core._rules import clip
from dapo_ops.logprobs._distill_topk import Terms, outside_mass
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR

TOPK_SUPPORTS: tuple[str, ...] = ("teacher", "student", "union")


def support_ids(support: str, k: int, s: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher's log-probs at the chunk's ids, and the ids: the student's top-k
    (``s`` its log-softmax), or the teacher's top-k then the student's not among them
    (the repeats as padding, ``-inf``); constants, no gradient through the choice."""
    ids = s.detach().topk(k, dim=1).indices
    if support == "student":
        return t.gather(1, ids), ids
    tk, tids = t.topk(k, dim=1)
    dup = (ids.unsqueeze(2) == tids.unsqueeze(1)).any(dim=2)
    sk = torch.where(dup, -math.inf, t.gather(1, ids))
    return torch.cat([tk, sk], dim=1), torch.cat([tids, ids], dim=1)


def _divergence(kind: str, beta: float, a: Tensor, b: Tensor, live: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``D`` per row and ``u = dD/da`` (0 off ``live``), ``a``, ``b`` finite where live."""
    a, b = torch.where(live, a, 0.0), torch.where(live, b, 0.0)
    pa = torch.where(live, a.exp(), 0.0)
    if kind == "reverse_kl":
        return (pa * (a - b)).sum(dim=1), pa * (a - b + 1.0)
    pb = torch.where(live, b.exp(), 0.0)
    m = torch.logaddexp(a + math.log1p(-beta), b + math.log(beta))
    kt, ks = (pb * (b - m)).sum(dim=1), (pa * (a - m)).sum(dim=1)
    return beta * kt + (1 - beta) * ks, (1 - beta) * pa * (a - m)


def support_terms(
    kind: str, beta: float, tail: str, s: Tensor, tl: Tensor, ids: Tensor, grad: bool, eager: bool
) -> Terms:
    """The chunk's losses (``s`` the student's log-softmax ``[n, vocab]``, overwritten
    when ``eager``; ``tl`` the teacher's log-probs at ``ids``, ``[n, k]``)."""
    inside = tl > -math.inf
    sk_raw = s.gather(1, ids)
    sk = sk_raw.clamp(min=LOGP_FLOOR)
    unfl = inside & (sk_raw >= LOGP_FLOOR)
    lpt = torch.logsumexp(tl, dim=1, keepdim=True)
    lps = torch.logsumexp(torch.where(inside, sk, -math.inf), dim=1, keepdim=True)
    tmass, smass = lpt.exp().squeeze(1), lps.exp().squeeze(1)
    tf = tl.clamp(min=LOGP_FLOOR)
    if tail == "renormalize":
        live = inside & (lpt > -math.inf)  # a row without any slot: 0, no gradient
        lpt0, lps0 = torch.where(live, lpt, 0.0), torch.where(live, lps, 0.0)
        loss, u = _divergence(kind, beta, sk - lps0, tf - lpt0, live)
        if not grad:
            return Terms(loss, None, smass, tmass)
        rho = torch.where(live, (sk - lps0).exp(), 0.0)
        w = torch.where(unfl & live, u - rho * u.sum(dim=1, keepdim=True), 0.0)
        c = -w.sum(dim=1, keepdim=True)
        g = s.exp_().mul_(c) if eager else s.exp() * c
        return Terms(loss, g.scatter_add_(1, ids, w) if eager else g.scatter_add(1, ids, w), smass, tmass)  # fmt: skip
    lt, r = outside_mass(s, ids, inside, eager)
    qt = (-torch.expm1(lpt)).clamp(min=0.0)
    a = torch.cat([sk, lt.clamp(min=LOGP_FLOOR).unsqueeze(1)], dim=1)
    b = torch.cat([tf, qt.log().clamp(min=LOGP_FLOOR)], dim=1)
    live = torch.cat([inside, torch.ones_like(inside[:, :1])], dim=1)
    loss, u = _divergence(kind, beta, a, b, live)
    if not grad:
        return Terms(loss, None, smass, tmass)
    k = ids.shape[1]
    uk = torch.where(unfl, u[:, :k], 0.0)
    ul = torch.where(lt >= LOGP_FLOOR, u[:, k], 0.0)
    total = uk.sum(dim=1) + ul
    coef = (ul - total * lt.exp()).unsqueeze(1)
    g = r.mul_(coef) if eager else r * coef
    gk = torch.where(inside, uk - sk_raw.exp() * total.unsqueeze(1), 0.0)
    return Terms(loss, g.scatter_add_(1, ids, gk) if eager else g.scatter_add(1, ids, gk), smass, tmass)  # fmt: skip


def support_reference(
    kind: str, beta: float, tail: str, s: Tensor, tl: Tensor, ids: Tensor
) -> Tensor:
    """:func:`support_terms`'s losses under autograd (``s`` the whole log-softmax): the
    two distributions written out, then the divergence."""
    inside = tl > -math.inf
    has = inside.any(dim=1, keepdim=True)
    sk = clip(s.gather(1, ids), LOGP_FLOOR)
    tf = tl.clamp(min=LOGP_FLOOR)
    if tail == "renormalize":
        keep = inside & has
        sk_in = torch.where(keep, sk, -math.inf)
        lps = torch.logsumexp(torch.where(has, sk_in, 0.0), dim=1, keepdim=True)
        lpt = torch.logsumexp(torch.where(has, torch.where(keep, tl, -math.inf), 0.0), 1, True)
        a, b, live = sk - lps, tf - lpt, keep
    else:
        hit = torch.zeros_like(s).scatter_add(1, ids, inside.to(s.dtype)) > 0
        rest = (~hit & (s > -math.inf)).any(dim=1, keepdim=True)
        lt = torch.logsumexp(torch.where(rest, torch.where(hit, -math.inf, s), 0.0), dim=1)
        lt = clip(torch.where(rest.squeeze(1), lt, -math.inf), LOGP_FLOOR)
        pt = torch.where(inside, tl.exp(), 0.0).sum(dim=1)
        qt = (1.0 - pt).clamp(min=0.0)
        a = torch.cat([sk, lt.unsqueeze(1)], dim=1)
        b = torch.cat([tf, qt.log().clamp(min=LOGP_FLOOR).unsqueeze(1)], dim=1)
        live = torch.cat([inside, torch.ones_like(inside[:, :1])], dim=1)
    a, b = torch.where(live, a, 0.0), torch.where(live, b, 0.0)
    pa, pb = torch.where(live, a.exp(), 0.0), torch.where(live, b.exp(), 0.0)
    if kind == "reverse_kl":
        return (pa * (a - b)).sum(dim=1)
    m = torch.where(live, torch.logaddexp(a + math.log1p(-beta), b + math.log(beta)), 0.0)
    return beta * (pb * (b - m)).sum(dim=1) + (1 - beta) * (pa * (a - m)).sum(dim=1)
