"""Peak memory and time of per-token log-probs + entropy: naive, TRL-style, chunked, fused.

Methods (float32 throughout; "logits size" = tokens x vocab x 4 bytes):

From logits ``[tokens, vocab]`` (a leaf tensor; baseline = logits, tokens, loss weights):
  naive         ``log_softmax`` -> ``gather``; entropy ``-(p * logp).sum(-1)``; both
                differentiable.
  trl_rows      our re-implementation of the idea of the float32 branch of TRL's
                ``selective_log_softmax`` (since TRL 0.15, Feb 2025; still TRL 1.16.0's
                fallback without Triton): ``gather`` + a Python loop of per-sequence
                ``torch.logsumexp`` over ``[batch, seq, vocab]``; entropy as TRL's chunked
                ``entropy_from_logits`` (``log_softmax`` per 128 flattened rows) under
                ``torch.no_grad()``, as TRL's trainers call it unless an entropy gradient
                is asked for. Only log-probs get a gradient here, so its backward does
                *less* work than the others. (On CUDA with Triton, TRL 1.16 dispatches to a
                fused kernel instead; not measured here.)
  ours          ``token_logprobs_and_entropy`` (default chunk size).
  ours_inplace  the same with ``inplace_backward=True`` (fwd+bwd only; forward is ``ours``).

From hidden states ``[tokens, d]`` and ``W [vocab, d]`` (leaves; baseline = hidden, W):
  naive_hidden  ``hidden @ W.T`` then ``naive``.
  fused         ``fused_logprobs_entropy`` (default chunk size).

The DAPO loss from hidden states, side by side with a peer (input group ``loss``: the
same hidden, W, tokens ``[batch, 1024]``, old log-probs, advantages and mask; baseline =
all of them; fwd+bwd only, ``backward()`` into hidden and W):
  fused_dapo    ``fused_logprobs_entropy`` + ``token_level_loss`` (token mean, clip
                0.2 / 0.28, no KL), default chunk size.
  liger_grpo    Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (``liger_kernel.chunked_loss``,
                plain PyTorch, no Triton needed) configured the same: ``loss_type="dapo"``,
                ``beta=0``, ``epsilon_low/high=0.2/0.28``, ``temperature=1``,
                ``use_ref_model=False``, ``compiled=False`` (no inductor on CPU), its
                default chunking (``chunk_size=1`` sequence per chunk; inside it 2048 rows x
                4096 vocabulary columns). It computes the gradients of hidden and W inside its
                forward (backward only hands them over) and no entropy; ``fused_dapo``
                computes the entropy too (forward only: it gets no gradient). Only measured
                when ``liger_kernel`` imports (``pip install --no-deps liger-kernel``);
                otherwise the rows are left out with a note.

Modes: ``fwd`` runs under ``torch.no_grad()`` (old-policy log-probs); ``fwd+bwd`` computes
``loss = sum(a * logp) + sum(b * entropy)`` (random ``a``, ``b``) and takes the gradient:
``torch.autograd.grad`` w.r.t. the logits (a leaf's ``AccumulateGrad`` would copy an
in-place gradient), ``backward()`` into hidden and W. Gradients count towards the peak.

Measurement: each input size runs in a fresh subprocess that allocates the inputs once
and runs the methods interleaved (repeat-major), so background load hits them alike and
their ratios are measured side by side. The first run of each (method, mode) gives the
memory: the *tensor peak* (peak bytes of live tensors allocated during the call, replayed
from the profiler's allocator events: the CPU analogue of
``torch.cuda.max_memory_allocated``) and the *RSS peak* (``VmHWM - VmRSS`` from
``/proc/self/status`` after ``malloc_trim(0)`` and a reset of the high-water mark via
``/proc/self/clear_refs``: what the process grows by, glibc slack included). Time is the
median wall-clock time over the repeats (CPU time is reported too). A tiny warm-up run of
the same code initialises the libraries first. Each child gets an address-space limit so
that a case that does not fit fails with an allocation error instead of waking the OOM
killer.

Usage::

    python benchmarks/bench_logprobs.py            # full run (< ~20 min on 2 cores),
                                                   # writes docs/benchmarks_logprobs.md
    python benchmarks/bench_logprobs.py --quick    # small smoke run, prints the table
    python benchmarks/bench_logprobs.py --only loss:4096x32000    # one size
    python benchmarks/bench_logprobs.py --quick --methods fused_dapo,liger_grpo
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    """One input size; its methods run interleaved on the same inputs in one subprocess."""

    group: str  # "logits", "hidden" or "loss"
    tokens: int
    vocab: int
    methods: tuple[tuple[str, tuple[str, ...]], ...]  # (method, modes)
    d: int = 0  # hidden size (from-hidden methods only)
    reps: int = 3
    seq: int = 1024  # sequence length of the [batch, seq, vocab] view (trl_rows loops over batch)
    threads: int = 2
    budget_gib: float = 16.0
    note: str = ""


@dataclass
class Result:
    case: Case
    method: str
    mode: str
    extra_peak: int = 0  # bytes of resident memory (VmHWM - VmRSS), first run
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    error: str = ""
    tensor_peak: int = 0  # bytes of live tensors (profiler), first run

    @property
    def logits_bytes(self) -> int:
        return self.case.tokens * self.case.vocab * 4

    @property
    def time(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    @property
    def cpu_time(self) -> float:
        return statistics.median(self.cpu_times) if self.cpu_times else float("nan")


# --------------------------------------------------------------------------- methods


def _naive(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _trl_rows(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # selective_log_softmax, float32 branch: gather + per-row (per-sequence) logsumexp loop
    selected = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    logp = selected - lse
    # entropy_from_logits: log_softmax per chunk of 128 flattened rows, under no_grad
    with torch.no_grad():
        flat = logits.reshape(-1, logits.shape[-1])
        parts = []
        for chunk in flat.split(128, dim=0):
            lp = torch.log_softmax(chunk, dim=-1)
            parts.append(-(torch.exp(lp) * lp).sum(-1))
        entropy = torch.cat(parts).view(logits.shape[:-1])
    return logp, entropy


def liger_version() -> str | None:
    """The installed liger-kernel version, or None when ``liger_kernel`` is not importable."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception:  # e.g. a build that requires triton at import time
        return None
    return importlib.metadata.version("liger-kernel")


