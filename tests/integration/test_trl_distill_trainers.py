"""dapo_ops against the losses of TRL 1.16's distillation trainers other than GKD.

- ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (``DistillationTrainer``,
  also ``trl.experimental.distillation``): ``linear_distill_loss`` on the student's hidden
  states and the teacher's logits, every ``beta``, two temperatures, ``num_items_in_batch``,
  ``lm_head`` bias and ``logit_scale`` (folded into the weight and bias),
  ``final_logit_softcapping`` (None, 30 and 2: ``softcap=`` for the student, the teacher's
  logits capped here as TRL caps them), fully masked rows and batches: value, gradient and the entropy metric, to float32 rounding (TRL's kernel
  projects and reduces in float32 whatever the input dtype: a documented difference).
- ``GOLDTrainer.generalized_jsd_loss`` and ``IWOPDTrainer.generalized_jsd_loss`` (full
  vocabulary): ``linear_distill_loss``, every ``beta``, temperature and reduction, GOLD's
  ``logits_are_probs``, fully masked batches: value and gradient, float64.
- ``IWOPDTrainer.generalized_jsd_loss`` with ``top_k``, every ``beta`` (the support: the
  teacher's top-k at ``beta=0``, the student's at 1, both between):
  ``linear_distill_loss(..., topk=k, topk_support=..., topk_tail="bucket" |
  "renormalize")``, three reductions: value and gradient everywhere, float64.
- ``IWOPDTrainer._compute_iw_opd_loss``: ``policy_loss(PolicyGradient(), ...)`` with
  ``distill_advantages`` (``k1``, unclamped) and TRL's prefix weights as ``is_weights``
  (the weights themselves are computed here: dapo_ops has no function for them), every
  ``gamma``, temperature, ``num_items_in_batch``, with and without rollout log-probs:
  value, gradient and the logged metrics, float64.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("PIL")
dt = pytest.importorskip("trl.trainer.distillation_trainer")
gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
iw = pytest.importorskip("trl.experimental.iw_opd.iw_opd_trainer")

from _self_distill_common import batch, trl_floor_binds  # noqa: E402

import dapo_ops as d  # noqa: E402

pytestmark = pytest.mark.integration

TOL = {"rtol": 1e-12, "atol": 1e-13}
F32 = {"rtol": 1e-5, "atol": 2e-6}  # TRL's chunked kernel computes in float32
BETAS = [0.0, 0.25, 0.5, 1.0]
REDUCTIONS = ["batchmean", "sum", "mean", "none", "num_items"]


def _kind(beta: float) -> dict[str, Any]:
    kind = {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")
    return {"kind": kind, **({"beta": beta} if kind == "jsd" else {})}


def _grads(loss: torch.Tensor, x: SimpleNamespace) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, (x.hidden, x.weight))


def _same_loss_and_grads(got: torch.Tensor, want: torch.Tensor, x: SimpleNamespace) -> None:
    torch.testing.assert_close(got, want.to(got.dtype), **TOL)
    for a, b in zip(_grads(got, x), _grads(want, x), strict=True):
        torch.testing.assert_close(a, b, **TOL)


# --------------------------------------------- DistillationTrainer (hidden states, float32)


def _cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The model's final-logit soft-capping (after the logit scale), as TRL applies it."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


@pytest.mark.parametrize(("beta", "temperature"), list(itertools.product(BETAS, [1.0, 0.7])))
@pytest.mark.parametrize("items", [None, 13])
@pytest.mark.parametrize(("with_bias", "scale"), [(False, 1.0), (True, 0.5)])
@pytest.mark.parametrize("softcap", [None, 30.0, 2.0])
def test_distillation_trainer_chunked_divergence(
    beta: float,
    temperature: float,
    items: int | None,
    with_bias: bool,
    scale: float,
    softcap: float | None,
) -> None:
    x = batch(int(beta * 8) + (items or 0))
    th = torch.randn(3, 6, 5, generator=x.g, dtype=torch.float64)  # another hidden width
    tw = torch.randn(x.v, 5, generator=x.g, dtype=torch.float64)
    sb = torch.randn(x.v, generator=x.g, dtype=torch.float64).requires_grad_(with_bias)
    tb = torch.randn(x.v, generator=x.g, dtype=torch.float64)
    bias = {"student_lm_head_bias": sb, "teacher_lm_head_bias": tb} if with_bias else {}
    want, entropy, n = dt._chunked_divergence_loss(
        x.hidden, th, x.weight, tw, x.mask.long(), beta, num_items_in_batch=items,
        student_logit_scale=scale, teacher_logit_scale=scale, temperature=temperature, **bias,
        student_final_logit_softcapping=softcap, teacher_final_logit_softcapping=softcap,
    )  # fmt: skip
    assert want.dtype == torch.float32  # whatever the input dtype
    t_logits = _cap(scale * (th @ tw.T + (tb if with_bias else 0)), softcap)
    norm = {} if items is None else {"normalizer": float(items)}
    got = d.linear_distill_loss(
        x.hidden, scale * x.weight, t_logits, x.mask, temperature=temperature,
        bias=scale * sb if with_bias else None, chunk_size=5, softcap=softcap, **_kind(beta),
        **norm,
    )  # fmt: skip
    torch.testing.assert_close(got, want.double(), **F32)
    leaves = (x.hidden, x.weight, *((sb,) if with_bias else ()))
    g_want = torch.autograd.grad(want, leaves)
    g_got = torch.autograd.grad(got, leaves)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, **F32)
    # the logged metric: the student's entropy summed over the valid tokens, and their count
    logits = _cap(scale * (x.hidden @ x.weight.T + (sb if with_bias else 0)), softcap)
    ent = d.token_entropy(logits.detach(), temperature=temperature)
    torch.testing.assert_close(ent[x.mask].sum(), entropy.double(), **F32)
    assert int(n) == int(x.mask.sum())


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("items", [None, 4])
def test_distillation_trainer_fully_maskedbatch(beta: float, items: int | None) -> None:
    x = batch(3)
    none = torch.zeros_like(x.mask)
    tw = torch.randn(x.v, 7, generator=x.g, dtype=torch.float64)
    want, _, n = dt._chunked_divergence_loss(
        x.hidden, x.hidden.detach(), x.weight, tw, none.long(), beta, num_items_in_batch=items
    )
    t_logits = x.hidden.detach() @ tw.T
    norm = {} if items is None else {"normalizer": float(items)}
    got = d.linear_distill_loss(x.hidden, x.weight, t_logits, none, **_kind(beta), **norm)
    assert int(n) == 0 and float(want.detach()) == 0.0 and float(got.detach()) == 0.0
    for a, b in zip(_grads(got, x), _grads(want, x), strict=True):
        assert not a.any() and not b.any()


# ------------------------------------ GOLD's and IW-OPD's generalized_jsd_loss (full vocab)


def _ours_full(
    x: SimpleNamespace, beta: float, temperature: float, reduction: str, **extra: Any
) -> Any:
    normalizer = {"sum": 1.0, "none": 1.0, "mean": float(x.mask.sum() * x.v), "num_items": 17.0}
    kw: dict[str, Any] = {"temperature": temperature, "chunk_size": 5, **_kind(beta), **extra}
    if reduction in normalizer:
        kw["normalizer"] = normalizer[reduction]
    return d.linear_distill_loss_with_diagnostics(x.hidden, x.weight, x.teacher, x.mask, **kw)


def _trl_kw(x: SimpleNamespace, reduction: str) -> dict[str, Any]:
    return {
        "labels": torch.where(x.mask, 1, -100),
        "reduction": "batchmean" if reduction == "num_items" else reduction,
        "num_items_in_batch": 17 if reduction == "num_items" else None,
    }


TRAINERS = {"gold": lambda: gold.GOLDTrainer, "iw_opd": lambda: iw.IWOPDTrainer}


@pytest.mark.parametrize("trainer", ["gold", "iw_opd"])
@pytest.mark.parametrize(("beta", "temperature"), list(itertools.product(BETAS, [1.0, 0.7])))
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_generalized_jsd_loss(
    trainer: str, beta: float, temperature: float, reduction: str
) -> None:
    x = batch(int(beta * 8) + len(reduction))
    extra = {"top_k": x.v} if trainer == "iw_opd" and beta == 0.25 else {}  # k = vocab: full
    want = TRAINERS[trainer]().generalized_jsd_loss(
        x.hidden @ x.weight.T, x.teacher, beta=beta, temperature=temperature,
        **_trl_kw(x, reduction), **extra,
    )  # fmt: skip
    got, diag = _ours_full(x, beta, temperature, reduction)
    if reduction == "none":  # TRL's [valid tokens, vocab]: ours summed over the vocabulary
        torch.testing.assert_close(diag.per_token[x.mask], want.detach().sum(-1), **TOL)
        want = want.sum()
    _same_loss_and_grads(got, want, x)


@pytest.mark.parametrize("beta", BETAS)
def test_gold_logits_are_probs(beta: float) -> None:
    """GOLD's probabilities in: log(max(p, 1e-8)), no temperature; ours from the logits."""
    x = batch(7)
    x.hidden = (0.3 * x.hidden).detach().requires_grad_(True)  # no probability below 1e-8
    t_probs = torch.softmax(x.teacher, -1)
    assert (
        float(t_probs.min()) > 1e-8
        and float(torch.softmax(x.hidden.detach() @ x.weight.T.detach(), -1).min()) > 1e-8
    )
    want = gold.GOLDTrainer.generalized_jsd_loss(
        torch.softmax(x.hidden @ x.weight.T, -1), t_probs, beta=beta, temperature=0.5,
        logits_are_probs=True, **_trl_kw(x, "batchmean"),
    )  # fmt: skip
    got, _ = _ours_full(x, beta, 1.0, "batchmean")
    _same_loss_and_grads(got, want, x)


