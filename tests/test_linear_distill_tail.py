"""``linear_distill_loss``'s ``topk_tail`` and ``is_weights`` at their edges, float64.

The general cases (every option against the naive composition, gradcheck, masked garbage,
``torch.compile``) are in ``test_linear_distill.py``; here: a student with (almost) all
its mass on the ids, a teacher whose top-k mass is 1, padding slots, the weights'
gradients and the per-token diagnostics, and the refused combinations.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_linear_distill import TOL, naive_per_token, problem

import dapo_ops as d
from dapo_ops._core._validate import InputError

TAILS = ["bucket", "renormalize"]


def _loss_and_grads(p: dict[str, Any], teacher: torch.Tensor, ids: torch.Tensor,
                    **kw: Any) -> list[torch.Tensor]:  # fmt: skip
    h, w = (p[k].detach().requires_grad_(True) for k in ("hidden", "weight"))
    loss = d.linear_distill_loss(h, w, teacher, p["mask"], teacher_ids=ids, chunk_size=4, **kw)
    return [loss.detach(), *torch.autograd.grad(loss, (h, w))]


@pytest.mark.parametrize("tail", TAILS)
def test_padding_slots_are_not_ids(tail: str) -> None:
    """A slot whose teacher log-prob is -inf is padding, whatever id it holds (even one of
    the real ids): the same as the loss over the other slots."""
    p = problem(11)
    ids, tl = p["ids"], p["topk_logp"]
    want = _loss_and_grads(p, tl[..., :3], ids[..., :3], topk_tail=tail)
    padded = torch.cat([ids[..., :3], ids[..., :1]], -1)  # a repeated id, as padding
    got = _loss_and_grads(p, torch.cat([tl[..., :3], torch.full_like(tl[..., :1], -torch.inf)], -1), padded, topk_tail=tail)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_student_mass_near_one_stays_exact() -> None:
    """P_s -> 1 with P_t < 1: 1 - P_s is the student's mass off the ids, summed there
    (no cancellation); the bucket term and its gradient stay finite and exact."""
    p = problem(12)
    ids, tl = p["ids"], p["topk_logp"]
    boost = torch.zeros(p["weight"].shape[0], dtype=torch.float64).index_fill(0, ids[0, 0], 30.0)
    loss = d.linear_distill_loss_with_diagnostics(
        p["hidden"], p["weight"], tl, p["mask"], teacher_ids=ids, bias=boost, topk_tail="bucket"
    )[1].per_token[0, 0]  # fmt: skip
    s = torch.log_softmax(p["hidden"][0, 0] @ p["weight"].T + boost, -1)
    off = torch.ones_like(s, dtype=torch.bool).index_fill(0, ids[0, 0], False)
    log_rest = torch.logsumexp(s[off], 0)  # log(1 - P_s), about -30
    assert log_rest < -25  # 1 - P_s underflows 1 - sum(p_s) in float64
    pt = tl[0, 0].exp()
    f = (pt * (tl[0, 0] - s[ids[0, 0]])).sum()
    want = f + (1 - pt.sum()) * (torch.log1p(-pt.sum()) - log_rest)
    torch.testing.assert_close(loss, want, **TOL)
    h = p["hidden"].detach().requires_grad_(True)
    grads = torch.autograd.grad(
        d.linear_distill_loss(h, p["weight"], tl, p["mask"], teacher_ids=ids, bias=boost, topk_tail="bucket"), h
    )  # fmt: skip
    assert torch.isfinite(grads[0]).all()


def test_no_student_mass_off_the_ids_is_floored() -> None:
    """Every id is a top-k id (k = vocab): 1 - P_s = 0. The teacher's 1 - P_t is 0 up to
    rounding, so the term is 0 log 0 or a rounding times the floored log: F, finite."""
    p = problem(13)
    vocab = p["weight"].shape[0]
    tl, ids = torch.log_softmax(p["teacher"], -1).topk(vocab, dim=-1)
    got = d.linear_distill_loss_with_diagnostics(
        p["hidden"], p["weight"], tl, p["mask"], teacher_ids=ids, topk_tail="bucket"
    )[1].per_token  # fmt: skip
    s = torch.log_softmax(p["hidden"] @ p["weight"].T, -1).gather(-1, ids)
    f = (tl.exp() * (tl - s)).sum(-1)
    torch.testing.assert_close(got, torch.where(p["mask"], f, 0.0), rtol=1e-10, atol=1e-10)
    grads = _loss_and_grads(p, tl, ids, topk_tail="bucket")
    assert all(torch.isfinite(g).all() for g in grads)


def test_teacher_mass_one_gives_no_bucket_term() -> None:
    """P_t >= 1 (here one id holding all the teacher's mass): 0 log 0 = 0, the loss is F."""
    p = problem(14)
    ids, tl = p["ids"][..., :1], torch.zeros_like(p["topk_logp"][..., :1])
    got = _loss_and_grads(p, tl, ids, topk_tail="bucket")
    s = torch.log_softmax(p["hidden"] @ p["weight"].T, -1).gather(-1, ids)[..., 0]
    want = d.token_level_aggregate(-s, p["mask"])
    torch.testing.assert_close(got[0], want, **TOL)


@pytest.mark.parametrize("tail", ["none", *TAILS])
def test_is_weights_scale_each_token(tail: str) -> None:
    """w l per token: the diagnostics keep l (unweighted), the loss and gradients are
    those of the weighted sum; w = 1 is no weight."""
    p = problem(15)
    opts: dict[str, Any] = {"teacher_ids": True, "topk_tail": tail, "mode": "seq_mean_token_mean"}
    kw = {"teacher_ids": p["ids"], "topk_tail": tail, "mode": "seq_mean_token_mean"}
    loss, diag = d.linear_distill_loss_with_diagnostics(
        p["hidden"], p["weight"], p["topk_logp"], p["mask"], is_weights=p["is_weights"], **kw
    )  # fmt: skip
    plain = naive_per_token(p, opts)
    torch.testing.assert_close(diag.per_token, torch.where(p["mask"], plain, 0.0), **TOL)
    want = d.token_level_aggregate(plain * p["is_weights"], p["mask"], mode="seq_mean_token_mean")
    torch.testing.assert_close(loss, want, **TOL)
    ones = torch.ones_like(p["is_weights"])
    a = _loss_and_grads(p, p["topk_logp"], p["ids"], topk_tail=tail, is_weights=ones)
    b = _loss_and_grads(p, p["topk_logp"], p["ids"], topk_tail=tail)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"topk_tail": "bucket"}, "topk_tail"),  # no top-k
        ({"topk_tail": "renormalize", "kind": "jsd"}, "topk_tail"),
        ({"topk_tail": "tail"}, "topk_tail"),
        ({"topk_tail": None}, "topk_tail"),
        ({"topk": 3, "topk_tail": "bucket", "log_prob_min_clamp": -10.0}, "log_prob_min_clamp"),
        ({"is_weights": "w"}, "is_weights"),
        ({"is_weights": torch.ones(2, 2, dtype=torch.float64)}, "is_weights"),
        ({"is_weights": torch.ones(3, 5, dtype=torch.int64)}, "is_weights"),
        ({"is_weights": torch.ones(3, 5, dtype=torch.float64, requires_grad=True)}, "is_weights"),
    ],
)
def test_bad_options(kw: dict[str, Any], match: str) -> None:
    p = problem(16)
    with pytest.raises(InputError, match=match):
        d.linear_distill_loss(p["hidden"], p["weight"], p["teacher"], p["mask"], **kw)


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize("tail", TAILS)
def test_repeated_ids_refused_with_a_tail(tail: str) -> None:
    p = problem(17)
    ids = p["ids"].clone()
    ids[0, 0, 1] = ids[0, 0, 0]
    with pytest.raises(InputError, match="distinct"):
        d.linear_distill_loss(
            p["hidden"], p["weight"], p["topk_logp"], p["mask"], teacher_ids=ids, topk_tail=tail
        )  # fmt: skip
    d.linear_distill_loss(p["hidden"], p["weight"], p["topk_logp"], p["mask"], teacher_ids=ids)
