r"""The row work of the two-pass lm-head path: one fused kernel per pass.

Private; :mod:`dapo_ops.logprobs._two_pass` forms blocks of logits ``z = h W^T + b`` with
cuBLAS (or ATen's CPU product) and hands each block here. A block is ``[rows, cols]``
with a row stride; its entries become the softmax's inputs ``x = cap(z) / T``
(:class:`RowMath`; ``cap(z) = c tanh(z / c)`` with a final-logit cap ``c``), with a
truncation the columns whose *raw* logit is below the row's threshold ``tau`` dropped
(the chosen column always kept: ``tau`` is a raw logit, so every pass and every
implementation keeps the same set, bit for bit, whatever rounding ``x`` gets).

- :func:`stats` (pass 1, whole rows or one rank's columns of them):
  ``(m, s0, s1, x_y)`` per row, the max of ``x``, ``sum e^{x-m}``, ``sum e^{x-m}(x-m)``
  and the chosen column's ``x`` (0 where the chosen id is not among the columns): the
  pieces :func:`merge` combines across column splits and :func:`finish` turns into
  ``lse = m + log s0``, ``H = log s0 - s1 / s0`` and ``log p_y = x_y - lse``.
- :func:`grad_` (pass 2, any block of columns): ``G = (a (\delta_y - p) - b p (\ell + H))
  / T`` (times ``1 - tanh^2(z/c)`` with the cap), with ``\ell = x - lse``, ``p = e^\ell``
  and ``a``, ``b`` the upstream gradients of ``log p_y`` and ``H`` per row, written in
  the output's dtype, in place over the logits when asked.

Two implementations, the same formulas: ``"triton"`` (:mod:`dapo_ops.kernels._triton_rows`:
pass 1 a program per row walking its columns, pass 2 a program per row and block of
columns; on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``) and ``"torch"`` (ATen
ops: any device, and what ``torch.compile`` traces); the tests hold both to the float64
reference within the derived bounds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import torch
from torch import Tensor

from dapo_ops._core._triton import interpreting, launch_options, load_kernels

RowImpl = Literal["triton", "torch"]

#: Columns a pass-1 program reads per step, and a pass-2 program's block: on a GPU, 16
#: bytes a thread at 8 warps for bfloat16 (pass 1) and 4 warps (pass 2); the
#: distillation's kernels (more live values per entry) at 8 warps and, for its float64
#: sums, 2048 columns: free of register spills on an A100 too (4096 spilled 192 bytes a
#: thread, tests/test_triton_compile.py); under the interpreter
#: (numpy, one program at a time) small blocks that still split the tests' rows.
GPU_BLOCKS = {"stats": (4096, 8), "grad": (1024, 4), "distill": (1024, 8), "distill_sums": (2048, 8)}  # fmt: skip
INTERPRET_BLOCKS = {"stats": (32, 1), "grad": (32, 1), "distill": (32, 1), "distill_sums": (32, 1)}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RowMath:
    """How raw logits become the softmax's inputs: ``x = cap(z) / temperature``."""

    temperature: float = 1.0
    softcap: float | None = None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scaled(z: Tensor, rm: RowMath, cdt: torch.dtype) -> tuple[Tensor, Tensor | None]:
    x = z.to(cdt)
    t = None
    if rm.softcap is not None:
        t = torch.tanh(x / rm.softcap)
        x = t * rm.softcap
    return x / rm.temperature, t


def _kept(z: Tensor, x: Tensor, tok: Tensor, tau: Tensor | None, col0: int) -> Tensor:
    if tau is None:
        return x
    cols = torch.arange(col0, col0 + z.shape[1], device=z.device)
    keep = (z.to(x.dtype) >= tau.unsqueeze(1)) | (cols == tok.unsqueeze(1))
    return torch.where(keep, x, -math.inf)


def _stats_torch(z: Tensor, tok: Tensor, tau: Tensor | None, rm: RowMath) -> Tensor:
    cdt = compute_dtype(z.dtype)
    x = _kept(z, _scaled(z, rm, cdt)[0], tok, tau, 0)
    m = x.amax(dim=1)
    ref = torch.where(m == -math.inf, 0.0, m)
    d = x - ref.unsqueeze(1)
    e = torch.exp(d)
    s0 = e.sum(dim=1)
    s1 = torch.where(e > 0, e * d, 0.0).sum(dim=1)
    here = (tok >= 0) & (tok < z.shape[1])
    xy = x.gather(1, torch.where(here, tok, 0).unsqueeze(1)).squeeze(1)
    return torch.stack([m, s0, s1, torch.where(here, xy, 0.0)])