@pytest.mark.parametrize("trainer", ["gold", "iw_opd"])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "num_items"])
def test_generalized_jsd_loss_fully_masked(trainer: str, beta: float, reduction: str) -> None:
    x = batch(11)
    x.mask = torch.zeros_like(x.mask)
    want = TRAINERS[trainer]().generalized_jsd_loss(
        x.hidden @ x.weight.T, x.teacher, beta=beta, **_trl_kw(x, reduction)
    )
    got, _ = _ours_full(x, beta, 1.0, reduction)
    assert float(want.detach()) == 0.0 and float(got.detach()) == 0.0
    _same_loss_and_grads(got, want, x)


# ---------------------------------------------- IW-OPD's top-k loss: our top-k KL with a tail


@pytest.mark.parametrize(("k", "temperature"), list(itertools.product([1, 3, 8], [1.0, 0.7])))
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "num_items"])
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_iw_opd_topk(
    k: int, temperature: float, add_tail: bool, reduction: str, beta: float
) -> None:
    """TRL's support: beta=0 the teacher's top-k ids, beta=1 the student's, else both:
    ``linear_distill_loss(..., topk=k, topk_support="teacher" | "student" | "union",
    topk_tail="bucket")`` (``add_tail=True``) or ``"renormalize"``: value and gradient at
    every position, float64."""
    x = batch(20 + k + 3 * add_tail + len(reduction) + int(10 * beta))
    if add_tail:  # TRL floors 1 - P at about 1e-7: compare where it does not bind
        s, t = (torch.log_softmax(z / temperature, -1) for z in (x.hidden @ x.weight.T, x.teacher))
        sup = [t.topk(k, -1).indices, s.detach().topk(k, -1).indices]
        ids = {0.0: sup[0], 1.0: sup[1]}.get(beta, torch.cat(sup, -1))
        x.mask = x.mask & ~trl_floor_binds(s, t, ids)
        assert x.mask.sum() >= 5
    want = iw.IWOPDTrainer.generalized_jsd_loss(
        x.hidden @ x.weight.T, x.teacher, beta=beta, temperature=temperature, top_k=k,
        add_tail=add_tail, **_trl_kw(x, reduction),
    )  # fmt: skip
    tail = "bucket" if add_tail else "renormalize"
    support = {0.0: "teacher", 1.0: "student"}.get(beta, "union")
    got, _ = _ours_full(x, beta, temperature, reduction, topk=k, topk_tail=tail, topk_support=support)  # fmt: skip
    _same_loss_and_grads(got, want, x)


