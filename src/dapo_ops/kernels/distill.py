r"""The row kernels of the two-pass distillation (private), Triton only.

:mod:`dapo_ops.logprobs._distill_two_pass` uses them under ``backend="triton"`` and the
same formulas as ATen ops otherwise (:mod:`dapo_ops.logprobs._distill_rows`). On a block
of the student's raw logits ``z`` (``x = cap(z) / T``) and the teacher's logits ``y``
(this rank's columns; a masked row's read as 0):

- :func:`sums` (pass 1, second round; a program per row): the two sums of a
  whole-vocabulary kind over the columns, the log-sum-exps known;
- :func:`grad_full_` (pass 2; a program per row and block of columns): its gradient
  w.r.t. the raw logits, times each row's ``coef`` (the token's weight over T);
- :func:`probs_` (pass 2 of a support path): ``coef p_s`` off the ids (the ids' values
  are scattered after, by the caller).

The first round's log-sum-exps come from :func:`dapo_ops.kernels.rows.stats`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dapo_ops.kernels.rows import RowMath, _acc, _launch

KINDS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


def params(rm: RowMath, beta: float, floor: float, cdt: torch.dtype, device: torch.device) -> Tensor:  # fmt: skip
    """``[T, c, floor, log(1 - beta), log(beta), 1 - beta]`` filled on the device (no host
    copy; Triton would narrow Python floats to float32)."""
    values = (rm.temperature, rm.softcap or 1.0, floor, math.log1p(-beta), math.log(beta), 1 - beta)  # fmt: skip
    out = torch.full((len(values),), values[0], dtype=cdt, device=device)
    for i, v in enumerate(values[1:], start=1):
        out[i] = v
    return out


def sums(z: Tensor, y: Tensor, lse: Tensor, lse_t: Tensor, kind: str, par: Tensor, has_cap: bool) -> Tensor:  # fmt: skip
    """``[2, rows]`` (see the module docstring) of the block ``z`` (``y``: the teacher's
    logits of the same rows and columns, unit column stride)."""
    ks, opts, block = _launch("distill_sums")
    out = z.new_empty((2, z.shape[0]), dtype=lse.dtype)
    if z.shape[0]:
        ks.distill_sums[(z.shape[0],)](
            z, z.stride(0), y, y.stride(0), par, lse.contiguous(), lse_t.contiguous(), out,
            z.shape[0], z.shape[1], KIND=KINDS[kind], HAS_CAP=has_cap, ACC=_acc(ks, lse.dtype),
            BLOCK=block, **opts,
        )  # fmt: skip
    return out


def grad_full_(
    z: Tensor, y: Tensor, out: Tensor, par: Tensor, stats: tuple[Tensor, Tensor, Tensor],
    coef: Tensor, valid: Tensor, kind: str, has_cap: bool,
) -> Tensor:  # fmt: skip
    """``out`` (``z``'s shape, ``z`` itself for in place) holding ``G``; ``stats`` = per
    row ``(lse, lse_t, the kind's number)``; ``valid`` per row (int8 or bool)."""
    if z.numel() == 0:
        return out
    ks, opts, block = _launch("distill")
    lse, lse_t, row = (x.contiguous() for x in stats)
    grid = (z.shape[0], (z.shape[1] + block - 1) // block)
    ks.distill_grad[grid](
        z, z.stride(0), y, y.stride(0), out, out.stride(0), par, lse, lse_t, row,
        coef.contiguous(), valid.to(torch.int8).contiguous(), z.shape[1], KIND=KINDS[kind],
        HAS_CAP=has_cap, ACC=_acc(ks, lse.dtype), BLOCK=block, **opts,
    )  # fmt: skip
    return out


def probs_(z: Tensor, out: Tensor, par: Tensor, lse: Tensor, coef: Tensor, has_cap: bool) -> Tensor:  # fmt: skip
    """``out`` holding ``coef p_s`` (times the cap's ``1 - t^2``) of the block ``z``."""
    if z.numel() == 0:
        return out
    ks, opts, block = _launch("distill")
    grid = (z.shape[0], (z.shape[1] + block - 1) // block)
    ks.scaled_probs[grid](
        z, z.stride(0), out, out.stride(0), par, lse.contiguous(), coef.contiguous(), z.shape[1],
        HAS_CAP=has_cap, ACC=_acc(ks, lse.dtype), BLOCK=block, **opts,
    )  # fmt: skip
    return out
