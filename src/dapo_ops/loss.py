"""``token_level_loss``: the DAPO policy loss, a drop-in for ``loss.backward()``."""

from __future__ import annotations

from typing import Literal, overload

from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops.aggregation import AggregationMode, token_level_aggregate
from dapo_ops.diagnostics import PolicyDiagnostics, policy_diagnostics
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
    return_diagnostics: bool = False,
) -> Float[Tensor, ""] | tuple[Float[Tensor, ""], PolicyDiagnostics]:
    r"""DAPO's policy loss: Clip-Higher surrogate, aggregated over tokens.

    .. math::

        \mathcal{L} = \frac{1}{N}\sum_{i,t} m_{i,t}\,\big(-\min(r_{i,t}A_{i,t},\;
            \mathrm{clip}(r_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high})A_{i,t})\big)

    i.e. :func:`clip_higher_surrogate` then :func:`token_level_aggregate`; ``N`` is the
    number of valid tokens (``mode="token_mean"``), or ``normalizer`` when given (the
    global count over micro-batches and ranks, from :func:`global_normalizer`). DAPO has
    no KL term (beta = 0), so no reference log-probs are needed.

    Shapes: logp, old_logp, mask ``[batch, seq]``; advantages ``[batch]``,
    ``[batch, 1]`` or ``[batch, seq]``. Returns a 0-dim float32 tensor (float64 for
    float64 input); the gradient reaches ``logp`` in its own dtype. Masked positions never
    touch the loss or the gradient, NaN included; an all-masked batch gives 0.

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
    per_token = clip_higher_surrogate(
        logp,
        old_logp,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
    )
    loss = token_level_aggregate(per_token, mask, mode=mode, normalizer=normalizer, max_len=max_len)
    if not return_diagnostics:
        return loss
    diagnostics = policy_diagnostics(
        logp,
        old_logp,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
    )
    return loss, diagnostics
