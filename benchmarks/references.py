"""Peer-style reference implementations, written for this benchmark.

Each function mirrors, op for op, the code path a peer trainer runs for the same job, so
the benchmark measures what a user of that trainer pays. They are our own code, written
from the peers' published algorithms and code structure; nothing is imported from (or
copied out of) verl or TRL. When a peer happens to be installed, ``run.py`` times its
real function next to the mirror.

Mirrored versions:

- verl 0.9.1, ``verl/trainer/ppo/core_algos.py``: ``compute_policy_loss_vanilla``
  (always with the dual clip ``clip_ratio_c``; its three metrics' ``.detach().item()``)
  and ``agg_loss`` (token-mean divides by the global token count the trainer passes in
  ``global_batch_info``); ``verl/utils/torch_functional.py``: ``masked_sum``
  (``where(mask, x, 0) * mask``, summed) and ``masked_mean``; the loss's ``.item()`` for
  the actor's metrics (``verl/workers/utils/losses.py: ppo_loss``). The verl 0.4 - 0.5
  form differed only in ``masked_sum`` (no ``where``).
  Unchanged since 0.4: ``compute_grpo_outcome_advantage`` (the
  defaultdict-of-lists loop over the ``uid`` array); the DAPO trainer's
  ``filter_groups`` loop (``recipe/dapo/dapo_ray_trainer.py``) and the DAPO reward
  manager's overlong-buffer penalty (``verl/workers/reward_manager/dapo.py``).
- TRL 0.19 - 0.21, ``trl/trainer/grpo_trainer.py``: ``GRPOTrainer._compute_loss``
  (``beta = 0``, ``loss_type="dapo"``/``"bnpo"``, with the clip-ratio metrics and their
  ``.item()`` calls) and the group-advantage block of ``_generate_and_score_completions``;
  ``trl/rewards``: ``get_soft_overlong_punishment``.

Semantics are the peers', not dapo_ops' (e.g. verl adds 1e-8 to the token count and
1e-6 to the std, TRL adds 1e-4 to the std and never clamps the log-ratio); the benchmark
checks that every reference agrees with dapo_ops on its inputs to within those
differences before timing it. The advantages, dynamic sampling, overlong penalty and
normaliser mirrors are in :mod:`benchmarks.references_rewards`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# --------------------------------------------------------------------------------------
# verl: policy loss, aggregation, metrics
# --------------------------------------------------------------------------------------


def verl_masked_sum(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """0.9's ``masked_sum``: ``where`` first (NaN outside the mask), then the product."""
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)  # type: ignore[call-overload,no-any-return]


def verl_masked_mean(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    s = verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)  # type: ignore[call-overload,no-any-return]


def verl_agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Tensor | int | None = None,
    global_batch_size: Tensor | int | None = None,
) -> Tensor:
    """0.9's ``agg_loss`` (the trainer passes the global counts; None: this batch's)."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        return verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / loss_mask.shape[-1]
        return loss
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).float()
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        return verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
    raise ValueError(loss_agg_mode)


def verl_compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cliprange_low: float = 0.2,
    cliprange_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    batch_num_tokens: Tensor | int | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """verl's ``compute_policy_loss_vanilla`` (dual clip always on) with its three metrics;
    rollout IS weights multiply the per-token loss before the aggregation, as in verl."""
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = verl_agg_loss(
        pg_losses, response_mask, loss_agg_mode, batch_num_tokens=batch_num_tokens
    )
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def verl_per_token_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    cliprange_low: float = 0.2,
    cliprange_high: float = 0.28,
    clip_ratio_c: float = 3.0,
) -> Tensor:
    """The elementwise part of verl's policy loss alone (no metrics, no aggregation)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_pg_losses2 = torch.min(-advantages * clip_ratio_c, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)


def verl_actor_step(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    backward: bool = True,
    batch_num_tokens: Tensor | int | None = None,
) -> dict[str, float]:
    """One micro-batch of verl's actor update (``workers/utils/losses.py: ppo_loss``):
    the policy loss with the trainer's global token count, backward, the ``.item()`` of
    the three policy metrics (inside ``compute_policy_loss_vanilla``) and of the loss."""
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = verl_compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, batch_num_tokens=batch_num_tokens
    )
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    if backward:
        pg_loss.backward()  # type: ignore[no-untyped-call]
    metrics["actor/pg_loss"] = pg_loss.detach().item()
    return metrics


