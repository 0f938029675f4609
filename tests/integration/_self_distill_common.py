"""Shared set-up of the self-distillation and async/server distillation peer tests.

A float64 batch (student leaves, teacher logits, sampled tokens, a mask with a fully
masked row) and the top-k forward KL of TRL 1.16's sparse distillation losses written as
``linear_distill_loss(..., teacher_ids=ids, topk_tail=...)`` (``topk_ours``).
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
              bias: Any = None, **agg: Any) -> torch.Tensor:  # fmt: skip
    """``linear_distill_loss(..., teacher_ids=ids, topk_tail=...)`` aggregated by ``agg``:
    TRL's tail bucket (``add_tail``) or renormalised top-k forward KL.

    ``t_k`` the teacher's log-probs at ``ids``; slots not ``valid`` (padding, id -1) are
    passed as ``-inf`` log-probs, which dapo_ops's tail paths leave out of the ids."""
    weight = x.weight if weight is None else weight
    t_in = torch.where(valid, t_k, -torch.inf)
    kw = {"teacher_ids": ids.clamp_min(0), "bias": bias, "temperature": temperature}
    tail = "bucket" if add_tail else "renormalize"
    return d.linear_distill_loss(x.hidden, weight, t_in, sel, chunk_size=4, topk_tail=tail, **kw, **agg)  # fmt: skip


def trl_floor_binds(s: torch.Tensor, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]``: where TRL's tail bucket floors ``1 - P`` (its ``log P`` clamped at
    -1e-7) for either model, ``s``, ``t`` the log-softmaxes, ``ids`` the support
    (repeats counted once). dapo_ops keeps the exact tail there, a documented difference:
    the peer tests compare the other positions."""
    hit = torch.zeros_like(s, dtype=torch.bool).scatter(-1, ids, True)
    mass = [torch.where(hit, x.detach(), -torch.inf).logsumexp(-1) for x in (s, t)]
    return (mass[0] > -1e-7) | (mass[1] > -1e-7)
