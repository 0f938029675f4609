"""Suite ``logprobs``: per-token log-probs and entropy, from logits and from hidden states.

From logits ``[tokens, vocab]`` (float32; extra peak as a multiple of the logits' size):
``naive`` (``log_softmax``, ``gather``, entropy ``-(p log p).sum(-1)``); ``trl_rows`` (our
re-implementation of the float32 branch of TRL's ``selective_log_softmax``: ``gather`` and
a per-sequence ``logsumexp`` loop, entropy as TRL's ``entropy_from_logits`` under
``no_grad``, so its backward does less work); ours, ``token_logprobs_and_entropy``, and
with ``inplace_backward=True`` (its backward overwrites the shared logits with the
gradient: finite values, the same work for every later call). From hidden states ``[tokens, d]`` and ``W [vocab, d]``: ``h @ W.T`` then
naive, against ``fused_logprobs_entropy`` (on a GPU also its recomputing setting,
``keep_logits=False``). ``fwd`` runs under ``no_grad``; ``fwd+bwd``
differentiates ``sum(a * logp) + sum(b * entropy)`` (random ``a``, ``b``) w.r.t. the logits
(``autograd.grad``), or into ``h`` and ``W`` (``backward``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import dapo_ops as d
from benchmarks.harness import Case, Fn, Impl, Result, Suite, Target, for_device
from benchmarks.pending import pending
from benchmarks.suites._linear_gpu import GPU_REASON, no_triton
from benchmarks.targets import because, compare

Pair = tuple[torch.Tensor, torch.Tensor]
NAIVE, NAIVE_HIDDEN, FUSED = "naive", "naive_hidden: h @ W.T, then naive", "fused_logprobs_entropy"
#: On a GPU, the two-pass design's recomputing setting beside the default (which keeps
#: the logits at every size of the suite)
RECOMPUTE = f"{FUSED}, backend='triton', keep_logits=False"


def naive(logits: torch.Tensor, tokens: torch.Tensor) -> Pair:
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def trl_rows(logits: torch.Tensor, tokens: torch.Tensor) -> Pair:
    selected = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    logp = selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        parts = []
        for chunk in flat.split(128, dim=0):  # type: ignore[no-untyped-call]
            lp = torch.log_softmax(chunk, dim=-1)
            parts.append(-(torch.exp(lp) * lp).sum(-1))
        entropy = torch.cat(parts).view(logits.shape[:-1])
    return logp, entropy


def lp_inputs(
    tokens: int, vocab: int, dim: int, seq: int, device: str = "cpu", bf16: bool = False
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens + vocab + dim)
    shape = (tokens // seq, seq)
    out = {"tokens": torch.randint(0, vocab, shape, generator=g)}
    if dim:
        out["hidden"] = torch.empty(*shape, dim).normal_(generator=g)
        out["weight"] = torch.empty(vocab, dim).normal_(0.0, 2.0 / dim**0.5, generator=g)
        if bf16:
            out["hidden"], out["weight"] = (out[k].bfloat16() for k in ("hidden", "weight"))
    else:
        out["logits"] = torch.empty(*shape, vocab).uniform_(-6.0, 6.0, generator=g)
    out["a"], out["b"] = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return {k: v.to(device) for k, v in out.items()}


def _from_logits(
    method: Callable[..., Pair], backward: bool
) -> Callable[[dict[str, torch.Tensor]], Fn]:
    def build(x: dict[str, torch.Tensor]) -> Fn:
        logits = x["logits"]

        def run() -> object:
            if not backward:
                with torch.no_grad():
                    return method(logits, x["tokens"])
            logits.requires_grad_(True)
            logp, ent = method(logits, x["tokens"])
            out = torch.autograd.grad((logp * x["a"]).sum() + (ent * x["b"]).sum(), logits)
            logits.requires_grad_(False)
            return out

        return run

    return build


def _from_hidden(
    method: Callable[..., Pair], backward: bool
) -> Callable[[dict[str, torch.Tensor]], Fn]:
    def build(x: dict[str, torch.Tensor]) -> Fn:
        h, w = x["hidden"], x["weight"]

        def run() -> object:
            if not backward:
                with torch.no_grad():
                    return method(h, w, x["tokens"])
            h.requires_grad_(True)
            w.requires_grad_(True)
            logp, ent = method(h, w, x["tokens"])
            loss = (logp * x["a"]).sum() + (ent * x["b"]).sum()
            loss.backward()  # type: ignore[no-untyped-call]
            h.grad = w.grad = None
            h.requires_grad_(False)
            w.requires_grad_(False)
            return None

        return run

    return build


def _pair(out: tuple[torch.Tensor, ...]) -> Pair:
    return out[0], out[1]


def _ours(inplace: bool = False) -> Callable[..., Pair]:
    return lambda z, t: tuple(d.token_logprobs_and_entropy(z, t, inplace_backward=inplace))  # type: ignore[return-value]


def _impls(hidden: bool, backward: bool) -> list[Impl]:
    if hidden:
        return [
            Impl(NAIVE_HIDDEN, "ref", _from_hidden(lambda h, w, t: naive(h @ w.T, t), backward)),
            Impl(
                FUSED,
                "ours",
                _from_hidden(lambda h, w, t: _pair(d.fused_logprobs_entropy(h, w, t)), backward),
            ),
            Impl(
                RECOMPUTE,
                "ours",
                _from_hidden(
                    lambda h, w, t: _pair(
                        d.fused_logprobs_entropy(h, w, t, backend="triton", keep_logits=False)
                    ),
                    backward,
                ),
                missing=no_triton(),
                devices=("cuda",),
            ),
        ]
    impls = [
        Impl(NAIVE, "ref", _from_logits(naive, backward)),
        Impl("trl_rows (TRL-style selective_log_softmax)", "ref", _from_logits(trl_rows, backward)),
        Impl("token_logprobs_and_entropy", "ours", _from_logits(_ours(), backward)),
    ]
    if backward:
        impls.append(
            Impl(
                "token_logprobs_and_entropy(inplace_backward=True)",
                "ours",
                _from_logits(_ours(True), backward),
            )
        )
    return impls


#: On a GPU also the 7B-scale step in bfloat16 (fwd+bwd only).
GPU_BF16 = (8192, 151936, 4096)


def make_cases(quick: bool, device: str) -> list[Case]:
    """(tokens, vocab, hidden size; 0: from logits), the issue's shapes for the hidden ones."""
    sizes = (
        [(1024, 8192, 0), (512, 8192, 128)]
        if quick
        else [
            (4096, 32000, 0),
            (4096, 152064, 0),
            (16384, 32000, 0),
            (2048, 32000, 896),
            (1024, 151936, 896),
        ]
    )
    cases = []
    for n, v, dim in sizes:
        seq = min(n, 256 if quick else 1024)
        for backward in (False, True):
            size = f"{n}x{v}" + (f", d={dim}" if dim else "")
            cases.append(_case(n, v, dim, seq, backward, size, quick, device))
    if device == "cuda" and not quick:
        n, v, dim = GPU_BF16
        cases.append(_case(n, v, dim, 1024, True, f"{n}x{v}, d={dim}, bf16", quick, device))
    return cases


