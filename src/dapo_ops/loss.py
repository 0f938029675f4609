"""``token_level_loss``: the DAPO policy loss, a drop-in for ``loss.backward()``."""

from __future__ import annotations

from typing import Literal, overload

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._fused import fused_token_level_loss
from dapo_ops._validate import InputError, as_bool_mask, check_float, check_same_shape
from dapo_ops.aggregation import AggregationMode, token_level_aggregate
from dapo_ops.diagnostics import PolicyDiagnostics, policy_diagnostics
from dapo_ops.kl import KLEstimator, kl_penalty
from dapo_ops.surrogate import LOG_RATIO_CLAMP, clip_higher_surrogate

Normalizer = Float[Tensor, ""] | Integer[Tensor, ""] | int | float | Literal["local"] | None


@overload
def token_level_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = ...,
    eps_high: float = ...,
    mode: AggregationMode = ...,
    normalizer: Normalizer = ...,
    dual_clip: float | None = ...,
    max_len: int | None = ...,
    log_ratio_clamp: float = ...,
    ref_logp: Tensor | None = ...,
    kl_beta: float = ...,
    kl_estimator: KLEstimator = ...,
    is_weights: Tensor | None = ...,
    compiled: bool = ...,
    return_diagnostics: Literal[False] = ...,
) -> Tensor: ...


@overload
def token_level_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = ...,
    eps_high: float = ...,
    mode: AggregationMode = ...,
    normalizer: Normalizer = ...,
    dual_clip: float | None = ...,
    max_len: int | None = ...,
    log_ratio_clamp: float = ...,
    ref_logp: Tensor | None = ...,
    kl_beta: float = ...,
    kl_estimator: KLEstimator = ...,
    is_weights: Tensor | None = ...,
    compiled: bool = ...,
    return_diagnostics: Literal[True],
) -> tuple[Tensor, PolicyDiagnostics]: ...


def token_level_loss(
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
    ref_logp: Float[Tensor, "batch seq"] | None = None,
    kl_beta: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    is_weights: Float[Tensor, "batch seq"] | None = None,
    compiled: bool = False,
    return_diagnostics: bool = False,
) -> Float[Tensor, ""] | tuple[Float[Tensor, ""], PolicyDiagnostics]:
    r"""DAPO's policy loss: Clip-Higher surrogate, aggregated over tokens.

    .. math::

        \mathcal{L} = \frac{1}{N}\sum_{i,t} m_{i,t}\,\big(-\min(r_{i,t}A_{i,t},\;
            \mathrm{clip}(r_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})A_{i,t})\big)

    i.e. :func:`clip_higher_surrogate` then :func:`token_level_aggregate`; ``N`` is the
    number of valid tokens (``mode="token_mean"``), or ``normalizer`` when given (the
    global count over micro-batches and ranks, from :func:`global_normalizer`). DAPO has
    no KL term (``kl_beta=0``, the default), so no reference log-probs are needed.

    Options for the objectives DAPO is compared with: ``kl_beta > 0`` adds
    ``kl_beta * kl_penalty(logp, ref_logp, estimator=kl_estimator)`` per token (GRPO:
    ``kl_beta=0.04``, k3); ``is_weights`` (e.g. :func:`truncated_is_weights`) multiplies
    the per-token surrogate to correct a rollout-engine mismatch; ``dual_clip`` bounds
    negative-advantage tokens (verl's default ``clip_ratio_c=3``).

    Shapes: logp, old_logp, mask ``[batch, seq]``; advantages ``[batch]``,
    ``[batch, 1]`` or ``[batch, seq]``. Returns a 0-dim float32 tensor (float64 for
    float64 input); the gradient reaches ``logp`` in its own dtype. Masked positions never
    touch the loss or the gradient, NaN included; an all-masked batch gives 0.

    Speed: without KL and IS weights (DAPO, Dr. GRPO) the loss and its gradient come
    from one fused pass with an analytic backward (the same value, the same gradient).
    ``compiled=True`` runs that pass through ``torch.compile`` (inductor: one kernel for
    the loss and the gradient): the first call in a process compiles it (seconds; one
    more compile at the first new shape, then dynamic shapes), later calls reuse it. It
    needs what inductor needs (a C++ compiler on CPU, Triton on GPU) and gives the same
    gradient as the eager path, kinks included (both use the clamp form of
    :func:`clip_higher_surrogate`). It is opt-in: the library never compiles behind the
    caller's back.

    With ``return_diagnostics=True`` returns ``(loss, PolicyDiagnostics)``: clip
    fractions low/high/dual, ratio mean/min/max, approximate KL old -> new and the valid
    token count, as detached 0-dim tensors (no host sync).

    Defaults: ``eps_low=0.2, eps_high=0.28, mode="token_mean"`` from the DAPO paper
    (Yu et al. 2025); see :func:`clip_higher_surrogate` and
    :func:`token_level_aggregate` for the other options.

    Example:
        >>> logp = torch.randn(4, 16, requires_grad=True)
        >>> mask = torch.rand(4, 16) > 0.3
        >>> loss = token_level_loss(logp, logp.detach(), torch.randn(4), mask)
        >>> loss.backward()
    """
    if not (kl_beta >= 0 and kl_beta < float("inf")):
        raise InputError(f"kl_beta must be finite and >= 0, got {kl_beta}")
    if kl_beta > 0 and ref_logp is None:
        raise InputError(f"kl_beta={kl_beta} needs ref_logp (the reference policy's log-probs)")
    clip_opts = {
        "eps_low": eps_low,
        "eps_high": eps_high,
        "dual_clip": dual_clip,
        "log_ratio_clamp": log_ratio_clamp,
    }
    if not isinstance(compiled, bool):
        raise InputError(f"compiled must be True or False, got {compiled!r}")
    if compiled and (kl_beta > 0 or is_weights is not None):
        raise InputError(
            "compiled=True covers the fused path only (kl_beta=0, is_weights=None); "
            f"got kl_beta={kl_beta}, is_weights={'set' if is_weights is not None else None}"
        )
    if kl_beta == 0 and is_weights is None:
        # DAPO's path: one fused pass with an analytic backward (dapo_ops._fused), the
        # same value and gradient as the composition below; on CPU 2-4x faster from 64x4096
        # up (1x at 16x1024) and 1/4-1/50 the extra memory (docs/benchmarks.md)
        loss = fused_token_level_loss(
            logp,
            old_logp,
            advantages,
            mask,
            mode=mode,
            normalizer=normalizer,
            max_len=max_len,
            compiled=compiled,
            **clip_opts,  # type: ignore[arg-type]
        )
    else:
        per_token = clip_higher_surrogate(logp, old_logp, advantages, mask, **clip_opts)  # type: ignore[arg-type]
        if is_weights is not None:
            check_float("is_weights", is_weights)
            check_same_shape("is_weights", is_weights, "logp", logp)
            valid = as_bool_mask("mask", mask, "logp", logp)
            weights = torch.where(
                valid, is_weights.to(per_token.dtype), torch.zeros_like(per_token)
            )
            per_token = per_token * weights.detach()
        if kl_beta > 0 and ref_logp is not None:
            kl = kl_penalty(
                logp, ref_logp, mask, estimator=kl_estimator, log_ratio_clamp=log_ratio_clamp
            )
            per_token = per_token + kl_beta * kl
        loss = token_level_aggregate(
            per_token, mask, mode=mode, normalizer=normalizer, max_len=max_len
        )
    if not return_diagnostics:
        return loss
    return loss, policy_diagnostics(logp, old_logp, advantages, mask, **clip_opts)  # type: ignore[arg-type]
