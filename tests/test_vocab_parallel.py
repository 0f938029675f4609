"""A vocabulary split across tensor-parallel ranks (``vocab_group=``), on CPU with gloo.

Each world (2 and 3 ranks, spawned by ``tests/_dist.py``) runs every case in one spawn:
rank ``r`` passes the same hidden states and per-token inputs and its contiguous slice of
the output layer (vocab 23 over 2 ranks: 12 + 11; over 3: 8 + 8 + 7, uneven). Against the
one-process call in float64, within ``F64_RTOL`` of each entry plus the largest: the
loss, the log-probs and entropies (equal on every rank), the hidden-state gradient after
summing the ranks' partial sums (Megatron's convention) and the weight and bias
gradients after concatenating the slices. Every objective, every aggregation mode, KL
and IS weights, the entropy bonus, temperature and cap, both memory settings;
``fused_logprobs_entropy`` through both outputs. Bad input gives the same ``InputError``
on every rank and leaves the group usable (a later call on it succeeds): no hang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _bounds import assert_within
from _dist import can_list_threads, run_world
from torch import Tensor

import dapo_ops as d
from dapo_ops import testing
from dapo_ops.objectives import OBJECTIVES

pytestmark = pytest.mark.distributed
F64, RTOL = torch.float64, testing.F64_RTOL
B, S, D, V = 3, 5, 4, 23
MODES = testing.MODES
SPLITS = {2: [12, 11], 3: [8, 8, 7]}


def problem(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[0] = True
    logp = -torch.rand(B, S, generator=g, dtype=F64) * 3 - 0.01
    return {
        "hidden": torch.randn(B, S, D, generator=g, dtype=F64),
        "weight": torch.randn(V, D, generator=g, dtype=F64) * 0.7,
        "bias": torch.randn(V, generator=g, dtype=F64) * 0.3,
        "tokens": torch.randint(0, V, (B, S), generator=g),
        "mask": mask,
        "old": logp + 0.2 * torch.randn(B, S, generator=g, dtype=F64).clamp(-1, 1),
        "adv": torch.randn(B, generator=g, dtype=F64),
        "ref": -(logp + 0.3 * torch.randn(B, S, generator=g, dtype=F64)).abs(),
        "rho": torch.rand(B, S, generator=g, dtype=F64) + 0.5,
    }


def cases() -> list[tuple[str, d.Objective, dict[str, Any]]]:
    """Every objective, the modes in rotation, the options in rotation."""
    extras: list[dict[str, Any]] = [
        {"entropy_coef": 0.03, "keep_logits": True},
        {"temperature": 0.7, "softcap": 3.0, "keep_logits": False},
        {"kl": d.KLPenalty(beta=0.1), "ref_logp": True, "is_weights": True},
    ]
    out = []
    for i, cls in enumerate(OBJECTIVES):
        mode = MODES[i % len(MODES)]
        opts = {"mode": mode, **extras[i % len(extras)]}
        if mode == "seq_mean_token_sum_norm":
            opts["max_len"] = S
        out.append((f"{cls.__name__}-{mode}", cls(), opts))
    return out


def call_policy(p: dict[str, Tensor], w: Tensor, b: Tensor, objective: d.Objective,
                opts: dict[str, Any], **extra: Any) -> tuple[Tensor, ...]:  # fmt: skip
    o = dict(opts)
    if o.pop("ref_logp", None):
        o["ref_logp"] = p["ref"]
    if o.pop("is_weights", None):
        o["is_weights"] = p["rho"]
    h = p["hidden"].clone().requires_grad_(True)
    loss, diag = d.linear_policy_loss_with_diagnostics(
        h, w, p["tokens"], p["old"], p["adv"], p["mask"], objective=objective, bias=b,
        backend="two_pass", **o, **extra,
    )  # fmt: skip
    gh, gw, gb = torch.autograd.grad(loss, [h, w, b])
    return loss.detach(), diag.logp, diag.entropy, gh, gw, gb


def call_fused(p: dict[str, Tensor], w: Tensor, b: Tensor, keep: bool, **extra: Any) -> tuple[Tensor, ...]:  # fmt: skip
    h = p["hidden"].clone().requires_grad_(True)
    out = d.fused_logprobs_entropy(
        h, w, p["tokens"], bias=b, temperature=0.9, keep_logits=keep, backend="two_pass", **extra
    )
    gh, gw, gb = torch.autograd.grad((out.logp.sin() + out.entropy.square()).sum(), [h, w, b])
    return out.logp.detach(), out.entropy.detach(), gh, gw, gb


#: Every distillation kind: the whole vocabulary (the teacher's logits split alike), the
#: top-k paths (global ids), tails and supports.
DISTILL = [
    {"kind": "forward_kl", "mode": "seq_mean_token_mean"},
    {"kind": "reverse_kl", "temperature": 0.8, "loss_clamp": 0.9},
    {"kind": "jsd", "beta": 0.3, "softcap": 3.0, "keep_logits": False},
    {"teacher_ids": True, "log_prob_min_clamp": -4.0},
    {"teacher_ids": True, "topk_tail": "bucket", "kind": "reverse_kl"},
    {"teacher_ids": True, "topk_tail": "renormalize", "kind": "jsd", "keep_logits": False},
    {"topk": 3, "topk_tail": "bucket"},
    {"topk": 4, "topk_support": "student", "topk_tail": "renormalize", "kind": "reverse_kl"},
    {"topk": 2, "topk_support": "union", "topk_tail": "bucket", "kind": "jsd"},
]


def teacher_of(p: dict[str, Tensor]) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(B, S, V, generator=g, dtype=F64)
    ids = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(B * S)]).view(B, S, 4)
    topk_logp = torch.log_softmax(logits, -1).gather(-1, ids)
    return {"logits": logits, "ids": ids, "topk_logp": topk_logp}


def call_distill(p: dict[str, Tensor], w: Tensor, b: Tensor, opts: dict[str, Any],
                 cols: slice, **extra: Any) -> tuple[Tensor, ...]:  # fmt: skip
    t = teacher_of(p)
    o = dict(opts)
    if o.pop("teacher_ids", None):
        teacher, o["teacher_ids"] = t["topk_logp"], t["ids"]
    else:
        teacher = t["logits"][..., cols]
    h = p["hidden"].clone().requires_grad_(True)
    loss, diag = d.linear_distill_loss_with_diagnostics(
        h, w, teacher, p["mask"], bias=b, backend="two_pass", **o, **extra
    )
    gh, gw, gb = torch.autograd.grad(loss, [h, w, b])
    return loss.detach(), diag.per_token, gh, gw, gb


def leaves(p: dict[str, Tensor], sl: slice) -> tuple[Tensor, Tensor]:
    return p["weight"][sl].clone().requires_grad_(True), p["bias"][sl].clone().requires_grad_(True)


def _errors(p: dict[str, Tensor], rank: int, sl: slice, group: Any) -> dict[str, str]:
    """The bad calls, each with the message this rank got (or "no error")."""
    w = leaves(p, sl)[0]
    bad_tokens = p["tokens"].clone()
    bad_tokens[0, 0] = V  # out of range on every rank (the global vocabulary is V)
    rows = B - (rank == 0)  # rank 0 passes one row fewer
    calls = {
        "ids out of range": lambda: d.linear_policy_loss(
            p["hidden"], w, bad_tokens, p["old"], p["adv"], p["mask"], vocab_group=group
        ),
        "ranks disagree on shapes": lambda: d.linear_policy_loss(
            p["hidden"][:rows],
            w,
            p["tokens"][:rows],
            p["old"][:rows],
            p["adv"][:rows],
            p["mask"][:rows],
            vocab_group=group,
        ),
        "an empty slice": lambda: d.fused_logprobs_entropy(
            p["hidden"], w[: 0 if rank == 1 else w.shape[0]], p["tokens"], vocab_group=group
        ),
        "one rank's weight of another width": lambda: d.fused_logprobs_entropy(
            p["hidden"], w[:, : D - (rank == 1)], p["tokens"], vocab_group=group
        ),
        "options differ": lambda: d.fused_logprobs_entropy(
            p["hidden"], w, p["tokens"], temperature=1.0 + rank, vocab_group=group
        ),
        "truncation": lambda: d.fused_logprobs_entropy(
            p["hidden"], w, p["tokens"], top_k=3, vocab_group=group
        ),
        "not a group": lambda: d.fused_logprobs_entropy(
            p["hidden"], w, p["tokens"], vocab_group="tp"
        ),
    }
    out = {}
    for name, fn in calls.items():
        try:
            fn()
            out[name] = "no error"
        except d.InputError as e:
            out[name] = str(e)
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    p = problem()
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    group = dist.group.WORLD
    out: dict[str, Any] = {"slice": (sl.start, sl.stop)}
    for name, objective, opts in cases():
        w, b = leaves(p, sl)
        out[name] = call_policy(p, w, b, objective, opts, vocab_group=group)
    for keep in (True, False):
        w, b = leaves(p, sl)
        out[f"fused-keep={keep}"] = call_fused(p, w, b, keep, vocab_group=group)
    for i, opts in enumerate(DISTILL):
        w, b = leaves(p, sl)
        out[f"distill-{i}"] = call_distill(p, w, b, opts, sl, vocab_group=group)
    out["errors"] = _errors(p, rank, sl, group)
    w, b = leaves(p, sl)
    out["after the errors"] = call_fused(p, w, b, True, vocab_group=group)
    return out


def _close(got: Tensor, want: Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert_within(got, want, RTOL * (want.abs() + want.abs().max()), what)


def _gathered(results: list[dict[str, Any]], key: str, n_shared: int) -> list[Tensor]:
    """A case's outputs over the ranks: the shared ones as rank 0 has them (after checking
    every rank has the same), the hidden gradient summed, the slices concatenated."""
    first = results[0][key]
    for r in results[1:]:
        for x, y in zip(r[key][:n_shared], first[:n_shared], strict=True):
            assert torch.equal(x, y), f"{key}: the ranks disagree"
    gh = sum(r[key][n_shared] for r in results)
    tails = [torch.cat([r[key][i] for r in results]) for i in range(n_shared + 1, len(first))]
    return [*first[:n_shared], gh, *tails]  # type: ignore[list-item]


@pytest.mark.parametrize("world", [2, 3])
def test_split_vocabulary_equals_one_process(world: int, tmp_path: Path) -> None:
    results = run_world(_worker, world, tmp_path)
    if can_list_threads():
        assert [r["leaked_threads"] for r in results] == [[]] * world
    p = problem()
    full_w, full_b = leaves(p, slice(None))
    for name, objective, opts in cases():
        want = call_policy(p, full_w, full_b, objective, opts)
        for i, (x, y) in enumerate(zip(_gathered(results, name, 3), want, strict=True)):
            _close(x, y, f"{name} output {i}")
    for keep in (True, False):
        want = call_fused(p, full_w, full_b, keep)
        got = _gathered(results, f"fused-keep={keep}", 2)
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            _close(x, y, f"fused keep={keep} output {i}")
    for i, opts in enumerate(DISTILL):
        want = call_distill(p, full_w, full_b, opts, slice(None))
        got = _gathered(results, f"distill-{i}", 2)
        for j, (x, y) in enumerate(zip(got, want, strict=True)):
            _close(x, y, f"distill {opts} output {j}")
    errors = [r["errors"] for r in results]
    for name in errors[0]:
        messages = [e[name] for e in errors]
        assert "no error" not in messages, (name, messages)
        if name != "not a group":  # refused before any exchange, by every rank alike
            assert len(set(messages)) == 1, (name, messages)
    assert "[0, 23)" in errors[0]["ids out of range"]
    assert "hidden" in errors[0]["ranks disagree on shapes"]
    assert "vocab_r >= 1" in errors[0]["an empty slice"]
    assert "rank 1" in errors[0]["one rank's weight of another width"]
    assert "temperature" in errors[0]["options differ"]
    assert "top_k" in errors[0]["truncation"]
    assert "ProcessGroup" in errors[0]["not a group"]
    _gathered(results, "after the errors", 2)
