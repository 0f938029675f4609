"""OpenRLHF integration: OpenRLHF 0.11.2's ``PolicyLoss`` computed by dapo_ops.

OpenRLHF's actor calls ``self.actor_loss_fn(log_probs, old_log_probs, advantages,
action_mask=..., rollout_log_probs=..., dp_size=..., batch_num_tokens=...,
global_batch_size=...)`` and gets ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``.
:class:`PolicyLossOptions` holds ``PolicyLoss``'s constructor options (same names, same
defaults, same checks); :func:`openrlhf_policy_loss` is the loss as a pure function of
tensors, with the same result; :func:`policy_loss_module` builds an ``nn.Module`` with
``PolicyLoss``'s constructor and ``forward``, to assign to ``actor.actor_loss_fn``; :func:`openrlhf_kl` is its
``compute_approx_kl`` (the actor's KL loss). Importing this module does not import OpenRLHF.

The mapping:

- ``policy_loss_type="ppo"``: :class:`~dapo_ops.ClipHigher` (``clip_eps_low``,
  ``clip_eps_high``, ``dual_clip``; log-ratio clamped to +-20 as OpenRLHF's).
- ``policy_loss_type="gspo"``: the same objective on each row's sequence ratio
  :math:`s_i = \\exp(\\overline{\\log\\pi_\\theta - \\log\\pi_{old}})` (the GSPO-token form,
  computed in float64), whose gradient OpenRLHF
  spreads over the row through the mean. Its per-token advantages enter exactly: the row's
  loss is :math:`-\\bar A^+_i\\,\\mathrm{clip}(s_i) - \\bar A^-_i\\,\\mathrm{clip}(s_i)`
  with :math:`\\bar A^\\pm_i` the row means of the positive and negative parts, each
  with the clip bounds of its sign. OpenRLHF forces the per-sequence mean for it.
- ``token_level_loss=True``: ``mode="token_mean"`` with ``normalizer=batch_num_tokens /
  dp_size`` (the local count when ``batch_num_tokens`` is None); ``False``:
  ``"seq_mean_token_mean"`` with ``global_batch_size / dp_size``.
- ``is_correction_*`` (vLLM/trainer mismatch, ``ppo`` only): the gate of
  :func:`correction_weights` as detached ``is_weights``; ``gspo`` takes its ratio against
  ``rollout_log_probs`` instead, as OpenRLHF.

Differences, all deliberate: an empty micro-batch (or row set) gives 0, not NaN; the
sequence mean divides by the token count, not ``count + 1e-8`` (a relative ``1e-8 / n``);
ratios are ``exp`` of log-ratios clamped to +-20 everywhere (OpenRLHF's ``ppo`` clamps too;
its ``gspo`` ratio and its correction ratios do not), so they differ only where a
probability moved by more than e^20; the metrics of an empty set are 0, not NaN.
Tested against OpenRLHF 0.11.2's own ``PolicyLoss`` (``tests/integration/test_openrlhf.py``).

Example:
    >>> opts = PolicyLossOptions(clip_eps_low=0.2, clip_eps_high=0.28)
    >>> logp = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> out = openrlhf_policy_loss(logp, logp, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool),
    ...                            options=opts)
    >>> out.loss, out.clip_ratio
    (tensor(-1.), tensor(0.))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from dapo_ops._core._checked import check_inputs, checked
from dapo_ops._core._rules import (
    LOG_RATIO_CLAMP,
    AggregationMode,
    compute_dtype,
    masked,
    safe_divide,
)
from dapo_ops._core._validate import InputError
from dapo_ops.engine.policy import policy_loss
from dapo_ops.integrations._openrlhf_options import PolicyLossOptions
from dapo_ops.integrations._openrlhf_terms import correction_weights, openrlhf_kl
from dapo_ops.integrations._trl_policy import sequence_log_ratio
from dapo_ops.objectives import ClipHigher


class OpenRLHFLoss(NamedTuple):
    """``PolicyLoss.forward``'s result: the loss and OpenRLHF's metrics (0-dim tensors)."""

    loss: Tensor
    clip_ratio: Tensor  # valid tokens whose clipped surrogate is below the unclipped one
    ppo_kl: Tensor  # token mean of log pi_old - log pi_theta
    vllm_kl: Tensor | None  # token mean of log pi_rollout - log pi_old (ppo with correction)
    is_filter_ratio: Tensor | None  # share of tokens (or rows) the correction filtered


def _mean(values: Tensor, valid: Tensor) -> Tensor:
    return safe_divide(masked(valid, values).sum(), valid.sum().to(values.dtype))


def openrlhf_policy_loss(
    log_probs: Float[Tensor, "batch seq"],
    old_log_probs: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, "batch seq"],
    action_mask: Bool[Tensor, "batch seq"],
    *,
    options: PolicyLossOptions,
    rollout_log_probs: Float[Tensor, "batch seq"] | None = None,
    dp_size: int = 1,
    batch_num_tokens: float | Tensor | None = None,
    global_batch_size: float | Tensor | None = None,
) -> OpenRLHFLoss:
    r"""OpenRLHF 0.11.2's ``PolicyLoss.forward`` by dapo_ops: same arguments, same result.

    ``advantages`` ``[batch, seq]`` (per token, as OpenRLHF's estimators give them; ``[batch]``
    and ``[batch, 1]`` are accepted too), ``action_mask`` bool or 0/1, ``rollout_log_probs``
    needed when ``options.is_correction_level != "off"``. ``dp_size``,
    ``batch_num_tokens`` and ``global_batch_size`` as OpenRLHF's ``get_loss_batch_info``
    gives them (the step's totals over the data-parallel ranks); ``None``: this call's own
    count. The module docstring states the mapping and the differences.

    Example:
        >>> opts = PolicyLossOptions(policy_loss_type="gspo")
        >>> lp = torch.tensor([[-1.0, -2.0, 0.0]])
        >>> m = torch.tensor([[True, True, False]])
        >>> float(openrlhf_policy_loss(lp, lp, torch.ones(1, 3), m, options=opts).loss)
        -1.0
    """
    if not isinstance(options, PolicyLossOptions):
        raise InputError(f"options must be a PolicyLossOptions, got {type(options).__name__}")
    valid = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    adv = advantages if advantages.ndim == 2 else advantages.reshape(-1, 1)
    adv = adv.expand_as(log_probs)
    correcting = options.is_correction_level != "off"
    if correcting and rollout_log_probs is None:
        raise InputError("rollout_log_probs is needed when is_correction_level != 'off'")
    dtype = compute_dtype(log_probs, old_log_probs, adv)
    mode: AggregationMode = "seq_mean_token_mean" if options.sequence_mean else "token_mean"
    total = global_batch_size if options.sequence_mean else batch_num_tokens
    normalizer: Any = "local" if total is None else torch.as_tensor(total, dtype=dtype) / dp_size
    objective = options.objective()
    raw = masked(valid, log_probs.detach().to(dtype) - old_log_probs.to(dtype))
    vllm_kl = is_filter = None
    if options.policy_loss_type == "gspo":
        base = rollout_log_probs if correcting else old_log_probs
        assert base is not None
        log_s = sequence_log_ratio(log_probs, base, valid)
        # checked mode: the caller's tensors here; _gspo_loss's old is logp - log s
        check_inputs(logp=log_probs, old_logp=base, advantages=adv, mask=action_mask)
        with checked(False):
            loss = _gspo_loss(objective, log_probs, log_s, adv, valid, normalizer)
        ratio = log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp().to(dtype).expand_as(raw)
    else:
        weights = None
        if correcting:
            assert rollout_log_probs is not None
            weights, filtered, filter_valid = correction_weights(
                old_log_probs.to(dtype), rollout_log_probs.to(dtype), valid, options
            )
            is_filter = _mean(filtered.to(dtype), filter_valid)
            vllm_kl = _mean(rollout_log_probs.detach().to(dtype) - old_log_probs.to(dtype), valid)
        loss = policy_loss(
            objective, log_probs, old_log_probs, adv, valid, mode=mode, normalizer=normalizer,
            is_weights=weights,
        )  # fmt: skip
        ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    a = adv.to(dtype)
    clipped = ((a > 0) & (ratio > 1 + options.clip_eps_high)) | (
        (a < 0) & (ratio < 1 - options.clip_eps_low)
    )
    return OpenRLHFLoss(
        loss, _mean(clipped.to(dtype), valid), _mean(-raw, valid), vllm_kl, is_filter
    )


def _gspo_loss(
    objective: ClipHigher,
    log_probs: Tensor,
    log_s: Tensor,
    adv: Tensor,
    valid: Tensor,
    normalizer: Any,
) -> Tensor:
    """OpenRLHF's GSPO row losses, ``mean_t -min(s A_t, clip(s) A_t)``, as the objective on
    the sequence ratio (``old = logp.detach() - log s``, float64) with the row means of the
    positive and of the negative advantages: two rows per row, the same normaliser (the
    non-empty rows of the micro-batch, or the given count)."""
    a = masked(valid, adv.double())
    n = valid.sum(dim=-1, keepdim=True).clamp(min=1).double()
    pos = a.clamp(min=0).sum(dim=-1, keepdim=True) / n
    neg = a.clamp(max=0).sum(dim=-1, keepdim=True) / n
    old = log_probs.detach().double() - log_s
    if isinstance(normalizer, str):  # the local count of non-empty rows, not of the 2B rows
        normalizer = valid.any(dim=-1).sum().double()
    loss = policy_loss(
        objective,
        torch.cat([log_probs, log_probs]),
        torch.cat([old, old]),
        torch.cat([pos, neg]),
        torch.cat([valid, valid]),
        mode="seq_mean_token_mean",
        normalizer=normalizer,
    )
    return loss.to(compute_dtype(log_probs, adv))


def policy_loss_module(**options: Any) -> torch.nn.Module:
    """An ``nn.Module`` with ``openrlhf.models.loss.PolicyLoss``'s constructor and ``forward``
    whose loss is :func:`openrlhf_policy_loss`: ``actor.actor_loss_fn =
    policy_loss_module(clip_eps_low=..., ...)`` in OpenRLHF's PPO actor.

    Example:
        >>> fn = policy_loss_module(clip_eps_low=0.2, clip_eps_high=0.28)
        >>> type(fn).__name__
        'DapoPolicyLoss'
    """
    if "is_correction_threshold" in options:
        options["is_correction_threshold"] = tuple(options["is_correction_threshold"])
    opts = PolicyLossOptions(**options)

    class DapoPolicyLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.options = opts

        def forward(
            self,
            log_probs: Tensor,
            old_log_probs: Tensor,
            advantages: Tensor,
            action_mask: Tensor | None = None,
            rollout_log_probs: Tensor | None = None,
            dp_size: int = 1,
            batch_num_tokens: float | Tensor | None = None,
            global_batch_size: float | Tensor | None = None,
        ) -> OpenRLHFLoss:
            mask = (
                torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None else action_mask
            )
            return openrlhf_policy_loss(
                log_probs, old_log_probs, advantages, mask, options=self.options,
                rollout_log_probs=rollout_log_probs, dp_size=dp_size,
                batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
            )  # fmt: skip

    return DapoPolicyLoss()


__all__ = [
    "OpenRLHFLoss",
    "PolicyLossOptions",
    "correction_weights",
    "openrlhf_kl",
    "openrlhf_policy_loss",
    "policy_loss_module",
]
