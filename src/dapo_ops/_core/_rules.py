"""The rules every loss function shares, defined once: compute dtype, masking, options.

- **Compute dtype**: float32 whatever the input dtype, float64 when any input is float64
  (never a downcast); :func:`compute_dtype`.
- **Masking**: a masked position never reaches a value or a gradient, whatever it holds
  (NaN and inf included), so it is removed with ``torch.where``, never by a
  multiplication (``0 * inf`` is NaN); :func:`masked`.
- **Options**: the aggregation modes (:data:`AggregationMode`) and what ``normalizer=``
  accepts (:data:`Normalizer`).
- **Kinks**: a clamp, clip or cap acts only strictly beyond its bound; on the bound the
  gradient passes (:func:`clip`, :func:`magnitude`), the same on every torch
  (docs/kinks.md).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from jaxtyping import Float, Integer
from torch import Tensor

#: The token log-ratio is clamped to +-LOG_RATIO_CLAMP before ``exp``: the ratio then lies
#: in [2e-9, 4.9e8] and can never overflow to inf, even for float16 inputs (verl uses 20).
LOG_RATIO_CLAMP = 20.0

AggregationMode = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
AGGREGATION_MODES: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)

#: What ``normalizer=`` accepts: a positive finite number or 0-dim tensor (the global
#: count, see :func:`dapo_ops.global_normalizer`), ``None`` (this call's own count) or
#: ``"local"`` (this call's own count, also under a multi-rank process group).
Normalizer = Float[Tensor, ""] | Integer[Tensor, ""] | int | float | Literal["local"] | None


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32, or float64 when any input is float64 (never a downcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def masked(valid: Tensor, values: Tensor) -> Tensor:
    """``values`` where ``valid``, exactly 0 elsewhere (whatever ``values`` holds there)."""
    return torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))


def clip(
    values: Tensor, low: Tensor | float | None = None, high: Tensor | float | None = None
) -> Tensor:
    """``torch.clamp(values, low, high)``, with the library's gradient at the bounds.

    The value is clamp's. The gradient is 1 where ``low <= values <= high``, *a bound
    itself included*, and 0 strictly beyond a bound and at NaN, on every torch:
    ``torch.clamp``'s own gradient on a bound is 1 up to torch 2.13 and 0 (number
    bounds) or 1/2 (tensor bounds) from torch 2.14, so no differentiated path may lean on
    it. Without autograd (no grad mode, or ``values`` not requiring grad) it is clamp.

    Example:
        >>> x = torch.tensor([0.8, 1.28, 1.5], requires_grad=True)
        >>> clip(x, 0.8, 1.28).sum().backward()
        >>> x.grad
        tensor([1., 1., 0.])
    """
    bounded = torch.clamp(values, low, high)  # type: ignore[arg-type]  # mixed bounds work
    if not (torch.is_grad_enabled() and values.requires_grad):
        return bounded
    return torch.where(bounded == values, values, bounded.detach())


def magnitude(values: Tensor) -> Tensor:
    """``|values|`` with the gradient ``sign(values)`` stated, 0 at 0 (the kink)."""
    if not (torch.is_grad_enabled() and values.requires_grad):
        return values.abs()
    return torch.where(values == 0, values.detach().abs(), values * torch.sign(values).detach())


def safe_divide(num: Tensor, den: Tensor | float) -> Tensor:
    """``num / den``, with a zero ``den`` replaced by 1, so the value and gradient stay finite.

    Every caller divides a sum by a count of what it sums (tokens, sequences, samples):
    a zero count means an empty sum, and the result is then 0, never NaN.
    """
    if not isinstance(den, Tensor):  # a host number: no tensor made of it (a copy to the device)
        return num / (den if den != 0 else 1.0)
    den_t = den.to(dtype=num.dtype, device=num.device)
    return num / torch.where(den_t == 0, torch.ones_like(den_t), den_t)


def finite_or_masked(t: Tensor, valid: Tensor, out: Tensor) -> tuple[Tensor | None, float]:
    """``t`` itself if all finite, else ``where(valid, t, 0)`` in ``out`` if that is all
    finite, else None (a non-finite value on a valid token); and the largest ``|value|``.
    One host read (two if sanitised), on the CPU."""
    low, high = (float(x) for x in torch.aminmax(t))
    if not (math.isfinite(low) and math.isfinite(high)):
        t = out.copy_(torch.where(valid, t, 0.0))
        low, high = (float(x) for x in torch.aminmax(t))
        if not (math.isfinite(low) and math.isfinite(high)):
            return None, math.inf
    return t, max(-low, high)