@pytest.mark.parametrize(("beta", "temperature"), list(itertools.product([0.3, 1.0], [1.0, 0.7])))
@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("mode", ["argmax", "sampled"])
def test_iw_opd_sparse_top_1(beta: float, temperature: float, add_tail: bool, mode: str) -> None:
    """``_compute_local_sparse_top_1_divergence_loss``: the support {the teacher's argmax,
    the student's argmax} is ``topk=1, topk_support="union"`` (the student's alone at
    ``beta=1``: ``"student"``); {the teacher's argmax, the sampled token} goes as
    ``teacher_ids`` with the repeat as ``-inf`` padding. Float64 value and gradient."""
    x = batch(90 + int(10 * beta) + 2 * add_tail + len(mode))
    tokens = torch.randint(0, x.v, x.mask.shape, generator=x.g)
    cls = iw.IWOPDTrainer
    owner = SimpleNamespace(beta=beta, loss_add_tail=add_tail, temperature=temperature,
                            reverse_kl_top_1_mode=mode, _reduce_divergence_loss=cls._reduce_divergence_loss)  # fmt: skip
    owner._get_reverse_kl_top_1_tokens = lambda s, c: cls._get_reverse_kl_top_1_tokens(owner, s, c)
    owner._compute_sparse_top_1_divergence_loss = lambda **kw: cls._compute_sparse_top_1_divergence_loss(owner, **kw)  # fmt: skip
    want = cls._compute_local_sparse_top_1_divergence_loss(
        owner, x.hidden @ x.weight.T, x.teacher, tokens, torch.where(x.mask, 1, -100)
    )  # fmt: skip
    tail = "bucket" if add_tail else "renormalize"
    if mode == "argmax":
        support = "student" if beta == 1.0 else "union"
        got, _ = _ours_full(x, beta, temperature, "batchmean", topk=1, topk_tail=tail, topk_support=support)  # fmt: skip
    else:
        t_all = torch.log_softmax(x.teacher / temperature, -1)
        top = x.teacher.argmax(-1)
        ids = tokens[..., None] if beta == 1.0 else torch.stack([top, tokens], -1)
        tl = t_all.gather(-1, ids)
        if beta != 1.0:
            tl[..., 1] = torch.where(tokens == top, -torch.inf, tl[..., 1])
        kw: dict[str, Any] = {"teacher_ids": ids, "topk_tail": tail, "temperature": temperature, **_kind(beta)}  # fmt: skip
        got = d.linear_distill_loss(x.hidden, x.weight, tl, x.mask, chunk_size=5, **kw)
    _same_loss_and_grads(got, want, x)


