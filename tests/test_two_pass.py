"""The two-pass lm-head path (``backend="two_pass"`` and ``"triton"``, both memory settings).

The same promises as the chunked path's tests (tests/test_linear_loss.py, whose
problems, references and derived bounds these reuse): float64 equal to the naive
composition within ``F64_RTOL``; float32 and bfloat16 within the bounds of
``tests/_bounds.py``; masked garbage changes no bit; micro-batches add up; ``gradcheck``
and double backward. Each runs the ATen row functions (``"two_pass"``) and the Triton
row kernels under Triton's interpreter (``"triton"``, marked ``triton``: ``.ci/triton``
runs them under every supported Triton), with the logits kept (``keep_logits=True``,
3 products) and formed again (``False``, 4 products), at a block budget small enough
that pass 1 walks several token blocks and pass 2 several vocabulary slices whose
widths are off every kernel block size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _bounds import assert_within
from test_linear_loss import (
    CASES,
    assert_f64,
    assert_micro_batches_add_up,
    case_inputs,
    float32_bounds,
    grads,
    naive_loss,
    problem,
)
from torch import Tensor

import dapo_ops as d
from dapo_ops.logprobs import _two_pass

F64 = torch.float64
KEEP = [pytest.param(True, id="keep"), pytest.param(False, id="recompute")]


@pytest.fixture(params=["two_pass", pytest.param("triton", marks=pytest.mark.triton)])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each two-pass backend; ``"triton"`` under the interpreter, whose time grows with
    the kernels' programs (a launch per block and slice, a program per row and column
    block), so at a budget of 200 elements: 15-row token blocks, 8-id slices (13-id
    vocabulary, 24 tokens: blocks of 15 and 9 rows, slices of 8 and 5 ids, off every
    kernel block size)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("triton_interpreter")
        request.getfixturevalue("monkeypatch").setitem(_two_pass.BUDGET_ELEMENTS, "cpu", 200)
    yield str(request.param)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of 60 elements: token blocks of 60 // vocab rows, vocabulary slices of
    60 // tokens ids (13-id vocabulary, 24 tokens: 4-row blocks, 2-id slices); the Triton
    rows take 200 (``backend``)."""
    monkeypatch.setitem(_two_pass.BUDGET_ELEMENTS, "cpu", 60)


