"""ClipHigher's eager CPU kernel: float-only ops on cache-sized row blocks.

Private; :meth:`ClipHigher.cpu_terms` hands it to the engine (:mod:`dapo_ops.engine._engine`),
which calls it for eager CPU work instead of the ``where``-based generic body (CPU
``where`` and bool-valued kernels cost 5-50x a float multiply there). It computes, for
each block of rows, exactly what the generic body computes from
:meth:`ClipHigher.term` and :meth:`ClipHigher.grad`:

.. math::

    \\ell = -A\\,\\mathrm{clamp}(r, lo_A, hi_A), \\qquad
    \\frac{\\partial \\textstyle\\sum_i w_i \\sum_t m\\,\\ell}{\\partial \\log\\pi}
        = (w\\,(-A))\\,r\\,[lo_A \\le r \\le hi_A]\\,[|\\log r| \\le C]\\,m

Masked positions are removed by multiplying *finite* values by 0, which is exact. So
every factor must be finite at masked positions: a block whose log-ratio holds a NaN at
a masked position (garbage, or ``-inf - -inf``) has it replaced by 0 first, and masked
advantages that are not finite are replaced by 0 before any block runs. The result is
then bitwise the one for clean inputs. Only non-finite or overflowing *valid* inputs
send a block (or the call) to the generic body.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dapo_ops._core._rules import finite_or_masked

#: Stands in for an infinite bound in the float-only path (its ratios are at most e^60).
_BIG = 1e30


@runtime_checkable
class Bounds(Protocol):
    """What the kernel reads of its objective (:class:`~dapo_ops.ClipHigher`'s fields)."""

    @property
    def eps_low(self) -> float: ...
    @property
    def eps_high(self) -> float: ...
    @property
    def dual_clip(self) -> float | None: ...
    @property
    def log_ratio_clamp(self) -> float: ...
    def bounds(self, adv: Tensor) -> tuple[Tensor, Tensor]: ...


@runtime_checkable
class BlockTerm(Protocol):
    """A term added row block by row block while the block is in cache: the engine's KL
    penalty (:class:`dapo_ops.engine._kl_cpu.KLBlocks`). Typed here, not imported: the
    engine sits above the objectives."""

    def prepare(self, sl: slice, valid: Tensor) -> bool: ...
    def add(
        self, sl: slice, vf: Tensor, row_sums: Tensor, grad: Tensor | None, scratch: Tensor
    ) -> None: ...


#: The generic body on a block: (logp, old_logp, adv, valid, scale, with_grad, rows) -> terms.
Exact = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, bool, slice], tuple[Tensor, Tensor | None]
]


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


def _magnitude(adv: Tensor, scale: Tensor, w_neg_adv: Tensor | None) -> tuple[float, float]:
    """Bounds on ``|w A|``: the largest, for the overflow checks (inf or NaN when a product
    is not finite), and the smallest (0 per token), for the sign-of-zero shortcut.

    Per-row advantages: ``w * -A`` finite implies ``-A`` finite unless ``w == 0``, when
    ``0 * inf`` is NaN and fails the check too. Per-token: ``max |A| * max(max |w|, 1)``.
    """
    if w_neg_adv is not None:
        if not w_neg_adv.numel():
            return 0.0, 0.0
        smallest, largest = (float(v) for v in torch.aminmax(w_neg_adv.abs()))
        return (largest if math.isfinite(largest) else math.inf), smallest
    biggest = float(adv.abs().amax()) if adv.numel() else 0.0
    return biggest * max(float(scale.abs().amax()), 1.0), 0.0


def _fast_path_ok(per_row: bool, magnitude: float, clamp: float) -> bool:
    """May the float-only path run? Every factor multiplied by a 0 mask must be finite:
    the ratio (``exp`` of a log-ratio within ``+-clamp <= 60``), ``-A`` and ``w * -A``; with
    per-token advantages the largest ``|A| |w| e^clamp`` must stay far below the float
    range (the bounds stand in for infinities with ``_BIG``)."""
    if clamp > 60.0 or not math.isfinite(magnitude):
        return False
    return per_row or magnitude * math.exp(clamp) < _BIG * 1e-3


def _masked_advantages(adv: Tensor, valid: Tensor) -> Tensor:
    """Advantages with 0 wherever they touch no valid token (rows with none, per row)."""
    live = valid.any(dim=-1, keepdim=True) if adv.shape[-1] == 1 else valid
    return torch.where(live, adv, 0.0)


