"""Conformance checks of the loss and its gradient: gradcheck, the fused path, masked
garbage, micro-batches."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.gradcheck import GradcheckError

from dapo_ops._core._rules import AggregationMode
from dapo_ops.engine.distributed import global_normalizer
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.engine.policy import policy_loss
from dapo_ops.objectives.base import Objective
from dapo_ops.testing._base import (
    Batch,
    _assert_exact,
    _assert_within,
    _bind,
    _default,
    _loss_and_grad,
    _name,
    reference_loss,
    reference_with_bounds,
)


def check_gradcheck(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    stop_gradient: bool = False,
) -> None:
    """float64 ``torch.autograd.gradcheck`` of :func:`policy_loss` with respect to ``logp``:
    the gradient (fused, when the objective has ``grad``) is the derivative of the loss.

    ``stop_gradient=True`` for objectives that detach part of their value on purpose
    (CISPO, DPPO, VESPO: ``-sg[w] A log pi``): their value is *not* the integral of their
    gradient, so a finite difference of the value cannot check it. Their gradient is then
    compared with autograd's gradient of the reference definition (:func:`reference_loss`)
    in float64 within :data:`F64_RTOL`, which checks ``grad`` against ``term``. (GSPO and
    GMPO detach too, yet every token carries its sequence's value, so the derivative of
    the aggregated value is their gradient: gradcheck applies to them.)
    """
    b = _default(objective, batch, torch.float64)
    assert b.logp.dtype == torch.float64, "gradcheck needs a float64 batch"
    if stop_gradient:
        check_fused_gradient(objective, b, mode=mode)
        return

    def loss(lp: Tensor) -> Tensor:
        return policy_loss(objective, lp, b.old_logp, b.advantages, b.mask, mode=mode)  # type: ignore[arg-type]

    try:
        torch.autograd.gradcheck(loss, (b.logp.detach().clone().requires_grad_(True),))
    except GradcheckError as err:
        raise AssertionError(
            f"{_name(objective)}, mode={mode}: the gradient is not the derivative of the loss "
            "value (if term() detaches part of its value on purpose, as CISPO, pass "
            f"stop_gradient=True):\n{err}"
        ) from None


def check_fused_gradient(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    bitwise: bool = False,
    signed_zeros: bool = False,
    kl_and_is_weights: bool = False,
) -> None:
    """The loss and ``logp`` gradient of :func:`policy_loss` (the fused path, for an
    objective with ``grad``) equal autograd's through :func:`reference_loss` in float64,
    within :func:`reference_with_bounds`; with ``bitwise``, the gradient also equals, exactly,
    autograd's through the reference evaluated in the batch's own dtype (``signed_zeros``:
    the sign of a zero too). ``kl_and_is_weights``: with a k3 ``KLPenalty`` (``beta=0.1``)
    and IS weights in ``[0.5, 1.5)``."""
    b = _default(objective, batch, torch.float64)
    extra: dict[str, Any] = {"mode": mode}
    if kl_and_is_weights:
        g = torch.Generator().manual_seed(2)
        noise = torch.randn(b.logp.shape, generator=g, dtype=torch.float64)
        extra["ref_logp"] = (-(b.logp.double() + 0.3 * noise).abs()).to(b.logp.dtype)  # <= 0
        extra["kl"] = KLPenalty(beta=0.1)
        extra["is_weights"] = (torch.rand(b.logp.shape, generator=g) + 0.5).to(b.logp.dtype)
    args = (b.old_logp, b.advantages, b.mask)
    got = _loss_and_grad(_bind(policy_loss, objective), b.logp, *args, **extra)
    what = f"{_name(objective)}, mode={mode}, {b.logp.dtype}" + (
        ", KL and IS weights" if kl_and_is_weights else ""
    )
    assert got[1].dtype == b.logp.dtype, f"{what}: gradient dtype {got[1].dtype}"
    if bitwise:  # against the reference evaluated in the same dtype
        want = _loss_and_grad(_bind(reference_loss, objective), b.logp, *args, **extra)
        _assert_exact(
            got[1], want[1], f"{what}: fused gradient vs autograd of the reference",
            signed_zeros=signed_zeros,
        )  # fmt: skip
    ref = reference_with_bounds(objective, b, **extra)
    _assert_within(got[0], ref.loss, ref.loss_err, f"{what}: loss vs the float64 reference")
    _assert_within(got[1], ref.grad, ref.grad_err, f"{what}: gradient vs the float64 reference")


def check_masked_garbage(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    junk: float = math.nan,
    where: tuple[str, ...] = ("logp", "old_logp", "advantages"),
    signed_zeros: bool = False,
) -> None:
    """``junk`` (NaN, +-inf, any value) at the masked positions of the tensors named in
    ``where`` (advantages: at masked positions if per token, on the empty rows if per
    sequence) changes the loss and the gradient by nothing: the same values (with
    ``signed_zeros``, the same bits: the sign of a zero too)."""
    b = _default(objective, batch, torch.float32)
    mask = b.mask.bool()
    dirty = dict(zip(("logp", "old_logp", "advantages"), b[:3], strict=True))
    for name in where:
        t = dirty[name]
        bad = torch.tensor(junk, dtype=t.dtype)
        if name == "advantages" and t.shape != mask.shape:
            empty = ~mask.any(dim=-1)
            dirty[name] = torch.where(empty.view(t.shape), bad, t)
        else:
            dirty[name] = torch.where(mask, t, bad)
    loss = _bind(policy_loss, objective)
    clean = _loss_and_grad(loss, b.logp, b.old_logp, b.advantages, b.mask, mode=mode)
    got = _loss_and_grad(
        loss, dirty["logp"], dirty["old_logp"], dirty["advantages"], b.mask, mode=mode
    )
    what = f"{_name(objective)}, mode={mode}, {junk} in masked {'/'.join(where)}"
    _assert_exact(got[0], clean[0], f"{what}: loss", signed_zeros=signed_zeros)
    _assert_exact(got[1], clean[1], f"{what}: gradient", signed_zeros=signed_zeros)


def check_micro_batches(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    sizes: tuple[int, ...] = (1, 2),
) -> None:
    """Micro-batches of ``sizes`` rows (the rest in a last one), each normalised by
    ``global_normalizer`` of all their masks, add up to the full-batch loss, and their
    gradients are the full batch's: both within :func:`reference_with_bounds` of the
    full-batch float64 reference."""
    b = _default(objective, batch, torch.float64)
    n = b.logp.shape[0]
    cuts = [c for c in torch.tensor(sizes).cumsum(0).tolist() if 0 < c < n]
    parts = [Batch(*(torch.tensor_split(t, cuts)[k] for t in b)) for k in range(len(cuts) + 1)]
    den = global_normalizer([p.mask for p in parts], mode=mode)  # type: ignore[arg-type]
    loss = _bind(policy_loss, objective)
    pieces = [_loss_and_grad(loss, p.logp, *p[1:], mode=mode, normalizer=den) for p in parts]
    total = torch.stack([p[0] for p in pieces]).sum()
    grad = torch.cat([p[1] for p in pieces])
    ref = reference_with_bounds(objective, b, mode=mode, extra_terms=len(parts))
    what = f"{_name(objective)}, mode={mode}, micro-batches {[p.mask.shape[0] for p in parts]}"
    _assert_within(total, ref.loss, ref.loss_err, f"{what}: summed loss vs the full batch's")
    _assert_within(grad, ref.grad, ref.grad_err, f"{what}: gradient vs the full batch's")
