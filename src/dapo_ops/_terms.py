"""Per-token bodies of the fused Clip-Higher loss: row sums of the loss and its gradient.

Private; used by :mod:`dapo_ops._fused` (eager) and :mod:`dapo_ops._compiled`. Both
bodies compute, for a block of rows,

.. math::

    \\ell = -A\\,\\mathrm{clamp}(r, lo_A, hi_A), \\qquad
    \\frac{\\partial \\textstyle\\sum_i w_i \\sum_t m\\,\\ell}{\\partial \\log\\pi}
        = w\\,(-A)\\,r\\,[lo_A \\le r \\le hi_A]\\,[|\\log r| \\le C]\\,m

with the bounds of :func:`dapo_ops.surrogate.clip_bounds` and the log-ratio clamp ``C``:
the clamp form of :func:`dapo_ops.surrogate.clipped_objective`, so the same per-token
values and the same gradient, rounded in the same order (``(w * -A) * r``), as the
reference composition under autograd.

- :func:`clamp_terms`: ``where``-based, exact whatever the masked positions hold (NaN and
  inf included); the body on GPUs, under ``torch.compile`` and for CPU blocks that hold
  garbage;
- :func:`cpu_terms`: the eager CPU path, float-only kernels on cache-sized row blocks
  (CPU ``where`` and bool-valued kernels cost 5-50x a float multiply there), which hands
  any block with a NaN log-ratio to :func:`clamp_terms`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from dapo_ops.surrogate import clip_bounds

#: Default block size (elements) of the eager CPU path: 512 Ki float32 = 2 MiB per
#: buffer. A block's two scratch buffers and its slice of the gradient (6 MiB) stay in
#: the last-level cache, and each op on a block is long enough to split across threads
#: (measured on 2 cores: 1.1x faster than 128 Ki blocks at 512x8192). They are allocated
#: per call (the library keeps no buffers between calls).
CPU_CHUNK_ELEMS = 1 << 19

#: Stands in for an infinite bound in the float-only path (its ratios are at most e^60).
_BIG = 1e30


def clamp_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    scale: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
    with_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """Row sums ``[b]`` of the masked loss and ``d(sum_i w_i rowsum_i)/d logp`` ``[b, s]``.

    ``advantages`` ``[b, 1]`` or ``[b, s]``; ``valid`` bool (or a uint8 view of it: see
    :mod:`dapo_ops._compiled`); ``scale`` 0-dim or ``[b, 1]`` (the weights w_i) in the
    compute dtype. Masked positions are removed with ``where``: whatever they hold never
    reaches a sum or the gradient.
    """
    dtype = scale.dtype
    if valid.dtype != torch.bool:
        valid = valid.to(dtype) != 0
    lr = logp.to(dtype) - old_logp.to(dtype)
    clamped = lr.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = clamped.exp()
    adv = advantages.to(dtype)
    lo, hi = clip_bounds(adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    neg_adv = adv.neg()
    bounded = torch.minimum(torch.maximum(ratio, lo), hi)
    row_sums = torch.where(valid, bounded * neg_adv, 0.0).sum(dim=-1)
    if not with_grad:
        return row_sums, None
    # the token passes the gradient where no clamp is active (NaN: none passes)
    keep = (clamped == lr) & (bounded == ratio) & valid
    return row_sums, torch.where(keep, (scale * neg_adv) * ratio, 0.0)


def _token_bounds(neg_adv: Tensor, bufs: list[Tensor], lo: float, cap: float, hi: float) -> None:
    """Per-token ``lo_A``/``hi_A`` into ``bufs[1]``/``bufs[2]`` with float ops (no ``where``).

    ``s = [A < 0]`` in {0, 1}; ``lo_A = (s - 1) BIG + lo s`` and ``hi_A = cap s + hi (1 - s)``:
    each is one exact term plus an exact zero, so the bounds are the rounded constants.
    """
    s, lo_a, hi_a = bufs[0], bufs[1], bufs[2]
    torch.gt(neg_adv, 0.0, out=s)
    torch.sub(s, 1.0, out=lo_a)  # s - 1
    torch.mul(s, cap, out=hi_a).sub_(lo_a, alpha=hi)
    lo_a.mul_(_BIG).add_(s, alpha=lo)


def _fast_path_ok(adv: Tensor, scale: Tensor, w_neg_adv: Tensor | None, clamp: float) -> bool:
    """May the float-only path run? Finite weights, no product overflow from a masked token.

    Masked tokens are removed by multiplying finite values by 0, so every factor must be
    finite: the ratio (``exp`` of a log-ratio within ``+-clamp <= 60``), ``-A`` and
    ``w * -A``. Per-row advantages: ``w * -A`` finite implies ``-A`` finite unless
    ``w == 0``, when ``0 * inf`` is NaN and fails the check too (a sum propagates NaN and
    inf; a finite sum that overflows only costs the fast path). Per-token: the largest
    ``|A| * |w| * e^clamp`` must stay far below the float range.
    """
    if clamp > 60.0:
        return False
    if w_neg_adv is not None:
        return math.isfinite(float(w_neg_adv.sum()))
    biggest = float(adv.abs().amax()) if adv.numel() else 0.0
    biggest *= max(float(scale.abs().amax()), 1.0)
    return biggest * math.exp(clamp) < _BIG * 1e-3


def cpu_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    scale: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
    with_grad: bool,
    *,
    rows: int,
) -> tuple[Tensor, Tensor | None]:
    """:func:`clamp_terms` on CPU, in blocks of ``rows`` rows, with float-only kernels.

    Per block, about ten passes over cache-resident memory, working inside the block's
    slice of the gradient and two scratch buffers: the log-ratio ``d``, one ``aminmax``
    of it (the only host read: is any ``d`` NaN, is the clamp active), ``r = exp(d)``,
    ``q = min(max(r, lo_A), hi_A)``, ``q m`` with the mask ``m`` as floats, its row sums
    (times ``-A``: the loss), then the gradient ``r [q m == r] (w * -A)``: ``r > 0``, so
    ``q m == r`` holds exactly where the token is valid and unclipped. Masked positions
    are removed by multiplying finite values with 0, which is exact; a block whose ``d``
    holds a NaN (garbage, or ``-inf - -inf``) goes to :func:`clamp_terms` instead, and so
    does every block when a weight or advantage could overflow (:func:`_fast_path_ok`).
    The loss row sum ``(-A) sum_t q m`` differs from the reference's ``sum_t (-A q) m``
    by rounding only; the gradient is bitwise the reference's.
    """
    batch, seq = logp.shape
    dtype = scale.dtype
    row_sums = torch.empty((batch,), dtype=dtype)
    grad = torch.empty((batch, seq), dtype=dtype) if with_grad else None
    clamp = log_ratio_clamp
    adv = advantages if advantages.dtype == dtype else advantages.to(dtype)
    per_row = adv.shape[-1] == 1
    # per-row advantages: -A, the bounds and w * -A, [b, 1] each, computed once
    row_terms = None
    if per_row:
        neg_adv = adv.neg()
        lo_all, hi_all = clip_bounds(adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        row_terms = (neg_adv, lo_all, hi_all, scale * neg_adv)
    fast = _fast_path_ok(adv, scale, row_terms[3] if row_terms else None, clamp)
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    cap = _BIG if dual_clip is None else dual_clip
    same_dtype = logp.dtype == old_logp.dtype == dtype
    valid_u8 = valid.view(torch.uint8)
    per_row_scale = scale.ndim > 0
    # q, the mask as floats, r when there is no gradient buffer to work in, per-token terms
    n_bufs = 2 + (not with_grad) + (0 if per_row else 4)
    bufs = [torch.empty((rows, seq), dtype=dtype) for _ in range(n_bufs)] if fast else []
    one_block = rows >= batch

    exact_opts = (eps_low, eps_high, dual_clip, clamp, with_grad)
    for start in range(0, batch, rows):
        sl = slice(start, min(start + rows, batch))
        lp_b, old_b = (logp, old_logp) if one_block else (logp[sl], old_logp[sl])
        block_fast = fast
        if fast:
            n = sl.stop - start
            views = bufs if n == rows else [b.view(-1)[: n * seq].view(n, seq) for b in bufs]
            q, vf = views[0], views[1]
            r = views[2] if grad is None else (grad if one_block else grad[sl])
            if same_dtype:
                torch.sub(lp_b, old_b, out=r)
            else:
                r.copy_(lp_b).sub_(old_b)
            low, high = (float(x) for x in torch.aminmax(r))
            block_fast = not (math.isnan(low) or math.isnan(high))  # NaN: garbage somewhere
        if not block_fast:
            _exact_block(lp_b, old_b, adv, valid, scale, row_sums, grad, sl, *exact_opts)
            continue
        keep = None
        if with_grad and (low < -clamp or high > clamp):  # rare: the log-ratio clamp acts
            keep = torch.empty_like(r)
            torch.eq(torch.clamp(r, -clamp, clamp, out=q), r, out=keep)
            r.copy_(q)
        elif low < -clamp or high > clamp:
            r.clamp_(-clamp, clamp)
        r.exp_()
        if row_terms is not None:
            na_b, lo_b, hi_b, wna_b = (t if one_block else t[sl] for t in row_terms)
        else:
            tok = views[-4:]
            na_b = torch.neg(adv if one_block else adv[sl], out=tok[3])
            _token_bounds(na_b, tok, lo, cap, hi)
            lo_b, hi_b = tok[1], tok[2]
        torch.maximum(r, lo_b, out=q)
        torch.minimum(q, hi_b, out=q)
        vf.copy_(valid_u8 if one_block else valid_u8[sl])
        q.mul_(vf)  # q m: the loss is (-A) q m
        rs = row_sums if one_block else row_sums[sl]
        if grad is not None:
            if row_terms is not None:
                torch.sum(q, dim=-1, out=rs).mul_(na_b[:, 0])
                ind = torch.eq(q, r, out=q)
            else:
                ind = torch.eq(q, r, out=tok[1])
                torch.sum(q.mul_(na_b), dim=-1, out=rs)
                # ((w * -A) * 1) * r: the reference's rounding order
                w_b = scale if not per_row_scale or one_block else scale[sl]
                wna_b = torch.mul(na_b, w_b, out=tok[2])
            if keep is not None:
                ind.mul_(keep)
            r.mul_(ind).mul_(wna_b)
        elif row_terms is not None:
            torch.sum(q, dim=-1, out=rs).mul_(na_b[:, 0])
        else:
            torch.sum(q.mul_(na_b), dim=-1, out=rs)
    return row_sums, grad


def _exact_block(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    valid: Tensor,
    scale: Tensor,
    row_sums: Tensor,
    grad: Tensor | None,
    sl: slice,
    *opts: Any,
) -> None:
    """:func:`clamp_terms` on the rows ``sl`` (``logp``/``old_logp`` already sliced)."""
    rs, g = clamp_terms(
        logp, old_logp, adv[sl], valid[sl], scale[sl] if scale.ndim > 0 else scale, *opts
    )
    row_sums[sl] = rs
    if grad is not None and g is not None:
        grad[sl] = g
