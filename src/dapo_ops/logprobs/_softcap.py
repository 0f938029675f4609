r"""Final-logit soft-capping: :math:`z \mapsto c\tanh(z/c)`, and its derivative.

Private; the fused output-projection paths (:mod:`dapo_ops.logprobs._fused_linear`'s chunks,
the linear policy and distillation losses, :func:`dapo_ops.fused_logprobs_entropy`) take
``softcap=c``. Gemma-2-style models cap their final logits this way (Hugging Face
``final_logit_softcapping``, e.g. 30.0) and vLLM samples from the capped logits, so the
cap sits after the projection (bias included) and before the temperature:
:math:`x = c\tanh((hW^\top + b)/c)/T`. Its derivative,

.. math:: \frac{d}{dz}\,c\tanh(z/c) = 1 - \tanh^2(z/c),

multiplies the gradient w.r.t. the capped logits (the one the softmax steps form)
elementwise; :math:`\tanh(z/c)` is kept from the forward step of each chunk for that.
The cap maps :math:`\pm\infty` to :math:`\pm c`: a ``-inf`` bias entry no longer masks its
token (as in the model).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError, check_real


def check_softcap(softcap: object) -> float | None:
    """``softcap`` as a float, or None (off); ``InputError`` unless finite and > 0."""
    if softcap is None:
        return None
    cap = check_real("softcap", softcap)
    if not cap > 0:
        raise InputError(
            f"softcap must be None or a finite number > 0 (the model's "
            f"final_logit_softcapping, e.g. 30.0); got {softcap!r}"
        )
    return cap


def capped(z: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    r"""``(c tanh(z/c), tanh(z/c))``, functional (differentiable, traceable)."""
    t = torch.tanh(z / softcap)
    return t * softcap, t


def cap_(z: Tensor, softcap: float, t: Tensor) -> Tensor:
    """In place: ``t <- tanh(z/c)`` (``t`` a buffer of ``z``'s shape), ``z <- c t``;
    returns ``t``."""
    torch.div(z, softcap, out=t).tanh_()
    torch.mul(t, softcap, out=z)
    return t


def through_cap(g: Tensor, t: Tensor, in_place: bool) -> Tensor:
    """``g * (1 - t**2)``: a gradient w.r.t. the capped logits taken back to the raw ones
    (``t = tanh(z/c)``); in place, ``t`` is overwritten."""
    if not in_place:
        return g * (1 - t * t)
    return g.mul_(t.mul_(t).neg_().add_(1))


def grad_through_cap(
    z: Tensor, softcap: float | None, cdt: torch.dtype, grad: Callable[[Tensor], Tensor]
) -> Tensor:
    """``grad`` (the gradient w.r.t. the logits it is given) of the raw logits ``z``, with
    differentiable ops (``create_graph=True``): of the capped ones, then through the cap."""
    if softcap is None:
        return grad(z)
    zc, t = capped(z.to(cdt), softcap)
    return grad(zc) * (1 - t * t)