def _grad_torch(
    z: Tensor, tok: Tensor, tau: Tensor | None, rm: RowMath, lse: Tensor, ent: Tensor,
    a: Tensor, b: Tensor | None, col0: int,
) -> Tensor:  # fmt: skip
    cdt = lse.dtype
    x, t = _scaled(z, rm, cdt)
    lp = _kept(z, x, tok, tau, col0) - lse.unsqueeze(1)
    p = torch.exp(lp)
    g = -a.unsqueeze(1) * p
    if b is not None:
        g = g - b.unsqueeze(1) * torch.where(p > 0, p * (lp + ent.unsqueeze(1)), 0.0)
    cols = torch.arange(col0, col0 + z.shape[1], device=z.device)
    g = g + torch.where(cols == tok.unsqueeze(1), a.unsqueeze(1), 0.0)
    g = g / rm.temperature
    return g if t is None else g * (1.0 - t * t)


def triton_kernels() -> Any:
    """The Triton kernel module in the current mode (compiled, or interpreted)."""
    return load_kernels("dapo_ops.kernels._triton_rows", interpreting())


def _launch(kind: str) -> tuple[Any, dict[str, Any], int]:
    ks = triton_kernels()
    block, warps = (INTERPRET_BLOCKS if interpreting() else GPU_BLOCKS)[kind]
    return ks, launch_options(warps), block


def _params(rm: RowMath, cdt: torch.dtype, device: torch.device) -> Tensor:
    """``[T, c]`` in the compute dtype (Triton would narrow a Python float to float32),
    filled on the device: no copy from the host."""
    out = torch.full((2,), rm.temperature, dtype=cdt, device=device)
    out[1] = rm.softcap or 1.0
    return out


def stats(z: Tensor, tok: Tensor, tau: Tensor | None, rm: RowMath, impl: RowImpl) -> Tensor:
    """``[4, rows]`` ``(m, s0, s1, x_y)`` of the logits block ``z`` (``[rows, cols]``,
    unit column stride), in the compute dtype. ``tok``: int64 ``[rows]``, the chosen
    column (any value outside ``[0, cols)``: not among them); ``tau``: ``[rows]`` raw
    thresholds in the compute dtype, or None."""
    cdt = compute_dtype(z.dtype)
    if impl == "torch" or z.shape[0] == 0:
        return _stats_torch(z, tok, tau, rm)
    ks, opts, block = _launch("stats")
    out = z.new_empty((4, z.shape[0]), dtype=cdt)
    ks.stats[(z.shape[0],)](
        z, z.stride(0), tok.contiguous(), z if tau is None else tau.contiguous(), _params(rm, cdt, z.device), out,
        z.shape[0], z.shape[1], HAS_TAU=tau is not None, HAS_CAP=rm.softcap is not None,
        ACC=_acc(ks, cdt), BLOCK=block, **opts,
    )  # fmt: skip
    return out


def grad_(
    z: Tensor, out: Tensor, tok: Tensor, tau: Tensor | None, rm: RowMath,
    upstream: tuple[Tensor, Tensor, Tensor, Tensor | None], impl: RowImpl, col0: int = 0,
) -> Tensor:  # fmt: skip
    """``out`` (``z``'s shape; ``z`` itself for in place) holding ``G`` of the block ``z``
    whose first column is vocabulary id ``col0``; ``upstream = (lse, H, a, b or None)``
    per row in the compute dtype; ``tok`` the chosen vocabulary ids."""
    lse, ent, a, b = (None if x is None else x.contiguous() for x in upstream)
    assert lse is not None and ent is not None and a is not None
    if impl == "torch" or z.numel() == 0:
        return out.copy_(_grad_torch(z, tok, tau, rm, lse, ent, a, b, col0))
    ks, opts, block = _launch("grad")
    rows, cols = z.shape
    grid = (rows, (cols + block - 1) // block)
    ks.grad[grid](
        z, z.stride(0), out, out.stride(0), tok - col0, z if tau is None else tau.contiguous(),
        _params(rm, lse.dtype, z.device), lse, ent, a, a if b is None else b, cols,
        HAS_TAU=tau is not None, HAS_CAP=rm.softcap is not None, HAS_B=b is not None,
        ACC=_acc(ks, lse.dtype), BLOCK=block, **opts,
    )  # fmt: skip
    return out


def _acc(ks: Any, cdt: torch.dtype) -> Any:
    return ks.tl.float64 if cdt == torch.float64 else ks.tl.float32


def merge(parts: Tensor) -> Tensor:
    """``[4, rows]`` pass-1 pieces of several column splits (``[splits, 4, rows]``, or
    their all-reduced form) combined into the pieces of the whole rows."""
    m = parts[:, 0].amax(dim=0)
    ref = torch.where(m == -math.inf, 0.0, m)
    dm = torch.where(parts[:, 0] == -math.inf, 0.0, parts[:, 0] - ref)
    scale = torch.exp(dm)
    s0 = (scale * parts[:, 1]).sum(dim=0)
    s1 = (scale * (parts[:, 2] + parts[:, 1] * dm)).sum(dim=0)
    return torch.stack([m, s0, s1, parts[:, 3].sum(dim=0)])


def finish(pieces: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(log p_y, H, lse)`` per row from the pieces of whole rows."""
    m, s0, s1, xy = pieces.unbind(0)
    log_s0 = torch.log(s0)
    lse = m + log_s0
    return xy - lse, log_s0 - s1 / s0, lse
