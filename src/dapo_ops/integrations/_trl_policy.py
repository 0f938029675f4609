"""One TRL batch through dapo_ops: the objective's inputs (:func:`trl_terms`) and
``GRPOTrainer``'s policy loss (:func:`trl_policy_loss`)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._checked import check_inputs, checked
from dapo_ops._core._rules import LOG_RATIO_CLAMP, clip, compute_dtype, masked
from dapo_ops._core._validate import InputError
from dapo_ops.diagnostics.measures import PolicyDiagnostics
from dapo_ops.engine.aggregation import token_level_aggregate
from dapo_ops.engine.kl import KLPenalty, kl_penalty
from dapo_ops.engine.policy import policy_loss_with_diagnostics
from dapo_ops.integrations._trl_loss import TRL_LOSS_TYPES, trl_normalizer, trl_objective
from dapo_ops.objectives import Objective, PolicyGradient

#: TRL clamps VESPO's folded vLLM log-ratio to [log(1e-8), 20].
_VESPO_LOG_IS = (math.log(1e-8), 20.0)


class TRLTerms(NamedTuple):
    """How one TRL batch enters :func:`dapo_ops.policy_loss`: the objective, the old
    log-probs it sees (the sequence ratio's, or with vLLM's ratio folded in for VESPO) and
    the per-token weights of its term."""

    objective: Objective
    old_logp: Tensor
    weights: Tensor | None


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, valid: Tensor) -> Tensor:
    """TRL's sequence log-ratio ``[batch, 1]``: the mean token log-ratio over the row's valid
    tokens (0 for an empty row), detached, in float64."""
    delta = masked(valid, logp.detach().double() - old_logp.double())
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1).double()
    return delta.sum(dim=-1, keepdim=True) / count


def trl_terms(
    objective: Objective,
    loss_type: str,
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    *,
    epsilon_high: float,
    importance_sampling_level: str = "token",
    importance_sampling_ratio: Tensor | None = None,
    selection: Tensor | None = None,
) -> TRLTerms:
    """The inputs of the objective's term for one TRL batch (see :class:`TRLTerms`).

    Sequence level (every loss type but ``vespo``): the objective sees the row's sequence
    ratio ``s_i`` on every token, through ``old = logp.detach() - log s_i`` (float64, so the
    log-ratio it sees is ``log s_i`` to float64 rounding): value ``f(s_i)``, gradient
    ``f'(s_i) s_i`` per token, TRL's ``f(s_i)`` differentiated through the mean.
    ``vespo`` with vLLM's ratio: TRL adds its clamped log to the sequence log-ratio of the
    weight; here it is subtracted from ``old`` (float64) at the valid tokens. Otherwise the
    ratio and the selections multiply the term, as TRL multiplies the per-token loss.
    """
    valid = mask != 0
    old = old_logp
    weights = selection
    if loss_type == "vespo":
        if importance_sampling_ratio is not None:
            ratio = importance_sampling_ratio.expand_as(logp).double()
            lo, hi = _VESPO_LOG_IS
            log_is = masked(valid, torch.log(ratio).clamp(lo, hi))
            old = old_logp.double() - log_is
    else:
        if importance_sampling_level == "sequence":
            old = logp.detach().double() - sequence_log_ratio(logp, old_logp, valid)
        if importance_sampling_ratio is not None:
            ratio = importance_sampling_ratio.expand_as(logp)
            weights = ratio if weights is None else weights * ratio
    if isinstance(objective, PolicyGradient) and loss_type == "cispo":  # TRL's cap below 1
        r = (logp.detach().to(old.dtype) - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        cap = r.clamp(max=epsilon_high)
        weights = cap if weights is None else weights * cap
    return TRLTerms(objective, old, weights)


def trl_policy_loss(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    num_items_in_batch: Tensor | float | None = None,
    num_processes: int = 1,
    accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    max_completion_length: int | None = None,
    training: bool = True,
    delta: float | None = None,
    beta: float = 0.0,
    ref_per_token_logps: Tensor | None = None,
    use_bias_correction_kl: bool = True,
    importance_sampling_ratio: Tensor | None = None,
    importance_sampling_level: str = "token",
    selection: Tensor | None = None,
    objective: Objective | None = None,
) -> tuple[Tensor, PolicyDiagnostics]:
    """``GRPOTrainer``'s policy loss for a ``loss_type`` of :data:`TRL_LOSS_TYPES`, via dapo_ops.

    The arguments are TRL's names: ``per_token_logps`` etc. ``[B, T]``, ``advantages``
    ``[B]`` or ``[B, T]``, ``mask`` the completion (times tool) mask. ``delta``: see
    :func:`trl_objective`. ``importance_sampling_ratio`` (vLLM correction, ``[B, T]`` or
    ``[B, 1]``) multiplies the term (for ``vespo``: folded into the weight, as TRL);
    ``selection`` (``[B, T]``, TRL's off-policy and entropy masks as 0/1) multiplies it too.
    ``importance_sampling_level="sequence"``: the objective on the sequence ratio
    (:func:`trl_terms`). With ``beta != 0`` the per-token k3 KL to ``ref_per_token_logps`` is
    added, multiplied by the (differentiable) token or sequence ratio when
    ``use_bias_correction_kl`` (TRL's default); the aggregation is linear, so that term is
    aggregated on its own with the same mode and normaliser. Returns ``(loss,
    diagnostics)``, the loss already divided for gradient accumulation as TRL's is.

    One deliberate difference: dapo_ops clamps the (token or sequence) log-ratio to +-20
    before ``exp`` (TRL does not), so the two differ only for tokens whose probability
    moved by a factor above e^20 since sampling, where TRL's value overflows.

    At an exact tie (a ratio exactly on ``1 - epsilon_low``, ``1 + epsilon_high`` or
    ``delta``) the gradient is this library's on every torch: it passes (docs/kinks.md).
    TRL's ``-min(r A, clamp(r) A)`` follows its torch: the same on torch <= 2.13, half of
    it on torch 2.14 (``min`` splits the tie, ``clamp`` passes 0 on its bound), and 0 at
    ``r = delta``.
    """
    if objective is None:
        options = {
            "epsilon_low": epsilon_low,
            "epsilon_high": epsilon_high,
            "delta": delta,
            "importance_sampling_level": importance_sampling_level,
        }
        objective = trl_objective(loss_type, options)
    mode = TRL_LOSS_TYPES[loss_type]
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise InputError("loss_type='dr_grpo' needs max_completion_length (its constant L)")
    normalizer = trl_normalizer(
        loss_type,
        mask,
        num_items_in_batch=num_items_in_batch,
        num_processes=num_processes,
        accumulation_steps=accumulation_steps,
        steps_per_generation=steps_per_generation,
        training=training,
    )
    if beta != 0.0 and ref_per_token_logps is None:
        raise InputError(f"beta={beta} needs ref_per_token_logps")
    terms = trl_terms(
        objective,
        loss_type,
        per_token_logps,
        old_per_token_logps,
        mask,
        epsilon_high=epsilon_high,
        importance_sampling_level=importance_sampling_level,
        importance_sampling_ratio=importance_sampling_ratio,
        selection=selection,
    )
    max_len = max_completion_length if mode == "seq_mean_token_sum_norm" else None
    kl_in_loss = beta != 0.0 and not use_bias_correction_kl
    weights = terms.weights
    if weights is not None and terms.old_logp.dtype == torch.float64:
        weights = weights.double()
    # checked mode: the caller's tensors here; terms.old_logp may be logp - log s (not
    # log-probs), so the call itself runs unchecked
    check_inputs(
        logp=per_token_logps, old_logp=old_per_token_logps, advantages=advantages, mask=mask
    )
    with checked(False):
        loss, diagnostics = policy_loss_with_diagnostics(
            terms.objective,
            per_token_logps,
            terms.old_logp,
            advantages,
            mask,
            mode=mode,
            normalizer=normalizer,
            max_len=max_len,
            ref_logp=ref_per_token_logps if kl_in_loss else None,
            kl=KLPenalty(beta=beta, estimator="k3") if kl_in_loss else None,
            is_weights=weights,
        )
    loss = loss.to(compute_dtype(per_token_logps, old_per_token_logps))
    if beta != 0.0 and ref_per_token_logps is not None and use_bias_correction_kl:
        kl = kl_penalty(per_token_logps, ref_per_token_logps, mask, estimator="k3")
        # `where`, not a product: garbage at masked positions must not reach the gradient.
        delta_logp = torch.where(mask != 0, per_token_logps - old_per_token_logps, 0.0)
        log_ratio = clip(delta_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # passes on +-20
        if importance_sampling_level == "sequence":  # TRL weights by the sequence ratio
            count = (mask != 0).sum(dim=-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
            log_ratio = log_ratio.sum(dim=-1, keepdim=True) / count
        weighted = beta * kl * torch.exp(log_ratio.to(kl.dtype))
        loss = loss + token_level_aggregate(
            weighted, mask, mode=mode, normalizer=normalizer, max_len=max_len
        )
    return loss, diagnostics
