"""Suite ``distill``: logit distillation from hidden states, fwd+bwd.

Two losses from ``hidden [batch, 1024, d]`` and ``W [vocab, d]``, with the gradients of
``hidden`` and ``W``: verl's forward KL over the teacher's top-64 log-probs
(``log_prob_min_clamp=-10``) and TRL GKD's generalised JSD (``beta=0.5``) against the
teacher's logits. ``naive``: ``h @ W.T``, ``log_softmax`` in float32 and the formula under
autograd; ``linear_distill_loss``: one chunked pass, the gradients formed in the forward.
Times in units of one forward ``h @ W.T``; extra peak memory (fresh process, live tensors)
as a multiple of the float32 logits.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

import dapo_ops as d
from benchmarks.harness import Case, Fn, Impl, Result, Suite, Target, for_device
from benchmarks.pending import pending
from benchmarks.suites._linear_gpu import GPU_REASON, no_triton
from benchmarks.suites.linear import CHUNK_ELEMENTS, UNIT
from benchmarks.targets import at_most, because, compare

NAIVE = "naive: h @ W.T, log_softmax, the formula"
LINEAR = "dapo_ops linear_distill_loss"
K = 64
SIZES = [(2048, 896, 32000)]
QUICK_SIZES = [(2048, 64, 32768)]  # 2 default chunks: the memory difference shows


def inputs(tokens: int, dim: int, vocab: int, topk: bool, device: str = "cpu") -> dict[str, Any]:
    """``[tokens / 1024, 1024]`` tokens, 10 % masked; the teacher: logits N(0, 2^2), or
    their top-64 log-probs and ids; on ``device``."""
    g = torch.Generator().manual_seed(tokens + dim + vocab)
    seq = min(tokens, 1024)
    shape = (tokens // seq, seq)
    out: dict[str, Any] = {
        "hidden": torch.empty(*shape, dim).normal_(generator=g),
        "weight": torch.empty(vocab, dim).normal_(0.0, 2.0 / dim**0.5, generator=g),
        "mask": torch.rand(shape, generator=g) > 0.1,
    }
    teacher = 2 * torch.randn(*shape, vocab, generator=g)
    if topk:
        out["logp"], out["ids"] = torch.log_softmax(teacher, -1).topk(K, dim=-1)
    else:
        out["teacher"] = teacher
    return {k: v.to(device) for k, v in out.items()}


def _naive(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
    s = torch.log_softmax((h @ w.T).float(), dim=-1)
    if "ids" in x:
        sk, tl = s.gather(-1, x["ids"]).clamp_min(-10.0), x["logp"].clamp_min(-10.0)
        per_token = (tl.exp() * (tl - sk)).sum(-1).clamp_min(0.0)
    else:
        t = torch.log_softmax(x["teacher"], -1)
        m = torch.logsumexp(torch.stack([s + torch.log(torch.tensor(0.5)), t + torch.log(torch.tensor(0.5))]), 0)  # fmt: skip
        per_token = 0.5 * F.kl_div(m, t, reduction="none", log_target=True).sum(-1)
        per_token = per_token + 0.5 * F.kl_div(m, s, reduction="none", log_target=True).sum(-1)
    return d.token_level_aggregate(per_token, x["mask"])


def _ours(**options: Any) -> Any:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        if "ids" in x:
            return d.linear_distill_loss(
                h,
                w,
                x["logp"],
                x["mask"],
                teacher_ids=x["ids"],
                log_prob_min_clamp=-10.0,
                **options,
            )
        return d.linear_distill_loss(h, w, x["teacher"], x["mask"], kind="jsd", beta=0.5, **options)

    return loss_of


def setting(keep: bool) -> str:
    return f"{LINEAR}, backend='triton', keep_logits={keep}"


def two_pass() -> bool:
    """Whether this dapo_ops's ``linear_distill_loss`` has the two-pass backends."""
    return "keep_logits" in inspect.signature(d.linear_distill_loss).parameters


def _step(loss_of: Any) -> Any:
    def build(x: dict[str, Any]) -> Fn:
        h, w = x["hidden"].detach().requires_grad_(True), x["weight"].detach().requires_grad_(True)

        def run() -> object:
            loss_of(h, w, x).backward()
            h.grad = w.grad = None
            return None

        return run

    return build


