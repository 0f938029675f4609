"""Suite ``linear``: the whole step from hidden states to the policy loss, fwd+bwd.

Every row computes DAPO's token-mean Clip-Higher loss (0.2 / 0.28, no KL) from
``hidden [batch, 1024, d]``, ``W [vocab, d]`` and the sampled tokens, and the gradients of
``hidden`` and ``W``: ``naive`` (``h @ W.T``, ``log_softmax`` in float32, ``gather``, then
``policy_loss``), ``composed`` (``fused_logprobs_entropy`` + ``policy_loss``),
``linear_policy_loss`` by default (CPU: the chunked path) and with each memory setting of
the two-pass design (``keep_logits=True``: 3 products; ``False``: 4; ``backend="triton"``
on a GPU, ``"two_pass"``, the same design with ATen row functions, on CPU), and the
peers' own lm heads followed by the same ``policy_loss`` (``_linear_peers.py``: Liger,
cut-cross-entropy, TRL's and verl's fused heads). Times are in units of one forward
``h @ W.T`` measured in the same run; extra peak memory (fresh process, live tensors; CUDA:
``max_memory_allocated``) as a multiple of the float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import dapo_ops as d
from benchmarks.harness import Case, Fn, Impl, Result, Suite, Target, for_device
from benchmarks.suites import _linear_gpu as gpu
from benchmarks.suites import _linear_peers as peers
from benchmarks.suites._linear_peers import LIGER
from benchmarks.targets import at_most, because, compare

UNIT = "one h @ W.T (forward matmul; the time unit)"
NAIVE = "naive: h @ W.T, log_softmax, gather, policy_loss"
COMPOSED = "composed: fused_logprobs_entropy + policy_loss"
LINEAR = "dapo_ops linear_policy_loss"
#: logits elements per chunk of linear_policy_loss's default (chunk_size=None), if the
#: library's own figure (dapo_ops.logprobs._fused_linear) cannot be read
CHUNK_ELEMENTS = {"cpu": 2**25, "other": 2**27}
SCRATCH = 8 * 2**20  # the entropies' scratch buffer (docs/linear_loss.md)


def setting(backend: str, keep: bool) -> str:
    """The row of ``linear_policy_loss(..., backend=backend, keep_logits=keep)``."""
    return f"{LINEAR}, backend='{backend}', keep_logits={keep}"


def linear_inputs(
    tokens: int, dim: int, vocab: int, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, Any]:
    """Tokens as ``[tokens / 1024, 1024]``; old log-probs = current + N(0, 0.3^2) (some ratios
    clip, most do not); advantages N(0, 1) per sequence; 10 % of positions masked."""
    g = torch.Generator().manual_seed(tokens + dim + vocab)
    seq = min(tokens, 1024)
    shape = (tokens // seq, seq)
    h = torch.empty(*shape, dim).normal_(generator=g)
    w = torch.empty(vocab, dim).normal_(0.0, 2.0 / dim**0.5, generator=g)
    tok = torch.randint(0, vocab, shape, generator=g)
    logp = _logp_of(h.to(device), w.to(device), tok.to(device)).cpu()
    out = {
        "hidden": h.to(dtype),
        "weight": w.to(dtype),
        "tokens": tok,
        "old": logp + 0.3 * torch.randn(shape, generator=g),
        "adv": torch.randn(shape[0], generator=g),
        "mask": torch.rand(shape, generator=g) > 0.1,
    }
    return {k: v.to(device) for k, v in out.items()}


def _logp_of(h: torch.Tensor, w: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """The sampled tokens' float32 log-probs, 1024 tokens at a time (no library code)."""
    with torch.no_grad():
        rows = [
            torch.log_softmax(hs @ w.T, dim=-1).gather(-1, ts.unsqueeze(-1)).squeeze(-1)
            for hs, ts in zip(
                torch.split(h.flatten(0, -2), 1024), torch.split(tok.flatten(), 1024), strict=True
            )
        ]
    return torch.cat(rows).view(tok.shape)


def _step(
    loss_of: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor],
) -> Callable[[dict[str, Any]], Fn]:
    def build(x: dict[str, Any]) -> Fn:
        h, w = x["hidden"].detach().requires_grad_(True), x["weight"].detach().requires_grad_(True)

        def run() -> object:
            loss_of(h, w, x).backward()  # type: ignore[no-untyped-call]
            h.grad = w.grad = None
            return None

        return run

    return build


