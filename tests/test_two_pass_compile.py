"""The two-pass backend under ``torch.compile(fullgraph=True)``, and what it refuses there.

``backend="two_pass"`` (the ATen rows), both memory settings, ``skip_padding`` with the
caller's count, and every call kind (policy loss, log-probs and entropies, whole-vocabulary
and top-k distillation) trace as one graph each; float64 results and gradients are within
``F64_RTOL`` of the naive composition (the eager two-pass call is, by tests/test_two_pass.py,
and so the compiled one is checked against the naive reference directly). What needs the
host is refused by name, before any other check: ``skip_padding=True`` (the count),
``cu_seqlens`` (the grid), ``vocab_group`` (the ranks' shape exchange) and ``backend="triton"`` (kernels launched
outside the graph). Compiled with ``aot_eager``: it traces forward and backward as inductor
does, in a fraction of the time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_linear_loss import assert_f64, grads, naive_loss, problem
from torch import Tensor

import dapo_ops as d
from dapo_ops.logprobs import _two_pass

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_runtime_typecheck")]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two token blocks and two vocabulary slices (13-id vocabulary, 24 tokens: blocks of
    15 rows, slices of 8 ids): the loops are unrolled in the graph, so few of them."""
    monkeypatch.setitem(_two_pass.BUDGET_ELEMENTS, "cpu", 200)


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    torch._dynamo.reset()  # a fresh graph per case: never a recompile-limit fallback
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def count(p: dict[str, Tensor]) -> int:
    return int(p["mask"].sum())  # the caller's count, read outside the compiled region


@pytest.mark.parametrize(
    ("objective", "opts"),
    [
        pytest.param(
            d.ClipHigher(dual_clip=3.0),
            {"keep_logits": True, "mode": "seq_mean_token_mean"},
            id="dual-clip-keep-seq-mean",
        ),
        pytest.param(d.GSPO(), {"keep_logits": False, "skip_padding": count}, id="gspo-skip"),
    ],
)
def test_policy_loss_compiles(objective: d.Objective, opts: dict[str, Any]) -> None:
    p = problem()
    opts = {k: v(p) if callable(v) else v for k, v in opts.items()}

    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return d.linear_policy_loss(
            h, w, p["tokens"], p["old"], p["adv"], p["mask"], objective=objective, bias=b,
            backend="two_pass", **opts,
        )  # fmt: skip

    naive_opts = {k: v for k, v in opts.items() if k in ("mode",)}
    assert_f64(grads(compiled(fn), p), grads(naive_loss(objective, p, naive_opts), p), "compiled")


def distill_naive(p: dict[str, Tensor], teacher: Tensor, kind: str) -> Callable[..., Tensor]:
    """The whole-vocabulary loss written out: token mean of the kind over valid tokens."""

    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        s = torch.log_softmax(h @ w.T + b, -1)
        t = torch.log_softmax(teacher, -1)
        forward = kind == "forward_kl"  # else reverse KL
        per = (t.exp() * (t - s) if forward else s.exp() * (s - t)).sum(-1)
        mask = p["mask"]
        return torch.where(mask, per, 0.0).sum() / mask.sum()

    return fn


@pytest.mark.parametrize(
    ("kind", "keep"),
    [("forward_kl", True), ("reverse_kl", False)],
    ids=["fkl-keep", "rkl-recompute"],
)
def test_whole_vocabulary_distillation_compiles(kind: str, keep: bool) -> None:
    p = problem()
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(*p["mask"].shape, p["weight"].shape[0], generator=g, dtype=p["hidden"].dtype)  # fmt: skip
    n = count(p)

    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return d.linear_distill_loss(
            h, w, teacher, p["mask"], kind=kind, bias=b, backend="two_pass", keep_logits=keep,  # type: ignore[arg-type]
            skip_padding=n,
        )  # fmt: skip

    assert_f64(grads(compiled(fn), p), grads(distill_naive(p, teacher, kind), p), "compiled")


def test_top_k_distillation_and_log_probs_compile() -> None:
    """Top-k forward KL against a teacher's ids (the teacher's log-probs renormalised on
    them, the student's taken at them) and ``fused_logprobs_entropy``, in one graph."""
    p = problem()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, p["weight"].shape[0], (*p["mask"].shape, 3), generator=g)
    t_logp = torch.log_softmax(torch.randn(*ids.shape, generator=g, dtype=torch.float64), -1)

    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        loss = d.linear_distill_loss(
            h, w, t_logp, p["mask"], teacher_ids=ids, bias=b, backend="two_pass", keep_logits=False
        )
        logp, ent = d.fused_logprobs_entropy(h, w, p["tokens"], bias=b, backend="two_pass")
        return loss + torch.where(p["mask"], logp + 0.1 * ent, 0.0).sum()

    def naive(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        s = torch.log_softmax(h @ w.T + b, -1)
        per = (t_logp.exp() * (t_logp - s.gather(-1, ids))).sum(-1)
        mask = p["mask"]
        loss = torch.where(mask, per, 0.0).sum() / mask.sum()
        logp = s.gather(-1, p["tokens"][..., None]).squeeze(-1)
        ent = -(s.exp() * s).sum(-1)
        return loss + torch.where(mask, logp + 0.1 * ent, 0.0).sum()

    assert_f64(grads(compiled(fn), p), grads(naive, p), "compiled")


def test_what_needs_the_host_is_refused_by_name() -> None:
    p = problem(2, 6, dtype=torch.float32)
    h, w = p["hidden"].float(), p["weight"].float()
    args = (p["tokens"], p["old"].float(), p["adv"].float(), p["mask"])
    flat = (x.reshape(1, -1, *x.shape[2:]) for x in (h, *args))
    packed = dict(zip(("h", "tokens", "old", "adv", "mask"), flat, strict=True))
    group = object()  # refused before it is looked at (no torch.distributed here)
    cases: list[tuple[str, Callable[[], Tensor]]] = [
        ("skip_padding=True", lambda: d.linear_policy_loss(h, w, *args, skip_padding=True)),
        ("backend='triton'", lambda: d.linear_policy_loss(h, w, *args, backend="triton")),
        ("cu_seqlens", lambda: d.linear_policy_loss(
            packed["h"], w, packed["tokens"], packed["old"], packed["adv"], packed["mask"],
            cu_seqlens=torch.tensor([0, 6, 12]),
        )),
        ("skip_padding=True", lambda: d.linear_distill_loss(
            h, w, F.pad(h, (0, w.shape[0] - h.shape[-1])), p["mask"], skip_padding=True
        )),
        ("vocab_group", lambda: d.fused_logprobs_entropy(h, w, args[0], vocab_group=group)[0]),
        ("vocab_group", lambda: d.linear_policy_loss(h, w, *args, vocab_group=group)),
    ]  # fmt: skip
    for name, fn in cases:
        with pytest.raises(Exception, match=name.replace("(", r"\(")) as caught:
            compiled(fn)()
        assert "eagerly only" in str(caught.value) or "pass the count" in str(caught.value), name
