"""Shared set-up of the self-distillation and async/server distillation peer tests.

A float64 batch (student leaves, teacher logits, sampled tokens, a mask with a fully
masked row) and the top-k forward KL of TRL 1.16's sparse distillation losses written as
``linear_distill_loss(..., teacher_ids=ids)`` plus the term TRL adds (``_topk_ours``).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import torch

import dapo_ops as d

TOL = {"rtol": 1e-12, "atol": 1e-13}
F32 = {"rtol": 1e-5, "atol": 2e-6}  # TRL's kernels that cast to float32
TOPK = list(itertools.product([1, 3, 8], [1.0, 0.7], [True, False]))  # k, temperature, tail


def batch(seed: int, b: int = 3, s: int = 6, dim: int = 7, v: int = 29) -> SimpleNamespace:
    """Student leaves, teacher logits, sampled tokens, a noise for the rollout log-probs,
    a mask with its first row full and its last fully masked."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, dim, generator=g, dtype=torch.float64).requires_grad_(True)
    weight = torch.randn(v, dim, generator=g, dtype=torch.float64).requires_grad_(True)
    teacher = 3 * torch.randn(b, s, v, generator=g, dtype=torch.float64)
    mask = torch.rand(b, s, generator=g) < 0.7
    mask[0], mask[-1] = True, False
    tokens = torch.randint(0, v, (b, s), generator=g)
    noise = 0.4 * torch.randn(b, s, generator=g, dtype=torch.float64)
    return SimpleNamespace(hidden=hidden, weight=weight, teacher=teacher, mask=mask, v=v, g=g,
                           tokens=tokens, noise=noise, b=b)  # fmt: skip


def same(got: torch.Tensor, want: torch.Tensor, leaves: tuple[torch.Tensor, ...],
         tol: dict[str, float] = TOL) -> None:  # fmt: skip
    """Equal values and equal gradients w.r.t. ``leaves``."""
    torch.testing.assert_close(got, want.to(got.dtype), **tol)
    grads = zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves), strict=True)
    for a, b in grads:
        torch.testing.assert_close(a, b.to(a.dtype), **tol)


def teacher_topk(
    x: SimpleNamespace, k: int, temperature: float, pad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and log-probs, and which slots are real (``pad``: the last
    one missing at about half the positions)."""
    t_k, ids = torch.topk(torch.log_softmax(x.teacher / temperature, -1), k, dim=-1)
    valid = torch.ones_like(ids, dtype=torch.bool)
    if pad and k > 1:
        valid[..., -1] = torch.rand(ids.shape[:2], generator=x.g) < 0.5
    return ids, t_k, valid


def topk_ours(x: SimpleNamespace, ids: torch.Tensor, t_k: torch.Tensor, valid: torch.Tensor,
              sel: torch.Tensor, temperature: float, add_tail: bool, *, weight: Any = None,
              bias: Any = None, **agg: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``linear_distill_loss`` on the ids (aggregated by ``agg``) and TRL's extra term per
    token ``[batch, seq]``, under autograd.

    ``t_k`` the teacher's log-probs at ``ids`` (slots not ``valid``: padding, ``-inf`` for
    ours), ``P_s``, ``P_t`` the top-k masses. With the tail bucket TRL's loss is our ``F``
    plus ``(1 - P_t) log((1 - P_t) / (1 - P_s))``; renormalised it is ``F`` on the
    renormalised teacher log-probs ``t - log P_t`` plus ``log P_s``."""
    weight = x.weight if weight is None else weight
    t_in = torch.where(valid, t_k, -torch.inf)
    if not add_tail:
        t_in = t_in - torch.logsumexp(t_in, -1, keepdim=True)
    kw = {"teacher_ids": ids.clamp_min(0), "bias": bias, "temperature": temperature}
    ours = d.linear_distill_loss(x.hidden, weight, t_in, sel, chunk_size=4, **kw, **agg)
    logits = x.hidden @ weight.T + (0 if bias is None else bias)
    s_k = torch.log_softmax(logits / temperature, -1).gather(-1, ids.clamp_min(0))
    log_ps = torch.logsumexp(torch.where(valid, s_k, -torch.inf), -1)
    pt = torch.where(valid, t_k, -torch.inf).exp().sum(-1)
    term = (1 - pt) * (torch.log1p(-pt) - torch.log1p(-log_ps.exp())) if add_tail else log_ps
    return ours, term


def unclamped(x: SimpleNamespace, ids: torch.Tensor, t_k: torch.Tensor, valid: torch.Tensor,
              temperature: float, add_tail: bool, weight: Any = None,
              bias: Any = None) -> torch.Tensor:  # fmt: skip
    """The valid positions where ours is not clamped: verl's top-k ``F`` is clamped at 0
    (it can be negative), TRL's tail form is not. Renormalised, ``F >= -log P_s >= 0``."""
    if not add_tail:
        return x.mask
    w = (x.weight if weight is None else weight).detach()
    _, diag = d.linear_distill_loss_with_diagnostics(
        x.hidden.detach(), w, torch.where(valid, t_k, -torch.inf), x.mask,
        teacher_ids=ids.clamp_min(0), temperature=temperature,
        bias=None if bias is None else bias.detach(),
    )  # fmt: skip
    pos = x.mask & (diag.per_token > 0)
    assert int(pos.sum()) >= 3
    return pos
