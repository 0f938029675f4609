r"""The two-pass lm-head path: cuBLAS products, one fused row kernel per pass.

Private; :mod:`dapo_ops.logprobs._two_pass_loss` runs it under autograd for
:func:`dapo_ops.linear_policy_loss` and :func:`dapo_ops.fused_logprobs_entropy`
(``backend="triton"`` or ``"two_pass"``). For ``hidden [N, d]`` (masked rows already
zero), ``weight [V, d]``, ``bias [V]``:

- **pass 1** (:func:`pass1`): the logits ``z = h W^T + b`` by one product (``torch.mm`` /
  ``addmm``: cuBLAS on a GPU) and one row kernel (:func:`dapo_ops.kernels.rows.stats`)
  giving per token ``log p_y``, ``H`` and ``lse``. With ``keep`` the ``[N, V]`` logits
  are formed whole, in the input dtype, and kept for pass 2; without, a block of
  ``budget // V`` tokens at a time in one reused buffer, then dropped.
- between the passes the caller's engine turns the ``[N]`` vectors into ``a = dL/d log
  p_y`` and ``b = dL/dH``;
- **pass 2** (:func:`pass2`): the row kernel :func:`dapo_ops.kernels.rows.grad_` writes
  ``G = dL/dz`` over the logits in the input dtype, then ``dh = G W``, ``dW = G^T h``,
  ``db = G^T 1``. With ``keep``: over the kept logits, two products over the whole
  vocabulary (3 products in all, the naive path's count). Without: the vocabulary a
  slice of ``budget // N`` ids at a time, the slice's logits formed again (4 products
  in all), its rows of ``dW`` written once in the weight's dtype, ``dh`` summed over the
  slices in float32 (cuBLAS's float32 output of a bfloat16 product where torch has
  ``out_dtype``, so no slice is rounded to bfloat16 before the sum). No float32
  ``[V, d]`` buffer in either setting.

With a sampler truncation the per-row thresholds are found from whole rows in pass 1
(:func:`dapo_ops.logprobs._truncation.thresholds` on ``x = cap(z)/T``) and kept as raw
logits: the smallest raw logit of the kept set, so every kernel and implementation keeps
the same columns of the same logits bit for bit, whatever rounding ``x`` gets. The logits
are then kept (``keep_logits=False`` is refused): a vocabulary slice's product formed
again may round a logit at the threshold to the other side. The derivation and the
memory/time arithmetic: ``docs/linear_loss.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.kernels.rows import RowImpl, RowMath, compute_dtype, finish, grad_, stats
from dapo_ops.logprobs._truncation import Truncation, thresholds
from dapo_ops.logprobs._vocab_parallel import VocabSplit, merge_stats

#: Elements of the recomputing setting's one buffer (pass 1's token blocks, pass 2's
#: vocabulary slices): 2**27, 256 MiB of bfloat16 logits (a few hundred rows of a 152k
#: vocabulary in pass 1; 16384 ids for 8192 tokens in pass 2). CPU: 2**24.
BUDGET_ELEMENTS = {"cpu": 2**24, "other": 2**27}

#: ``keep_logits=None`` keeps the logits when they take at most this many bytes in the
#: input dtype (the 7B-scale step, 8192 x 151936 bfloat16, is 2.3 GiB), else recomputes.
KEEP_LOGITS_BYTES = 4 * 2**30

#: With the torch row functions, rows per call: their float temporaries stay a few
#: times this many elements. Both this and the budget are a rank's share of them with a
#: split vocabulary (its memory falls with the number of ranks).
TORCH_ROWS_ELEMENTS = 2**22


@dataclasses.dataclass(frozen=True)
class TwoPassSpec:
    """The row math, the truncation, the row kernels' implementation, the memory setting."""

    rows: RowMath
    trunc: Truncation | None
    impl: RowImpl
    keep: bool
    budget: int  # elements of the recomputing buffer
    split: VocabSplit | None = None  # the rank's share of a split vocabulary, or None
    piece: int = 2**22  # elements of the torch row functions' (and thresholds') pieces
    whole_budget: int = 2**27  # the budget of the whole vocabulary (a split's ranks alike)