def two_pass(objective: d.Objective, p: dict[str, Tensor], opts: dict[str, Any]) -> Any:
    def fn(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return d.linear_policy_loss(
            h, w, p["tokens"], p["old"], p["adv"], p["mask"], objective=objective, bias=b, **opts
        )

    return fn


def without_chunks(opts: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in opts.items() if k != "chunk_size"}


@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize(("objective", "opts"), CASES)
def test_float64_equals_naive(
    backend: str, keep: bool, objective: d.Objective, opts: dict[str, Any]
) -> None:
    p, opts = case_inputs(without_chunks(opts))
    got = grads(two_pass(objective, p, opts | {"backend": backend, "keep_logits": keep}), p)
    assert_f64(got, grads(naive_loss(objective, p, opts), p), f"{backend} keep={keep}")


@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_derived_bounds(
    backend: str, keep: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 / bfloat16 inputs: the loss (float32) and the gradients (input dtype)
    within the bounds of the exact values of the same rounded inputs: vocabulary 301, 36
    tokens, a budget of 1800 (5-row token blocks, 50-id slices and a last one of 1); on
    the Triton rows, which the interpreter runs slowly, vocabulary 77 and a budget of 500
    (6-row blocks, 13-id slices and a last one of 12)."""
    vocab, budget = (77, 500) if backend == "triton" else (301, 1800)
    monkeypatch.setitem(_two_pass.BUDGET_ELEMENTS, "cpu", budget)
    p = problem(4, 9, 16, vocab, seed=3, dtype=dtype)
    opts = {"entropy_coef": 0.05, "backend": backend, "keep_logits": keep}
    objective = d.ClipHigher()
    loss, grad = grads(two_pass(objective, p, opts), p)
    assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grad)
    want_loss, loss_err, want, errs = float32_bounds(objective, p, 0.05, dtype)
    assert_within(loss, want_loss, loss_err, "loss")
    for name, x, y, e in zip(("hidden", "weight", "bias"), grad, want, errs, strict=True):
        assert_within(x, y, e, f"{backend} {dtype} d {name}")


@pytest.mark.parametrize("keep", KEEP)
def test_masked_positions_change_nothing(backend: str, keep: bool) -> None:
    """NaN / inf hidden rows and -100 ids at masked positions: bit for bit the same."""
    p = problem(dtype=torch.float32)
    mask = p["mask"]
    opts = {"entropy_coef": 0.05, "backend": backend, "keep_logits": keep}
    base = grads(two_pass(d.ClipHigher(), p, opts), p)
    for value in (math.nan, math.inf):
        dirty = dict(p)
        dirty["hidden"] = torch.where(mask[..., None], p["hidden"], value)
        dirty["tokens"] = torch.where(mask, p["tokens"], -100)
        loss, got = grads(two_pass(d.ClipHigher(), dirty, opts), dirty)
        assert torch.equal(loss, base[0]), value
        for x, y in zip(got, base[1], strict=True):
            assert torch.equal(x, y), value


@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_add_up(backend: str, keep: bool, mode: str) -> None:
    opts = {"mode": mode, "entropy_coef": 0.02, "backend": backend, "keep_logits": keep}
    parts = [slice(0, 1), slice(1, 3), slice(3, 4)]
    assert_micro_batches_add_up(d.GSPO(), problem(), opts, parts, f"{backend} {mode}")


@pytest.mark.parametrize("keep", KEEP)
def test_gradcheck_and_double_backward(keep: bool) -> None:
    p = problem(3, 4, 3, 7, seed=1)
    opts = {"temperature": 0.8, "entropy_coef": 0.1, "softcap": 2.0}
    if keep:  # a truncation keeps the logits (decided once: test_truncation_keeps_the_logits)
        opts["top_k"] = 5
    fn = two_pass(d.ClipHigher(), p, opts | {"backend": "two_pass", "keep_logits": keep})
    args = tuple(p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    assert torch.autograd.gradcheck(fn, args, fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, args, fast_mode=True)


def test_a_retained_graph_gives_the_same_gradients_twice(backend: str) -> None:
    """The kept logits hold ``G`` after a first backward: a second one forms them again."""
    p = problem(dtype=torch.float32)
    fn = two_pass(d.ClipHigher(), p, {"backend": backend, "keep_logits": True})
    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss = fn(*leaves)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(2 * loss, leaves)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(2 * a, b)


@pytest.mark.parametrize("keep", KEEP)
def test_fused_logprobs_entropy(backend: str, keep: bool) -> None:
    """Log-probs, entropies and their gradients (through both outputs) equal the chunked
    path's in float64, with a truncation, a cap and a temperature."""
    p = problem(3, 5, 4, 13, seed=6)
    h, w = p["hidden"].reshape(15, 4), p["weight"]
    tok = p["tokens"].reshape(15)
    opts = {"bias": p["bias"], "temperature": 0.7, "softcap": 3.0}
    if keep:
        opts["top_p"] = 0.8

    def run(**kw: Any) -> tuple[Tensor, ...]:
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = d.fused_logprobs_entropy(hh, ww, tok, **opts, **kw)
        (out.logp.sin().sum() + out.entropy.square().sum()).backward()
        assert hh.grad is not None and ww.grad is not None
        return out.logp.detach(), out.entropy.detach(), hh.grad, ww.grad

    got = run(backend=backend, keep_logits=keep)
    want = run(backend="chunked")
    for x, y in zip(got, want, strict=True):
        assert_within(x, y, 1e-12 * (y.abs() + y.abs().max()), f"{backend} keep={keep}")


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, as users get them
def test_options_refused_by_name() -> None:
    p = problem(dtype=torch.float32)
    args = (p["hidden"], p["weight"], p["tokens"], p["old"], p["adv"], p["mask"])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"backend": "chunked", "keep_logits": True}, "keep_logits"),
        ({"chunk_size": 4, "keep_logits": False}, "keep_logits"),
        ({"backend": "two_pass", "chunk_size": 4}, "chunk_size"),
        ({"keep_logits": 1}, "keep_logits"),
        ({"backend": "tiles"}, "backend"),
    ]
    for kw, name in cases:
        with pytest.raises(d.InputError, match=name):
            d.linear_policy_loss(*args, **kw)
    if not _interpreting():
        with pytest.raises(d.InputError, match="backend='triton' needs CUDA"):
            d.linear_policy_loss(*args, backend="triton")


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def test_auto_picks_by_device_and_options() -> None:
    """On CPU ``"auto"`` is the chunked path (bit for bit), and a two-pass one as soon as
    ``keep_logits`` is given."""
    p = problem(dtype=torch.float32)
    args = (p["hidden"], p["weight"], p["tokens"], p["old"], p["adv"], p["mask"])
    auto = d.linear_policy_loss(*args)
    assert torch.equal(auto, d.linear_policy_loss(*args, backend="chunked"))
    kept = d.linear_policy_loss(*args, keep_logits=True)
    assert torch.equal(kept, d.linear_policy_loss(*args, backend="two_pass", keep_logits=True))


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_truncation_keeps_the_logits() -> None:
    """With top_k/top_p/min_p the kept set is decided once: the logits are kept (None
    means True), and keep_logits=False is refused by name: forming them again in
    vocabulary slices may round a logit at the threshold to the other side."""
    p = problem(dtype=torch.float32)
    h = p["hidden"].reshape(-1, p["hidden"].shape[-1])
    tok = p["tokens"].reshape(-1)
    with pytest.raises(d.InputError, match="keep_logits=False with top_k"):
        d.fused_logprobs_entropy(
            h, p["weight"], tok, top_k=3, keep_logits=False, backend="two_pass"
        )
    spec = _two_pass.two_pass_spec(
        "two_pass", _two_pass.RowMath(), _two_pass.Truncation(top_k=3), None, h, 10**9
    )
    assert spec.keep


