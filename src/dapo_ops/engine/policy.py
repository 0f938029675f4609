"""``policy_loss``: any objective, composed the same way, on one fast path."""

from __future__ import annotations

from typing import TypedDict

from jaxtyping import Bool, Float, Integer
from torch import Tensor
from typing_extensions import Unpack

from dapo_ops._core._rules import AggregationMode, Normalizer
from dapo_ops._core._validate import InputError
from dapo_ops.diagnostics.measures import PolicyDiagnostics, objective_diagnostics
from dapo_ops.engine._engine import LossInputs, LossSpec, fused_loss
from dapo_ops.engine.checks import (
    check_constants,
    check_loss_options,
    normalizer_tensor,
    objective_inputs,
)
from dapo_ops.engine.distill import TeacherKL, check_pair, distill_loss
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.objectives.base import Objective


class LossOptions(TypedDict, total=False):
    """The keyword options every policy loss takes (:func:`policy_loss`,
    :func:`dapo_ops.linear_policy_loss`): aggregation, KL penalty, IS weights."""

    mode: AggregationMode
    normalizer: Normalizer
    max_len: int | None
    ref_logp: Tensor | None
    kl: KLPenalty | None
    is_weights: Tensor | None


class PolicyOptions(LossOptions, total=False):
    """The keyword options of :func:`policy_loss`, for the functions that pass them on."""

    kl_weights: Tensor | None
    teacher_logp: Tensor | None
    distill: TeacherKL | None
    compiled: bool


def prepare(
    objective: Objective,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mode: str,
    normalizer: object,
    max_len: int | None,
    ref_logp: Tensor | None,
    kl: KLPenalty | None,
    is_weights: Tensor | None,
    compiled: bool,
    kl_weights: Tensor | None = None,
) -> tuple[LossSpec, LossInputs, Tensor | None]:
    """Check every argument of :func:`policy_loss` (metadata only, no host sync) and
    return what :func:`dapo_ops.engine._engine.fused_loss` takes."""
    check_loss_options(objective, mode=mode, max_len=max_len, kl=kl, ref_logp=ref_logp)
    if not isinstance(compiled, bool):
        raise InputError(f"compiled must be True or False, got {compiled!r}")
    adv, valid, dtype = objective_inputs(
        objective, logp, old_logp, advantages, mask, device_of=("logp", logp)
    )
    if kl_weights is not None and kl is None:
        raise InputError(
            "kl_weights weight the KL penalty's terms: pass them with kl=KLPenalty(...) and "
            "ref_logp, or leave them out"
        )
    check_constants(
        (("ref_logp", ref_logp), ("is_weights", is_weights), ("kl_weights", kl_weights)),
        shape_of=("logp", logp),
        device_of=("logp", logp),
    )
    den = normalizer_tensor(normalizer, dtype, logp.device)
    spec = LossSpec(objective, kl, mode, max_len)
    tensors = LossInputs(logp, old_logp, adv, valid, ref_logp, is_weights, kl_weights)
    return spec, tensors, den


