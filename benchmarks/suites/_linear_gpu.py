"""The ``linear`` suite on a GPU: issue 37's targets for the two-pass design
(``linear_policy_loss(..., backend="triton", keep_logits=True / False)``: cuBLAS products,
the Triton row kernels of ``dapo_ops.kernels``), read from one run's rows.

- 8192x4096x151936 bf16: the setting that keeps the logits at most 0.80x the naive
  path's time at most 0.25x its extra peak memory; the recomputing one at most 1.0x at
  at most 0.05x; each faster than cut-cross-entropy, TRL's fused head and verl's two.
- 2048x896x32000, bf16 and fp32: each setting at most 1.0x the naive path's time, with
  less extra peak memory than it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.environment import installed
from benchmarks.harness import Case, Result, Target
from benchmarks.pending import pending
from benchmarks.suites._linear_peers import CCE, TRL_HEAD, VERL_TORCH, VERL_TRITON
from benchmarks.targets import at_most, because, compare

#: (time / naive, extra peak / naive's) limits per setting (keep_logits) and shape
LIMITS: dict[str, dict[bool, tuple[float, float]]] = {
    "8192x4096x151936": {True: (0.80, 0.25), False: (1.0, 0.05)},
    "2048x896x32000": {True: (1.0, 1.0), False: (1.0, 1.0)},
}
#: The peers the two settings must beat at the 7B-scale shape: (label, text in the row)
PEERS = (
    ("cut-cross-entropy", CCE),
    ("TRL's fused head", TRL_HEAD),
    ("verl's linear_cross_entropy", VERL_TRITON),
    ("verl's FusedLinearForPPO", VERL_TORCH),
)
#: Why a GPU target of the default path is missed. Nothing of the two-pass design has
#: been timed on a GPU yet: the kernel table of a miss is one command away.
GPU_REASON = (
    "not analysed yet: `python -m benchmarks.profile_linear --backend triton` on the GPU "
    "prints the kernel table of both paths"
)


def no_triton() -> str | None:
    """Why the Triton rows cannot run here (they need a CUDA device), or None."""
    if not installed("triton"):
        return "triton is not installed (it ships with CUDA builds of torch)"
    return None if torch.cuda.is_available() else "backend='triton' runs on CUDA devices only"


def pending_reason(t: Target, impl: str, size: str) -> Target:
    """``t`` (a target of row ``impl`` of the case ``size``), with the reason its row is
    not measured on a GPU yet when it is not."""
    if t.met is None:
        t.reason = pending("cuda", impl, size) or t.reason
    return t


def targets(
    results: list[Result], case: Case, naive: str, setting: Callable[[str, bool], str]
) -> list[Target]:
    """Issue 37's targets of ``case`` for the rows ``setting("triton", keep)``."""
    limits = LIMITS.get(case.size)
    if limits is None:
        return []
    rs = {r.impl: r for r in results if (r.op, r.size) == (case.op, case.size)}
    base = rs.get(naive)
    out = []
    for keep, (time_limit, mem_limit) in limits.items():
        impl = setting("triton", keep)
        ours = rs.get(impl)
        why = (ours.error if ours is not None else "") or ""
        where = f"linear_policy_loss(backend='triton', keep_logits={keep}), {case.op}, {case.size}"
        rows = [compare(f"{where}: time / naive", ours, base, time_limit, faster=False)]
        ratio = None
        if ours is not None and ours.mem is not None and base is not None and base.mem:
            ratio = ours.mem / base.mem
        rows.append(at_most(f"{where}: extra peak / the naive path's", ratio, mem_limit, "x", why))
        if case.size == "8192x4096x151936":
            for label, text in PEERS:
                peer = next((r for k, r in rs.items() if text in k), None)
                rows.append(compare(f"{where}: time / {label}", ours, peer, 1.0, faster=False))
        out += [because(pending_reason(t, impl, case.size), GPU_REASON) for t in rows]
    return out