def test_keep_by_size() -> None:
    assert _two_pass.keep_by_size(None, 8192, 151936, torch.bfloat16)  # 2.3 GiB: kept
    assert not _two_pass.keep_by_size(None, 32768, 151936, torch.bfloat16)  # 9.3 GiB
    assert not _two_pass.keep_by_size(False, 1, 1, torch.float32)


# --------------------------------------------------------------------------- distillation


def _distill_problem(dtype: torch.dtype = F64) -> dict[str, Any]:
    from test_linear_distill import problem as distill_problem

    return distill_problem(8, dtype)


@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize(
    "opts",
    [
        {"kind": "jsd", "beta": 0.3, "temperature": 0.9, "softcap": 2.0},
        {"teacher_ids": True, "log_prob_min_clamp": -4.0},
        {"teacher_ids": True, "topk_tail": "bucket", "temperature": 0.8},
        {"kind": "reverse_kl", "topk": 3, "topk_support": "union", "topk_tail": "renormalize"},
    ],
)  # fmt: skip
def test_distill_gradcheck(keep: bool, opts: dict[str, Any]) -> None:
    """float64 gradcheck and double backward of ``linear_distill_loss(backend="two_pass")``."""
    p = _distill_problem()
    teacher = p["topk_logp"] if "teacher_ids" in opts else p["teacher"]
    kw = {k: v for k, v in opts.items() if k != "teacher_ids"}
    if "teacher_ids" in opts:
        kw["teacher_ids"] = p["ids"]

    def fn(h: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return d.linear_distill_loss(
            h, w, teacher, p["mask"], bias=b, backend="two_pass", keep_logits=keep, **kw
        )

    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, leaves, fast_mode=True)


