"""CISPO's per-token loss as a plain autograd function (the objective: :class:`CISPO`)."""

from __future__ import annotations

from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import LOG_RATIO_CLAMP
from dapo_ops._core._validate import InputError
from dapo_ops.engine.surrogate import per_token_loss
from dapo_ops.objectives import CISPO


@checks_values
def cispo_surrogate(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"] | None = None,
    *,
    cap: float = 1.28,
    floor: float = 0.0,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> Float[Tensor, "batch seq"]:
    r"""Per-token CISPO loss: ``per_token_loss(CISPO(eps_low=1 - floor, eps_high=cap - 1))``.

    .. math::

        \ell_{i,t} = -\,\mathrm{sg}\big[\mathrm{clip}(r_{i,t}, \text{floor}, \text{cap})\big]
                     \,A_{i,t}\,\log\pi_\theta(y_{i,t})

    No token loses its gradient (``-w A``, at most ``cap * |A|`` in size); the value is
    not an objective estimate (it contains ``log pi``). See :class:`CISPO`.

    Shapes and masking as :func:`clip_higher_surrogate`; returns ``[batch, seq]``.

    Defaults: ``floor=0`` (MiniMax-M1: no lower bound), ``cap=1.28`` (``1 + 0.28``, DAPO's
    ``eps_high``, as verl's CISPO).

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.9]]))
        >>> old = torch.log(torch.tensor([[0.5, 0.3]]))
        >>> cispo_surrogate(lp, old, torch.tensor([1.0]))  # weights 1 and min(3, 1.28)
        tensor([[0.6931, 0.1349]])
    """
    if not (0.0 <= floor <= 1.0 <= cap < float("inf")):
        raise InputError(f"need 0 <= floor <= 1 <= cap < inf; got floor={floor}, cap={cap}")
    objective = CISPO(eps_low=1.0 - floor, eps_high=cap - 1.0, log_ratio_clamp=log_ratio_clamp)
    return per_token_loss(objective, logp, old_logp, advantages, mask)
