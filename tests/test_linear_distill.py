"""``linear_distill_loss`` against the naive composition (whole logits), float64.

The naive composition is written here from the formulas (``F.kl_div`` as TRL's GKD
uses it, and verl's top-k steps): every kind, beta, temperature, top-k path, clamp and
aggregation mode, over chunk sizes that split sequences; gradcheck; masked garbage
bitwise; micro-batches with ``global_normalizer``; ``torch.compile``; memory.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import dapo_ops as d
from dapo_ops._core._validate import InputError
from dapo_ops.logprobs import _two_pass

B, S, D, V = 3, 5, 6, 17
TOL = {"rtol": 1e-11, "atol": 1e-12}
#: The chunked path (one chunk, chunks of 4 tokens) and the two-pass design with the
#: logits kept and formed again (``backend="two_pass"``, blocks of 60 elements).
PATHS = [
    {"chunk_size": None},
    {"chunk_size": 4},
    {"backend": "two_pass", "keep_logits": True},
    {"backend": "two_pass", "keep_logits": False},
]
PATH_IDS = ["chunked", "chunks-of-4", "two-pass-keep", "two-pass-recompute"]


def case_paths(cases: list[dict[str, Any]]) -> list[Any]:
    """Each case on the two chunked paths and one two-pass setting, the settings in turn
    (the suite's time: every case and every setting, not every pair)."""
    out = []
    for i, opts in enumerate(cases):
        name = ",".join(f"{k}={v}" for k, v in opts.items())
        for j in (0, 1, 2 + i % 2):
            out.append(pytest.param(opts, PATHS[j], id=f"{name}-{PATH_IDS[j]}"))
    return out


def small_two_pass_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two-pass blocks of 60 logits: 3-row blocks in pass 1, 4-id slices in pass 2."""
    monkeypatch.setitem(_two_pass.BUDGET_ELEMENTS, "cpu", 60)


def problem(seed: int, dtype: torch.dtype = torch.float64, k: int = 4) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g, dtype=dtype)
    weight = torch.randn(V, D, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype)
    teacher = 2 * torch.randn(B, S, V, generator=g, dtype=dtype)
    mask = torch.rand(B, S, generator=g) < 0.7
    mask[0], mask[-1, 1:] = True, False
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(B * S)]).view(B, S, k)
    logp = torch.log_softmax(3 * torch.randn(B, S, V, generator=g, dtype=dtype), -1)
    topk_logp = logp.gather(-1, ids)
    is_weights = torch.rand(B, S, generator=g, dtype=dtype) * 1.5
    return {"hidden": hidden, "weight": weight, "bias": bias, "teacher": teacher,
            "mask": mask, "ids": ids, "topk_logp": topk_logp, "is_weights": is_weights}  # fmt: skip


def naive_per_token(p: dict[str, Any], opts: dict[str, Any]) -> torch.Tensor:
    """The per-token loss from the whole logits (``[batch, seq]``)."""
    temp = opts.get("temperature", 1.0)
    z = p["hidden"] @ p["weight"].T + (p["bias"] if opts.get("bias") is not None else 0)
    s = torch.log_softmax(z / temp, -1)
    if "teacher_ids" in opts or opts.get("topk"):
        if "teacher_ids" in opts:
            tl, ids = p["topk_logp"], p["ids"]
        else:
            tl, ids = torch.log_softmax(p["teacher"] / temp, -1).topk(opts["topk"], dim=-1)
        sk = s.gather(-1, ids)
        c, tail = opts.get("log_prob_min_clamp"), opts.get("topk_tail", "none")
        if c is not None:
            sk, tl = sk.clamp_min(c), tl.clamp_min(c)
        f = (tl.exp() * (tl - sk)).sum(-1)
        pt, ps = tl.exp().sum(-1), sk.exp().sum(-1)
        if tail == "bucket":  # TRL's add_tail=True: one more category, the rest
            loss = f + (1 - pt) * (torch.log1p(-pt) - torch.log1p(-ps))
        elif tail == "renormalize":  # add_tail=False: both renormalised on the ids
            loss = f / pt - pt.log() + ps.log()
        else:
            loss = f.clamp_min(0.0)
    else:
        t = torch.log_softmax(p["teacher"] / temp, -1)
        kind, beta = opts.get("kind", "forward_kl"), opts.get("beta", 0.5)
        if kind == "forward_kl":
            loss = F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
        elif kind == "reverse_kl":
            loss = F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
        else:
            bt = torch.tensor(beta, dtype=s.dtype)
            m = torch.logsumexp(torch.stack([s + torch.log1p(-bt), t + torch.log(bt)]), 0)
            kt = F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
            ks = F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
            loss = beta * kt + (1 - beta) * ks
    c = opts.get("loss_clamp")
    loss = loss if c is None else loss.clamp(-c, c)
    return loss if opts.get("is_weights") is None else loss * p["is_weights"]


def naive(p: dict[str, Any], opts: dict[str, Any]) -> torch.Tensor:
    agg = {k: opts[k] for k in ("mode", "normalizer", "max_len") if k in opts}
    return d.token_level_aggregate(naive_per_token(p, opts), p["mask"], **agg)


def fused(p: dict[str, Any], opts: dict[str, Any]) -> torch.Tensor:
    teacher = p["topk_logp"] if "teacher_ids" in opts else p["teacher"]
    kw = {k: v for k, v in opts.items() if k != "teacher_ids"}
    if "teacher_ids" in opts:
        kw["teacher_ids"] = p["ids"]
    if opts.get("bias") is not None:
        kw["bias"] = p["bias"]
    if opts.get("is_weights") is not None:
        kw["is_weights"] = p["is_weights"]
    return d.linear_distill_loss(p["hidden"], p["weight"], teacher, p["mask"], **kw)


def values_and_grads(fn: Any, p: dict[str, Any], opts: dict[str, Any]) -> list[torch.Tensor]:
    leaves = [p[k].detach().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    q = {**p, "hidden": leaves[0], "weight": leaves[1], "bias": leaves[2]}
    loss = fn(q, opts)
    return [loss.detach(), *torch.autograd.grad(loss, leaves, allow_unused=True)]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for x, y in zip(got, want, strict=True):
        if y is None:  # no bias: its gradient is None on the naive side
            assert x is None or not x.abs().max()
        else:
            torch.testing.assert_close(x, y, **TOL)


CASES = [
    *({"kind": k, "temperature": t} for k, t in itertools.product(("forward_kl", "reverse_kl"), (1.0, 0.7))),
    *({"kind": "jsd", "beta": b, "temperature": t} for b, t in itertools.product((0.1, 0.5, 0.9), (1.0, 1.5))),
    {"kind": "jsd", "bias": True, "mode": "seq_mean_token_mean"},
    {"kind": "reverse_kl", "loss_clamp": 0.5, "mode": "seq_mean_token_sum_norm", "max_len": 7},
    {"teacher_ids": True},
    {"teacher_ids": True, "log_prob_min_clamp": -3.0, "temperature": 0.8},
    {"teacher_ids": True, "log_prob_min_clamp": -10.0, "loss_clamp": 1.0, "mode": "seq_mean_token_sum"},
    {"topk": 3, "temperature": 1.3, "bias": True},
    {"topk": 5, "log_prob_min_clamp": -2.0, "normalizer": 11.0},
    *({"kind": k, "is_weights": True, "temperature": 0.9} for k in ("forward_kl", "reverse_kl", "jsd")),
    {"kind": "jsd", "beta": 0.3, "is_weights": True, "loss_clamp": 0.4, "mode": "seq_mean_token_mean", "bias": True},
    {"teacher_ids": True, "is_weights": True, "log_prob_min_clamp": -3.0},
    *({"teacher_ids": True, "topk_tail": tl, "temperature": t} for tl, t in itertools.product(("bucket", "renormalize"), (1.0, 0.7))),
    *({"topk": 3, "topk_tail": tl, "bias": True, "is_weights": True} for tl in ("bucket", "renormalize")),
    {"teacher_ids": True, "topk_tail": "bucket", "loss_clamp": 0.3, "is_weights": True, "mode": "seq_mean_token_sum_norm", "max_len": 7},
    {"topk": 1, "topk_tail": "bucket", "temperature": 1.3, "normalizer": 5.0},
]  # fmt: skip


@pytest.mark.parametrize(("opts", "path"), case_paths(CASES))
def test_equals_the_naive_composition(
    opts: dict[str, Any], path: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    small_two_pass_blocks(monkeypatch)
    p = problem(1)
    want = values_and_grads(naive, p, opts)
    got = values_and_grads(fused, p, {**opts, **path})
    _close(got, want)
    assert float(want[0]) != 0.0


def test_per_token_diagnostics_and_masses() -> None:
    p = problem(2)
    _, diag = d.linear_distill_loss_with_diagnostics(
        p["hidden"], p["weight"], p["topk_logp"], p["mask"], teacher_ids=p["ids"],
        log_prob_min_clamp=-5.0,
    )  # fmt: skip
    want = naive_per_token(p, {"teacher_ids": True, "log_prob_min_clamp": -5.0})
    torch.testing.assert_close(diag.per_token, torch.where(p["mask"], want, 0.0), **TOL)
    s = torch.log_softmax(p["hidden"] @ p["weight"].T, -1).gather(-1, p["ids"])
    m = p["mask"]
    assert diag.student_mass is not None and diag.teacher_mass is not None
    torch.testing.assert_close(diag.student_mass[m], s.exp().sum(-1)[m], **TOL)
    torch.testing.assert_close(diag.teacher_mass[m], p["topk_logp"].exp().sum(-1)[m], **TOL)
    _, full = d.linear_distill_loss_with_diagnostics(p["hidden"], p["weight"], p["teacher"], m)
    assert full.student_mass is None and full.teacher_mass is None


@pytest.mark.parametrize(
    "opts",
    [
        {"kind": "jsd", "beta": 0.3, "temperature": 0.9, "is_weights": True},
        {"teacher_ids": True, "log_prob_min_clamp": -4.0},
        {"teacher_ids": True, "topk_tail": "bucket", "is_weights": True, "temperature": 0.8},
        {"teacher_ids": True, "topk_tail": "renormalize"},
    ],
)  # fmt: skip
def test_gradcheck(opts: dict[str, Any]) -> None:
    p = problem(3)
    teacher = p["topk_logp"] if "teacher_ids" in opts else p["teacher"]
    kw = {k: v for k, v in opts.items() if k != "teacher_ids"}
    if "teacher_ids" in opts:
        kw["teacher_ids"] = p["ids"]
    if "is_weights" in opts:
        kw["is_weights"] = p["is_weights"]

    def fn(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return d.linear_distill_loss(h, w, teacher, p["mask"], bias=b, chunk_size=4, **kw)

    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)  # the definition


def dirtied(p: dict[str, Any], logp: str, ids: str) -> dict[str, Any]:
    """A copy of ``p`` with NaN / inf / -100 at every masked position of the hidden states,
    the teacher's logits, its top-k log-probs (``logp``) and ids (``ids``), the IS weights."""
    dirty = {k: v.clone() for k, v in p.items()}
    off = ~p["mask"]
    dirty["hidden"][off] = float("nan")
    dirty["teacher"][off] = float("inf")
    dirty[logp][off] = float("nan")
    dirty[ids][off] = -100
    dirty["is_weights"][off] = float("nan")
    return dirty


@pytest.mark.parametrize("topk", [False, True, "bucket", "renormalize"])
def test_masked_garbage_changes_nothing_bitwise(topk: bool | str) -> None:
    p = problem(4, torch.float32)
    dirty = dirtied(p, "topk_logp", "ids")
    opts: dict[str, Any] = {"teacher_ids": True} if topk else {"kind": "jsd", "bias": True}
    opts["is_weights"] = True
    if isinstance(topk, str):
        opts["topk_tail"] = topk
    clean = values_and_grads(fused, p, {**opts, "chunk_size": 3})
    got = values_and_grads(fused, dirty, {**opts, "chunk_size": 3})
    for x, y in zip(got, clean, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_add_up(mode: str) -> None:
    p = problem(5)
    opts = {"kind": "reverse_kl", "mode": mode, "chunk_size": 4}
    whole = values_and_grads(fused, p, opts)
    parts = [slice(0, 1), slice(1, B)]
    den = d.global_normalizer([p["mask"][s] for s in parts], mode=mode)  # type: ignore[arg-type]
    total: list[torch.Tensor] | None = None
    for s in parts:
        q = {k: (v[s] if v.ndim == 3 or k == "mask" else v) for k, v in p.items()}
        q["ids"] = p["ids"][s]
        got = values_and_grads(fused, q, {**opts, "normalizer": den})
        grads_h = torch.zeros_like(p["hidden"])
        grads_h[s] = got[1]
        got[1] = grads_h
        got = got[:3]  # no bias
        total = got if total is None else [x + y for x, y in zip(total, got, strict=True)]
    assert total is not None
    _close(total, whole[:3])


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize("topk", [False, True, "bucket", "renormalize"])
def test_compile_fullgraph(topk: bool | str) -> None:
    p = problem(6, torch.float32)
    opts: dict[str, Any] = (
        {"teacher_ids": True, "log_prob_min_clamp": -3.0} if topk else {"kind": "jsd", "beta": 0.2}
    )
    if isinstance(topk, str):
        opts = {"teacher_ids": True, "topk_tail": topk, "is_weights": True}
    opts["chunk_size"] = 4
    torch._dynamo.reset()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    want = values_and_grads(fused, p, opts)
    got = values_and_grads(compiled, p, opts)
    for x, y in zip(got, want, strict=True):
        assert (x is None and y is None) or torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def test_bfloat16_runs_close_to_float32() -> None:
    p = problem(7, torch.float32)
    want = values_and_grads(fused, p, {"kind": "jsd"})
    q = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in p.items()}
    got = values_and_grads(fused, q, {"kind": "jsd"})
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=5e-2, atol=1e-2)


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kind": "forward_kl", "beta": 0.5}, "beta"),
        ({"kind": "jsd", "beta": 0.0}, "beta"),
        ({"kind": "jsd", "beta": 1.0}, "beta"),
        ({"kind": "reverse_kl", "topk": 3}, "top-k"),
        ({"log_prob_min_clamp": -10.0}, "log_prob_min_clamp"),
        ({"topk": 0}, "topk"),
        ({"loss_clamp": 0.0}, "loss_clamp"),
        ({"kind": "kl"}, "kind"),
    ],
)
def test_bad_options(kw: dict[str, Any], match: str) -> None:
    p = problem(8)
    with pytest.raises(InputError, match=match):
        d.linear_distill_loss(p["hidden"], p["weight"], p["teacher"], p["mask"], **kw)


def test_bad_teacher_ids() -> None:
    p = problem(8)
    bad = p["ids"].clone()
    bad[0, 0, 0] = V
    with pytest.raises(InputError, match="teacher_ids"):
        d.linear_distill_loss(p["hidden"], p["weight"], p["topk_logp"], p["mask"], teacher_ids=bad)
    with pytest.raises(InputError, match="topk"):
        d.linear_distill_loss(
            p["hidden"], p["weight"], p["topk_logp"], p["mask"], teacher_ids=p["ids"], topk=2
        )
    with pytest.raises(InputError, match="teacher"):
        d.linear_distill_loss(p["hidden"], p["weight"], p["topk_logp"], p["mask"])