def cpu_terms(
    objective: Bounds,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    scale: Tensor,
    with_grad: bool,
    rows: int,
    exact: Exact,
    *,
    is_weights: Tensor | None = None,
    kl: BlockTerm | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Row sums ``[b]`` and ``d(sum_i w_i rowsum_i)/d logp`` ``[b, s]`` (or None).

    Per block, about ten passes over cache-resident memory, working inside the block's
    slice of the gradient and a few scratch buffers: the log-ratio ``d``, one ``aminmax``
    of it (the only host read: is any ``d`` NaN, is the clamp active), ``r = exp(d)``,
    ``q = min(max(r, lo_A), hi_A)``, ``q m`` with the mask ``m`` as floats, its row sums
    (times ``rho`` and ``-A``: the loss), then the gradient ``r [q m == r] ((w rho) (-A))``:
    ``r > 0``, so ``q m == r`` holds exactly where the token is valid and unclipped. The
    loss row sum ``(-A) sum_t q m rho`` differs from the generic ``sum_t (-A q) rho m`` by
    rounding only; the gradient is bitwise the generic one. ``is_weights`` ``rho`` (one
    more host read per block: are they finite) and the KL term ``kl`` (added per block by
    :class:`dapo_ops.engine._kl_cpu.KLBlocks`) are optional.
    """
    batch, seq = logp.shape
    dtype = scale.dtype
    row_sums = torch.empty((batch,), dtype=dtype)
    grad = torch.empty((batch, seq), dtype=dtype) if with_grad else None
    clamp = objective.log_ratio_clamp
    adv = advantages if advantages.dtype == dtype else advantages.to(dtype)
    per_row = adv.shape[-1] == 1

    def row_terms_of(a: Tensor) -> tuple[Tensor, ...] | None:
        # per-row advantages: -A, the bounds and w * -A, [b, 1] each, computed once
        if not per_row:
            return None
        lo_all, hi_all = objective.bounds(a)
        return (a.neg(), lo_all, hi_all, scale * a.neg())

    row_terms = row_terms_of(adv)
    magnitude, smallest = _magnitude(adv, scale, row_terms[3] if row_terms else None)
    fast = _fast_path_ok(per_row, magnitude, clamp)
    if not fast and clamp <= 60.0:  # maybe only masked advantages are not finite
        adv = _masked_advantages(adv, valid)
        row_terms = row_terms_of(adv)
        magnitude, smallest = _magnitude(adv, scale, row_terms[3] if row_terms else None)
        fast = _fast_path_ok(per_row, magnitude, clamp)
    tiny = torch.finfo(dtype).tiny
    lo, hi = 1.0 - objective.eps_low, 1.0 + objective.eps_high
    cap = _BIG if objective.dual_clip is None else objective.dual_clip
    same_dtype = logp.dtype == old_logp.dtype == dtype
    valid_u8 = valid.view(torch.uint8)
    per_row_scale = scale.ndim > 0
    # scratch: q, the mask as floats, r when there is no gradient buffer to work in, the
    # per-token terms or, with IS weights and per-row advantages, one for (w rho) (-A);
    # rho itself is copied (to the compute dtype, or without masked garbage) on demand
    i_tok = 2 + (not with_grad)
    n_bufs = i_tok + (4 if not per_row else int(is_weights is not None))
    bufs = [torch.empty((rows, seq), dtype=dtype) for _ in range(n_bufs)] if fast else []
    rho_buf: list[Tensor] = []
    one_block = rows >= batch

    for start in range(0, batch, rows):
        sl = slice(start, min(start + rows, batch))
        lp_b, old_b = (logp, old_logp) if one_block else (logp[sl], old_logp[sl])
        valid_b = valid if one_block else valid[sl]
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
            if math.isnan(low) or math.isnan(high):  # NaN somewhere: masked garbage?
                r.copy_(torch.where(valid_b, r, 0.0))
                low, high = (float(x) for x in torch.aminmax(r))
            block_fast = not (math.isnan(low) or math.isnan(high))  # NaN on a valid token
        rho = None
        if block_fast and is_weights is not None:
            if not rho_buf and is_weights.dtype != dtype:
                rho_buf.append(torch.empty((rows, seq), dtype=dtype))
            rho, bound = _weights(is_weights, sl, one_block, valid_b, rho_buf, magnitude)
            block_fast = rho is not None and math.exp(min(high, clamp)) * bound < _BIG * 1e-3
        if block_fast and kl is not None:
            block_fast = kl.prepare(sl, valid_b)
        if not block_fast:
            w_b = scale[sl] if per_row_scale else scale
            rs, g = exact(lp_b, old_b, adv[sl], valid_b, w_b, with_grad, sl)
            row_sums[sl] = rs
            if grad is not None and g is not None:
                grad[sl] = g
            continue
        keep = None
        if with_grad and (low < -clamp or high > clamp):  # rare: the log-ratio clamp acts
            keep = torch.empty_like(r)
            torch.eq(torch.clamp(r, -clamp, clamp, out=q), r, out=keep)
            r.copy_(q)
        elif low < -clamp or high > clamp:
            r.clamp_(-clamp, clamp)
        r.exp_()
        w_b = scale if not per_row_scale or one_block else scale[sl]
        if row_terms is not None:
            na_b, lo_b, hi_b, wna_b = (t if one_block else t[sl] for t in row_terms)
        else:
            tok = views[i_tok : i_tok + 4]
            na_b = torch.neg(adv if one_block else adv[sl], out=tok[3])
            _token_bounds(na_b, tok, lo, cap, hi)
            lo_b, hi_b = tok[1], tok[2]
        torch.maximum(r, lo_b, out=q)  # (clamp with tensor bounds is ~5x slower on CPU)
        torch.minimum(q, hi_b, out=q)
        vf.copy_(valid_u8 if one_block else valid_u8[sl])
        q.mul_(vf)  # q m: the loss is (-A) q m rho
        rs = row_sums if one_block else row_sums[sl]
        ind = None  # [unclipped and valid] as 0/1 floats, for the gradient
        if row_terms is not None:
            if grad is not None and rho is not None:  # the indicator first, then q rho
                ind = torch.eq(q, r, out=views[-1])
            torch.sum(q if rho is None else q.mul_(rho), dim=-1, out=rs).mul_(na_b[:, 0])
            if grad is not None and rho is None:
                ind = torch.eq(q, r, out=q)
            elif grad is not None and rho is not None:  # ((w * rho) * -A): q is free now
                wna_b = torch.mul(rho, w_b, out=q).mul_(na_b)
        else:
            if grad is not None:
                ind = torch.eq(q, r, out=tok[1])
            q.mul_(na_b)
            torch.sum(q if rho is None else q.mul_(rho), dim=-1, out=rs)
            if grad is not None:  # ((w * rho) * -A) * 1: the reference's rounding order
                w_tok = w_b if rho is None else torch.mul(rho, w_b, out=tok[2])
                wna_b = torch.mul(na_b, w_tok, out=tok[2])
        g_b = None
        if ind is not None:
            assert r is not None
            g_b = r.mul_(ind.mul_(keep) if keep is not None else ind).mul_(wna_b)
            # (r ind) wna is the generic (w -A) r where ind = 1, and +-0 elsewhere, where the
            # generic body writes +0.0: adding -0.0 * (ind - 1) turns exactly those -0.0 into
            # +0.0 (and keeps the generic -0.0 of an unclipped token with A = +0). Per-row
            # terms with no |w A| r below the normal range: no -0.0 where ind = 1, so + 0.0
            # does it in one pass
            if rho is None and smallest * math.exp(max(low, -clamp)) > 2 * tiny:
                g_b.add_(0.0)
            else:
                g_b.add_(ind.sub_(1.0), alpha=-0.0)
        if kl is not None:  # q is free again: the KL term's scratch
            kl.add(sl, vf, rs, g_b, q)
    return row_sums, grad


def _weights(
    is_weights: Tensor, sl: slice, one_block: bool, valid: Tensor, buf: list[Tensor], mag: float
) -> tuple[Tensor | None, float]:
    """The block's IS weights in the compute dtype, finite (masked garbage replaced by 0;
    a copy goes to ``buf``, allocated here when first needed), and the bound
    ``max |rho| * mag`` of ``(w rho) (-A)``; None if a valid weight is not finite."""
    rho = is_weights if one_block else is_weights[sl]
    n = rho.shape[0]
    if buf and rho.dtype != buf[0].dtype:
        rho = buf[0].view(-1)[: rho.numel()].view(rho.shape).copy_(rho)
    low, high = (float(x) for x in torch.aminmax(rho))
    if math.isfinite(low) and math.isfinite(high):
        return rho, max(-low, high) * mag
    if not buf:
        buf.append(torch.empty(rho.shape, dtype=rho.dtype))
    out = buf[0].view(-1)[: rho.numel()].view(n, -1)
    clean, biggest = finite_or_masked(rho, valid, out)
    return clean, biggest * mag
