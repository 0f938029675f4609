"""Fused Clip-Higher loss + weighted masked sum: one autograd.Function, analytic backward.

Private fast path behind :func:`dapo_ops.token_level_loss`. It computes exactly what
``token_level_aggregate(clip_higher_surrogate(...), mask, mode=..., normalizer=...)``
computes, in one pass over the inputs:

.. math::

    \\mathcal{L} = \\sum_{i,t} w_i\\, m_{i,t}\\, \\ell_{i,t}

with :math:`\\ell` the Clip-Higher per-token loss and :math:`w_i` the per-row weight of
the aggregation mode (:func:`loss_scale`). The gradient with respect to ``logp`` is
produced in the same pass as the loss (the ratio is computed once) and kept as one
``[batch, seq]`` tensor in the compute dtype; ``backward`` hands that buffer over, scaled
in place by the incoming gradient (on CPU not at all when it is 1), so the backward pass
costs nothing for float32 ``logp``. No boolean temporaries are kept for backward.

Semantics, identical to the reference composition (surrogate + aggregate, under autograd):

- masked positions contribute 0 to the loss and to every gradient, whatever they hold
  (NaN and inf included): they are removed with ``where``, never multiplied by 0;
- the log-ratio is clamped to ``+-log_ratio_clamp`` before ``exp``; the gradient is 0
  where the clamp is active (strictly outside the interval), as for ``clamp``'s autograd;
- the gradient is exactly 0 where the clip is active;
- ties, as ``torch.maximum``/``torch.minimum`` autograd: where the clipped and unclipped
  products are equal although the ratio lies outside ``[1 - eps_low, 1 + eps_high]``
  (float rounding next to a bound), each branch gets half the gradient; likewise for
  the dual-clip bound;
- compute dtype float32, float64 if any of logp/old_logp/advantages is float64; the
  gradient reaches each input in its own dtype.

In eager mode, in float32 with an incoming gradient of 1 (a plain ``loss.backward()``),
the ``logp`` gradient is bitwise equal to the reference's: the same products are rounded
in the same order. The loss value differs from the reference only by summation order (~1 ulp per
reduction level).

Execution paths, all computing the same thing:

- eager on CPU (:func:`_cpu_terms`): row chunks of about ``chunk_elems`` elements through
  eight preallocated cache-sized buffers, with float-only kernels (CPU ``where``,
  ``heaviside`` and bool comparisons are several times slower than float arithmetic);
  a chunk whose result is not finite (garbage in masked positions) is recomputed by the
  ``where``-based body;
- eager on other devices, and while traced by ``torch.compile`` around the caller
  (fullgraph-clean, no host sync): the ``where``-based body :func:`_chunk_terms` on the
  whole batch;
- ``compiled=True``: :mod:`dapo_ops._compiled` (one ``torch.compile`` graph, compiled
  lazily on first use and cached): the loss written as one clamp per token, the same
  values up to float rounding, ``clamp``'s gradient convention at the kinks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor
from torch.autograd.function import once_differentiable

from dapo_ops._compiled import compiled_chunk_terms, compiled_token_level_loss, logp_grads
from dapo_ops._validate import (
    InputError,
    check_clip_range,
    is_compiling,
)
from dapo_ops.aggregation import AggregationMode, Normalizer, loss_scale, scaled_sum
from dapo_ops.surrogate import LOG_RATIO_CLAMP, compute_dtype, policy_inputs

#: Default chunk size (elements) on CPU: 128 Ki float32 = 512 KiB per buffer; the eight
#: buffers of one chunk (4 MiB) stay in the last-level cache, and each op on a chunk is
#: long enough to split across threads. They are allocated on every call (the library
#: keeps no buffers between calls); in a process that has freed a large tensor before,
#: as any trainer has, glibc serves them from its heap without new page faults.
CPU_CHUNK_ELEMS = 1 << 17


# --------------------------------------------------------------------------------------
# The per-chunk body: loss row sums and the logp gradient, in one pass
# --------------------------------------------------------------------------------------


def _log_ratio(logp: Tensor, old_logp: Tensor, dtype: torch.dtype) -> Tensor:
    """``logp.to(dtype) - old_logp.to(dtype)`` as a fresh tensor, in one op when possible."""
    if torch.promote_types(logp.dtype, old_logp.dtype) == dtype:
        return torch.sub(logp, old_logp)  # inputs are cast exactly to dtype, then subtracted
    return logp.to(dtype, copy=True).sub_(old_logp)


def _chunk_terms(
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
    """Row sums of the masked per-token loss and ``d(sum_i w_i rowsum_i)/d logp``.

    ``advantages`` ``[b, 1]`` or ``[b, s]``; ``scale`` 0-dim or ``[b, 1]`` (the weights
    w_i), already in the compute dtype. Written with in-place ops on its own temporaries
    (cheap in eager mode, functionalised under torch.compile).
    """
    dtype = scale.dtype
    lr = _log_ratio(logp, old_logp, dtype)
    ratio = lr.clamp(-log_ratio_clamp, log_ratio_clamp)
    neg_adv = advantages.to(dtype).neg()
    # gradient flows where the token is valid and the log-ratio clamp is not active (NaN: no)
    keep = torch.eq(ratio, lr).logical_and_(valid) if with_grad else valid
    del lr
    ratio.exp_()
    unclipped = ratio * neg_adv  # -A r
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    in_band = torch.eq(clipped_ratio, ratio) if with_grad else None
    clipped = clipped_ratio.mul_(neg_adv)  # -A clip(r)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        bound = _dual_bound(neg_adv, dual_clip)
        capped = torch.minimum(loss, bound)
    else:
        capped = loss
    row_sums = torch.where(valid, capped, 0.0).sum(dim=-1)
    if not with_grad:
        return row_sums, None
    assert in_band is not None
    # torch.maximum's autograd: all to the larger branch, half each on a tie. The clipped
    # branch passes the gradient only inside the band (clamp's autograd), and inside the
    # band both products are equal, so  d loss / d r = -A * factor  with factor 1 where
    # u > c or inside the band, 1/2 on a tie outside it, 0 elsewhere. Written with float
    # ``where`` (not ``heaviside``, which inductor does not vectorise on CPU).
    tie = torch.where(in_band, 1.0, 0.5)
    factor = torch.where(unclipped > clipped, 1.0, torch.where(unclipped == clipped, tie, 0.0))
    del unclipped, clipped, tie
    if dual_clip is not None:
        # torch.minimum's autograd for the dual bound (a constant in logp)
        share = torch.where(loss < bound, 1.0, torch.where(loss == bound, 0.5, 0.0))
        factor = factor * share
    # same rounding order as the reference autograd chain: ((w * -A) * factor) * r
    grad = (scale * neg_adv * factor).mul_(ratio)
    return row_sums, torch.where(keep, grad, 0.0)


def _row_chunks(batch: int, seq: int, device: torch.device, chunk_elems: int | None) -> int:
    """Rows per chunk: the whole batch off CPU and while tracing, else ~chunk_elems."""
    if chunk_elems is None:
        if device.type != "cpu" or is_compiling():
            return max(batch, 1)
        chunk_elems = CPU_CHUNK_ELEMS
    return max(1, min(batch, chunk_elems // max(seq, 1)))


def _all_terms(
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
    compiled: bool | str,
    chunk_elems: int | None,
) -> tuple[Tensor, Tensor | None]:
    """Row sums ``[batch]`` and the logp gradient ``[batch, seq]`` (or None), chunked."""
    batch, seq = logp.shape
    opts = (eps_low, eps_high, dual_clip, log_ratio_clamp, with_grad)
    if compiled and not is_compiling():  # one kernel on the whole batch, no chunks
        body = compiled_chunk_terms("inductor" if compiled is True else str(compiled))
        valid_u8 = valid.view(torch.uint8)  # see dapo_ops._compiled
        return body(logp, old_logp, advantages, valid_u8, scale, *opts)  # type: ignore[no-any-return]
    rows = _row_chunks(batch, seq, logp.device, chunk_elems)
    if logp.device.type == "cpu" and not compiled and not is_compiling() and batch * seq > 0:
        return _cpu_terms(logp, old_logp, advantages, valid, scale, *opts, rows=rows)
    if rows >= batch:
        return _chunk_terms(logp, old_logp, advantages, valid, scale, *opts)
    row_sums = logp.new_empty((batch,), dtype=scale.dtype)
    grad = logp.new_empty((batch, seq), dtype=scale.dtype) if with_grad else None
    per_row_scale = scale.ndim > 0
    for start in range(0, batch, rows):
        sl = slice(start, start + rows)
        rs, g = _chunk_terms(
            logp[sl],
            old_logp[sl],
            advantages[sl],
            valid[sl],
            scale[sl] if per_row_scale else scale,
            *opts,
        )
        row_sums[sl] = rs
        if grad is not None and g is not None:
            grad[sl] = g
    return row_sums, grad


def _workspace(numel: int, dtype: torch.dtype) -> list[Tensor]:
    """Eight CPU chunk buffers of ``numel`` elements, allocated per call.

    Nothing is kept across calls (the library holds no global state); the buffers are
    reused for every chunk of this call, so they stay warm in cache.
    """
    return [torch.empty((numel,), dtype=dtype) for _ in range(8)]


def _dual_bound(neg_adv: Tensor, dual_clip: float) -> Tensor:
    """``-A c`` where ``A < 0``, ``+inf`` elsewhere: ``min(loss, bound)`` is the dual clip."""
    return torch.where(neg_adv > 0, neg_adv * dual_clip, float("inf"))


def _cpu_terms(
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
    """Eager CPU path: cache-sized row chunks, preallocated buffers, float-only ops.

    CPU kernels for ``where``, ``heaviside`` and bool-valued comparisons are several
    times slower than plain float arithmetic, so this path masks by multiplying with the
    0/1 mask and writes comparisons into float buffers. That is exact whenever the masked
    products are finite (they are then exactly 0). A chunk is trusted without a check
    when its log-ratio needs no clamping (one ``torch.equal``, which is also False on
    NaN) and the advantages and weights are too small for any product to overflow;
    otherwise its result is checked, and recomputed with the ``where``-based
    :func:`_chunk_terms` if it is not finite (garbage in masked positions, or a
    genuinely non-finite loss). The arithmetic is :func:`_chunk_terms`' (same products,
    same rounding order); the tie-splitting factors are built as ``1 + sign(.)``, with
    the exact halves folded into the weight.
    """
    batch, seq = logp.shape
    dtype = scale.dtype
    row_sums = torch.empty((batch,), dtype=dtype)
    grad = torch.empty((batch, seq), dtype=dtype) if with_grad else None
    bufs = _workspace(rows * seq, dtype)
    valid_u8 = valid.view(torch.uint8)
    neg_adv_all = advantages.to(dtype).neg()
    per_row_adv = neg_adv_all.shape[-1] == 1 or seq == 1
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    # exact powers of two: the two tie factors below are built as 2 * factor
    quarter = 0.5 if dual_clip is None else 0.25
    bound_all = weight_all = None
    if per_row_adv:  # [batch, 1]: tiny, computed once
        if dual_clip is not None:
            bound_all = _dual_bound(neg_adv_all, dual_clip)
        if with_grad:
            weight_all = scale * neg_adv_all * quarter
    # no product can overflow when |A| * e^clamp * |w| stays far below the float range
    biggest = float(neg_adv_all.abs().amax()) if neg_adv_all.numel() else 0.0
    biggest *= float(scale.abs().amax()) if with_grad else 1.0
    safe = log_ratio_clamp <= 80.0 and biggest * math.exp(log_ratio_clamp) < 1e30
    same_dtype = torch.promote_types(logp.dtype, old_logp.dtype) == dtype
    opts = (eps_low, eps_high, dual_clip, log_ratio_clamp, with_grad)
    per_row_scale = scale.ndim > 0
    full_views = [b[: rows * seq].view(rows, seq) for b in bufs]

    for start in range(0, batch, rows):
        stop = min(start + rows, batch)
        sl = slice(start, stop)
        views = (
            full_views
            if stop - start == rows
            else [b[: (stop - start) * seq].view(stop - start, seq) for b in bufs]
        )
        lr, ratio, keep, validf, unclipped, clipped, in_band, loss = views
        neg_adv = neg_adv_all[sl]
        if same_dtype:
            torch.sub(logp[sl], old_logp[sl], out=lr)
        else:
            lr.copy_(logp[sl]).sub_(old_logp[sl])
        torch.clamp(lr, -log_ratio_clamp, log_ratio_clamp, out=ratio)
        validf.copy_(valid_u8[sl])
        trusted = safe and torch.equal(ratio, lr)  # no clamp active and no NaN
        if with_grad:
            # gradient mask: token valid and log-ratio clamp not active (NaN: not active)
            keep = validf if trusted else torch.eq(ratio, lr, out=keep).mul_(validf)
        ratio.exp_()
        torch.mul(ratio, neg_adv, out=unclipped)  # -A r
        torch.clamp(ratio, lo, hi, out=clipped)
        if with_grad:
            torch.eq(clipped, ratio, out=in_band)
        clipped.mul_(neg_adv)  # -A clip(r)
        torch.maximum(unclipped, clipped, out=loss)
        bound = None
        if dual_clip is not None:
            bound = bound_all[sl] if bound_all is not None else _dual_bound(neg_adv, dual_clip)
            masked = torch.minimum(loss, bound, out=lr)  # lr is free; loss kept for the dual
        else:
            masked = loss  # the factor below needs u and c only
        masked.mul_(validf)
        rs = torch.sum(masked, dim=-1, out=row_sums[sl])
        g = None
        if with_grad and grad is not None:
            # 2 * (dloss/dr) / (-A) = 1 + sign(u - c) + in_band: maximum's autograd (all to
            # the larger branch, half each on a tie), the clipped branch only in the band
            factor = torch.sub(unclipped, clipped, out=unclipped).sign_().add_(in_band).add_(1.0)
            if bound is not None:  # 2 * minimum's share for the loss: 1 + sign(bound - loss)
                factor.mul_(torch.sub(bound, loss, out=loss).sign_().add_(1.0))
            if weight_all is not None:
                weight = weight_all[sl]
            else:
                w = scale[sl] if per_row_scale else scale
                weight = torch.mul(neg_adv, w, out=clipped).mul_(quarter)
            # ((w * -A) * factor) * r: the reference's rounding order (factor: exact halves)
            factor.mul_(weight).mul_(ratio)
            g = torch.mul(factor, keep, out=grad[sl])
        if trusted:
            continue
        finite = bool(torch.isfinite(rs.sum() if g is None else rs.sum() + g.sum()))
        if not finite:  # garbage in masked positions (or a non-finite loss): exact path
            rs_exact, g_exact = _chunk_terms(
                logp[sl],
                old_logp[sl],
                advantages[sl],
                valid[sl],
                scale[sl] if per_row_scale else scale,
                *opts,
            )
            rs.copy_(rs_exact)
            if g is not None and g_exact is not None:
                g.copy_(g_exact)
    return row_sums, grad


# --------------------------------------------------------------------------------------
# Gradient with respect to the advantages (rare: advantages usually carry no grad)
# --------------------------------------------------------------------------------------


def _advantage_grad(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    scale: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
) -> Tensor:
    """``d(sum w_i m l)/d advantages`` in the advantages' (broadcast) shape, compute dtype."""
    dtype = scale.dtype
    ratio = _log_ratio(logp, old_logp, dtype).clamp_(-log_ratio_clamp, log_ratio_clamp).exp_()
    neg_adv = advantages.to(dtype).neg()
    clipped_ratio = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped = ratio * neg_adv
    clipped = clipped_ratio * neg_adv
    loss = torch.maximum(unclipped, clipped)
    half = torch.full((), 0.5, dtype=dtype, device=ratio.device)
    to_unclipped = torch.heaviside(unclipped - clipped, half)
    # d loss / d A = -(r * H(u - c) + clip(r) * H(c - u))
    d_adv = -(ratio * to_unclipped + clipped_ratio * (1.0 - to_unclipped))
    if dual_clip is not None:
        bound = torch.where(neg_adv > 0, neg_adv * dual_clip, float("inf"))
        to_loss = torch.heaviside(bound - loss, half)
        d_adv = torch.where(
            neg_adv > 0, d_adv * to_loss - dual_clip * (1.0 - to_loss), d_adv
        )  # d(-A c)/dA = -c
    d_adv = torch.where(valid, d_adv * scale, 0.0)
    if advantages.shape[-1] == 1 and d_adv.shape[-1] != 1:
        d_adv = d_adv.sum(dim=-1, keepdim=True)
    return d_adv


