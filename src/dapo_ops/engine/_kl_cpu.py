"""The KL penalty's eager CPU block: float-only ops next to an objective's CPU kernel.

Private; the engine (:mod:`dapo_ops.engine._engine`) hands a :class:`KLBlocks` to an
objective's CPU kernel (:meth:`ClipHigher.cpu_terms`), which calls it on each row block
while the block is in cache. For a block it adds to the row sums and the gradient what
:func:`dapo_ops.engine._engine.generic_terms` adds for ``kl`` (:class:`~dapo_ops.KLPenalty`)
against ``ref_logp``, weighted per token by ``kl_weights`` ``kappa``:

.. math::

    \\mathrm{rows}_i \\mathrel{+}= \\beta \\sum_t m\\,\\kappa\\,k(\\delta), \\qquad
    g \\mathrel{+}= \\big((w\\kappa)\\beta\\big)\\,k'(\\delta)\\,[\\text{no clamp acts}]\\,m

with ``delta = logp - ref_logp`` clamped to ``+-log_ratio_clamp``. Masked positions are
removed by multiplying *finite* values by 0: a block whose log-ratio or ``kappa`` holds a
NaN or inf at a masked position has it replaced by 0 first (one host read per tensor and
block, on the CPU). A non-finite value on a *valid* token sends the block to the
generic body. The gradient is bitwise the generic one (same operations on the same
values); the row sums differ from it by rounding only.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dapo_ops._core._rules import finite_or_masked
from dapo_ops.engine.kl import KLPenalty


class KLBlocks:
    """One call's KL term, block by block (see the module docstring).

    :meth:`prepare` reads a block's log-ratio (and ``kappa``) into buffers of its own and
    says whether the float-only path may run the block; :meth:`add` then adds the
    block's terms, working in one scratch buffer the kernel lends it.
    """

    def __init__(
        self,
        kl: KLPenalty,
        logp: Tensor,
        ref_logp: Tensor,
        kl_weights: Tensor | None,
        scale: Tensor,
        rows: int,
    ) -> None:
        self.kl, self.logp, self.ref, self.kappa = kl, logp, ref_logp, kl_weights
        self.scale, self.dtype = scale, scale.dtype
        rows = min(rows, logp.shape[0])
        seq = logp.shape[-1]
        # the raw log-ratio; kappa in the compute dtype (only when it must be copied)
        self.bufs = [torch.empty((rows, seq), dtype=self.dtype)]
        self.spare: Tensor | None = None
        self.whole = rows >= logp.shape[0]
        self._raw = self.bufs[0]
        # k3 (GRPO's) works on -delta: expm1(-delta) needs no negation pass then
        self.negated = kl.estimator == "k3" and not kl.straight_through
        self._kappa: Tensor | None = None
        self._clamped = False

    def _view(self, buf: Tensor, n: int) -> Tensor:
        return buf if n == buf.shape[0] else buf.view(-1)[: n * buf.shape[1]].view(n, -1)

    def _spare(self, n: int) -> Tensor:
        if self.spare is None:
            self.spare = torch.empty_like(self.bufs[0])
        return self._view(self.spare, n)

    def prepare(self, sl: slice, valid: Tensor) -> bool:
        """Read the block's log-ratio (and ``kappa``); False if the generic body must run
        it (a NaN on a valid token)."""
        n = sl.stop - sl.start
        raw = self._raw = self._view(self.bufs[0], n)
        lp = self.logp if self.whole else self.logp[sl]
        ref = self.ref if self.whole else self.ref[sl]
        if self.negated:  # k3 reads -delta = ref - logp (exactly -(logp - ref))
            lp, ref = ref, lp
        if lp.dtype == ref.dtype == self.dtype:
            torch.sub(lp, ref, out=raw)
        else:
            raw.copy_(lp).sub_(ref)
        low, high = (float(x) for x in torch.aminmax(raw))
        if not (math.isfinite(low) and math.isfinite(high)):  # masked garbage, maybe
            raw.copy_(torch.where(valid, raw, 0.0))
            low, high = (float(x) for x in torch.aminmax(raw))
            if math.isnan(low) or math.isnan(high):
                return False
        clamp = self.kl.log_ratio_clamp
        self._clamped = low < -clamp or high > clamp
        self._kappa = None
        if self.kappa is not None:
            kappa = self.kappa if self.whole else self.kappa[sl]
            if len(self.bufs) == 1:
                self.bufs.append(torch.empty_like(self.bufs[0]))
            out = self._view(self.bufs[1], n)
            if kappa.dtype != self.dtype:
                kappa = out.copy_(kappa)
            self._kappa = finite_or_masked(kappa, valid, out)[0]
            if self._kappa is None:
                return False
        return True

    def add(
        self, sl: slice, vf: Tensor, row_sums: Tensor, grad: Tensor | None, scratch: Tensor
    ) -> None:
        """Add the prepared block's KL terms to ``row_sums [n]`` and ``grad [n, seq]`` (or
        None); ``vf`` is the block's mask as 0/1 floats, ``scratch`` a free ``[n, seq]``
        buffer."""
        kl, kappa, raw = self.kl, self._kappa, self._raw
        keep = None
        d = raw
        if self._clamped or kl.straight_through:  # raw is needed apart from delta
            d = self._spare(raw.shape[0])
            c = kl.log_ratio_clamp
            torch.clamp(raw, -c, c, out=d)
            if self._clamped and grad is not None and not kl.straight_through:
                keep = torch.eq(d, raw).to(self.dtype)  # rare: the log-ratio clamp acts
        slope: Tensor | None
        if self.negated:  # value expm1(-delta) + delta = e - d, slope -e (d = -delta)
            slope = torch.expm1(d, out=scratch)
            value = torch.sub(slope, d, out=d)
        else:
            value, slope = _value_and_slope(kl, d, scratch)
        if kl.clamp is not None:
            if grad is not None and not kl.straight_through:
                inside = torch.le(value.abs(), kl.clamp).to(self.dtype)
                keep = inside if keep is None else keep.mul_(inside)
            value.clamp_(-kl.clamp, kl.clamp)
        value.mul_(vf)
        if kappa is not None:
            value.mul_(kappa)
        row_sums.add_(value.sum(dim=-1), alpha=kl.beta)
        if grad is None:
            return
        w = self.scale
        if w.ndim > 0 and not self.whole:
            w = w[sl]
        # (w * beta), or ((w * kappa) * beta): generic_terms' rounding
        wb = w * kl.beta if kappa is None else torch.mul(kappa, w, out=value).mul_(kl.beta)
        if self.negated:  # e (-(w beta)) is exactly (w beta) (-e)
            wb = wb.neg_()
        if kl.straight_through:
            slope = raw  # the gradient of k2 at the raw log-ratio
        assert slope is not None
        slope.mul_(wb)
        if keep is not None:  # where(keep, slope, +0.0): -0.0 (keep - 1) fixes the sign
            slope.mul_(keep).add_(keep.sub_(1.0), alpha=-0.0)
        grad.addcmul_(slope, vf)


def _value_and_slope(kl: KLPenalty, d: Tensor, t: Tensor) -> tuple[Tensor, Tensor | None]:
    """The estimate ``k(d)`` and ``k'(d)`` with the generic body's operations, in place
    in ``d`` and ``t`` (which holds which depends on the estimator)."""
    est = kl.estimator
    if est == "k3":  # value expm1(-d) + d, slope -expm1(-d) (straight-through: no slope)
        torch.neg(d, out=t).expm1_()
        return d.add_(t), None  # t + d: commutative, the rounding of expm1(-d) + d
    if est == "k2":  # value (0.5 d) d, slope d
        torch.mul(d, 0.5, out=t).mul_(d)
        return t, d
    if est == "abs":  # value |d|, slope sign(d)
        torch.sign(d, out=t)
        return d.abs_(), t
    t.fill_(1.0)  # k1: value d, slope 1
    return d, t
