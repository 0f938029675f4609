"""Suite ``padding``: ``linear_policy_loss`` with and without ``skip_padding``, fwd+bwd.

Issue 39: at 50 % padding the call with ``skip_padding`` takes at most 0.55x the time of
the same call without it. One right-padded batch ``[batch, seq]`` per padding fraction
(0, 50 and 75 %: :func:`lengths`), the ``linear`` suite's inputs otherwise (DAPO's
Clip-Higher token-mean loss, the gradients of ``hidden`` and ``W``), the padding's ids
-100 (as TRL's and verl's batches hold them). Three rows per case, on the same inputs
and backend (``"two_pass"`` on CPU, ``"triton"`` on a GPU; ``keep_logits=None``, which
keeps the logits at these sizes): every position (``skip_padding=False``), the valid
rows counted by the call (``skip_padding=True``: one host sync) and the caller's count
(``skip_padding=n``, ``n`` counted when the inputs are built: no sync). Extra peak
memory in a fresh process (live tensors; CUDA: ``max_memory_allocated``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

import dapo_ops as d
from benchmarks.harness import Case, Fn, Impl, Result, Suite, Target, for_device
from benchmarks.pending import pending_suite
from benchmarks.suites._linear_gpu import no_triton
from benchmarks.suites.linear import linear_inputs
from benchmarks.targets import compare

EVERY = "every position (skip_padding=False)"
COUNTED = "skip_padding=True (counted by the call: one host sync)"
GIVEN = "skip_padding=n (the caller's count: no host sync)"
#: The issue's limit at 50 % padding: time with skip_padding / time without.
LIMIT = 0.55
FRACTIONS = (0.0, 0.5, 0.75)
#: (batch, seq, d, vocab, dtype) per device; quick runs: a small CPU shape
SHAPES: dict[str, tuple[int, int, int, int, torch.dtype]] = {
    "cpu": (8, 128, 896, 32000, torch.float32),
    "cuda": (8, 1024, 4096, 151936, torch.bfloat16),
    "quick": (4, 64, 128, 8192, torch.float32),
}


def lengths(batch: int, seq: int, padding: float) -> list[int]:
    """Response lengths with exactly ``round((1 - padding) * batch * seq)`` valid tokens:
    the longest fills the row (the batch is padded to it), the others share the rest."""
    total = round((1.0 - padding) * batch * seq)
    first = min(seq, total)
    rest, extra = divmod(total - first, batch - 1)
    return [first] + [rest + (i < extra) for i in range(batch - 1)]


def padded_inputs(
    batch: int, seq: int, dim: int, vocab: int, padding: float, dtype: torch.dtype, device: str
) -> dict[str, Any]:
    """The ``linear`` suite's inputs laid out as ``[batch, seq]``, right-padded."""
    x = linear_inputs(batch * seq, dim, vocab, dtype, device)
    for k in ("hidden", "tokens", "old"):
        x[k] = x[k].reshape(batch, seq, *x[k].shape[2:])
    g = torch.Generator().manual_seed(batch * seq + vocab)
    x["adv"] = torch.randn(batch, generator=g).to(device)
    mask = torch.arange(seq) < torch.tensor(lengths(batch, seq, padding))[:, None]
    x["mask"] = mask.to(device)
    x["tokens"] = torch.where(x["mask"], x["tokens"], -100)
    x["count"] = int(mask.sum())  # what the host knows (the rollout's lengths)
    return x


def _step(backend: Literal["two_pass", "triton"], skip: str) -> Callable[[dict[str, Any]], Fn]:
    def build(x: dict[str, Any]) -> Fn:
        h, w = x["hidden"].detach().requires_grad_(True), x["weight"].detach().requires_grad_(True)
        option: bool | int = {"every": False, "counted": True, "given": x["count"]}[skip]

        def run() -> object:
            loss = d.linear_policy_loss(
                h,
                w,
                x["tokens"],
                x["old"],
                x["adv"],
                x["mask"],
                backend=backend,
                skip_padding=option,
            )
            loss.backward()  # type: ignore[no-untyped-call]
            h.grad = w.grad = None
            return None

        return run

    return build


def impls() -> list[Impl]:
    out = []
    pairs: tuple[tuple[Literal["two_pass", "triton"], str], ...] = (
        ("two_pass", "cpu"),
        ("triton", "cuda"),
    )
    for backend, device in pairs:
        missing = no_triton() if backend == "triton" else None
        out += [
            Impl(name, "ours", _step(backend, skip), missing=missing, devices=(device,))
            for name, skip in ((EVERY, "every"), (COUNTED, "counted"), (GIVEN, "given"))
        ]
    return out


def make_cases(quick: bool, device: str) -> list[Case]:
    batch, seq, dim, vocab, dtype = SHAPES["quick" if quick else device]
    backend = "triton" if device == "cuda" else "two_pass"
    bf16 = " bf16" if dtype == torch.bfloat16 else ""
    return [
        Case(
            f"linear_policy_loss fwd+bwd, backend {backend}, {p:.0%} padding",
            f"{batch}x{seq}x{dim}x{vocab}{bf16}",
            lambda p=p: padded_inputs(batch, seq, dim, vocab, p, dtype, device),  # type: ignore[misc]
            for_device(impls(), device),
            basis_bytes=batch * seq * vocab * 4,
            basis_name="logits",
            main_ref=EVERY,
            memory="all",
            memory_quick=True,
            warm_inputs=lambda p=p: padded_inputs(2, 32, 32, 512, p, dtype, "cpu"),  # type: ignore[misc]
            repeats=None if quick or device != "cpu" else 11,
            budget_gib=16.0,
            elems=batch * seq,
        )
        for p in FRACTIONS
    ]


def targets(
    results: list[Result], cases: list[Case], bandwidth: float, device: str = "cpu"
) -> list[Target]:
    """At 50 % padding, each ``skip_padding`` row's time / the every-position row's at
    most :data:`LIMIT`; at the other fractions recorded, and every extra peak ratio."""
    out = []
    for c in cases:
        rs = {r.impl: r for r in results if (r.op, r.size) == (c.op, c.size)}
        every = rs.get(EVERY)
        for impl in (COUNTED, GIVEN):
            where = f"{c.op}, {c.size}, {impl.split(' (')[0]}"
            t = compare(f"{where}: time / every position", rs.get(impl), every, LIMIT, faster=False)
            if "50% padding" not in c.op:
                t = Target(t.name, t.measured, "—", None, t.reason, recorded=t.met is not None)
            out.append(t)
            ours = rs.get(impl)
            ratio = None
            if ours is not None and ours.mem is not None and every is not None and every.mem:
                ratio = ours.mem / every.mem
            measured = "n/a" if ratio is None else f"{ratio:.3g}x"
            mem = Target(f"{where}: extra peak / every position's", measured, "—", None)
            mem.recorded = ratio is not None
            out.append(mem)
    for t in out:
        if t.met is None and not t.recorded:
            t.reason = pending_suite(device, "padding") or t.reason or "not in this run"
    return out


SUITE = Suite(
    name="padding",
    title="Padding: linear_policy_loss with and without skip_padding",
    make_cases=make_cases,
    targets=targets,
    notes=(
        "`x ref` = the every-position row's time / this row's, same case, same run (above "
        "1: faster). Batches right-padded to the longest response (`lengths`: the first "
        "row full, the others sharing the rest of the valid tokens), padding ids -100.",
        "`skip_padding=n`: the count passed as an int, counted once when the inputs are "
        "built (as a trainer knows it from the rollout's lengths).",
    ),
    bandwidth=False,
)