def _case(
    n: int, v: int, dim: int, seq: int, backward: bool, size: str, quick: bool, device: str
) -> Case:
    bf16 = size.endswith("bf16")
    return Case(
        f"{'from hidden' if dim else 'from logits'} {'fwd+bwd' if backward else 'fwd'}",
        size,
        lambda: lp_inputs(n, v, dim, seq, device, bf16),
        for_device(_impls(bool(dim), backward), device),
        basis_bytes=n * v * 4,
        basis_name="logits",
        main_ref=NAIVE_HIDDEN if dim else NAIVE,
        memory="all",
        memory_quick=True,
        warm_inputs=lambda: lp_inputs(64, 512, min(dim, 32), 16, bf16=bf16),
        repeats=None if quick else 3,
        budget_gib=16.0,
        elems=n,
    )


def targets(
    results: list[Result], cases: list[Case], bandwidth: float, device: str = "cpu"
) -> list[Target]:
    out = []
    for c in (c for c in cases if c.op == "from hidden fwd+bwd"):
        rs = {r.impl: r for r in results if (r.op, r.size) == (c.op, c.size)}
        name = f"fused_logprobs_entropy fwd+bwd, {c.size}: time / naive"
        t = compare(name, rs.get(FUSED), rs.get(NAIVE_HIDDEN), 1.0, faster=False)
        out.append(because(t, GPU_REASON if device != "cpu" else CPU_REASON))
        if device == "cuda":  # issue 37: the two-pass design, pending until measured
            if t.met is None:
                t.reason = pending("cuda", FUSED, c.size) or t.reason
            out.append(_recorded(rs, c.size))
    return out


def _recorded(rs: dict[str, Result], size: str) -> Target:
    """The recomputing setting's time over the naive path's: a figure (the issue's
    target is the default's), or why it is missing."""
    ours, naive = rs.get(RECOMPUTE), rs.get(NAIVE_HIDDEN)
    name = f"{RECOMPUTE} fwd+bwd, {size}: time / naive"
    if ours is None or naive is None or not ours.times or not naive.times:
        why = (ours.error if ours is not None else "") or pending("cuda", RECOMPUTE, size)
        return Target(name, "n/a", "—", None, why or "not in this run")
    return Target(name, f"{ours.median / naive.median:.3g}x", "—", None, recorded=True)


#: Why the fused path can be slower than the naive one on CPU: where the vocabulary is
#: large the matmuls dominate there too.
CPU_REASON = (
    "the fused backward forms each chunk's logits again: 4 matmuls where the naive path "
    "does 3, which at vocab 152k is more than its fewer passes over memory save; its "
    "point is memory. For a loss, linear_policy_loss forms the gradient in the forward "
    "(3 matmuls)"
)


SUITE = Suite(
    name="logprobs",
    title="Log-probs and entropy",
    make_cases=make_cases,
    targets=targets,
    notes=(
        "float32 throughout (on a GPU also the 7B-scale step from hidden states in "
        "bfloat16); `extra peak` = peak bytes of live tensors above the inputs "
        "(fresh process, profiler allocator events), as a multiple of the float32 logits "
        "(tokens x vocab x 4 bytes); gradients count towards it.",
        "Large cases run 3 interleaved repeats under a 16 GiB address-space cap (a method "
        "that does not fit reports the allocation error); `[batch, 1024]` token layout.",
        "inplace_backward=True overwrites the logits every method of the case shares with "
        "its gradient (a second logits-sized copy would not fit the largest cases): later "
        "calls read those finite values instead, the same work.",
        "On a GPU `fused_logprobs_entropy` by default is the two-pass design "
        "(`backend='triton'`), which keeps the logits at every size here; the row with "
        "`keep_logits=False` times the recomputing setting.",
    ),
    bandwidth=False,
)
