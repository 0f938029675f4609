"""Losses whose gradients are formed in their forward pass: handing them to backward.

Private; :class:`dapo_ops.logprobs._linear_loss.LinearPolicyLoss` and
:class:`dapo_ops.logprobs._distill_terms.LinearDistill` form each chunk's gradients while its
logits are at hand (:mod:`dapo_ops.logprobs._fused_linear`); these two helpers keep them
from forward (:func:`keep_grads`) and return them from backward (:func:`grads_from_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._validate import is_compiling


def keep_grads(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, grads: Any) -> None:
    """Forward side of a loss whose gradients are formed in its forward pass: eagerly they
    are handed over to the first backward (no copy when the incoming gradient is 1); traced
    by torch.compile, they are plain saved tensors."""
    ctx.handover = not is_compiling()
    ctx.grads = grads if ctx.handover else None
    saved = [] if ctx.handover else [g for g in grads if g is not None]
    ctx.save_for_backward(hidden, weight, bias, *saved)


def grads_from_forward(
    ctx: Any,
    grad_out: Tensor,
    reference: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    again: Callable[[Tensor, Tensor, Tensor | None], Any],
) -> tuple[Tensor | None, ...]:
    """Backward side of :func:`keep_grads`: the kept gradients times ``grad_out``;
    ``create_graph=True`` differentiates ``reference`` (the definition); a second backward
    through a retained graph forms them ``again``. Then ``None`` for the two non-tensor
    inputs (spec, inputs)."""
    hidden, weight, bias, *saved = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: differentiate the definition
        wanted = [x for x, n in zip((hidden, weight, bias), ctx.need, strict=True) if n]
        with torch.enable_grad():
            loss = reference(hidden, weight, bias)
            got = iter(torch.autograd.grad(loss, wanted, grad_out, create_graph=True))
        return (*(next(got) if n else None for n in ctx.need), None, None)
    if ctx.handover:
        grads, ctx.grads = ctx.grads, None
        if grads is None:  # a second backward through a retained graph
            grads = again(hidden, weight, bias)
    else:
        it = iter(saved)
        grads = tuple(next(it) if n else None for n in ctx.need)
    one = ctx.handover and grad_out.device.type == "cpu" and float(grad_out) == 1.0
    out = [g if g is None or one else (g * grad_out).to(g.dtype) for g in grads]
    return (*out, None, None)
