"""The one fast path of every objective: loss and gradient in one pass, analytic backward.

Private; :func:`dapo_ops.policy_loss` checks its inputs and calls :func:`fused_loss`. For
an objective with an analytic :meth:`~dapo_ops.objectives.Objective.grad` it computes

.. math::

    \\mathcal{L} = \\sum_{i,t} w_i\\, m_{i,t}\\,\\big(\\rho_{i,t}\\,\\ell_{i,t}
        + \\beta\\,\\kappa_{i,t}\\,k_{i,t}\\big)

(``w`` the aggregation weights of :func:`~dapo_ops.engine.aggregation.loss_scale`, ``m`` the
mask, ``rho`` the IS weights, ``ell`` the objective's term, ``k`` the KL estimate,
``kappa`` the KL weights, 1 when not given) *and*
its gradient with respect to ``logp`` in the forward pass; backward hands that buffer
over, scaled by the incoming gradient (on CPU not at all when it is 1). Where the work
runs:

- eager on CPU, when the objective has a CPU kernel (:meth:`ClipHigher.cpu_terms`):
  row blocks of about ``CPU_CHUNK_ELEMS`` elements, IS weights included, and the KL
  term added block by block (:class:`dapo_ops.engine._kl_cpu.KLBlocks`);
- otherwise, and while traced by ``torch.compile`` around the caller: the generic body
  :func:`generic_terms` (``where``-based, exact whatever masked positions hold);
- ``compiled=True``: the loss scale and :func:`generic_terms` as one ``torch.compile``
  graph (:mod:`dapo_ops.engine._compiled`), or ahead of time per input signature
  (:class:`dapo_ops.CompiledPolicyLoss`).

Objectives without an analytic ``grad`` compose the reference :func:`reference_terms`
under autograd instead. Double backward (``create_graph=True``) differentiates the
reference definition, so it is exact for every objective.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import clip, compute_dtype, masked
from dapo_ops._core._validate import (
    InputError,
    is_compiling,
)
from dapo_ops.engine._kl_cpu import KLBlocks
from dapo_ops.engine.aggregation import loss_scale, scaled_sum
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.objectives.base import Objective, token_inputs

#: Default block size (elements) of the eager CPU kernels: 512 Ki float32 = 2 MiB per
#: buffer: a block's two scratch buffers and its slice of the gradient (6 MiB) stay in the
#: last-level cache, and each op on a block is long enough to split across threads
#: (measured on 2 cores: 1.1x faster than 128 Ki blocks at 512x8192).
CPU_CHUNK_ELEMS = 1 << 19


class LossInputs(NamedTuple):
    """The checked tensors of one call."""

    logp: Tensor
    old_logp: Tensor
    adv: Tensor  # [batch, 1] or [batch, seq]
    valid: Tensor  # bool
    ref_logp: Tensor | None = None
    is_weights: Tensor | None = None
    kl_weights: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Everything but the tensors: the objective, the KL penalty and the aggregation."""

    objective: Objective
    kl: KLPenalty | None = None
    mode: str = "token_mean"
    max_len: int | None = None
    chunk_elems: int | None = None


def reference_terms(
    spec: LossSpec,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    valid: Tensor,
    ref_logp: Tensor | None = None,
    is_weights: Tensor | None = None,
    kl_weights: Tensor | None = None,
) -> Tensor:
    """The per-token loss ``rho * term + beta * kappa * k``, 0 at masked positions, under
    autograd: the definition every fast path is tested against."""
    dtype = compute_dtype(logp, old_logp, adv)
    x = token_inputs(spec.objective, logp, old_logp, adv, valid, dtype, reference=True)
    per_token = masked(valid, spec.objective.term(x))
    if is_weights is not None:
        per_token = per_token * masked(valid, is_weights.to(dtype))
    if spec.kl is not None and ref_logp is not None:
        clamp = spec.kl.log_ratio_clamp
        raw = masked(valid, logp.to(dtype) - ref_logp.to(dtype))
        penalty = masked(valid, spec.kl.penalty(raw, clip(raw, -clamp, clamp)))
        if kl_weights is not None:
            penalty = penalty * masked(valid, kl_weights.to(dtype))
        per_token = per_token + spec.kl.beta * penalty
    return per_token