def budget(n: int, dim: int, v: int) -> int:
    """The memory target: the gradients (dW, dh) + four default chunks of float32
    ``[chunk, vocab]`` (the student's log-softmax, its probabilities, the teacher's
    log-softmax, the gradient)."""
    rows = min(n, max(1, CHUNK_ELEMENTS["cpu"] // v))
    return (v * dim + n * dim) * 4 + 4 * rows * v * 4


def make_cases(quick: bool, device: str) -> list[Case]:
    impls = [
        Impl(UNIT, "unit", lambda x: lambda: x["hidden"] @ x["weight"].T),
        Impl(NAIVE, "ref", _step(_naive)),
        Impl(LINEAR, "ours", _step(_ours())),
    ]
    if two_pass():  # on a GPU, the two memory settings of its default there
        impls += [
            Impl(
                setting(keep),
                "ours",
                _step(_ours(backend="triton", keep_logits=keep)),
                missing=no_triton(),
                devices=("cuda",),
            )
            for keep in (True, False)
        ]
    cases = []
    for n, dim, v in QUICK_SIZES if quick else SIZES:
        for topk, op in (
            (True, f"top-{K} forward KL (verl)"),
            (False, "JSD, teacher logits (TRL)"),
        ):
            cases.append(
                Case(
                    f"distill fwd+bwd, {op}",
                    f"{n}x{dim}x{v}",
                    lambda n=n, dim=dim, v=v, topk=topk: inputs(n, dim, v, topk, device),  # type: ignore[misc]
                    for_device(impls, device),
                    basis_bytes=n * v * 4,
                    basis_name="logits",
                    main_ref=NAIVE,
                    unit=UNIT,
                    memory="all",
                    memory_quick=True,
                    warm_inputs=lambda topk=topk: inputs(64, 32, 512, topk),  # type: ignore[misc]
                    repeats=None if quick else 3,
                    budget_gib=16.0,
                    limit_bytes=budget(n, dim, v),
                    elems=n,
                )
            )
    return cases


def targets(
    results: list[Result], cases: list[Case], bandwidth: float, device: str
) -> list[Target]:
    """Per case: ``linear_distill_loss`` (and on a GPU each two-pass setting) at most the
    naive path's time; on CPU the default's extra peak within :func:`budget`."""
    out = []
    for c in cases:
        rs = {r.impl: r for r in results if (r.op, r.size) == (c.op, c.size)}
        ours, where = rs.get(LINEAR), f"{c.op}, {c.size}"
        rows = [
            compare(
                f"linear_distill_loss, {where}: time / naive",
                ours,
                rs.get(NAIVE),
                1.0,
                faster=False,
            )
        ]
        if device == "cpu":
            mem = ours.mem / 2**20 if ours is not None and ours.mem is not None else None
            why = (ours.error if ours is not None else None) or ""
            rows.append(
                at_most(
                    f"linear_distill_loss, {where}: extra peak (live tensors)",
                    mem,
                    c.limit_bytes / 2**20,
                    " MiB",
                    why,
                )
            )
            out += [because(t, REASON) for t in rows]
            continue
        impls = [LINEAR] + [setting(k) for k in (True, False) if two_pass()]
        rows = [
            compare(
                f"{i.removeprefix('dapo_ops ')}, {where}: time / naive",
                rs.get(i),
                rs.get(NAIVE),
                1.0,
                faster=False,
            )
            for i in impls
        ]
        for t, impl in zip(rows, impls, strict=True):
            if t.met is None:
                t.reason = pending("cuda", impl, c.size) or t.reason
        out += [because(t, GPU_REASON) for t in rows]
    return out


#: Why a target would be missed (read off the code, not measured step by step): eagerly,
#: ``_distill_terms`` works in place through the student's and the teacher's chunk buffers
#: and two small scratch slices, so its extra memory is the gradients + two chunks (one
#: more than ``linear_policy_loss``, whose chunk size it shares); the time is one more
#: softmax pass per chunk (the teacher's).
REASON = (
    "each chunk holds the teacher's [chunk, vocab] buffer beside the student's (in place, "
    "with two small scratch slices): the gradients + two chunks, where linear_policy_loss "
    "holds one; and one more softmax pass per chunk"
)


SUITE = Suite(
    name="distill",
    title="Hidden states to a distillation loss (top-k forward KL, JSD)",
    make_cases=make_cases,
    targets=targets,
    notes=(
        "`x unit` = median / the median of one forward `h @ W.T`, same run.",
        "Memory target (`budget`): extra peak <= the gradients (dW, dh in float32) + four "
        "float32 `[chunk, vocab]` buffers of the default chunk (2^25 logits elements on CPU).",
        "The teacher's logits (JSD rows) are an input, not counted as extra memory.",
        "On a GPU (no memory target there) the default is the two-pass design where "
        "`linear_distill_loss` has it (`keep_logits`), with a row for each memory setting.",
    ),
    bandwidth=False,
)
