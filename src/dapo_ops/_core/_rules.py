"""The rules every loss function shares, defined once: compute dtype, masking, options.

- **Compute dtype**: float32 whatever the input dtype, float64 when any input is float64
  (never a downcast); :func:`compute_dtype`.
- **Masking**: a masked position never reaches a value or a gradient, whatever it holds
  (NaN and inf included), so it is removed with ``torch.where``, never by a
  multiplication (``0 * inf`` is NaN); :func:`masked`.
- **Options**: the aggregation modes (:data:`AggregationMode`) and what ``normalizer=``
  accepts (:data:`Normalizer`).
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


def safe_divide(num: Tensor, den: Tensor | float) -> Tensor:
    """``num / den``, with a zero ``den`` replaced by 1, so the value and gradient stay finite.

    Every caller divides a sum by a count of what it sums (tokens, sequences, samples):
    a zero count means an empty sum, and the result is then 0, never NaN.
    """
    den_t = torch.as_tensor(den, dtype=num.dtype, device=num.device)
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