def generic_terms(
    spec: LossSpec,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    valid: Tensor,
    scale: Tensor,
    ref_logp: Tensor | None,
    is_weights: Tensor | None,
    with_grad: bool,
    kl_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Row sums ``[b]`` of the masked per-token loss and ``d(sum_i w_i rowsum_i)/d logp``."""
    objective, kl = spec.objective, spec.kl
    dtype = scale.dtype
    x = token_inputs(objective, logp, old_logp, adv, valid, dtype, reference=False)
    value = objective.term(x)
    weight = scale
    if is_weights is not None:
        rho = is_weights.to(dtype)
        value = value * rho
        weight = scale * rho
    if kl is not None and ref_logp is not None:
        raw = logp.to(dtype) - ref_logp.to(dtype)
        delta = raw.clamp(-kl.log_ratio_clamp, kl.log_ratio_clamp)
        kl_value = kl.beta * kl.estimate(delta)
        kl_scale = scale
        if kl_weights is not None:
            kappa = kl_weights.to(dtype)
            kl_value = kl_value * kappa
            kl_scale = scale * kappa
        value = value + kl_value
    row_sums = masked(valid, value).sum(dim=-1)
    if not with_grad:
        return row_sums, None
    grad = objective.grad(x, weight)
    if grad is None:
        raise InputError(f"{type(objective).__name__} has no analytic grad()")
    if kl is not None and ref_logp is not None:
        grad = grad + kl.grad(raw, delta, kl_scale)
    return row_sums, masked(valid, grad)


def _row_block(batch: int, seq: int, chunk_elems: int | None, extras: int = 0) -> int:
    """Rows per block: ``chunk_elems`` elements per block, or by default about
    ``CPU_CHUNK_ELEMS``, shrunk so that the buffers the IS weights and the KL term add
    (``extras`` of them) fit in the scratch budget of the plain loss's two."""
    chunk = chunk_elems or (2 * CPU_CHUNK_ELEMS) // (2 + extras)
    return max(1, min(batch, chunk // max(seq, 1)))


def all_terms(
    spec: LossSpec, tensors: LossInputs, scale: Tensor, with_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Row sums and the gradient, on the fastest eager path for this call."""
    logp, old_logp, adv, valid, ref_logp, is_weights, kl_weights = tensors
    kernel = getattr(spec.objective, "cpu_terms", None)
    batch, seq = logp.shape
    if kernel is not None and logp.device.type == "cpu" and not is_compiling() and batch * seq:
        with_kl = spec.kl is not None and ref_logp is not None
        # the kernel's scratch beyond its two: (w rho)(-A) per row, the KL log-ratio, kappa
        extras = (is_weights is not None and adv.shape[-1] == 1) + with_kl
        extras += with_kl and kl_weights is not None
        rows = _row_block(batch, seq, spec.chunk_elems, extras)

        def exact(*block: Any) -> tuple[Tensor, Tensor | None]:
            lp, old, a, v, w, grad_wanted, sl = block
            ref, rho, kappa = (None if t is None else t[sl] for t in tensors[4:])
            return generic_terms(spec, lp, old, a, v, w, ref, rho, grad_wanted, kappa)

        kl = None
        if with_kl:
            assert spec.kl is not None and ref_logp is not None
            kl = KLBlocks(spec.kl, logp, ref_logp, kl_weights, scale, rows)
        return kernel(  # type: ignore[no-any-return]
            logp, old_logp, adv, valid, scale, with_grad, rows, exact, is_weights=is_weights, kl=kl
        )
    return generic_terms(
        spec, logp, old_logp, adv, valid, scale, ref_logp, is_weights, with_grad, kl_weights
    )


def reference_loss(spec: LossSpec, tensors: LossInputs, normalizer: Tensor | None) -> Tensor:
    """The loss as the reference composition (autograd through :func:`reference_terms`)."""
    logp, old_logp, adv, valid, ref_logp, is_weights, kl_weights = tensors
    dtype = compute_dtype(logp, old_logp, adv)
    scale = _scale(spec, valid, normalizer, dtype)
    per_token = reference_terms(spec, logp, old_logp, adv, valid, ref_logp, is_weights, kl_weights)
    return scaled_sum(per_token.sum(dim=-1), scale)


def _scale(spec: LossSpec, valid: Tensor, normalizer: Tensor | None, dtype: torch.dtype) -> Tensor:
    den = "local" if normalizer is None else normalizer  # the distributed check ran already
    return loss_scale(valid, mode=spec.mode, normalizer=den, max_len=spec.max_len, dtype=dtype)  # type: ignore[arg-type]


def definition_grad(
    spec: LossSpec, tensors: LossInputs, normalizer: Tensor | None, grad_out: Tensor
) -> Tensor:
    """``grad_out * d loss / d logp`` of :func:`reference_loss`, itself differentiable: the
    backward of every fused path under ``create_graph=True``."""
    with torch.enable_grad():
        loss = reference_loss(spec, tensors, normalizer)
        (g,) = torch.autograd.grad(loss, tensors.logp, grad_out, create_graph=True)
    return g  # type: ignore[no-any-return]


class _FusedLoss(torch.autograd.Function):
    """The loss with its precomputed ``logp`` gradient handed over to backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logp: Tensor,
        spec: LossSpec,
        rest: tuple[Tensor | None, ...],
        normalizer: Tensor | None,
        body: Any,
    ) -> Tensor:
        total, grad = body(spec, LossInputs._make((logp, *rest)), normalizer, True)
        ctx.spec, ctx.body, ctx.dtype = spec, body, logp.dtype
        # Eager: the gradient buffer is handed over to the first backward (no copy when the
        # incoming gradient is 1); a second backward through a retained graph recomputes it.
        # Traced by torch.compile: a plain saved tensor.
        ctx.handover = not is_compiling()
        if ctx.handover:
            ctx.grad_buffer = grad
            grad = None
        ctx.n_rest = len(rest)
        present = [t for t in (*rest, normalizer) if t is not None]
        ctx.layout = [t is not None for t in (*rest, normalizer)]
        # saving the inputs costs no memory and lets torch refuse an in-place change of
        # any of them between forward and backward
        ctx.save_for_backward(logp, grad, *present)
        return total  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logp, grad, *present = ctx.saved_tensors
        it = iter(present)
        given = [next(it) if here else None for here in ctx.layout]
        rest, normalizer = tuple(given[: ctx.n_rest]), given[ctx.n_rest]
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition
            g = definition_grad(ctx.spec, LossInputs._make((logp, *rest)), normalizer, grad_out)
            return g, None, None, None, None
        owned = False
        if ctx.handover:
            grad, ctx.grad_buffer, owned = ctx.grad_buffer, None, True
            if grad is None:  # second backward through a retained graph
                inputs = LossInputs._make((logp.detach(), *rest))
                grad = ctx.body(ctx.spec, inputs, normalizer, True)[1]
        if not owned:
            grad = grad * grad_out
        elif grad_out.device.type != "cpu" or float(grad_out) != 1.0:
            grad.mul_(grad_out)
        return (grad if grad.dtype == ctx.dtype else grad.to(ctx.dtype)), None, None, None, None


def eager_body(
    spec: LossSpec, tensors: LossInputs, normalizer: Tensor | None, with_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The loss (0-dim) and ``d loss / d logp`` (or None), eagerly."""
    logp, old_logp, adv, valid = tensors[:4]
    scale = _scale(spec, valid, normalizer, compute_dtype(logp, old_logp, adv))
    row_sums, grad = all_terms(spec, tensors, scale, with_grad)
    return scaled_sum(row_sums, scale), grad


def fused_loss(
    spec: LossSpec, tensors: LossInputs, normalizer: Tensor | None, body: Any = eager_body
) -> Tensor:
    """The 0-dim loss for checked inputs; ``normalizer`` None (the local count) or a
    0-dim tensor in the compute dtype. ``body``: :func:`eager_body` or a compiled one."""
    logp = tensors[0]
    if type(spec.objective).grad is Objective.grad:  # no analytic gradient: autograd
        return reference_loss(spec, tensors, normalizer)
    if not (torch.is_grad_enabled() and logp.requires_grad):
        return body(spec, tensors, normalizer, False)[0]  # type: ignore[no-any-return]
    return _FusedLoss.apply(logp, spec, tensors[1:], normalizer, body)  # type: ignore[no-any-return,no-untyped-call]