def keep_by_size(keep_logits: bool | None, tokens: int, vocab: int, dtype: torch.dtype) -> bool:
    """``keep_logits``, or when None whether the logits fit :data:`KEEP_LOGITS_BYTES`."""
    if keep_logits is not None:
        return keep_logits
    return tokens * vocab * dtype.itemsize <= KEEP_LOGITS_BYTES


def two_pass_spec(
    path: str, rows: RowMath, trunc: Truncation | None, keep_logits: bool | None,
    h: Tensor, vocab: int, split: VocabSplit | None = None, rows_run: int | None = None,
) -> TwoPassSpec:  # fmt: skip
    """The spec of a call resolved to ``path`` (``"two_pass"`` or ``"triton"``) with
    ``h`` its ``[..., d]`` hidden states, ``vocab`` the rank's rows of the weight and
    ``rows_run`` the rows the passes run on (None: all of ``h``'s)."""
    tokens = h.numel() // max(h.shape[-1], 1) if rows_run is None else rows_run
    if trunc is not None and keep_logits is False:
        raise InputError(
            "keep_logits=False with top_k, top_p or min_p: pass 2 would form the logits again "
            "in vocabulary slices, whose products may round a logit at the kept set's "
            "threshold to the other side; keep_logits=True (or None) decides the set once, "
            "backend='chunked' forms each chunk again with the same product"
        )
    # with a truncation the kept set is decided once, over logits formed once: kept
    keep = True if trunc is not None else keep_by_size(keep_logits, tokens, vocab, h.dtype)
    budget, piece = (
        BUDGET_ELEMENTS["cpu" if h.device.type == "cpu" else "other"],
        TORCH_ROWS_ELEMENTS,
    )
    if split is not None:  # a rank's buffers its share of the vocabulary's: memory / tp
        budget = max(1, budget * split.size // split.vocab)
        piece = max(1, piece * split.size // split.vocab)
    impl: RowImpl = "triton" if path == "triton" else "torch"
    return TwoPassSpec(rows, trunc, impl, keep, budget, split, piece)


def local_ids(tok: Tensor, spec: TwoPassSpec) -> Tensor:
    """The chosen ids as columns of this rank's slice (outside ``[0, V_r)``: elsewhere)."""
    return tok if spec.split is None else tok - spec.split.start


class Pass1(NamedTuple):
    """Pass 1's per-token results (compute dtype) and what pass 2 reuses."""

    logp: Tensor
    ent: Tensor
    lse: Tensor
    tau: Tensor | None  # raw-logit thresholds of the kept sets (truncation), or None
    logits: Tensor | None  # the kept [N, V] logits (keep), or None


def logits_into(out: Tensor, h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """``h W^T + b`` written into ``out`` (one product)."""
    if b is None:
        return torch.mm(h, w.T, out=out)
    return torch.addmm(b, h, w.T, out=out)


def _view(buf: Tensor, rows: int, cols: int) -> Tensor:
    return buf[: rows * cols].view(rows, cols)


def _thresholds(z: Tensor, spec: TwoPassSpec) -> Tensor | None:
    """Raw-logit thresholds of the rows of ``z``: the smallest raw logit whose ``x`` is
    at least the sampler's threshold on ``x`` (a piece of rows at a time: the float
    temporaries stay a few times ``spec.piece``)."""
    if spec.trunc is None:
        return None
    cdt, cap = compute_dtype(z.dtype), spec.rows.softcap
    step = max(1, spec.piece // max(z.shape[1], 1))
    out = []
    for s in range(0, z.shape[0], step):
        raw = z[s : s + step].to(cdt)
        x = raw if cap is None else cap * torch.tanh(raw / cap)
        x = x / spec.rows.temperature
        tau = thresholds(x, spec.trunc)
        out.append(torch.where(x >= tau.unsqueeze(1), raw, math.inf).amin(dim=1))
    return torch.cat(out) if out else z.new_zeros(0, dtype=cdt)


def _row_pieces(spec: TwoPassSpec, rows: int, cols: int) -> list[tuple[int, int]]:
    step = rows if spec.impl == "triton" else max(1, spec.piece // max(cols, 1))
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


#: Reads a block of whole rows of logits in pass 1: ``(z, rows)``.
RowVisit = Callable[[Tensor, slice], None]


def blocks1(
    spec: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None, visit: RowVisit,
    rows_per_block: int | None = None,
) -> Tensor | None:  # fmt: skip
    """Pass 1's products: every row's logits handed to ``visit`` a block of whole rows at
    a time (``rows_per_block`` of them when given: the same blocks on every rank); the
    ``[N, V]`` logits returned when kept, else None."""
    n, vocab = h.shape[0], w.shape[0]
    if spec.keep:
        z = logits_into(h.new_empty(n, vocab), h, w, b)
        for s, e in _visits(spec, vocab, rows_per_block, 0, n):
            visit(z[s:e], slice(s, e))
        return z
    rows = max(1, spec.budget // vocab) if rows_per_block is None else rows_per_block
    buf = h.new_empty(min(rows, n) * vocab)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        z = logits_into(_view(buf, e - s, vocab), h[s:e], w, b)
        for s2, e2 in _visits(spec, vocab, rows_per_block, s, e):
            visit(z[s2 - s : e2 - s], slice(s2, e2))
    return None


def _visits(
    spec: TwoPassSpec, vocab: int, rows_per_block: int | None, s: int, e: int
) -> list[tuple[int, int]]:
    """The blocks of rows ``[s, e)`` that pass 1 hands to its visitor."""
    if rows_per_block is None:
        return [(s + a, s + c) for a, c in _row_pieces(spec, e - s, vocab)]
    return [(a, min(a + rows_per_block, e)) for a in range(s, e, rows_per_block)]


def pass1(spec: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None, tok: Tensor) -> Pass1:
    """``log p_y``, ``H``, ``lse`` of every row of ``h`` (``tok`` int64 ``[N]``)."""
    cdt = compute_dtype(h.dtype)
    pieces = h.new_empty((4, h.shape[0]), dtype=cdt)
    taus: list[Tensor] = []
    tok = local_ids(tok, spec)
    logits = blocks1(spec, h, w, b, functools.partial(_visit_stats, spec, tok, pieces, taus))
    if spec.split is not None:
        pieces = merge_stats(pieces, spec.split)
    logp, ent, lse = finish(pieces)
    return Pass1(logp, ent, lse, torch.cat(taus) if taus else None, logits)


# The visitors of the passes are module functions bound by functools.partial, not
# closures: torch.compile traces them inside the autograd functions either way, but a
# closure is a function made at run time, which a decorating import hook (the test suite's
# jaxtyping one) then wraps at run time too, and that wrapping does not trace.
def _visit_stats(
    spec: TwoPassSpec, tok: Tensor, pieces: Tensor, taus: list[Tensor], z: Tensor, rows: slice
) -> None:
    """Pass 1 on a block: the rows' statistics into ``pieces``, the thresholds kept."""
    tau = _thresholds(z, spec)
    pieces[:, rows] = stats(z, tok[rows], tau, spec.rows, spec.impl)
    if tau is not None:
        taus.append(tau)


@functools.lru_cache(maxsize=4)
def _has_out_dtype(device_type: str) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` runs on this device type
    (a float32 result of a bfloat16/float16 product: CUDA builds of recent torch)."""
    if device_type == "cpu":
        return False
    try:
        a = torch.zeros(2, 2, dtype=torch.bfloat16, device=device_type)
        torch.addmm(a.float(), a, a, out_dtype=torch.float32)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _add_hidden_grad(dh: Tensor, g: Tensor, w: Tensor) -> None:
    """``dh += g w`` with ``dh`` in the compute dtype, whatever ``g``'s and ``w``'s dtype."""
    if g.dtype == dh.dtype:
        dh.addmm_(g, w)
    elif _has_out_dtype(g.device.type):
        torch.addmm(dh, g, w, out_dtype=dh.dtype, out=dh)  # type: ignore[call-overload]
    elif g.device.type == "cpu":
        dh.addmm_(g.to(dh.dtype), w.to(dh.dtype))
    else:  # an old torch without out_dtype: the slice's product rounded once
        dh.add_(g @ w)


#: Writes ``G`` over a block of logits in place: ``(z, rows, col0)`` with ``z`` the
#: block (``[rows.stop - rows.start, width]``), its first vocabulary id ``col0``.
RowGrad = Callable[[Tensor, slice, int], None]


def products2(
    spec: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None, logits: Tensor | None,
    row_grad: RowGrad, need: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """Pass 2's products around ``row_grad``: ``(dh, dW, db)`` in the inputs' dtypes
    (None where ``need`` says so), over the kept ``logits`` or vocabulary slices."""
    n, vocab = h.shape[0], w.shape[0]
    cdt = compute_dtype(h.dtype)
    if n == 0:
        zeros = (h.new_zeros(h.shape), w.new_zeros(w.shape), w.new_zeros(vocab))
        return tuple(z if want else None for z, want in zip(zeros, need, strict=True))  # type: ignore[return-value]
    if spec.keep:
        assert logits is not None
        for s, e in _row_pieces(spec, n, vocab):
            row_grad(logits[s:e], slice(s, e), 0)
        g = logits
        return (
            g @ w if need[0] else None,
            g.T @ h if need[1] else None,
            g.sum(dim=0, dtype=cdt).to(w.dtype) if need[2] else None,
        )
    cols = max(1, spec.budget // n)
    buf = h.new_empty(n * min(cols, vocab))
    dh = h.new_zeros(h.shape, dtype=cdt) if need[0] else None
    gw = w.new_empty(w.shape) if need[1] else None
    gb = w.new_empty(vocab, dtype=cdt) if need[2] else None
    for c0 in range(0, vocab, cols):
        c1 = min(c0 + cols, vocab)
        g = logits_into(_view(buf, n, c1 - c0), h, w[c0:c1], None if b is None else b[c0:c1])
        for s, e in _row_pieces(spec, n, c1 - c0):
            row_grad(g[s:e], slice(s, e), c0)
        if gw is not None:
            torch.mm(g.T, h, out=gw[c0:c1])
        if dh is not None:
            _add_hidden_grad(dh, g, w[c0:c1])
        if gb is not None:
            torch.sum(g, dim=0, dtype=cdt, out=gb[c0:c1])
    return (
        None if dh is None else dh.to(h.dtype),
        gw,
        None if gb is None else gb.to(w.dtype),
    )


def pass2(
    spec: TwoPassSpec, h: Tensor, w: Tensor, b: Tensor | None, tok: Tensor, p1: Pass1,
    a: Tensor, bvec: Tensor | None, need: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """``(dh, dW, db)`` of ``sum_t a_t log p_y + b_t H_t``; ``p1`` from :func:`pass1` on
    the same inputs."""
    cdt = compute_dtype(h.dtype)
    up = (p1.lse, p1.ent, a.to(cdt), None if bvec is None else bvec.to(cdt))
    row_grad = functools.partial(_row_grad, spec, local_ids(tok, spec), up, p1.tau)
    return products2(spec, h, w, b, p1.logits, row_grad, need)


def _row_grad(
    spec: TwoPassSpec, tok: Tensor, up: tuple[Tensor | None, ...], tau: Tensor | None,
    z: Tensor, rows: slice, col0: int,
) -> None:  # fmt: skip
    """Pass 2 on a slice: the logits' gradient over ``z``, in place."""
    part = tuple(None if x is None else x[rows] for x in up)
    grad_(z, z, tok[rows], None if tau is None else tau[rows], spec.rows, part, spec.impl, col0)  # type: ignore[arg-type]
