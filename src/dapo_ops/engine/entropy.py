"""The entropy bonus and TRL's adaptive entropy-coefficient controller.

:func:`entropy_bonus` is the term ``-coef * H`` added to a policy loss, with ``H`` the
token entropy aggregated like any per-token loss (:func:`dapo_ops.token_level_aggregate`),
so that micro-batches and ranks add up exactly under a global ``normalizer``.
:func:`adaptive_entropy_coef` is one step of the adaptive controller of Skywork-OR1
(He et al. 2025), as TRL 1.16 runs it (``use_adaptive_entropy``).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import AggregationMode, Normalizer, compute_dtype
from dapo_ops._core._validate import InputError, check_float, check_real, check_scalar
from dapo_ops.engine.aggregation import token_level_aggregate

__all__ = ["EntropyCoef", "adaptive_entropy_coef", "entropy_bonus"]


@checks_values
def entropy_bonus(
    entropy: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    coef: float | Float[Tensor, ""],
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
) -> Float[Tensor, ""]:
    r"""The entropy bonus to add to a policy loss: ``-coef`` times the aggregated entropy.

    .. math::

        \mathcal{L}_H = -c \cdot \mathrm{agg}(H, m),\qquad
        H_{i,t} = -\sum_v \pi_\theta(v \mid \cdot)\log\pi_\theta(v \mid \cdot)

    with ``agg`` = :func:`dapo_ops.token_level_aggregate` (``mode``, ``normalizer``,
    ``max_len``: the same options, the same rules). Minimising ``loss + entropy_bonus(...)``
    raises the policy's entropy when ``coef > 0``. The gradient flows into ``entropy``
    (from :func:`dapo_ops.token_logprobs_and_entropy` or
    :func:`dapo_ops.fused_logprobs_entropy`); masked positions reach neither the value nor
    the gradient, whatever they hold. With ``normalizer=global_normalizer(masks, mode=...)``
    the bonuses of the step's micro-batches add up to the whole batch's.

    The peers, reproduced:

    - verl 0.9.1 (``actor.entropy_coeff``): ``entropy_bonus(H, mask, coef=entropy_coeff,
      mode=<loss_agg_mode>, normalizer=<the policy loss's>)``: the policy loss's own
      aggregation.
    - TRL 1.16 (``entropy_coef``): a per-micro-batch token mean over the loss mask (times
      the top-entropy selection when ``top_entropy_quantile < 1``) divided by the
      accumulation steps, whatever the ``loss_type``: ``mode="token_mean",
      normalizer=count.clamp(min=1) * accumulation_steps`` with ``count`` that
      micro-batch's selected tokens (``DapoGRPOTrainer`` does this).
    - OpenRLHF 0.11.2 (``actor.entropy_coef``): always a token mean over the step's tokens,
      ``mode="token_mean", normalizer=batch_num_tokens / dp_size``.

    ``coef``: a finite number, or a 0-dim tensor that does not require grad (a coefficient
    kept on the device, e.g. by :func:`adaptive_entropy_coef`, so no host sync and no
    recompilation when it changes).

    Shapes: entropy ``[batch, seq]``, mask ``[batch, seq]`` (bool or 0/1 integers);
    returns a 0-dim float32 tensor (float64 when ``entropy`` or ``coef`` is float64).

    Example:
        >>> h = torch.tensor([[0.5, 1.5, 9.0]])
        >>> entropy_bonus(h, torch.tensor([[True, True, False]]), coef=0.01)
        tensor(-0.0100)
    """
    check_float("entropy", entropy)
    c = check_scalar("coef", coef)
    total = token_level_aggregate(entropy, mask, mode=mode, normalizer=normalizer, max_len=max_len)
    if isinstance(c, Tensor):
        dtype = compute_dtype(entropy, c)
        return -(c.to(device=total.device, dtype=dtype) * total.to(dtype))
    return -(c * total)


def _check_entropy(value: object) -> float | Tensor:
    """A real number that is not NaN (+-inf allowed: "no measurement yet"), or a 0-dim tensor."""
    if isinstance(value, Tensor):
        return check_scalar("entropy", value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"entropy must be a real number or a 0-dim tensor, got {value!r}")
    if math.isnan(value):
        raise InputError("entropy must not be NaN (a broken measurement)")
    return float(value)


class EntropyCoef(NamedTuple):
    """One step of the adaptive controller: the coefficient to keep, and the one to apply."""

    coef: float | Tensor  # the controller's coefficient for the next step
    applied: float | Tensor  # what the next step multiplies the entropy by: coef, or 0


def adaptive_entropy_coef(
    coef: float | Float[Tensor, ""],
    entropy: float | Float[Tensor, ""],
    *,
    target: float = 0.2,
    delta: float = 0.005,
    coef_min: float = 0.0,
    coef_max: float = 1.0,
) -> EntropyCoef:
    r"""One update of the adaptive entropy coefficient (Skywork-OR1; TRL's ``use_adaptive_entropy``).

    From the coefficient :math:`c_k` and the entropy :math:`e_k` measured over the step just
    taken (the token mean over every micro-batch and rank of the optimiser step):

    .. math::

        c_{k+1} = \begin{cases} \min(c_k + \Delta,\ c_{max}) & e_k \le e_{target} \\
                                \max(c_k - \Delta,\ c_{min}) & \text{otherwise} \end{cases}
        \qquad a_{k+1} = c_{k+1}\,[e_k \le e_{target}]

    Returns ``EntropyCoef(coef=c_{k+1}, applied=a_{k+1})``: keep ``coef`` for the next
    update, pass ``applied`` to :func:`entropy_bonus` during the next step (the bonus is
    switched off while the entropy is above the target). Before the first measurement the
    applied coefficient is 0 (TRL starts from ``e = inf``).

    ``coef`` and ``entropy``: Python numbers (then the result holds floats) or 0-dim
    tensors that do not require grad (then tensors, computed with ``torch.where``: no host
    sync). A NaN ``entropy`` is refused as a number; as a tensor it makes both results NaN
    (TRL would count it as above the target), so a broken measurement is never silent.

    Defaults: TRL 1.16's (``entropy_target=0.2``, ``entropy_coef_delta=0.005``,
    ``entropy_coef_min=0.0``, ``entropy_coef_max=1.0``).

    Example:
        >>> adaptive_entropy_coef(0.01, 0.15, target=0.2, delta=0.005)
        EntropyCoef(coef=0.015, applied=0.015)
        >>> adaptive_entropy_coef(0.01, 0.35, target=0.2, delta=0.005)
        EntropyCoef(coef=0.005, applied=0.0)
    """
    c = check_scalar("coef", coef)
    e = _check_entropy(entropy)
    t = check_real("target", target)
    d = check_real("delta", delta)
    if d < 0:
        raise InputError(f"delta must be >= 0, got {d}")
    lo, hi = check_real("coef_min", coef_min), check_real("coef_max", coef_max)
    if lo > hi:
        raise InputError(f"coef_min must be <= coef_max, got coef_min={lo}, coef_max={hi}")
    if not isinstance(c, Tensor) and not isinstance(e, Tensor):
        below = e <= t
        up = min(c + d, hi) if below else max(c - d, lo)
        return EntropyCoef(up, up if below else 0.0)
    ref = c if isinstance(c, Tensor) else e
    assert isinstance(ref, Tensor)
    dtype = compute_dtype(*(x for x in (c, e) if isinstance(x, Tensor)))
    ct = torch.as_tensor(c, dtype=dtype, device=ref.device)
    et = torch.as_tensor(e, dtype=dtype, device=ref.device)
    below_t = et <= t
    nan = torch.isnan(et)
    up_t = torch.where(below_t, (ct + d).clamp(max=hi), (ct - d).clamp(min=lo))
    up_t = torch.where(nan, torch.nan, up_t)
    applied = torch.where(below_t | nan, up_t, 0.0)
    return EntropyCoef(up_t, applied)
