"""``linear_distill_loss``'s reverse KL and JSD over a support of ids, float64.

The support: ``teacher_ids`` as given (some slots padding, ``-inf``), or with ``topk=k``
the teacher's top-k, the student's (``topk_support="student"``) or both
(``"union"``), completed by a tail bucket or renormalised. Against the naive composition
written here from the definition (whole logits, ``log_softmax``, gather, the two
distributions over the support, the divergence, autograd): values and the gradients of
hidden, weight and bias; gradcheck; masked garbage bitwise; refused combinations.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from test_linear_distill import (
    TOL,
    B,
    S,
    V,
    case_paths,
    dirtied,
    problem,
    small_two_pass_blocks,
)

import dapo_ops as d
from dapo_ops._core._validate import InputError

TAILS = ("bucket", "renormalize")


def padded(seed: int, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """:func:`problem` and a given support: its top-k log-probs with the last slot padding
    (-inf, a repeated id) at about half the positions."""
    p = problem(seed, dtype)
    pad = torch.rand(B, S, generator=torch.Generator().manual_seed(seed)) < 0.5
    p["pad_logp"] = p["topk_logp"].clone()
    p["pad_logp"][..., -1] = torch.where(pad, -math.inf, p["topk_logp"][..., -1])
    p["pad_ids"] = p["ids"].clone()
    p["pad_ids"][..., -1] = torch.where(pad, p["ids"][..., 0], p["ids"][..., -1])
    return p


def _support(s: torch.Tensor, t: torch.Tensor, support: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The ids (``[..., k]`` or ``[..., 2k]``) and the teacher's log-probs there (-inf: a
    student id already among the teacher's)."""
    tk, tids = t.topk(k, dim=-1)
    sids = s.detach().topk(k, dim=-1).indices
    if support == "teacher":
        return tk, tids
    if support == "student":
        return t.gather(-1, sids), sids
    seen = (sids[..., :, None] == tids[..., None, :]).any(-1)
    return torch.cat([tk, t.gather(-1, sids).masked_fill(seen, -math.inf)], -1), torch.cat([tids, sids], -1)  # fmt: skip


def naive_per_token(p: dict[str, Any], o: dict[str, Any]) -> torch.Tensor:
    temp, cap = o.get("temperature", 1.0), o.get("softcap")
    z = p["hidden"] @ p["weight"].T + (p["bias"] if o.get("bias") else 0)
    z = z if cap is None else cap * torch.tanh(z / cap)
    s = torch.log_softmax(z / temp, -1)
    if o.get("given"):
        tl, ids = p["pad_logp"], p["pad_ids"]
    else:
        t = torch.log_softmax(p["teacher"] / temp, -1)
        tl, ids = _support(s, t, o.get("topk_support", "teacher"), o["topk"])
    real = tl > -math.inf
    a = torch.where(real, s.gather(-1, ids), -math.inf)
    b = tl
    if o["topk_tail"] == "bucket":  # one more point: the mass off the ids
        a = torch.cat([a, torch.log1p(-a.exp().sum(-1, keepdim=True))], -1)
        b = torch.cat([b, torch.log1p(-b.exp().sum(-1, keepdim=True))], -1)
        real = torch.cat([real, torch.ones_like(real[..., :1])], -1)
    else:
        a, b = a - a.logsumexp(-1, keepdim=True), b - b.logsumexp(-1, keepdim=True)
    a, b = torch.where(real, a, 0.0), torch.where(real, b, 0.0)
    pa, pb = torch.where(real, a.exp(), 0.0), torch.where(real, b.exp(), 0.0)
    kind = o.get("kind", "forward_kl")
    if kind == "forward_kl":
        loss = (pb * (b - a)).sum(-1)
    elif kind == "reverse_kl":
        loss = (pa * (a - b)).sum(-1)
    else:
        beta = o["beta"]
        m = torch.log((1 - beta) * pa + beta * pb)
        m = torch.where(real, m, 0.0)
        loss = beta * (pb * (b - m)).sum(-1) + (1 - beta) * (pa * (a - m)).sum(-1)
    return loss if o.get("is_weights") is None else loss * p["is_weights"]


def _call(p: dict[str, Any], o: dict[str, Any], **extra: Any) -> torch.Tensor:
    kw = {k: v for k, v in o.items() if k not in ("given", "bias", "is_weights")}
    if o.get("bias"):
        kw["bias"] = p["bias"]
    if o.get("is_weights"):
        kw["is_weights"] = p["is_weights"]
    if o.get("given"):
        tl, ids = p["pad_logp"], p["pad_ids"]
        return d.linear_distill_loss(p["hidden"], p["weight"], tl, p["mask"], teacher_ids=ids, **kw, **extra)  # fmt: skip
    return d.linear_distill_loss(p["hidden"], p["weight"], p["teacher"], p["mask"], **kw, **extra)