# --------------------------------------------------------- IW-OPD's sampled-token objective


@pytest.mark.parametrize(
    ("gamma", "temperature"), list(itertools.product([0.0, 0.5, 2.0], [1.0, 0.7]))
)
@pytest.mark.parametrize("items", [None, 11])
@pytest.mark.parametrize("rollout", [False, True])
def test_iw_opd_loss(gamma: float, temperature: float, items: int | None, rollout: bool) -> None:
    x = batch(int(gamma * 4) + (items or 0) + rollout, s=7)
    tokens = torch.randint(0, x.v, x.mask.shape, generator=x.g)
    logits = (x.hidden @ x.weight.T).detach().requires_grad_(True)
    t_logp = torch.log_softmax(x.teacher, -1).gather(-1, tokens[..., None])[..., 0]
    t_logp = torch.where(x.mask, t_logp, -torch.inf)  # missing at padding: ignored by both
    r_logp = t_logp.clamp_min(-9) + 0.3 * torch.randn(
        x.mask.shape, generator=x.g, dtype=torch.float64
    )
    r_logp = torch.where(x.mask, r_logp, torch.nan) if rollout else None
    owner = SimpleNamespace(
        temperature=temperature, iw_opd_gamma=gamma, iw_opd_epsilon=1e-8,
        model=SimpleNamespace(training=True), _metrics=defaultdict(lambda: defaultdict(list)),
    )  # fmt: skip
    want = iw.IWOPDTrainer._compute_iw_opd_loss(
        owner, logits, tokens, torch.where(x.mask, tokens, -100), t_logp,
        rollout_logprobs=r_logp, num_items_in_batch=items,
    )  # fmt: skip
    logp = d.token_logprobs(logits, tokens, temperature=temperature)
    behaviour = logp.detach() if r_logp is None else r_logp
    teacher_k1 = d.TeacherKL(estimator="k1", clamp=None, log_ratio_clamp=None)
    adv = d.distill_advantages(behaviour, t_logp, x.mask, distill=teacher_k1)  # log pi_T - log pi
    w = d.iw_opd_weights(adv, x.mask, gamma=gamma, eps=1e-8)
    norm = {} if items is None else {"normalizer": float(items)}
    got = d.policy_loss(d.PolicyGradient(), logp, logp.detach(), adv, x.mask, is_weights=w, **norm)
    torch.testing.assert_close(got, want, **TOL)
    (g_got,) = torch.autograd.grad(got, logits)
    (g_want,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(g_got, g_want, **TOL)
    m = owner._metrics["train"]
    for key, ours in (("mean_advantage", (w * adv)[x.mask].mean()), ("mean_weight", w[x.mask].mean()),
                      ("min_weight", w[x.mask].min()), ("max_weight", w[x.mask].max())):  # fmt: skip
        assert m[f"iw_opd/{key}"] == pytest.approx([float(ours)], rel=1e-12, abs=1e-13), key