def verl_low_var_kl(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """verl's ``kl_penalty(..., "low_var_kl")``: k3 with the log-ratio clamped to +-20 and
    the estimate to [-10, 10]."""
    kl = torch.clamp(ref_log_prob - log_prob, min=-20, max=20)
    kld = (torch.exp(kl) - kl - 1).contiguous()
    return torch.clamp(kld, min=-10, max=10)


def verl_kl_is_step(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    ref_log_prob: Tensor | None,
    rollout_is_weights: Tensor | None,
    loss_agg_mode: str,
    kl_coef: float = 0.04,
    clip: tuple[float, float] = (0.2, 0.28),
) -> dict[str, float]:
    """One micro-batch of verl's actor update with a KL loss (``use_kl_loss``,
    ``kl_loss_type=low_var_kl``) and/or rollout IS weights: the policy loss, the KL
    term aggregated with the same mode, their sum, backward, the metrics' ``.item()``."""
    pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower = verl_compute_policy_loss(
        old_log_prob, log_prob, advantages, response_mask, clip[0], clip[1],
        loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights,
    )  # fmt: skip
    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    loss = pg_loss
    if ref_log_prob is not None:
        kld = verl_low_var_kl(log_prob, ref_log_prob)
        kl_loss = verl_agg_loss(kld, response_mask, loss_agg_mode)
        loss = pg_loss + kl_loss * kl_coef
        metrics["kl_loss"] = kl_loss.detach().item()
    loss.backward()  # type: ignore[no-untyped-call]
    metrics["actor/pg_loss"] = pg_loss.detach().item()
    return metrics


def verl_metrics_only(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """verl's three policy metrics (the part of compute_policy_loss that is not the loss)."""
    with torch.no_grad():
        negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
        ratio = torch.exp(negative_approx_kl)
        ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
        pg_losses1 = -advantages * ratio
        pg_losses2 = -advantages * torch.clamp(ratio, 0.8, 1.28)
        clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
        pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
        pg_clipfrac_lower = verl_masked_mean(
            torch.gt(clip_pg_losses1, -advantages * 3.0) * (advantages < 0).float(),
            response_mask,
        )
    return {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.item(),
    }


# --------------------------------------------------------------------------------------
# TRL: GRPOTrainer._compute_loss (beta = 0) and its clip metrics
# --------------------------------------------------------------------------------------


def _nanmin(t: Tensor) -> Tensor:
    return torch.min(t[~torch.isnan(t)]) if not torch.isnan(t).all() else t.new_tensor(np.nan)


def _nanmax(t: Tensor) -> Tensor:
    return torch.max(t[~torch.isnan(t)]) if not torch.isnan(t).all() else t.new_tensor(np.nan)


def trl_compute_loss(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    loss_type: str = "dapo",
    num_items_in_batch: Tensor | None = None,
    num_processes: int = 1,
    metrics: dict[str, list[float]] | None = None,
) -> Tensor:
    """TRL's GRPO loss for ``beta = 0`` with its clip-ratio metrics (``advantages [B]``)."""
    coef_1 = torch.exp(per_token_logps - old_per_token_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if loss_type == "grpo":
        loss = (
            (per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
        ).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
    elif loss_type == "dapo":
        assert num_items_in_batch is not None
        normalizer = num_items_in_batch / num_processes
        loss = (per_token_loss * completion_mask).sum() / normalizer
    else:
        raise ValueError(loss_type)

    if metrics is not None:
        completion_token_count = completion_mask.sum().clamp(min=1.0)

        def masked_batch_mean(x: Tensor) -> Tensor:
            return (x * completion_mask).sum() / completion_token_count

        is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages.unsqueeze(1) < 0)
        is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages.unsqueeze(1) > 0)
        is_region_clipped = is_low_clipped | is_high_clipped
        low_clip = masked_batch_mean(is_low_clipped.float())
        high_clip = masked_batch_mean(is_high_clipped.float())
        clip_ratio = masked_batch_mean(is_region_clipped.float())
        gathered_low = low_clip[None]  # accelerator.gather on one process
        gathered_high = high_clip[None]
        gathered_region = clip_ratio[None]
        metrics.setdefault("clip_ratio/low_mean", []).append(gathered_low.nanmean().item())
        metrics.setdefault("clip_ratio/low_min", []).append(_nanmin(gathered_low).item())
        metrics.setdefault("clip_ratio/high_mean", []).append(gathered_high.nanmean().item())
        metrics.setdefault("clip_ratio/high_max", []).append(_nanmax(gathered_high).item())
        metrics.setdefault("clip_ratio/region_mean", []).append(gathered_region.nanmean().item())
    return loss