def _grads(fn: Any, p: dict[str, Any]) -> list[torch.Tensor]:
    leaves = [p[k].detach().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss = fn({**p, "hidden": leaves[0], "weight": leaves[1], "bias": leaves[2]})
    return [loss.detach(), *torch.autograd.grad(loss, leaves, allow_unused=True)]


KINDS = [{"kind": "reverse_kl"}, {"kind": "jsd", "beta": 0.2}, {"kind": "jsd", "beta": 0.7}]
SUPPORTS = [{"given": True}, {"topk": 3}, {"topk": 3, "topk_support": "student"},
            {"topk": 2, "topk_support": "union"}]  # fmt: skip
EXTRAS = [{}, {"temperature": 0.7, "bias": True}, {"softcap": 2.0, "is_weights": True, "temperature": 1.3}]  # fmt: skip
CASES = [
    {**k, **s, **e, "topk_tail": t}
    for (k, s, e, t) in itertools.product(KINDS, SUPPORTS, EXTRAS, TAILS)
    if (KINDS.index(k) + SUPPORTS.index(s) + EXTRAS.index(e)) % 2 == 0  # half the grid
] + [
    {"kind": "forward_kl", "topk": 3, "topk_support": sup, "topk_tail": t, "temperature": 0.8}
    for sup, t in itertools.product(("student", "union"), TAILS)
]  # fmt: skip


@pytest.mark.parametrize(("opts", "path"), case_paths(CASES))
def test_equals_the_naive_composition(
    opts: dict[str, Any], path: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    small_two_pass_blocks(monkeypatch)
    p = padded(21)
    want = _grads(lambda q: d.token_level_aggregate(naive_per_token(q, opts), q["mask"]), p)
    got = _grads(lambda q: _call(q, opts, **path), p)
    for x, y in zip(got, want, strict=True):
        if y is None:
            assert x is None or not x.abs().max()
        else:
            torch.testing.assert_close(x, y, **TOL)
    assert float(want[0]) > 0.0


@pytest.mark.parametrize("opts", [
    {"kind": "jsd", "beta": 0.4, "given": True, "topk_tail": "bucket", "temperature": 0.8},
    {"kind": "reverse_kl", "given": True, "topk_tail": "renormalize", "softcap": 3.0},
    {"kind": "jsd", "beta": 0.6, "topk": 2, "topk_support": "union", "topk_tail": "bucket"},
    {"kind": "reverse_kl", "topk": 3, "topk_support": "student", "topk_tail": "renormalize"},
])  # fmt: skip
def test_gradcheck(opts: dict[str, Any]) -> None:
    p = padded(22)

    def fn(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _call({**p, "hidden": h, "weight": w, "bias": b}, {**opts, "bias": True}, chunk_size=4)  # fmt: skip

    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)  # the definition


@pytest.mark.parametrize("support", ["given", "student", "union"])
@pytest.mark.parametrize("tail", TAILS)
def test_masked_garbage_changes_nothing_bitwise(support: str, tail: str) -> None:
    p = padded(23, torch.float32)
    opts: dict[str, Any] = {"kind": "jsd", "beta": 0.3, "topk_tail": tail, "is_weights": True}
    opts.update({"given": True} if support == "given" else {"topk": 2, "topk_support": support})
    dirty = dirtied(p, "pad_logp", "pad_ids")
    clean = _grads(lambda q: _call(q, opts, chunk_size=3), p)
    got = _grads(lambda q: _call(q, opts, chunk_size=3), dirty)
    for x, y in zip(got, clean, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


def test_teacher_mass_one_and_no_student_mass_off_the_ids() -> None:
    """k = vocab: both bucket masses 0 up to rounding, floored logs: the loss is the
    divergence over the ids (renormalised = as given), finite gradients."""
    p = problem(24)
    tl, ids = torch.log_softmax(p["teacher"], -1).topk(V, dim=-1)
    kw: dict[str, Any] = {"teacher_ids": ids, "kind": "jsd", "beta": 0.5}
    h = p["hidden"].detach().requires_grad_(True)
    bucket = d.linear_distill_loss(h, p["weight"], tl, p["mask"], topk_tail="bucket", **kw)
    renorm = d.linear_distill_loss(p["hidden"], p["weight"], tl, p["mask"], topk_tail="renormalize", **kw)  # fmt: skip
    full = d.linear_distill_loss(p["hidden"], p["weight"], p["teacher"], p["mask"], kind="jsd")
    torch.testing.assert_close(bucket.detach(), renorm, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(renorm, full, rtol=1e-9, atol=1e-10)
    assert torch.isfinite(torch.autograd.grad(bucket, h)[0]).all()


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kind": "reverse_kl", "topk": 3}, "topk_tail"),  # tail "none": forward KL only
        ({"kind": "jsd", "topk": 3, "topk_tail": "none"}, "topk_tail"),
        ({"topk_support": "student", "topk_tail": "bucket"}, "topk_tail"),  # no top-k
        ({"topk_support": "student", "topk": 3}, "topk_support"),  # tail "none"
        ({"topk_support": "both", "topk": 3, "topk_tail": "bucket"}, "topk_support"),
        ({"topk_support": None}, "topk_support"),
        ({"kind": "jsd", "beta": 1.0, "topk": 3, "topk_tail": "bucket"}, "beta"),
    ],
)
def test_bad_options(kw: dict[str, Any], match: str) -> None:
    p = problem(25)
    with pytest.raises(InputError, match=match):
        d.linear_distill_loss(p["hidden"], p["weight"], p["teacher"], p["mask"], **kw)


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_student_support_refused_with_teacher_ids() -> None:
    p = problem(26)
    with pytest.raises(InputError, match="topk_support"):
        d.linear_distill_loss(
            p["hidden"], p["weight"], p["topk_logp"], p["mask"], teacher_ids=p["ids"],
            topk_support="union", topk_tail="bucket", kind="reverse_kl",
        )  # fmt: skip


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize(
    "opts",
    [
        {"kind": "jsd", "beta": 0.3, "given": True, "topk_tail": "renormalize"},
        {"kind": "reverse_kl", "topk": 2, "topk_support": "union", "topk_tail": "bucket"},
    ],
)
def test_compile_fullgraph(opts: dict[str, Any]) -> None:
    p = padded(27, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: _call(q, opts, chunk_size=4), fullgraph=True, backend="aot_eager")  # fmt: skip
    want = _grads(lambda q: _call(q, opts, chunk_size=4), p)
    got = _grads(compiled, p)
    for x, y in zip(got, want, strict=True):
        assert (x is None and y is None) or torch.allclose(x, y, rtol=1e-5, atol=1e-6)
