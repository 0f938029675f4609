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

import torch
from torch import Tensor

from dapo_ops.surrogate import clip_bounds

#: Default block size (elements) of the eager CPU path: 256 Ki float32 = 1 MiB per buffer;
#: the three buffers of a block and its slice of the gradient stay in L2/L3, and each op
#: on a block is long enough to split across threads. They are allocated per call (the
#: library keeps no buffers between calls).
CPU_CHUNK_ELEMS = 1 << 18

#: Stands in for an infinite bound in the float-only path (ratios are below e^80 there).
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

    Per block, about ten passes over cache-resident buffers: the log-ratio, one
    ``aminmax`` of it (the only host read: is any log-ratio NaN, is the clamp active),
    ``exp``, ``maximum``/``minimum`` against the bounds, the mask as floats, the loss row
    sums (``q * m`` summed), and the gradient ``[bounded == r] * m * r * (w
    * -A)``. The mask multiplies finite values only, so masked positions contribute
    exactly 0: a log-ratio that is NaN anywhere in the block (garbage, or ``-inf - -inf``)
    sends the block to :func:`clamp_terms`, and so do advantages or weights large enough
    for a product to overflow. With per-row advantages the loss row sum is
    ``(-A) * sum_t m q`` (one rounding of the sum's order away from the reference's).
    """
    batch, seq = logp.shape
    dtype = scale.dtype
    row_sums = torch.empty((batch,), dtype=dtype)
    grad = torch.empty((batch, seq), dtype=dtype) if with_grad else None
    clamp = log_ratio_clamp
    adv = advantages.to(dtype)
    per_row = adv.shape[-1] == 1
    # per-row advantages: -A, the bounds and w * -A, [b, 1] each, computed once
    row_terms = (
        (
            adv.neg(),
            *clip_bounds(adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip),
            scale * adv.neg(),
        )
        if per_row
        else None
    )
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    cap = _BIG if dual_clip is None else dual_clip
    # no product can overflow while |A| * e^clamp * max(|w|, 1) stays far below the range
    biggest = float(adv.abs().amax()) if adv.numel() else 0.0
    biggest *= max(float(scale.abs().amax()), 1.0)
    exact_only = not (clamp <= 60.0 and biggest * math.exp(clamp) < _BIG * 1e-3)
    same_dtype = torch.promote_types(logp.dtype, old_logp.dtype) == dtype
    valid_u8 = valid.view(torch.uint8)
    per_row_scale = scale.ndim > 0
    numel = rows * seq
    n_bufs = 4 if per_row else 8
    bufs = [torch.empty((numel,), dtype=dtype) for _ in range(n_bufs)]

    for start in range(0, batch, rows):
        sl = slice(start, min(start + rows, batch))
        n = sl.stop - start
        r, q, vf, kv, *tok = (b[: n * seq].view(n, seq) for b in bufs)
        if same_dtype:
            torch.sub(logp[sl], old_logp[sl], out=r)
        else:
            r.copy_(logp[sl]).sub_(old_logp[sl])
        low, high = torch.aminmax(r)
        low_f, high_f = float(low), float(high)
        if exact_only or math.isnan(low_f) or math.isnan(high_f):
            rs, g = clamp_terms(
                logp[sl],
                old_logp[sl],
                adv[sl],
                valid[sl],
                scale[sl] if per_row_scale else scale,
                eps_low,
                eps_high,
                dual_clip,
                clamp,
                with_grad,
            )
            row_sums[sl] = rs
            if grad is not None and g is not None:
                grad[sl] = g
            continue
        vf.copy_(valid_u8[sl])
        keep = vf
        if low_f < -clamp or high_f > clamp:  # rare: the log-ratio clamp is active
            torch.clamp(r, -clamp, clamp, out=q)
            if with_grad:
                keep = torch.eq(q, r, out=kv).mul_(vf)
            r.copy_(q)
        r.exp_()
        if row_terms is not None:
            na_b, lo_b, hi_b, wna_b = (t[sl] for t in row_terms)
        else:
            na_b = torch.neg(adv[sl], out=tok[3])
            _token_bounds(na_b, tok, lo, cap, hi)
            lo_b, hi_b = tok[1], tok[2]
            # ((w * -A) * 1) * r below: the reference's rounding order
            wna_b = torch.mul(na_b, scale[sl] if per_row_scale else scale, out=tok[0])
        torch.maximum(r, lo_b, out=q)
        torch.minimum(q, hi_b, out=q)
        if grad is not None:
            torch.eq(q, r, out=grad[sl]).mul_(keep).mul_(r).mul_(wna_b)
        if per_row:  # the loss row sums: (-A) * sum_t m q
            torch.sum(q.mul_(vf), dim=-1, out=row_sums[sl]).mul_(na_b[:, 0])
        else:
            torch.sum(q.mul_(na_b).mul_(vf), dim=-1, out=row_sums[sl])
    return row_sums, grad
