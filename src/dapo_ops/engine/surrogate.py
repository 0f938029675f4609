"""Per-token losses of the objectives, as plain autograd functions."""

from __future__ import annotations

from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import LOG_RATIO_CLAMP
from dapo_ops._core._validate import check_no_grad
from dapo_ops.engine._engine import LossSpec, reference_terms
from dapo_ops.objectives import ClipHigher, Objective
from dapo_ops.objectives.base import check_objective_value, per_sequence_advantages

__all__ = ["LOG_RATIO_CLAMP", "clip_higher_surrogate", "per_token_loss"]


def per_token_loss(
    objective: Objective,
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"] | None = None,
) -> Float[Tensor, "batch seq"]:
    r"""An objective's per-token loss :math:`\ell_{i,t}`, 0 at masked positions.

    The reference definition (:meth:`~dapo_ops.objectives.Objective.term` under
    autograd) that :func:`policy_loss` aggregates; use it to inspect an objective or to
    compose your own aggregation. ``old_logp`` and ``advantages`` must not require grad.

    Shapes: ``[batch, seq]`` (advantages also ``[batch]`` or ``[batch, 1]``); returns
    ``[batch, seq]`` in float32 (float64 if any input is float64).

    Example:
        >>> from dapo_ops import ClipHigher
        >>> per_token_loss(ClipHigher(), torch.tensor([[-1.0, -2.0]]),
        ...                torch.tensor([[-1.0, -2.5]]), torch.tensor([1.0]))
        tensor([[-1.0000, -1.2800]])
    """
    check_objective_value(objective)
    adv, valid, _ = policy_tensors(
        logp, old_logp, advantages, mask, per_sequence=per_sequence_advantages(objective)
    )
    check_no_grad("old_logp", old_logp)
    check_no_grad("advantages", advantages)
    return reference_terms(LossSpec(objective), logp, old_logp, adv, valid)


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
    r"""Per-token Clip-Higher PPO loss (to be minimised): ``per_token_loss(ClipHigher(...))``.

    .. math::

        r_{i,t} = \exp(\log\pi_\theta - \log\pi_{old}),\qquad
        \ell_{i,t} = -\min\big(r_{i,t} A_{i,t},\;
                     \mathrm{clip}(r_{i,t}, 1-\varepsilon_{low}, 1+\varepsilon_{high}) A_{i,t}\big)

    With ``dual_clip = c`` (dual-clip PPO, Ye et al. 2020), tokens with ``A < 0`` use
    ``min(ell, -c A)``. Where the clip is active the token's gradient is exactly 0. See
    :class:`ClipHigher` for the clamp form it is computed in and the defaults' origin
    (DAPO: ``eps_low=0.2, eps_high=0.28``; verl's log-ratio clamp of 20).

    Shapes:
        logp, old_logp: ``[batch, seq]`` log-probs of the sampled tokens under the current
        and the behaviour (old) policy. advantages: ``[batch]`` or ``[batch, 1]`` (one per
        sequence) or ``[batch, seq]`` (per token). mask: ``[batch, seq]``, True on
        response tokens; bool or 0/1 integers. Returns ``[batch, seq]``, 0 at masked
        positions (whatever they hold, NaN included), float32 (float64 for float64 input).

    Example:
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -2.5]])
        >>> clip_higher_surrogate(logp, old, torch.tensor([1.0]))  # second ratio clipped at 1.28
        tensor([[-1.0000, -1.2800]], grad_fn=<WhereBackward0>)
    """
    objective = ClipHigher(
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, log_ratio_clamp=log_ratio_clamp
    )
    return per_token_loss(objective, logp, old_logp, advantages, mask)