def _loss(logp: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
    return d.policy_loss(d.ClipHigher(), logp, x["old"], x["adv"], x["mask"])


def _naive(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
    logp_all = torch.log_softmax((h @ w.T).float(), dim=-1)
    return _loss(logp_all.gather(-1, x["tokens"].unsqueeze(-1)).squeeze(-1), x)


def _ours(**options: Any) -> Callable[[dict[str, Any]], Fn]:
    return _step(
        lambda h, w, x: d.linear_policy_loss(
            h, w, x["tokens"], x["old"], x["adv"], x["mask"], **options
        )
    )


def impls(quick: bool) -> list[Impl]:
    """Every row of the suite, on every device (:func:`for_device` picks a device's)."""
    out = [
        Impl(UNIT, "unit", lambda x: lambda: x["hidden"] @ x["weight"].T),
        Impl(NAIVE, "ref", _step(_naive)),
        Impl(
            COMPOSED,
            "ours",
            _step(lambda h, w, x: _loss(d.fused_logprobs_entropy(h, w, x["tokens"]).logp, x)),
        ),
        Impl(LINEAR, "ours", _ours()),
    ]
    for backend, device in (("two_pass", "cpu"), ("triton", "cuda")):
        out += [
            Impl(
                setting(backend, keep),
                "ours",
                _ours(backend=backend, keep_logits=keep),
                missing=gpu.no_triton() if backend == "triton" else None,
                devices=(device,),
            )
            for keep in (True, False)
        ]
    return out + peers.impls(quick, _step, _loss)


SIZES = [(2048, 896, 32000), (1024, 896, 151936)]
#: On a GPU: the issue's two shapes, 2048x896x32000 in both dtypes and the 7B-scale one
#: in bfloat16 (1024x896x151936 is CPU-only: no GPU target reads it).
GPU_SIZES = [((2048, 896, 32000), "both"), ((8192, 4096, 151936), "bf16")]
QUICK_SIZES = [(512, 128, 8192)]


def memory_budget(n: int, dim: int, v: int, dtype: torch.dtype, device: str) -> int:
    """The chunked path's memory target: the gradients every method returns (dW and dh,
    summed in float32, plus their bfloat16 copies for bfloat16 inputs) + one default
    chunk's temporaries (its float32 logits and their gradient, a bfloat16 copy for
    bfloat16 inputs) + the scratch."""
    try:
        from dapo_ops.logprobs._fused_linear import DEFAULT_FUSED_CHUNK_ELEMENTS as elements
    except ImportError:
        elements = CHUNK_ELEMENTS
    per = 4 + (2 if dtype == torch.bfloat16 else 0)
    rows = min(n, max(1, elements["cpu" if device == "cpu" else "other"] // v))
    return (v * dim + n * dim) * per + rows * v * (4 + per) + SCRATCH


def sizes(quick: bool, device: str) -> list[tuple[tuple[int, int, int], tuple[torch.dtype, ...]]]:
    both: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    if quick:
        return [(s, both) for s in QUICK_SIZES]
    if device == "cpu":
        return [(s, both) for s in SIZES]
    return [(s, both if which == "both" else (torch.bfloat16,)) for s, which in GPU_SIZES]


def make_cases(quick: bool, device: str) -> list[Case]:
    cases = []
    for (n, dim, v), dtypes in sizes(quick, device):
        for dtype in dtypes:
            name = "fp32" if dtype == torch.float32 else "bf16"
            cases.append(
                Case(
                    f"linear loss fwd+bwd, {name}",
                    f"{n}x{dim}x{v}",
                    lambda n=n, dim=dim, v=v, dtype=dtype: linear_inputs(n, dim, v, dtype, device),  # type: ignore[misc]
                    for_device(impls(quick), device),
                    basis_bytes=n * v * 4,
                    basis_name="logits",
                    main_ref=NAIVE,
                    unit=UNIT,
                    memory="all",
                    memory_quick=True,
                    warm_inputs=lambda dtype=dtype: linear_inputs(64, 32, 512, dtype),  # type: ignore[misc]
                    repeats=None if quick or device != "cpu" else 3,
                    budget_gib=16.0,
                    limit_bytes=memory_budget(n, dim, v, dtype, device),
                    elems=n,
                )
            )
    return cases


def targets(
    results: list[Result], cases: list[Case], bandwidth: float, device: str = "cpu"
) -> list[Target]:
    """Per case, the default ``linear_policy_loss`` against the naive path, Liger (eager)
    and the time unit, and (CPU: the chunked path) its memory budget; on a GPU issue 37's
    targets for the two memory settings (:func:`benchmarks.suites._linear_gpu.targets`)."""
    out = []
    for c in cases:
        rs = {r.impl: r for r in results if (r.op, r.size) == (c.op, c.size)}
        ours = rs.get(LINEAR)
        liger = next(
            (r for k, r in rs.items() if k.startswith(LIGER) and k.endswith("eager")), None
        )
        where = f"linear_policy_loss, {c.op}, {c.size}"
        rows = [
            compare(f"{where}: time / naive", ours, rs.get(NAIVE), 1.0, faster=False),
            compare(f"{where}: time / Liger (eager)", ours, liger, 1.0, faster=False),
            compare(f"{where}: time in one h @ W.T", ours, rs.get(UNIT), 3.3, faster=False),
        ]
        if device == "cpu":  # the chunked path's budget; the two-pass one's is issue 37's
            mem = ours.mem / 2**20 if ours is not None and ours.mem is not None else None
            why = (ours.error if ours is not None else None) or ""
            name = f"{where}: extra peak (live tensors)"
            rows.append(at_most(name, mem, c.limit_bytes / 2**20, " MiB", why))
        rows = [_reason(t, results, device) for t in rows]
        if device == "cuda":
            rows = [gpu.pending_reason(t, LINEAR, c.size) for t in rows]
            rows += gpu.targets(results, c, NAIVE, setting)
        out += rows
    return out


def _reason(t: Target, results: list[Result], device: str) -> Target:
    if device == "cpu":  # only the bf16 unit target is missed there
        reason = "in bf16 one h @ W.T is fast next to the float32 softmax passes"
    else:
        reason = gpu.GPU_REASON
    if "h @ W.T" in t.name and "bf16" in t.name:
        size = t.name.split(", ")[-1].split(":")[0]
        rs = {r.impl: r for r in results if r.size == size and "bf16" in r.op and r.times}
        if NAIVE in rs and UNIT in rs:
            naive = rs[NAIVE].median / rs[UNIT].median
            reason += f"; a bf16 matmul is so fast that the naive path takes {naive:.1f} units"
    return because(t, reason)


SUITE = Suite(
    name="linear",
    title="Hidden states to policy loss (the lm-head step)",
    make_cases=make_cases,
    targets=targets,
    notes=(
        "`x unit` = median / the median of one forward `h @ W.T` in the same dtype, same "
        "run (3 matmuls plus the softmax is the ideal fwd+bwd, about 3.3 units).",
        "Memory target of the CPU's default, the chunked path (`memory_budget`): extra peak "
        "<= the gradients every method returns (dW and dh summed in float32, plus their "
        "bfloat16 copies for bfloat16 inputs) + one chunk of the default size "
        "(`chunk_size=None`: 2^25 logits elements on CPU; its float32 logits and their "
        "gradient, a bfloat16 copy for bfloat16 inputs) + its 8 MiB scratch. On a GPU the "
        "default is the two-pass design; its memory targets are issue 37's, against the "
        "naive path's extra peak.",
        "Liger: `LigerFusedLinearGRPOLoss(loss_type='dapo', beta=0, epsilon_low=0.2, "
        "epsilon_high=0.28, use_ref_model=False, chunk_size=1)` (plain PyTorch chunking); it "
        "computes no entropy. TRL 1.16: `ChunkedLogProbFunction.apply(h, W, None, ids, 1.0, "
        "32768, None, 1.0, ('log_probs', 'entropy'))` as its GRPO trainer's fused head calls "
        "it (on a GPU the valid positions only, scattered back). verl 0.9.1: "
        "`linear_cross_entropy(h, W, ids, 1.0, 'none')` (Triton, CUDA only) and "
        "`FusedLinearForPPO()` (torch, chunk 512), each returning log-probs and entropy. "
        "Each peer's log-probs then feed the same `policy_loss`; a row that cannot run "
        "here shows its exact error.",
        "bf16 rows: hidden and W in bfloat16 (the matmuls in bf16, the softmax and loss in "
        "float32 in every method).",
    ),
    bandwidth=False,
)