def policy_loss(
    objective: Objective,
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
    ref_logp: Float[Tensor, "batch seq"] | None = None,
    kl: KLPenalty | None = None,
    is_weights: Float[Tensor, "batch seq"] | None = None,
    kl_weights: Float[Tensor, "batch seq"] | None = None,
    teacher_logp: Float[Tensor, "batch seq"] | Float[Tensor, "teachers batch seq"] | None = None,
    distill: TeacherKL | None = None,
    compiled: bool = False,
) -> Float[Tensor, ""]:
    r"""The policy loss of any objective: term, IS weights, KL penalty, aggregation.

    .. math::

        \mathcal{L} = \sum_{i,t} w_{i,t}\, m_{i,t}\,\big(\rho_{i,t}\,\ell_{i,t}
            + \beta\,\kappa_{i,t}\, k_{i,t}\big)

    ``ell`` is the objective's per-token term (:class:`ClipHigher`, :class:`GSPO`,
    :class:`CISPO` or your own :class:`~dapo_ops.objectives.Objective`); ``rho`` the
    detached ``is_weights`` (e.g. :func:`truncated_is_weights`), 1 when not given;
    ``beta k`` the KL penalty ``kl`` (:class:`KLPenalty`) against ``ref_logp``, weighted
    per token by the detached ``kl_weights`` ``kappa`` (1 when not given; e.g. a token
    selection such as :func:`kl_cov_mask` times the IS weights); ``w`` the
    aggregation weights of ``mode`` (the table in :func:`aggregate_partial`) with the
    local count, or ``normalizer`` (the global count from :func:`global_normalizer`:
    then micro-batch losses add up exactly to the full-batch loss).

    Masked positions never touch the loss or the gradient, whatever they hold (NaN
    included); an all-masked batch gives 0. Computed in float32 (float64 if any input is
    float64); the gradient reaches ``logp`` in its own dtype. ``old_logp``,
    ``advantages``, ``ref_logp``, ``is_weights``, ``kl_weights`` and a ``normalizer``
    tensor are constants of the objective: passing one that requires grad is refused
    (``.detach()`` it). Objectives with an analytic gradient compute the loss and its gradient in one
    fused pass; ``compiled=True`` runs that pass as one ``torch.compile`` graph (compiled
    on first use; opt-in). Double backward differentiates the definition.

    ``distill`` (:class:`TeacherKL`) with ``teacher_logp`` adds on-policy distillation's
    teacher term :func:`distill_loss` with the same ``mode``, ``normalizer`` and
    ``max_len`` (so it is exact across micro-batches too), under autograd beside the
    fused pass (also with ``compiled=True``).

    Shapes: logp, old_logp, mask, ref_logp, is_weights, kl_weights ``[batch, seq]``;
    teacher_logp ``[batch, seq]`` or ``[teachers, batch, seq]``; advantages
    ``[batch]``, ``[batch, 1]`` or ``[batch, seq]`` (per sequence only for sequence-level
    objectives such as GSPO). Returns a 0-dim tensor.

    Defaults: ``mode="token_mean"`` (DAPO, sec. 3.3); the objective's own defaults are
    documented on its class.

    Example:
        >>> from dapo_ops import ClipHigher, KLPenalty
        >>> logp = torch.randn(4, 16, requires_grad=True)
        >>> mask = torch.rand(4, 16) > 0.3
        >>> loss = policy_loss(ClipHigher(), logp, logp.detach(), torch.randn(4), mask)
        >>> loss.backward()
        >>> ref = logp.detach() - 0.1  # GRPO: symmetric clip, a KL penalty, sequence mean
        >>> loss = policy_loss(ClipHigher(eps_high=0.2), logp, logp.detach(), torch.randn(4),
        ...                    mask, mode="seq_mean_token_mean", ref_logp=ref, kl=KLPenalty())
        >>> loss.backward()
    """
    spec, tensors, den = prepare(
        objective, logp, old_logp, advantages, mask, mode=mode, normalizer=normalizer,
        max_len=max_len, ref_logp=ref_logp, kl=kl, is_weights=is_weights, compiled=compiled,
        kl_weights=kl_weights,
    )  # fmt: skip
    check_pair(distill, teacher_logp)
    if compiled:
        from dapo_ops.engine._compiled import compiled_body

        loss = fused_loss(spec, tensors, den, compiled_body("inductor"))
    else:
        loss = fused_loss(spec, tensors, den)
    if distill is None or teacher_logp is None:
        return loss
    return loss + distill_loss(
        logp, teacher_logp, mask, distill=distill, mode=mode, normalizer=normalizer, max_len=max_len
    )


def policy_loss_with_diagnostics(
    objective: Objective,
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    **options: Unpack[PolicyOptions],
) -> tuple[Float[Tensor, ""], PolicyDiagnostics]:
    """:func:`policy_loss` (same arguments and keyword options) and its diagnostics.

    The :class:`PolicyDiagnostics` hold, as detached 0-dim float64 tensors (no host
    sync): the valid-token count, the tokens the objective clips (low, high, dual: its
    :meth:`~dapo_ops.objectives.Objective.clipped`), the token ratio's sum/min/max and
    the k3 estimate of KL(old || new).

    Example:
        >>> from dapo_ops import ClipHigher
        >>> logp = torch.zeros(1, 2, requires_grad=True)
        >>> loss, d = policy_loss_with_diagnostics(
        ...     ClipHigher(), logp, torch.tensor([[0.0, -1.0]]), torch.tensor([1.0]),
        ...     torch.ones(1, 2, dtype=torch.bool))
        >>> float(d.clip_frac_high)
        0.5
    """
    loss = policy_loss(objective, logp, old_logp, advantages, mask, **options)
    return loss, objective_diagnostics(objective, logp, old_logp, advantages, mask)