# --------------------------------------------------------------------------------------
# The autograd.Function
# --------------------------------------------------------------------------------------


class _ClipHigherLoss(torch.autograd.Function):
    """sum_{i,t} scale_i * where(valid, clip_higher_loss, 0), with an analytic backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        valid: Tensor,
        scale: Tensor,
        eps_low: float,
        eps_high: float,
        dual_clip: float | None,
        log_ratio_clamp: float,
        want_grad: bool,
        compiled: bool | str,
        chunk_elems: int | None,
    ) -> Tensor:
        row_sums, grad = _all_terms(
            logp,
            old_logp,
            advantages,
            valid,
            scale,
            eps_low,
            eps_high,
            dual_clip,
            log_ratio_clamp,
            want_grad,
            compiled,
            chunk_elems,
        )
        ctx.opts = (eps_low, eps_high, dual_clip, log_ratio_clamp)
        ctx.dtypes = (logp.dtype, old_logp.dtype, advantages.dtype)
        ctx.scale_ndim = scale.ndim
        need_adv = ctx.needs_input_grad[2]
        # Eager: the gradient buffer is handed over to the first backward (no copy when the
        # incoming gradient is 1); a second backward through a retained graph recomputes it
        # from the inputs, which are kept as plain references (the caller's tensors: no
        # extra memory). Traced by torch.compile: a plain saved tensor.
        ctx.handover = grad is not None and not is_compiling()
        if ctx.handover:
            ctx.grad_buffer = grad
            ctx.recompute = (
                (logp.detach(), old_logp.detach(), advantages.detach(), valid, scale.detach()),
                (eps_low, eps_high, dual_clip, log_ratio_clamp, True, compiled, chunk_elems),
            )
        # inputs are saved only when the advantages need a gradient
        ctx.save_for_backward(
            None if ctx.handover else grad,
            row_sums,
            logp if need_adv else None,
            old_logp if need_adv else None,
            advantages if need_adv else None,
            valid if need_adv else None,
            scale if need_adv else None,
        )
        return scaled_sum(row_sums, scale)

    @staticmethod
    @once_differentiable  # the gradient is precomputed: no double backward (raises instead)
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad, row_sums, logp, old_logp, advantages, valid, scale = ctx.saved_tensors
        logp_dtype, old_dtype, adv_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        g_logp = g_old = g_adv = g_scale = None
        if needs[0] or needs[1]:
            if ctx.handover:
                grad, ctx.grad_buffer = ctx.grad_buffer, None
                if grad is None:  # second backward through a retained graph
                    inputs, opts = ctx.recompute
                    grad = _all_terms(*inputs, *opts)[1]
            elif grad is None:
                raise RuntimeError(
                    "dapo_ops fused loss: the forward ran without a gradient (grad mode off "
                    "or want_grad=False) but backward was called"
                )
            g_logp, g_old = logp_grads(
                grad, grad_out, needs, (logp_dtype, old_dtype), owned=ctx.handover
            )
        if needs[2]:
            g_adv = (
                _advantage_grad(logp, old_logp, advantages, valid, scale, *ctx.opts) * grad_out
            ).to(adv_dtype)
        if needs[4]:
            g_scale = (
                grad_out * row_sums.sum()
                if ctx.scale_ndim == 0
                else grad_out * rearrange(row_sums, "batch -> batch 1")
            )
        return (g_logp, g_old, g_adv, None, g_scale) + (None,) * 7


# --------------------------------------------------------------------------------------
# Internal API
# --------------------------------------------------------------------------------------


def clip_higher_loss_fused(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    valid: Bool[Tensor, "batch seq"],
    scale: Float[Tensor, ""] | Float[Tensor, "batch 1"],
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    compiled: bool | str = False,
    chunk_elems: int | None = None,
) -> Float[Tensor, ""]:
    r"""``sum_{i,t} scale_i * where(valid, clip_higher_surrogate(...), 0)`` in one pass.

    Low-level entry: inputs are assumed checked (use :func:`fused_token_level_loss` for
    the checked drop-in). ``advantages`` is ``[batch, 1]`` or ``[batch, seq]``; ``valid``
    is a bool mask; ``scale`` is the 0-dim weight of every token or per-row weights
    ``[batch, 1]`` (see :func:`loss_scale`), in the compute dtype (float32, or float64
    when any input is float64). Returns a 0-dim tensor of that dtype.

    Gradients: ``logp`` and ``old_logp`` (analytic, computed in the forward pass),
    ``advantages`` (analytic, recomputed in backward) and ``scale`` (row sums).
    ``compiled=True`` (or a backend name) runs the loss + gradient body
    (:func:`dapo_ops._compiled.clamp_terms`) through ``torch.compile``, compiled on first
    use and cached, on the whole batch. ``chunk_elems`` overrides the eager CPU chunk
    size (elements per chunk, default ``CPU_CHUNK_ELEMS`` = 128 Ki; whole rows, at least
    one; no chunking on other devices or when compiled).

    Example:
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -2.5]])
        >>> valid = torch.ones(1, 2, dtype=torch.bool)
        >>> loss = clip_higher_loss_fused(logp, old, torch.ones(1, 1), valid, torch.tensor(0.5))
        >>> loss  # (-1 - 1.28) / 2: the second ratio is clipped at 1.28
        tensor(-1.1400, grad_fn=<_ClipHigherLossBackward>)
        >>> loss.backward()
        >>> torch.equal(logp.grad, torch.tensor([[-0.5, 0.0]]))  # 0 where the clip is active
        True
    """
    dtype = compute_dtype(logp, old_logp, advantages)
    if scale.dtype != dtype:
        raise InputError(f"scale must have the compute dtype {dtype}, got {scale.dtype}")
    want_grad = torch.is_grad_enabled() and (logp.requires_grad or old_logp.requires_grad)
    if not (
        torch.is_grad_enabled()
        and (
            logp.requires_grad
            or old_logp.requires_grad
            or advantages.requires_grad
            or scale.requires_grad
        )
    ):
        row_sums, _ = _all_terms(
            logp,
            old_logp,
            advantages,
            valid,
            scale,
            eps_low,
            eps_high,
            dual_clip,
            log_ratio_clamp,
            False,
            compiled,
            chunk_elems,
        )
        return scaled_sum(row_sums, scale)
    out = _ClipHigherLoss.apply(  # type: ignore[no-untyped-call]
        logp,
        old_logp,
        advantages,
        valid,
        scale,
        eps_low,
        eps_high,
        dual_clip,
        log_ratio_clamp,
        want_grad,
        compiled,
        chunk_elems,
    )
    return out  # type: ignore[no-any-return]


def fused_token_level_loss(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    dual_clip: float | None = None,
    max_len: int | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    compiled: bool | str = False,
    chunk_elems: int | None = None,
) -> Float[Tensor, ""]:
    r"""Checked drop-in for ``token_level_loss(..., return_diagnostics=False)``.

    Same arguments, checks, errors and result as :func:`dapo_ops.token_level_loss` (the
    reference composition ``clip_higher_surrogate`` + ``token_level_aggregate``), computed
    by :func:`clip_higher_loss_fused`. ``compiled`` and ``chunk_elems`` are passed on.

    Example:
        >>> logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -2.5, float("nan")]])
        >>> fused_token_level_loss(logp, old, torch.tensor([1.0]), torch.tensor([[1, 1, 0]]))
        tensor(-1.1400, grad_fn=<_ClipHigherLossBackward>)
    """
    check_clip_range(eps_low, eps_high, dual_clip)
    adv, valid, dtype = policy_inputs(
        logp, old_logp, advantages, mask, log_ratio_clamp=log_ratio_clamp
    )
    if compiled and chunk_elems is None and not is_compiling():
        out = compiled_token_level_loss(
            logp,
            old_logp,
            adv,
            valid,
            eps_low=eps_low,
            eps_high=eps_high,
            mode=mode,
            normalizer=normalizer,
            dual_clip=dual_clip,
            max_len=max_len,
            log_ratio_clamp=log_ratio_clamp,
            backend="inductor" if compiled is True else str(compiled),
        )
        if out is not None:  # else: gradients for advantages/normalizer, eager below
            return out
        compiled = False
    scale = loss_scale(valid, mode=mode, normalizer=normalizer, max_len=max_len, dtype=dtype)
    return clip_higher_loss_fused(
        logp,
        old_logp,
        adv,
        valid,
        scale,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
        compiled=compiled,
        chunk_elems=chunk_elems,
    )
