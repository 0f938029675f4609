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
  (NaN and inf included);
- the log-ratio is clamped to ``+-log_ratio_clamp`` before ``exp``; the gradient is 0
  where the clamp is active (strictly outside the interval), as for ``clamp``'s autograd;
- the per-token loss is the clamp form ``-A clamp(r, lo_A, hi_A)``
  (:func:`dapo_ops.surrogate.clipped_objective`): its gradient is exactly 0 where the
  clip is active and ``-A r`` elsewhere, bounds included;
- compute dtype float32, float64 if any of logp/old_logp/advantages is float64; the
  gradient reaches each input in its own dtype.

The ``logp`` gradient is bitwise equal to the reference's when the incoming gradient is
1 (a plain ``loss.backward()``): the same products are rounded in the same order. The
loss value differs from the reference only in the order of its sums (a few ulps).

Execution paths (:mod:`dapo_ops._terms`), all computing the same thing:

- eager on CPU: :func:`~dapo_ops._terms.cpu_terms`, row blocks of about ``chunk_elems``
  elements through a few cache-sized buffers, float-only kernels; a block whose
  log-ratio holds a NaN (garbage in masked positions) is computed by the ``where``-based
  :func:`~dapo_ops._terms.clamp_terms`;
- eager on other devices, and while traced by ``torch.compile`` around the caller
  (fullgraph-clean, no host sync): :func:`~dapo_ops._terms.clamp_terms` on the whole
  batch;
- ``compiled=True``: :mod:`dapo_ops._compiled` (one ``torch.compile`` graph, compiled
  lazily on first use and cached) around the same body.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor
from torch.autograd.function import once_differentiable

from dapo_ops._compiled import compiled_chunk_terms, compiled_token_level_loss, logp_grads
from dapo_ops._terms import CPU_CHUNK_ELEMS, clamp_terms, cpu_terms
from dapo_ops._validate import (
    InputError,
    check_clip_range,
    is_compiling,
)
from dapo_ops.aggregation import AggregationMode, Normalizer, loss_scale, scaled_sum
from dapo_ops.surrogate import LOG_RATIO_CLAMP, clip_bounds, compute_dtype, policy_inputs


def _log_ratio(logp: Tensor, old_logp: Tensor, dtype: torch.dtype) -> Tensor:
    """``logp.to(dtype) - old_logp.to(dtype)`` as a fresh tensor, in one op when possible."""
    if torch.promote_types(logp.dtype, old_logp.dtype) == dtype:
        return torch.sub(logp, old_logp)  # inputs are cast exactly to dtype, then subtracted
    return logp.to(dtype, copy=True).sub_(old_logp)


def _row_chunks(batch: int, seq: int, chunk_elems: int | None) -> int:
    """Rows per block of the eager CPU path: about ``chunk_elems`` elements, whole rows."""
    return max(1, min(batch, (chunk_elems or CPU_CHUNK_ELEMS) // max(seq, 1)))


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
    """Row sums ``[batch]`` and the logp gradient ``[batch, seq]`` (or None)."""
    batch, seq = logp.shape
    opts = (eps_low, eps_high, dual_clip, log_ratio_clamp, with_grad)
    if compiled and not is_compiling():  # one kernel on the whole batch, no blocks
        body = compiled_chunk_terms("inductor" if compiled is True else str(compiled))
        valid_u8 = valid.view(torch.uint8)  # see dapo_ops._compiled
        return body(logp, old_logp, advantages, valid_u8, scale, *opts)  # type: ignore[no-any-return]
    if logp.device.type == "cpu" and not is_compiling() and batch * seq > 0:
        rows = _row_chunks(batch, seq, chunk_elems)
        return cpu_terms(logp, old_logp, advantages, valid, scale, *opts, rows=rows)
    return clamp_terms(logp, old_logp, advantages, valid, scale, *opts)


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
    """``d(sum w_i m l)/d A = -w_i m clamp(r, lo_A, hi_A)`` (the bounds are constant in A),
    in the advantages' (broadcast) shape and the compute dtype."""
    dtype = scale.dtype
    ratio = _log_ratio(logp, old_logp, dtype).clamp_(-log_ratio_clamp, log_ratio_clamp).exp_()
    adv = advantages.to(dtype)
    lo, hi = clip_bounds(adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    d_adv = torch.where(valid, torch.clamp(ratio, lo, hi).neg_() * scale, 0.0)
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
        opts: tuple[float, float, float | None, float, bool, bool | str, int | None],
    ) -> Tensor:
        # options in one tuple: Function.apply's per-argument bookkeeping is not free
        row_sums, grad = _all_terms(logp, old_logp, advantages, valid, scale, *opts)
        ctx.opts = opts[:4]  # eps_low, eps_high, dual_clip, log_ratio_clamp
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
            # the same options, with the gradient asked for
            ctx.recompute = (
                (logp, old_logp, advantages, valid, scale),
                (*opts[:4], True, *opts[5:]),
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
        return g_logp, g_old, g_adv, None, g_scale, None


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
    (:func:`dapo_ops._terms.clamp_terms`) through ``torch.compile``, compiled on first
    use and cached, on the whole batch. ``chunk_elems`` overrides the eager CPU block
    size (elements per block, default ``CPU_CHUNK_ELEMS`` = 512 Ki; whole rows, at least
    one; no blocks on other devices or when compiled).

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
    opts = (eps_low, eps_high, dual_clip, log_ratio_clamp, want_grad, compiled, chunk_elems)
    if not (
        want_grad or (torch.is_grad_enabled() and (advantages.requires_grad or scale.requires_grad))
    ):
        row_sums, _ = _all_terms(logp, old_logp, advantages, valid, scale, *opts)
        return scaled_sum(row_sums, scale)
    out = _ClipHigherLoss.apply(logp, old_logp, advantages, valid, scale, opts)  # type: ignore[no-untyped-call]
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