@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("topk", [False, True, "bucket"])
def test_distill_masked_garbage_changes_nothing(keep: bool, topk: bool | str) -> None:
    from test_linear_distill import dirtied

    p = _distill_problem(torch.float32)
    opts: dict[str, Any] = {"teacher_ids": p["ids"]} if topk else {"kind": "jsd"}
    if isinstance(topk, str):
        opts["topk_tail"] = topk

    def run(q: dict[str, Any]) -> list[Tensor]:
        teacher = q["topk_logp"] if topk else q["teacher"]
        kw = dict(opts, teacher_ids=q["ids"]) if topk else opts
        leaves = [q[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        loss = d.linear_distill_loss(
            leaves[0], leaves[1], teacher, q["mask"], bias=leaves[2], is_weights=q["is_weights"],
            backend="two_pass", keep_logits=keep, **kw,
        )  # fmt: skip
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    for x, y in zip(run(dirtied(p, "topk_logp", "ids")), run(p), strict=True):
        assert torch.equal(x, y)


def test_distill_retained_graph_and_diagnostics() -> None:
    """A second backward gives the same bits (the kept logits formed again); the
    diagnostics equal the chunked path's."""
    p = _distill_problem(torch.float32)
    args = (p["topk_logp"], p["mask"])
    kw = {"teacher_ids": p["ids"], "topk_tail": "bucket", "backend": "two_pass"}
    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight")]
    loss, diag = d.linear_distill_loss_with_diagnostics(leaves[0], leaves[1], *args, keep_logits=True, **kw)  # fmt: skip
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(loss, leaves)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    kw["backend"] = "chunked"
    _, want = d.linear_distill_loss_with_diagnostics(p["hidden"], p["weight"], *args, **kw)
    for x, y in zip(diag, want, strict=True):
        assert x is not None and y is not None
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_distill_refuses_keep_logits_on_the_chunked_path() -> None:
    p = _distill_problem(torch.float32)
    with pytest.raises(d.InputError, match="keep_logits"):
        d.linear_distill_loss(
            p["hidden"], p["weight"], p["teacher"], p["mask"], backend="chunked", keep_logits=True
        )


DISTILL_KERNEL_CASES = [
    {"kind": "forward_kl", "temperature": 0.8},
    {"kind": "reverse_kl", "softcap": 2.0, "loss_clamp": 0.7},
    {"kind": "jsd", "beta": 0.3, "is_weights": True},
    {"teacher_ids": True, "topk_tail": "bucket", "kind": "jsd", "softcap": 2.0},
    {"topk": 3, "log_prob_min_clamp": -4.0},
]


@pytest.mark.triton
@pytest.mark.parametrize("keep", KEEP)
@pytest.mark.parametrize("opts", DISTILL_KERNEL_CASES, ids=lambda o: ",".join(o))
def test_distill_on_the_triton_rows(
    triton_interpreter: None, keep: bool, opts: dict[str, Any]
) -> None:
    """The distillation kernels (float64 under the interpreter) equal the ATen rows."""
    p = _distill_problem()
    o = dict(opts)
    teacher = p["teacher"]
    if o.pop("teacher_ids", None):
        teacher, o["teacher_ids"] = p["topk_logp"], p["ids"]
    if o.pop("is_weights", None):
        o["is_weights"] = p["is_weights"]

    def run(backend: str) -> list[Tensor]:
        leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        loss = d.linear_distill_loss(
            leaves[0], leaves[1], teacher, p["mask"], bias=leaves[2], backend=backend,
            keep_logits=keep, **o,
        )  # fmt: skip
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    for x, y in zip(run("triton"), run("two_pass"), strict=True):
        assert_within(x, y, 1e-12 * (y.abs() + y.abs().max()), f"{opts} keep={keep}")


def test_nothing_outlives_the_step() -> None:
    """After forward and backward, with the outputs dropped, no pass-1 state survives
    (both memory settings): an output held by the autograd context would close a cycle
    through the graph that Python's collector cannot see, leaking the kept logits (2.3
    GiB at the 7B scale) and, with a split vocabulary, the process group."""
    import gc

    from dapo_ops.logprobs._distill_two_pass import DistillPass1
    from dapo_ops.logprobs._two_pass import Pass1, TwoPassSpec

    for keep in (True, False):
        p = problem(dtype=torch.float32)
        grads(two_pass(d.ClipHigher(), p, {"backend": "two_pass", "keep_logits": keep}), p)
        h = p["hidden"].reshape(-1, p["hidden"].shape[-1]).requires_grad_(True)
        out = d.fused_logprobs_entropy(h, p["weight"], p["tokens"].reshape(-1), keep_logits=keep)
        out.logp.sum().backward()
        q = _distill_problem(torch.float32)
        w = q["weight"].clone().requires_grad_(True)
        loss = d.linear_distill_loss(q["hidden"], w, q["teacher"], q["mask"], keep_logits=keep)
        loss.backward()
        del out, loss
    gc.collect()
    kinds = (Pass1, DistillPass1, TwoPassSpec)
    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds)]
    assert not alive, alive
