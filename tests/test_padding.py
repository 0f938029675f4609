"""Padding that costs nothing: ``skip_padding`` and ``cu_seqlens`` (the two-pass design).

``skip_padding`` runs the products and row kernels on the valid rows only: at every
padding fraction (none, half, all but one token, all-padding rows, an all-padding
batch) the loss, the log-probs and entropies at valid positions and every gradient equal
the call without it (float64, within ``F64_RTOL`` of each entry plus the largest: the
products sum other rows, so the bits may differ); the count measured (``True``) or given.
A count below the valid tokens gives a NaN loss (checked mode: ``InputError``); one above
costs work only. ``cu_seqlens``: a padded batch packed as verl's remove-padding forward
packs it (``[1, total]``, boundaries ``[seqs + 1]``) gives the padded call's loss and
gradients, for sequence-level objectives and the seq-mean modes too.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _bounds import assert_within
from torch import Tensor

import dapo_ops as d
from dapo_ops import testing
from dapo_ops.logprobs import _two_pass

F64, RTOL = torch.float64, testing.F64_RTOL
B, S, D, V = 4, 7, 5, 29


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_two_pass.BUDGET_ELEMENTS, "cpu", 120)


def problem(lengths: list[int], seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(S) < torch.tensor(lengths)[:, None]
    logp = -torch.rand(B, S, generator=g, dtype=F64) * 3 - 0.01
    return {
        "hidden": torch.randn(B, S, D, generator=g, dtype=F64),
        "weight": torch.randn(V, D, generator=g, dtype=F64) * 0.7,
        "bias": torch.randn(V, generator=g, dtype=F64) * 0.3,
        "tokens": torch.randint(0, V, (B, S), generator=g),
        "mask": mask,
        "old": logp,
        "adv": torch.randn(B, generator=g, dtype=F64),
    }


def run(p: dict[str, Tensor], **opts: Any) -> list[Tensor]:
    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss, diag = d.linear_policy_loss_with_diagnostics(
        leaves[0], leaves[1], p["tokens"], p["old"], p["adv"], p["mask"], bias=leaves[2],
        backend="two_pass", entropy_coef=0.02, **opts,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    m = p["mask"]
    logp, ent = torch.where(m, diag.logp, 0.0), torch.where(m, diag.entropy, 0.0)
    return [loss.detach(), logp, ent, *(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True))]  # fmt: skip


def assert_same(got: list[Tensor], want: list[Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert_within(x, y, RTOL * (y.abs() + y.abs().max()), f"{what}: output {i}")


FRACTIONS = {
    "no padding": [S] * B,
    "half": [S, 4, 2, 1],
    "all-padding rows": [S, 0, 3, 0],
    "one token": [1, 0, 0, 0],
    "all padding": [0, 0, 0, 0],
}


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recompute"])
@pytest.mark.parametrize("lengths", FRACTIONS.values(), ids=FRACTIONS.keys())
@pytest.mark.parametrize("objective", [d.ClipHigher(), d.GSPO()], ids=["clip-higher", "gspo"])
def test_skip_padding_changes_nothing(
    objective: d.Objective, lengths: list[int], keep: bool
) -> None:
    p = problem(lengths)
    n = int(p["mask"].sum())
    mode = "seq_mean_token_mean" if isinstance(objective, d.GSPO) else "token_mean"
    opts = {"objective": objective, "keep_logits": keep, "mode": mode}
    want = run(p, **opts)
    for skip in (True, n, n + 3 if n + 3 <= B * S else n):
        assert_same(run(p, skip_padding=skip, **opts), want, f"skip_padding={skip}")


@pytest.mark.triton
def test_skip_padding_on_the_triton_rows(triton_interpreter: None) -> None:
    p = problem(FRACTIONS["half"])
    want = run(p)
    assert_same(_triton(p), want, "triton")


def _triton(p: dict[str, Tensor]) -> list[Tensor]:
    leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss, diag = d.linear_policy_loss_with_diagnostics(
        leaves[0], leaves[1], p["tokens"], p["old"], p["adv"], p["mask"], bias=leaves[2],
        backend="triton", entropy_coef=0.02, skip_padding=True,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, leaves)
    m = p["mask"]
    return [loss.detach(), torch.where(m, diag.logp, 0.0), torch.where(m, diag.entropy, 0.0), *grads]  # fmt: skip


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, as users get them
def test_a_count_below_the_valid_tokens_is_loud() -> None:
    p = problem(FRACTIONS["half"])
    n = int(p["mask"].sum())
    args = (p["hidden"], p["weight"], p["tokens"], p["old"], p["adv"], p["mask"])
    with d.checked(False):  # no host sync to raise: the loss is NaN
        assert math.isnan(float(d.linear_policy_loss(*args, skip_padding=n - 1)))
    with d.checked(), pytest.raises(d.InputError, match="below the batch's valid tokens"):
        d.linear_policy_loss(*args, skip_padding=n - 1)
    for bad in (-1, B * S + 1, 2.0, "yes"):
        with pytest.raises(d.InputError, match="skip_padding"):
            d.linear_policy_loss(*args, skip_padding=bad)  # type: ignore[arg-type]
    with pytest.raises(d.InputError, match="skip_padding"):
        d.linear_policy_loss(*args, skip_padding=True, backend="chunked")


def pack(
    p: dict[str, Tensor], lengths: list[int], more: tuple[str, ...] = ()
) -> tuple[dict[str, Tensor], Tensor]:
    """The padded batch packed as verl's remove-padding forward packs it: each row's
    first ``lengths[i]`` tokens (its attention mask; the loss mask travels along, so a
    prompt token inside a sequence stays masked), rows of no token dropped; and
    ``cu_seqlens``."""
    rows = [i for i in range(B) if lengths[i]]
    keys = ("hidden", "tokens", "old", "mask", *more)
    flat = {k: torch.cat([p[k][i, : lengths[i]] for i in rows]).unsqueeze(0) for k in keys}
    cu = torch.tensor([0, *torch.tensor([lengths[i] for i in rows]).cumsum(0).tolist()])
    return flat | {"adv": p["adv"][rows], "weight": p["weight"], "bias": p["bias"]}, cu


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(
    ("objective", "mode"),
    [(d.ClipHigher(), "token_mean"), (d.GSPO(), "seq_mean_token_mean"), (d.GMPO(), "seq_mean_token_sum")],
    ids=["clip-higher", "gspo", "gmpo"],
)  # fmt: skip
def test_cu_seqlens_equals_the_padded_call(objective: d.Objective, mode: str, skip: bool) -> None:
    """Three sequences of 7, 4 and 2 tokens (the third row empty), the first starting
    with a masked prompt token; with ``skip_padding`` that row does not even run."""
    lengths = [S, 4, 0, 2]
    p = problem(lengths)
    p["mask"][0, 0] = False
    q, cu = pack(p, lengths)
    want = run(p, objective=objective, mode=mode)
    got = run(q, objective=objective, mode=mode, cu_seqlens=cu, skip_padding=skip)
    assert_same(got[:1], want[:1], "loss")
    inside = torch.arange(S) < torch.tensor(lengths)[:, None]  # the packed positions
    for i in (1, 2):  # logp, entropy: back in the packed [1, total] layout
        assert_same([got[i][0]], [want[i][inside]], f"output {i}")
    assert_same([got[3][0]], [want[3][inside]], "hidden gradient")
    assert_same(got[4:], want[4:], "weight and bias gradients")


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_bad_cu_seqlens_name_the_argument() -> None:
    p = problem([S, 4, 0, 2])
    q, cu = pack(p, [S, 4, 0, 2])
    args = (q["hidden"], q["weight"], q["tokens"], q["old"], q["adv"], q["mask"])
    for bad, match in (
        (cu[1:], "start at 0"),
        (cu.flip(0), "start at 0"),
        (cu.float(), "integer"),
        (torch.tensor([0, 5, 3, int(cu[-1])]), "never decrease"),
    ):
        with pytest.raises(d.InputError, match=match):
            d.linear_policy_loss(*args, cu_seqlens=bad)
    with pytest.raises(d.InputError, match=r"hidden must have shape \[1, total, d\]"):
        d.linear_policy_loss(p["hidden"], *args[1:], cu_seqlens=cu)
    with pytest.raises(d.InputError, match=r"old_logp must have shape \[1, total\]"):
        d.linear_policy_loss(args[0], args[1], args[2], p["old"], *args[4:], cu_seqlens=cu)


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "recompute"])
@pytest.mark.parametrize(
    "opts",
    [{"kind": "jsd", "mode": "seq_mean_token_mean"}, {"topk": 3, "topk_tail": "bucket"},
     {"kind": "reverse_kl", "topk": 2, "topk_support": "union", "topk_tail": "bucket", "loss_clamp": 0.5}],
    ids=["jsd", "topk-bucket", "union"],
)  # fmt: skip
@pytest.mark.parametrize(
    "lengths", [FRACTIONS["half"], FRACTIONS["all padding"]], ids=["half", "all"]
)
def test_skip_padding_in_distillation(lengths: list[int], opts: dict[str, Any], keep: bool) -> None:
    p = problem(lengths)
    teacher = 2 * torch.randn(B, S, V, generator=torch.Generator().manual_seed(3), dtype=F64)

    def call(**extra: Any) -> list[Tensor]:
        leaves = [p[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        loss, diag = d.linear_distill_loss_with_diagnostics(
            leaves[0], leaves[1], teacher, p["mask"], bias=leaves[2], backend="two_pass",
            keep_logits=keep, **opts, **extra,
        )  # fmt: skip
        return [loss.detach(), diag.per_token, *torch.autograd.grad(loss, leaves)]

    want = call()
    n = int(p["mask"].sum())
    for skip in (True, n):
        assert_same(call(skip_padding=skip), want, f"skip_padding={skip}")


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(
    "opts",
    [{"kind": "jsd", "mode": "seq_mean_token_mean"}, {"topk": 3, "topk_tail": "bucket", "mode": "seq_mean_token_sum"}],
    ids=["jsd", "topk-bucket"],
)  # fmt: skip
def test_cu_seqlens_in_distillation(opts: dict[str, Any], skip: bool) -> None:
    """Packed distillation inputs (the teacher's logits packed alike) give the padded
    call's loss, per-token losses and gradients, each sequence weighed as one."""
    lengths = [S, 4, 0, 2]
    p = problem(lengths)
    p["mask"][0, 0] = False  # a prompt token inside the first sequence
    teacher = 2 * torch.randn(B, S, V, generator=torch.Generator().manual_seed(3), dtype=F64)
    q, cu = pack({**p, "teacher": teacher}, lengths, ("teacher",))

    def call(r: dict[str, Tensor], t: Tensor, **extra: Any) -> list[Tensor]:
        leaves = [r[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        loss, diag = d.linear_distill_loss_with_diagnostics(
            leaves[0], leaves[1], t, r["mask"], bias=leaves[2], backend="two_pass", **opts, **extra
        )
        return [loss.detach(), diag.per_token, *torch.autograd.grad(loss, leaves)]

    want = call(p, teacher)
    got = call(q, q["teacher"], cu_seqlens=cu, skip_padding=skip)
    inside = torch.arange(S) < torch.tensor(lengths)[:, None]
    assert_same(got[:1], want[:1], "loss")
    assert_same([got[1][0]], [want[1][inside]], "per-token losses")
    assert_same([got[2][0]], [want[2][inside]], "hidden gradient")
    assert_same(got[3:], want[3:], "weight and bias gradients")
