"""``token_level_loss``: the DAPO policy loss, a drop-in for ``loss.backward()``."""

from __future__ import annotations

from typing import Any, Literal, TypedDict, overload

from jaxtyping import Bool, Float, Integer
from torch import Tensor
from typing_extensions import Unpack

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import LOG_RATIO_CLAMP, AggregationMode, Normalizer
from dapo_ops._core._validate import InputError, check_bool, check_option, check_real
from dapo_ops.diagnostics.measures import PolicyDiagnostics
from dapo_ops.engine.kl import KL_ESTIMATORS, KLEstimator, KLPenalty
from dapo_ops.engine.policy import policy_loss, policy_loss_with_diagnostics
from dapo_ops.objectives import ClipHigher


class _ClipOptions(TypedDict, total=False):
    """token_level_loss's options but ``return_diagnostics`` (typing of its two overloads)."""

    eps_low: float
    eps_high: float
    mode: AggregationMode
    normalizer: Normalizer
    dual_clip: float | None
    max_len: int | None
    log_ratio_clamp: float
    ref_logp: Tensor | None
    kl_beta: float
    kl_estimator: KLEstimator
    is_weights: Tensor | None
    compiled: bool


@overload
def token_level_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    return_diagnostics: Literal[False] = ...,
    **options: Unpack[_ClipOptions],
) -> Tensor: ...


@overload
def token_level_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    return_diagnostics: Literal[True],
    **options: Unpack[_ClipOptions],
) -> tuple[Tensor, PolicyDiagnostics]: ...


@checks_values
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

    i.e. ``policy_loss(ClipHigher(eps_low, eps_high, dual_clip), ...)``: the same value and
    gradient, bit for bit, as :func:`clip_higher_surrogate` then :func:`token_level_aggregate`
    would give (the gradient; the value up to the order of its sums). ``N`` is the
    number of valid tokens (``mode="token_mean"``), or ``normalizer`` when given (the
    global count over micro-batches and ranks, from :func:`global_normalizer`). DAPO has
    no KL term (``kl_beta=0``, the default), so no reference log-probs are needed.

    Options for the objectives DAPO is compared with: ``kl_beta > 0`` adds
    ``kl_beta * kl_penalty(logp, ref_logp, estimator=kl_estimator)`` per token (GRPO:
    ``kl_beta=0.04``, k3; ``ref_logp`` without ``kl_beta > 0`` is refused, as it would be
    ignored); ``is_weights`` (e.g. :func:`truncated_is_weights`) multiplies the per-token
    surrogate to correct a rollout-engine mismatch; ``dual_clip`` bounds negative-advantage
    tokens (verl's default ``clip_ratio_c=3``). ``old_logp``, ``advantages``, ``ref_logp``
    and ``is_weights`` must not require grad (the commonest mistake,
    ``token_level_loss(logp, logp, ...)``, is refused with the ``.detach()`` hint).

    Shapes: logp, old_logp, mask ``[batch, seq]``; advantages ``[batch]``,
    ``[batch, 1]`` or ``[batch, seq]``. Returns a 0-dim float32 tensor (float64 for
    float64 input); the gradient reaches ``logp`` in its own dtype. Masked positions never
    touch the loss or the gradient, NaN included; an all-masked batch gives 0.

    Speed: the loss and its gradient come from one fused pass with an analytic backward
    (the same value, the same gradient), with or without KL and IS weights.
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
        >>> logp = torch.rand(4, 16).log().requires_grad_()  # log-probs: <= 0
        >>> mask = torch.rand(4, 16) > 0.3
        >>> loss = token_level_loss(logp, logp.detach(), torch.randn(4), mask)
        >>> loss.backward()
    """
    check_bool("return_diagnostics", return_diagnostics)
    kl_beta = check_real("kl_beta", kl_beta)
    if kl_beta < 0:
        raise InputError(f"kl_beta must be finite and >= 0, got {kl_beta}")
    check_option("kl_estimator", kl_estimator, KL_ESTIMATORS)
    if kl_beta > 0 and ref_logp is None:
        raise InputError(f"kl_beta={kl_beta} needs ref_logp (the reference policy's log-probs)")
    if kl_beta == 0 and ref_logp is not None:
        raise InputError(
            "ref_logp is given but kl_beta=0, so it would be ignored: set kl_beta > 0 for a "
            "KL penalty, or drop ref_logp"
        )
    objective = ClipHigher(
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, log_ratio_clamp=log_ratio_clamp
    )
    kl = (
        KLPenalty(beta=kl_beta, estimator=kl_estimator, log_ratio_clamp=log_ratio_clamp)
        if kl_beta > 0
        else None
    )
    options: dict[str, Any] = {
        "mode": mode,
        "normalizer": normalizer,
        "max_len": max_len,
        "ref_logp": ref_logp,
        "kl": kl,
        "is_weights": is_weights,
        "compiled": compiled,
    }
    if return_diagnostics:
        return policy_loss_with_diagnostics(objective, logp, old_logp, advantages, mask, **options)
    return policy_loss(objective, logp, old_logp, advantages, mask, **options)
