"""Suite ``rows``: the two-pass path's row kernels alone, in bytes moved per second.

``dapo_ops.kernels.rows.stats`` (pass 1: per row the max, ``sum e^(x-m)``, ``sum
e^(x-m)(x-m)`` and the chosen logit; an online log-sum-exp) and ``grad_`` (pass 2: the
logits' gradient, written in the logits' dtype) on one ``[tokens, vocab]`` block of
bfloat16 logits (N(0, 2^2); no temperature, cap or truncation): the Triton kernels as
the two-pass path launches them (one launch per block), the ATen row functions as it
calls them (``impl="torch"``, pieces of ``TORCH_ROWS_ELEMENTS``), and those under
``torch.compile`` on the whole block (what inductor makes of the same formulas). Each
case's floor is the bytes the kernel must read and write (below); ``x floor`` = time /
(bytes / the copy bandwidth measured in the same run), so the bandwidth reached is the
copy bandwidth / ``x floor``.

- pass 1 reads the logits and the chosen ids and writes ``[4, tokens]`` float32:
  ``tokens * (vocab * 2 + 8 + 16)`` bytes;
- pass 2 reads the logits, the ids and ``lse``, ``H``, ``a`` (and ``b``: the entropy's
  gradient too) in float32 and writes the gradient: ``tokens * (vocab * 4 + 8 + 12)``
  (``+ 4`` with ``b``) bytes; it writes into a second buffer here (in the path it
  overwrites the logits: the same bytes).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness import Case, Fn, Impl, Result, Suite, Target, for_device
from benchmarks.pending import pending
from benchmarks.suites._linear_gpu import no_triton
from benchmarks.targets import at_least, because
from dapo_ops.kernels import rows as kernels
from dapo_ops.logprobs._two_pass import TORCH_ROWS_ELEMENTS

TRITON = "Triton kernel (impl='triton'), one launch"
ATEN = "ATen row functions (impl='torch'), as the two-pass path calls them"
COMPILED = "torch.compile of the ATen row functions, whole block"
STATS = "pass 1: rows.stats"
GRAD_A = "pass 2: rows.grad_, a only (a policy loss)"
GRAD_AB = "pass 2: rows.grad_, a and b (entropy's gradient too)"
#: Issue 37: the row kernels move bytes at this fraction of the copy bandwidth, or more.
SHARE = 0.70
MATH = kernels.RowMath()
#: Why a Triton row kernel misses its share: no GPU run has had them, nothing analysed.
MISS = "not analysed yet: Nsight Compute (`ncu --set full`) on one launch shows where it stalls"


@functools.cache
def block(tokens: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    """The inputs, made once for the suite's three cases (on the device: a GPU's block
    is 2.3 GiB); pass 2 writes into ``out``, nothing else is written."""
    g = torch.Generator(device).manual_seed(tokens + vocab)
    z = torch.empty(tokens, vocab, dtype=torch.bfloat16, device=device)
    for s in range(0, tokens, 1024):  # 1024 rows at a time: no float32 block
        e = min(s + 1024, tokens)
        z[s:e] = 2 * torch.randn(e - s, vocab, generator=g, device=device)
    tok = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    x = {"z": z, "out": torch.empty_like(z), "tok": tok}
    pieces = [kernels.stats(z[p], tok[p], None, MATH, "torch") for p in _pieces(x, "torch")]
    _, x["ent"], x["lse"] = kernels.finish(torch.cat(pieces, dim=1))
    x["a"], x["b"] = (torch.randn(tokens, generator=g, device=device) for _ in range(2))
    return x


def _pieces(x: dict[str, torch.Tensor], impl: str) -> list[slice]:
    n, v = x["z"].shape
    step = n if impl == "triton" else max(1, TORCH_ROWS_ELEMENTS // v)
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def _stats(impl: kernels.RowImpl) -> Callable[[dict[str, torch.Tensor]], Fn]:
    def build(x: dict[str, torch.Tensor]) -> Fn:
        parts = _pieces(x, impl)
        return lambda: [kernels.stats(x["z"][p], x["tok"][p], None, MATH, impl) for p in parts]

    return build


def _grad(impl: kernels.RowImpl, with_b: bool) -> Callable[[dict[str, torch.Tensor]], Fn]:
    def build(x: dict[str, torch.Tensor]) -> Fn:
        parts = _pieces(x, impl)

        def run() -> object:
            for p in parts:
                up = (x["lse"][p], x["ent"][p], x["a"][p], x["b"][p] if with_b else None)
                kernels.grad_(x["z"][p], x["out"][p], x["tok"][p], None, MATH, up, impl)
            return None

        return run

    return build


def _compiled(op: str) -> Callable[[dict[str, torch.Tensor]], Fn]:
    with_b = op == GRAD_AB

    def stats(z: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return kernels.stats(z, tok, None, MATH, "torch")

    def grad(x: dict[str, torch.Tensor]) -> torch.Tensor:
        up = (x["lse"], x["ent"], x["a"], x["b"] if with_b else None)
        return kernels.grad_(x["z"], x["out"], x["tok"], None, MATH, up, "torch")

    def build(x: dict[str, torch.Tensor]) -> Fn:
        if op == STATS:
            fn: Any = torch.compile(stats)
            return lambda: fn(x["z"], x["tok"])
        compiled: Any = torch.compile(grad)
        return lambda: compiled(x)

    return build


def _impls(op: str) -> list[Impl]:
    def kernel(impl: kernels.RowImpl) -> Callable[[dict[str, torch.Tensor]], Fn]:
        return _stats(impl) if op == STATS else _grad(impl, op == GRAD_AB)

    return [
        Impl(TRITON, "ours", kernel("triton"), missing=no_triton(), devices=("cuda",)),
        Impl(ATEN, "ours", kernel("torch")),
        Impl(COMPILED, "ref", _compiled(op), compiled=True),
    ]


def floor_bytes(op: str, tokens: int, vocab: int) -> int:
    per_row = (
        vocab * 2 + 8 + 16 if op == STATS else vocab * 4 + 8 + 12 + (4 if op == GRAD_AB else 0)
    )
    return tokens * per_row


def make_cases(quick: bool, device: str) -> list[Case]:
    """One block: ``[8192, 151936]`` on a GPU (the 7B-scale step's logits, 2.3 GiB),
    ``[2048, 32000]`` on CPU, ``[256, 8192]`` in quick runs."""
    n, v = (256, 8192) if quick else (8192, 151936) if device == "cuda" else (2048, 32000)
    return [
        Case(
            op,
            f"{n}x{v} bf16",
            lambda: block(n, v, device),
            for_device(_impls(op), device),
            floor_bytes=floor_bytes(op, n, v),
            basis_bytes=n * v * 2,
            basis_name="block",
            memory="none",
            elems=n,
        )
        for op in (STATS, GRAD_A, GRAD_AB)
    ]


def targets(
    results: list[Result], cases: list[Case], bandwidth: float, device: str = "cpu"
) -> list[Target]:
    """On a GPU, the Triton kernels' bytes / time at least 70 % of the copy bandwidth;
    every other row's share recorded."""
    out = []
    for c in cases:
        for impl in (TRITON, ATEN, COMPILED):
            r = next((r for r in results if (r.op, r.size, r.impl) == (c.op, c.size, impl)), None)
            if impl == TRITON and device != "cuda":
                continue
            share = None
            if r is not None and r.times and bandwidth > 0:
                share = c.floor_bytes / r.median / bandwidth
            name = f"{c.op}, {c.size}, {impl}: bytes / time over the copy bandwidth"
            if impl == TRITON:
                why = (r.error if r is not None else "") or pending(device, impl, c.size) or ""
                t = because(at_least(name, share, SHARE, "x", why), MISS)
            elif share is None:
                why = (r.error if r is not None else "") or "not in this run"
                t = Target(name, "n/a", "—", None, pending(device, impl, c.size) or why)
            else:
                t = Target(name, f"{share:.3g}x", "—", None, recorded=True)
            if share is not None:  # the rate itself beside the share
                rate = share * bandwidth / 1e9
                t.measured = (
                    f"{rate:.0f} GB/s, {t.measured}"
                    if rate >= 100
                    else f"{rate:.3g} GB/s, {t.measured}"
                )
            out.append(t)
    return out


SUITE = Suite(
    name="rows",
    title="The row kernels alone (bytes moved / time)",
    make_cases=make_cases,
    targets=targets,
    notes=(
        "`x floor` = time / (the bytes the kernel must read and write / the copy bandwidth "
        "of this run): 1.0 moves bytes at the copy bandwidth; issue 37 asks the Triton "
        f"kernels for at most {1 / SHARE:.3g}x ({SHARE:.0%} of it).",
        "One bfloat16 block of logits; pass 2 gets `lse` and `H` from pass 1 and random "
        "upstream gradients `a`, `b` per row. The ATen rows run in the pieces the two-pass "
        "path uses (`TORCH_ROWS_ELEMENTS` logits at a time); the compiled rows take the "
        "whole block in one call.",
    ),
)
