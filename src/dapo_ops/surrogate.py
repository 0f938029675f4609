"""Clip-Higher PPO surrogate (DAPO change 1), with optional dual clip."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._validate import (
    InputError,
    as_bool_mask,
    check_clip_range,
    check_float,
    check_ndim,
    check_same_shape,
    shape_str,
)

#: The log-ratio is clamped to +-LOG_RATIO_CLAMP before ``exp``: the ratio then lies in
#: [2e-9, 4.9e8] and can never overflow to inf, even in float16 inputs (verl uses 20 too).
LOG_RATIO_CLAMP = 20.0


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float32, or float64 when any input is float64 (never a downcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class TokenTerms(NamedTuple):
    """Per-token quantities shared by the surrogate and the diagnostics."""

    valid: Bool[Tensor, "batch seq"]
    log_ratio: Float[Tensor, "batch seq"]  # clamped, 0 at masked positions
    ratio: Float[Tensor, "batch seq"]  # exp(log_ratio), 1 at masked positions
    advantages: Float[Tensor, "batch seq"]  # broadcast, 0 at masked; empty if not given


def policy_inputs(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor | None,
    mask: Tensor | None,
    *,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    names: tuple[str, str] = ("logp", "old_logp"),
) -> tuple[Tensor, Tensor, torch.dtype]:
    """Check the per-token inputs; return advantages as ``[batch, 1|seq]``, the bool mask
    and the compute dtype. Metadata only: no host sync, compile-friendly."""
    name, old_name = names
    check_float(name, logp)
    check_float(old_name, old_logp)
    check_ndim(name, logp, 2, "[batch, seq]")
    check_same_shape(old_name, old_logp, name, logp)
    batch, seq = logp.shape
    if advantages is None:  # ratio-only callers (KL, IS weights, GSPO's sequence ratio)
        adv = logp.new_zeros(0, 0)
    elif advantages.ndim == 1 and advantages.shape[0] == batch:
        adv = rearrange(advantages, "batch -> batch 1")
    elif advantages.ndim == 2 and advantages.shape[0] == batch and advantages.shape[1] in (1, seq):
        adv = advantages
    else:
        raise InputError(
            f"advantages must have shape [batch]=[{batch}], [batch, 1]=[{batch}, 1] or "
            f"[batch, seq]=[{batch}, {seq}] to match {name} {shape_str(logp)}; "
            f"got {shape_str(advantages)}"
        )
    if not (log_ratio_clamp > 0 and log_ratio_clamp < float("inf")):
        raise InputError(f"log_ratio_clamp must be finite and > 0, got {log_ratio_clamp}")
    if advantages is not None:
        check_float("advantages", advantages)
    if mask is None:
        valid = torch.ones_like(logp, dtype=torch.bool)
    else:
        valid = as_bool_mask("mask", mask, name, logp)
    return adv, valid, compute_dtype(logp, old_logp, adv)


def token_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor | None,
    mask: Tensor | None,
    *,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
    names: tuple[str, str] = ("logp", "old_logp"),
) -> TokenTerms:
    """Check inputs, broadcast advantages and build the masked, clamped token ratio."""
    adv, valid, dtype = policy_inputs(
        logp, old_logp, advantages, mask, log_ratio_clamp=log_ratio_clamp, names=names
    )
    zero = logp.new_zeros((), dtype=dtype)
    # `where`, never a multiplication: NaN/inf at masked positions must not reach the
    # forward value or, through 0 * inf, the gradient.
    log_ratio = torch.where(valid, logp.to(dtype) - old_logp.to(dtype), zero)
    log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    adv_full = adv.to(dtype) if advantages is None else torch.where(valid, adv.to(dtype), zero)
    return TokenTerms(valid, log_ratio, torch.exp(log_ratio), adv_full)


def clip_higher_surrogate(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"] | None = None,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> Float[Tensor, "batch seq"]:
    r"""Per-token Clip-Higher PPO loss (to be minimised).

    .. math::

        r_{i,t} = \exp(\log\pi_\theta - \log\pi_{old}),\qquad
        \ell_{i,t} = -\min\big(r_{i,t} A_{i,t},\;
                     \mathrm{clip}(r_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high}) A_{i,t}\big)

    With ``dual_clip = c`` (dual-clip PPO, Ye et al. 2020), tokens with ``A < 0`` use
    ``min(ell, -c A)``: the loss of a negative-advantage token whose ratio exploded is
    capped at ``c |A|``, and its gradient is 0 beyond ``r > c``.

    Where the clip is active the token's gradient is exactly 0: ``A > 0`` and
    ``r > 1 + eps_high``, or ``A < 0`` and ``r < 1 - eps_low`` (and ``r > c`` with dual clip).
    It is computed as ``-A clamp(r, lo_A, hi_A)`` (:func:`clipped_objective`): the same
    values as the formula above, bit for bit, and exactly that gradient, ratios on a bound
    included (full gradient) and ratios a float ulp past one excluded (zero).

    Shapes:
        logp, old_logp: ``[batch, seq]`` log-probs of the sampled tokens under the current
        and the behaviour (old) policy. advantages: ``[batch]`` or ``[batch, 1]`` (one per
        sequence) or ``[batch, seq]`` (per token). A 1-D advantage is always per sequence.
        mask: ``[batch, seq]``, True on response tokens; bool or 0/1 integers.
        Returns ``[batch, seq]``, 0 at masked positions (whatever they hold, NaN included).

    Dtypes: computed in float32 (float64 if any input is float64); the gradient reaches
    ``logp`` in its own dtype. The log-ratio is clamped to ``+-log_ratio_clamp`` before
    ``exp`` so the ratio is always finite.

    Defaults: ``eps_low=0.2`` and ``eps_high=0.28`` are DAPO's (Yu et al. 2025, sec. 3.1);
    ``dual_clip`` is off (verl's ``clip_ratio_c`` is 3.0); the clamp of 20 is verl's.

    Example:
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -2.5]])
        >>> clip_higher_surrogate(logp, old, torch.tensor([1.0]))  # second ratio clipped at 1.28
        tensor([[-1.0000, -1.2800]], grad_fn=<WhereBackward0>)
    """
    check_clip_range(eps_low, eps_high, dual_clip)
    valid, _, ratio, adv = token_terms(
        logp, old_logp, advantages, mask, log_ratio_clamp=log_ratio_clamp
    )
    loss = clipped_objective(ratio, adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    return torch.where(valid, loss, torch.zeros_like(loss))


def clip_bounds(
    adv: Tensor, *, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per-element bounds ``(lo_A, hi_A)`` of the clamp form of the clipped objective.

    ``[1 - eps_low, dual_clip or inf]`` where ``A < 0``, ``[-inf, 1 + eps_high]`` elsewhere
    (``A >= 0``, NaN included), in ``adv``'s dtype and shape.
    """
    negative = adv < 0
    cap = math.inf if dual_clip is None else dual_clip
    if adv.dtype == torch.get_default_dtype():  # two Python numbers give that dtype
        return (
            torch.where(negative, 1.0 - eps_low, -math.inf),
            torch.where(negative, cap, 1.0 + eps_high),
        )
    lo = torch.where(negative, torch.full_like(adv, 1.0 - eps_low), -math.inf)
    hi = torch.where(negative, torch.full_like(adv, cap), torch.full_like(adv, 1.0 + eps_high))
    return lo, hi


def clipped_objective(
    ratio: Tensor, adv: Tensor, *, eps_low: float, eps_high: float, dual_clip: float | None
) -> Tensor:
    r"""``-min(r A, clip(r) A)`` (dual bound for ``A < 0``) as ``-A clamp(r, lo_A, hi_A)``.

    For :math:`A < 0`, :math:`-\min(rA, \mathrm{clip}(r)A) = -A\max(r, 1-\varepsilon_{low})`,
    capped by the dual clip at :math:`r \le c`; for :math:`A \ge 0` it is
    :math:`-A\min(r, 1+\varepsilon_{high})`. Float rounding is monotone, so every value is
    bitwise the one of the ``maximum``/``minimum`` chain; the gradient is ``clamp``'s:
    ``-A`` times 1 where :math:`lo_A \le r \le hi_A` (bounds included) and exactly 0 where
    the clip is active, even when a float product rounds ``r A`` onto ``clip(r) A`` (where
    ``torch.maximum``'s autograd would pass half). Shared by PPO and GSPO.
    """
    lo, hi = clip_bounds(adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
    return -adv * torch.clamp(ratio, lo, hi)