def _fused_dapo(h: torch.Tensor, w: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    from dapo_ops import token_level_loss
    from dapo_ops.logprobs import fused_logprobs_entropy

    hidden = h.view(*inp["tokens"].shape, h.shape[-1])
    logp = fused_logprobs_entropy(hidden, w, inp["tokens"]).logp
    return token_level_loss(logp, inp["old_logp"], inp["adv"], inp["mask"], **DAPO_CLIP)


def _liger_grpo(h: torch.Tensor, w: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(**LIGER_OPTIONS)
    hidden = h.view(*inp["tokens"].shape, h.shape[-1])
    loss, _ = loss_fn(
        hidden,
        w,
        inp["tokens"],
        inp["mask"].long(),
        inp["adv"],
        old_per_token_logps=inp["old_logp"],
    )
    return loss  # type: ignore[no-any-return]


DAPO_CLIP = {"eps_low": 0.2, "eps_high": 0.28}
LIGER_OPTIONS: dict[str, Any] = {
    "loss_type": "dapo",
    "beta": 0.0,
    "epsilon_low": 0.2,
    "epsilon_high": 0.28,
    "temperature": 1.0,
    "use_ref_model": False,
    "compiled": False,
    "chunk_size": 1,
}


def _method(method: str) -> Callable[..., Any]:
    from dapo_ops.logprobs import fused_logprobs_entropy, token_logprobs_and_entropy

    if method == "naive":
        return _naive
    if method == "trl_rows":
        return _trl_rows
    if method == "ours":
        return lambda x, t: tuple(token_logprobs_and_entropy(x, t))  # type: ignore[return-value]
    if method == "ours_inplace":
        return lambda x, t: tuple(token_logprobs_and_entropy(x, t, inplace_backward=True))  # type: ignore[return-value]
    if method == "naive_hidden":
        return lambda h, w, t: _naive(h @ w.T, t)
    if method == "fused":
        return lambda h, w, t: tuple(fused_logprobs_entropy(h, w, t))  # type: ignore[return-value]
    if method == "fused_dapo":
        return _fused_dapo
    if method == "liger_grpo":
        return _liger_grpo
    raise ValueError(method)


# --------------------------------------------------------------------------- child


def _status(key: str, path: str = "/proc/self/status") -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> int:
    """Return freed memory to the OS, reset VmHWM to the current RSS; return that RSS."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


class _TensorPeak:
    """Peak bytes of live tensors allocated inside the block, from the profiler's events.

    The analogue of ``torch.cuda.max_memory_allocated`` for CPU tensors: allocation and
    free events of the CPU allocator, replayed in order; allocator slack is not counted.
    """

    def __enter__(self) -> _TensorPeak:
        self.prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.prof.__exit__(None, None, None)
        events = [e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        cur = self.peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            cur += e.nbytes()
            self.peak = max(self.peak, cur)


def _inputs(case: Case, gen: torch.Generator) -> dict[str, torch.Tensor]:
    n, v = case.tokens, case.vocab
    out: dict[str, torch.Tensor] = {}
    if case.group in ("hidden", "loss"):
        out["hidden"] = torch.empty(n, case.d).normal_(generator=gen)
        out["weight"] = torch.empty(v, case.d).normal_(0.0, 2.0 / case.d**0.5, generator=gen)
        out["tokens"] = torch.randint(0, v, (n,), generator=gen)
        if case.group == "loss":
            _loss_inputs(out, case, gen)
    else:
        seq = case.seq if n % case.seq == 0 else n
        out["logits"] = torch.empty(n // seq, seq, v)
        _fill_logits(out["logits"], gen)
        out["tokens"] = torch.randint(0, v, (n // seq, seq), generator=gen)
    out["a"] = torch.randn(out["tokens"].shape, generator=gen)
    out["b"] = torch.randn(out["tokens"].shape, generator=gen)
    return out


def _loss_inputs(out: dict[str, torch.Tensor], case: Case, gen: torch.Generator) -> None:
    """Tokens as ``[batch, seq]``; old log-probs = the current ones + N(0, 0.3^2) noise (so
    that some ratios clip and most do not), advantages N(0, 1), 10 % of positions masked."""
    from dapo_ops.logprobs import fused_logprobs_entropy

    seq = case.seq if case.tokens % case.seq == 0 else case.tokens
    out["tokens"] = out["tokens"].view(-1, seq)
    with torch.no_grad():
        hidden = out["hidden"].view(*out["tokens"].shape, case.d)
        logp = fused_logprobs_entropy(hidden, out["weight"], out["tokens"]).logp
    out["old_logp"] = logp + 0.3 * torch.randn(logp.shape, generator=gen)
    out["adv"] = torch.randn(out["tokens"].shape[0], generator=gen)
    out["mask"] = torch.rand(out["tokens"].shape, generator=gen) > 0.1


def _fill_logits(logits: torch.Tensor, gen: torch.Generator) -> None:
    logits.uniform_(-6.0, 6.0, generator=gen)


def _run_once(
    case: Case, mode: str, fn: Callable[..., Any], inp: dict[str, torch.Tensor]
) -> tuple[float, float]:
    leaves = [inp["logits"]] if case.group == "logits" else [inp["hidden"], inp["weight"]]
    grads: tuple[torch.Tensor, ...] = ()
    t0, c0 = time.perf_counter(), time.process_time()
    if case.group == "loss":  # the loss itself, then .grad of hidden and W
        for leaf in leaves:
            leaf.requires_grad_(True)
        fn(*leaves, inp).backward()
        logp = entropy = None
    elif mode == "fwd":
        with torch.no_grad():
            logp, entropy = fn(*leaves, inp["tokens"])
    else:
        for leaf in leaves:
            leaf.requires_grad_(True)
        logp, entropy = fn(*leaves, inp["tokens"])
        loss = (logp * inp["a"]).sum() + (entropy * inp["b"]).sum()
        if case.group == "hidden":
            loss.backward()  # .grad of hidden and W: the trainer's parameter gradients
        else:
            # the gradient w.r.t. the logits, as it would flow on into lm_head's backward
            # (no leaf AccumulateGrad, which would copy an in-place gradient)
            grads = torch.autograd.grad(loss, leaves)
    elapsed = (time.perf_counter() - t0, time.process_time() - c0)
    del logp, entropy, grads  # the high-water mark already holds their peak
    for leaf in leaves:
        leaf.grad = None
        leaf.requires_grad_(False)
    return elapsed


def child(case: Case) -> list[dict[str, Any]]:
    torch.set_num_threads(case.threads)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _status("VmSize") + int(case.budget_gib * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard < 0 else min(limit, hard), hard))
    gen = torch.Generator().manual_seed(0)
    tiny = Case(case.group, 64, 512, case.methods, d=min(case.d, 32), seq=16)
    tiny_inp = _inputs(tiny, gen)
    for method, modes in case.methods:  # warm-up: library initialisation, not measured
        for mode in modes:
            with _TensorPeak():  # the profiler's one-time set-up happens here too
                _run_once(tiny, mode, _method(method), tiny_inp)
            _fill_logits(tiny_inp.get("logits", torch.empty(0)), gen)
    del tiny_inp
    res: dict[tuple[str, str], dict[str, Any]] = {
        (m, mode): {"method": m, "mode": mode, "times": [], "cpu_times": []}
        for m, modes in case.methods
        for mode in modes
    }
    try:
        inp = _inputs(case, gen)
    except RuntimeError as exc:
        for r in res.values():
            r["error"] = f"inputs do not fit: {str(exc).splitlines()[0][:80]}"
        return list(res.values())
    for rep in range(case.reps):  # methods interleaved: background load hits them alike
        for method, modes in case.methods:
            for mode in modes:
                r = res[(method, mode)]
                if r.get("error"):
                    continue
                try:
                    if rep == 0:
                        base = _reset_peak()
                        with _TensorPeak() as tensor_peak:
                            wall, cpu = _run_once(case, mode, _method(method), inp)
                        r["extra_peak"] = _status("VmHWM") - base
                        r["tensor_peak"] = tensor_peak.peak
                    else:
                        wall, cpu = _run_once(case, mode, _method(method), inp)
                    r["times"].append(wall)
                    r["cpu_times"].append(cpu)
                except RuntimeError as exc:  # allocation failure under the address-space cap
                    r["error"] = f"does not fit in {case.budget_gib:g} GiB"
                    r["detail"] = str(exc).splitlines()[0][:120]
                if method == "ours_inplace" and mode == "fwd+bwd":
                    _fill_logits(inp["logits"], gen)  # it holds a gradient now
    return list(res.values())


# --------------------------------------------------------------------------- parent


def run_case(case: Case) -> list[Result]:
    env = dict(os.environ, OMP_NUM_THREADS=str(case.threads), PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(asdict(case))],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or ["?"])[-1][:120]
        return [
            Result(case, m, mode, error=f"exit {proc.returncode}: {err}")
            for m, modes in case.methods
            for mode in modes
        ]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return [
        Result(
            case,
            r["method"],
            r["mode"],
            r.get("extra_peak", 0),
            r.get("times", []),
            r.get("cpu_times", []),
            r.get("error", ""),
            r.get("tensor_peak", 0),
        )
        for r in rows
    ]


BOTH = ("fwd", "fwd+bwd")
LOGITS_METHODS = (
    ("naive", BOTH),
    ("trl_rows", BOTH),
    ("ours", BOTH),
    ("ours_inplace", ("fwd+bwd",)),
)
HIDDEN_METHODS = (("naive_hidden", BOTH), ("fused", BOTH))


def loss_methods() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Ours, and Liger's GRPO loss when ``liger_kernel`` imports."""
    peer = (("liger_grpo", ("fwd+bwd",)),) if liger_version() else ()
    return (("fused_dapo", ("fwd+bwd",)), *peer)


def plan(quick: bool, threads: int, budget: float) -> list[Case]:
    def c(group: str, n: int, v: int, methods: Any, **kw: Any) -> Case:
        return Case(group, n, v, methods, threads=threads, budget_gib=budget, **kw)

    if quick:
        return [
            c("logits", 1024, 8192, LOGITS_METHODS, reps=2, seq=256),
            c("hidden", 512, 8192, HIDDEN_METHODS, d=128, reps=2),
            c("loss", 256, 8192, loss_methods(), d=128, reps=2, seq=128),
        ]
    big = (
        "16384 x 152064 from logits: the logits alone are 9.3 GiB; only methods that need "
        "less than one more logits-sized buffer fit the budget (naive needs >= 3 more)"
    )
    return [
        c("logits", 4096, 32000, LOGITS_METHODS),
        c("logits", 4096, 152064, LOGITS_METHODS, reps=2),
        c("logits", 16384, 32000, LOGITS_METHODS, reps=2),
        c(
            "logits",
            16384,
            152064,
            (("trl_rows", ("fwd",)), ("ours", ("fwd",)), ("ours_inplace", ("fwd+bwd",))),
            reps=1,
            note=big,
        ),
        c("hidden", 4096, 32000, HIDDEN_METHODS, d=1024, reps=2),
        c("hidden", 4096, 152064, HIDDEN_METHODS, d=1024, reps=2),
        c("loss", 4096, 32000, loss_methods(), d=1024, reps=2),
        c("loss", 4096, 152064, loss_methods(), d=1024, reps=2),
    ]


def _fmt_t(r: Result) -> str:
    return f"{r.time:.2f}" if r.times else "-"


def _naive_of(r: Result, results: list[Result]) -> Result | None:
    naive = "naive_hidden" if r.case.group == "hidden" else "naive"
    for b in results:
        same = (b.case.group, b.case.tokens, b.case.vocab, b.mode) == (
            r.case.group,
            r.case.tokens,
            r.case.vocab,
            r.mode,
        )
        if same and b.method == naive and not b.error:
            return b
    return None


def table(results: list[Result]) -> str:
    lines = [
        "| input | tokens x vocab | method | mode | tensor peak GiB | x logits | vs naive | "
        "RSS peak x logits | time s | CPU s | time vs naive |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        size = f"{r.case.tokens} x {r.case.vocab}" + (f" (d={r.case.d})" if r.case.d else "")
        head = f"| {r.case.group} | {size} | {r.method} | {r.mode} |"
        if r.error:
            lines.append(f"{head} {r.error} | | | | | | |")
            continue
        base = _naive_of(r, results)
        peak_ratio = f"{r.tensor_peak / base.tensor_peak:.3f}" if base else "-"
        time_ratio = f"{r.time / base.time:.2f}" if base else "-"
        lines.append(
            f"{head} {r.tensor_peak / GIB:.3f} | {r.tensor_peak / r.logits_bytes:.3f} | "
            f"{peak_ratio} | {r.extra_peak / r.logits_bytes:.3f} | {_fmt_t(r)} | "
            f"{r.cpu_time:.2f} | {time_ratio} |"
        )
    return "\n".join(lines)


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


#: The default from-logits backward must return a new gradient buffer (exactly 1.0x) and
#: its outputs (a few floats per row) exist during the call too, so "<= 1.0x" is read as
#: the gradient buffer plus at most this much (per-row vectors and one backward piece).
BOOKKEEPING = 0.01


def targets(results: list[Result]) -> str:
    out = []
    for r in results:
        if r.error or r.mode != "fwd+bwd" or r.method not in ("ours", "ours_inplace"):
            continue
        x, rss = r.tensor_peak / r.logits_bytes, r.extra_peak / r.logits_bytes
        if r.method == "ours":
            out.append(
                f"- from logits, default, {r.case.tokens} x {r.case.vocab}: extra peak {x:.4f}x "
                f"(RSS {rss:.3f}x) = the gradient buffer (1.0x) + {x - 1:.4f}x <= 1.0x "
                f"(+ {BOOKKEEPING:g}x for per-row vectors and one piece): "
                f"{_verdict(x <= 1.0 + BOOKKEEPING)}"
            )
            continue
        out.append(
            f"- from logits, inplace_backward, {r.case.tokens} x {r.case.vocab}: extra peak "
            f"{x:.4f}x (RSS {rss:.3f}x) <= 0.25x: {_verdict(x <= 0.25)}"
        )
    for r in results:
        base = _naive_of(r, results)
        if r.method != "fused" or r.error or base is None:
            continue
        pr, tr = r.tensor_peak / base.tensor_peak, r.time / base.time
        rss = r.extra_peak / base.extra_peak
        tag = " (the target size)" if r.case.vocab == 152064 else ""
        out.append(
            f"- fused, {r.case.tokens} x {r.case.vocab}{tag}, {r.mode}: peak {pr:.3f}x naive "
            f"(RSS {rss:.3f}x) <= 0.125x: {_verdict(pr <= 1 / 8)}; time {tr:.2f}x naive "
            f"<= 1.3x: {_verdict(tr <= 1.3)}"
        )
    return "\n".join(out)


def peer_lines(results: list[Result]) -> list[str]:
    """Liger's GRPO loss against ours, per size: peak and time ratios (no target)."""
    out = []
    for r in results:
        if r.method != "liger_grpo" or r.error:
            continue
        ours = [
            b
            for b in results
            if b.method == "fused_dapo" and not b.error and b.case.vocab == r.case.vocab
        ]
        if ours:
            o = ours[0]
            out.append(
                f"- DAPO loss from hidden states, {r.case.tokens} x {r.case.vocab} "
                f"(d={r.case.d}), fwd+bwd: liger_grpo peak {r.tensor_peak / GIB:.3f} GiB vs "
                f"fused_dapo {o.tensor_peak / GIB:.3f} GiB ({r.tensor_peak / o.tensor_peak:.2f}x); "
                f"time {r.time:.2f} s vs {o.time:.2f} s ({r.time / o.time:.2f}x) (peer, no target)"
            )
    return out


def peer_note(cases: list[Case]) -> str:
    """The markdown line on the Liger comparison (or why it is missing)."""
    if not any(c.group == "loss" for c in cases):
        return ""
    version = liger_version()
    if version is None:
        return (
            "- Peer: `liger_kernel` is not installed (or does not import), so the liger_grpo "
            "rows are left out; `pip install --no-deps liger-kernel` adds them."
        )
    opts = ", ".join(f"{k}={v!r}" for k, v in LIGER_OPTIONS.items())
    shapes = sorted({f"[{c.tokens // c.seq}, {c.seq}]" for c in cases if c.group == "loss"})
    return (
        f"- Peer (input `loss`): Liger-Kernel {version}, "
        "`liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss` (plain PyTorch, no Triton) "
        f"with {opts}: DAPO's token-mean Clip-Higher loss (0.2 / 0.28, no KL) from hidden "
        "states and W, with its own chunking (one sequence per chunk, 2048 rows x 4096 "
        "vocabulary columns inside), gradients of hidden and W computed inside its forward; "
        "no entropy. Against `fused_dapo` = `fused_logprobs_entropy` (default chunk, which "
        "also computes the entropy in forward) + `token_level_loss(eps_low=0.2, "
        f"eps_high=0.28)`, same inputs (tokens as {' / '.join(shapes)}, old log-probs = current + "
        "N(0, 0.3^2), 10 % masked); `tests/test_logprobs.py` checks that both give the same "
        "loss and gradients. Same work: loss + gradients of hidden and W."
    )


def machine() -> str:
    cpu = platform.processor() or "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = _status_file("/proc/meminfo", "MemTotal") / GIB
    return (
        f"{cpu}, {os.cpu_count()} cores visible, {mem:.1f} GiB RAM, Linux "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}"
    )


def _status_file(path: str, key: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _case_from_json(text: str) -> Case:
    raw = json.loads(text)
    raw["methods"] = tuple((m, tuple(modes)) for m, modes in raw["methods"])
    return Case(**raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke run, table to stdout")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-gib", type=float, default=16.0, help="per-case address-space cap")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only these sizes, e.g. --only logits:4096x32000 (repeatable)",
    )
    ap.add_argument(
        "--methods",
        default="",
        help="comma-separated methods to run (default all), e.g. fused_dapo,liger_grpo",
    )
    ap.add_argument("--out", type=Path, default=None, help="markdown file to write")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(_case_from_json(args.child))))
        return
    partial = args.quick or args.only or args.methods
    default_out = None if partial else REPO / "docs" / "benchmarks_logprobs.md"
    out = args.out or default_out
    cases = plan(args.quick, args.threads, args.budget_gib)
    if args.only:
        cases = [c for c in cases if f"{c.group}:{c.tokens}x{c.vocab}" in args.only]
    if args.methods:
        keep = set(args.methods.split(","))
        for c in cases:
            c.methods = tuple(m for m in c.methods if m[0] in keep)
        cases = [c for c in cases if c.methods]
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    start = time.perf_counter()
    results: list[Result] = []
    for case in cases:
        t = time.perf_counter()
        rs = run_case(case)
        results.extend(rs)
        print(
            f"[{time.perf_counter() - start:5.0f}s] {case.group} {case.tokens}x{case.vocab}"
            f"{f' d={case.d}' if case.d else ''} ({time.perf_counter() - t:.0f}s)",
            flush=True,
        )
        for r in rs:
            what = r.error or (
                f"{r.tensor_peak / r.logits_bytes:.3f}x logits (RSS "
                f"{r.extra_peak / r.logits_bytes:.3f}x), {r.time:.2f}s"
            )
            print(f"        {r.method:13s} {r.mode:8s} {what}", flush=True)
    total = time.perf_counter() - start
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    cmd = "python benchmarks/bench_logprobs.py" + " ".join(
        [""] + (["--quick"] if args.quick else [])
    )
    notes = sorted({c.note for c in cases if c.note})
    reps = sorted({c.reps for c in cases})
    doc = "\n".join(
        [
            "# Benchmark: token log-probs and entropy",
            "",
            f"- Date: {datetime.date.today().isoformat()}; command: `{cmd}` "
            f"(total {total / 60:.1f} min).",
            f"- Machine: {machine()}; torch threads: {args.threads}. Load average "
            f"{' '.join(load0)} at the start, {' '.join(load1)} at the end: the machine is "
            "shared, so wall times are noisy; methods of one size run interleaved in one "
            "process, so their ratios are measured side by side.",
            f"- Time: median wall-clock seconds over {'/'.join(map(str, reps))} repeats "
            "(see each size); CPU s = median process CPU time (both threads). Memory, first "
            "run, above the already allocated inputs: *tensor peak* = peak bytes of live "
            "tensors allocated during the call (replay of the profiler's allocator events, the "
            "CPU analogue of `torch.cuda.max_memory_allocated`); *RSS peak* = `VmHWM - VmRSS` "
            "from `/proc/self/status` after `malloc_trim` and a reset of the high-water mark "
            "(what the process grows by, glibc slack included). Targets use the tensor peak.",
            "- float32 everywhere. 'x logits' = extra peak / (tokens x vocab x 4 bytes); "
            "'vs naive' = ratio to the naive path of the same input, size and mode.",
            "- fwd: under `torch.no_grad()`. fwd+bwd: `loss = sum(a*logp) + sum(b*entropy)` "
            "then the gradient w.r.t. the logits (`torch.autograd.grad`, kept until the end) "
            "or `backward()` into hidden and W (their `.grad` counted). trl_rows computes its "
            "entropy without gradient (as TRL's trainers do by default), so its backward "
            "does less work than the others.",
            *[f"- {n}." for n in notes],
            *([peer_note(cases)] if peer_note(cases) else []),
            "- Reading the times: memory is deterministic (the tensor peaks repeat exactly "
            "from run to run); wall times on this shared machine are not. Other jobs share the "
            "2 cores (CPU s close to wall s means about one core was available), and the "
            "chunked code, which issues many small parallel ops, suffers most when its two "
            "threads cannot run at the same time. Compare ratios within one size, and expect "
            "them to move between runs.",
            "",
            table(results),
            "",
            "## Targets",
            "",
            targets(results) if not args.quick else "(evaluated on the full run only)",
            "",
            *(
                ["## Peer: Liger-Kernel", "", *peer_lines(results), ""]
                if peer_lines(results)
                else []
            ),
        ]
    )
    print()
    print(doc)
    if out is not None:
        out.write_text(doc)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
