"""The ``linear`` suite on a GPU: cut-cross-entropy's row and issue 30's targets for the
Triton kernels (``linear_policy_loss(..., backend="triton")``).

cut-cross-entropy 25.1.1 (Wijmans et al., 2025) gives per-token cross-entropy from the
hidden states without the logits in memory; its log-probs ``-CE`` (``reduction="none"``,
-100 at masked positions, its default gradient filter) feed the same ``policy_loss``, the
anchor the issue names. It runs on CUDA only; carry its wheel to an offline GPU machine
(``pip download --no-deps cut-cross-entropy==25.1.1``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from benchmarks.environment import installed
from benchmarks.harness import Case, Result, Target
from benchmarks.pending import pending
from benchmarks.targets import at_most, compare
from dapo_ops.logprobs._triton_linear import GPU_TILES

CCE = "cut-cross-entropy"
TRITON = "backend='triton'"
#: Issue 30: the kernels' extra peak may exceed the gradients by this much.
SLACK = 64 * 2**20


def cce_name() -> str:
    version = installed("cut_cross_entropy")
    tag = f"{CCE} {version} (installed)" if version else f"{CCE} (not installed)"
    return f"{tag} linear_cross_entropy + policy_loss"


def no_cce() -> str | None:
    """Why cut-cross-entropy's row cannot run here, or None."""
    if not installed("cut_cross_entropy"):
        return "cut-cross-entropy is not installed (pip install --no-deps cut-cross-entropy)"
    return None if torch.cuda.is_available() else "cut-cross-entropy's kernels need CUDA"


def cce_loss(
    loss: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]:
    """``loss(-CE, x)``: cut-cross-entropy's per-token log-probs into ``loss``."""

    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        from cut_cross_entropy import linear_cross_entropy  # type: ignore[import-not-found]

        targets = torch.where(x["mask"], x["tokens"], -100)
        return loss(-linear_cross_entropy(h, w, targets, reduction="none"), x)

    return loss_of


def kernel_budget(n: int, dim: int, vocab: int, dtype: torch.dtype, programs: int = 132) -> int:
    """Issue 30's memory limit for the kernels, in the dtypes they accumulate in: the
    hidden gradient in float32 (``n x d x 4``) plus its copy in the input dtype, the
    weight gradient in the weight's dtype, for bfloat16/float16 weights the float32 rows
    its persistent kernel accumulates (``programs x rows x d x 4``: one program per
    multiprocessor, 132 on an H100, each with the weight kernel's vocabulary tile of rows;
    instead of a ``vocab x d x 4`` buffer), and 64 MiB (which holds the hidden gradient's
    vocabulary splits, at most ``SPLIT_BYTES``)."""
    size = dtype.itemsize
    acc = 8 if dtype == torch.float64 else 4  # the kernels' accumulation dtype
    hidden = n * dim * (acc + (size if size < acc else 0))  # + the copy in the input dtype
    rows = programs * GPU_TILES[dtype].weight.vocab * dim * 4 if size < 4 else 0
    return hidden + vocab * dim * size + rows + SLACK


def triton_targets(
    results: list[Result], case: Case, naive: str, liger: str, impl: str
) -> list[Target]:
    """The kernels' row ``impl`` of ``case`` against the naive path, cut-cross-entropy and
    Liger (eager): time at most 1.0x each (the issue's goal in bf16: 0.8x the naive path);
    extra peak below the naive path's and within :func:`kernel_budget`."""
    rs = {r.impl: r for r in results if (r.op, r.size) == (case.op, case.size)}
    ours = rs.get(impl)
    why = (ours.error if ours is not None else "") or pending("cuda", impl, case.size) or ""
    where = f"linear_policy_loss({TRITON}), {case.op}, {case.size}"
    cce = next((r for k, r in rs.items() if k.startswith(CCE)), None)
    goal = " (goal 0.8x)" if "bf16" in case.op else ""
    out = [
        compare(f"{where}: time / naive{goal}", ours, rs.get(naive), 1.0, faster=False),
        compare(f"{where}: time / cut-cross-entropy", ours, cce, 1.0, faster=False),
        compare(f"{where}: time / Liger (eager)", ours, rs.get(liger), 1.0, faster=False),
    ]
    mem = ours.mem if ours is not None else None
    base = rs.get(naive)
    if base is not None and base.mem is not None:
        name = f"{where}: extra peak / the naive path's"
        out.append(at_most(name, None if mem is None else mem / base.mem, 1.0, "x", why))
    n, dim, vocab = (int(s) for s in case.size.split("x"))
    dtype = torch.bfloat16 if "bf16" in case.op else torch.float32
    limit = kernel_budget(n, dim, vocab, dtype) / 2**20
    name = f"{where}: extra peak (gradients in their accumulation dtypes + 64 MiB)"
    out.append(at_most(name, None if mem is None else mem / 2**20, limit, " MiB", why))
    for t in out:  # a row not measured: say why (pending, or its error)
        if t.met is None and why:
            t.reason = why
    return out
