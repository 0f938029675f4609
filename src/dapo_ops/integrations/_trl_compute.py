"""``DapoGRPOTrainer.compute_loss``: TRL 1.16's ``_compute_loss`` with every term computed by
dapo_ops (the policy loss, the entropy bonus and its adaptive coefficient, the MoE router
loss), and TRL's metrics under TRL's names."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import LOG_RATIO_CLAMP, masked
from dapo_ops.correction.masks import high_entropy_mask, off_policy_sequence_mask
from dapo_ops.engine.entropy import adaptive_entropy_coef, entropy_bonus
from dapo_ops.engine.kl import kl_penalty
from dapo_ops.integrations._trl_loss import (
    CLIPPED_TYPES,
    trl_objective,
    trl_options,
    unsupported_settings,
)
from dapo_ops.integrations._trl_policy import sequence_log_ratio, trl_policy_loss, trl_terms
from dapo_ops.objectives import VESPO
from dapo_ops.objectives.base import token_inputs

# Model-input keys TRL forwards to ``_get_per_token_logps_and_entropies`` (VLM fields).
_FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
#: Loss types whose TRL loss is divided by the accumulation steps after the ``policy_loss``
#: metric is taken (the others are normalised by the token count of the window already).
_DIVIDED_AFTER = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")


def check_supported(trainer: Any) -> None:
    problems = unsupported_settings(trainer)
    if problems:
        raise ValueError(
            f"{type(trainer).__name__} computes the loss with dapo_ops and does not reproduce: "
            + "; ".join(problems)
            + ". Use trl.GRPOTrainer for these settings."
        )


def _per_row(adv: Tensor) -> Tensor:
    return adv.unsqueeze(-1) if adv.ndim == 1 else adv


def dapo_compute_loss(trainer: Any, model: Any, inputs: dict[str, Any]) -> Tensor:
    """``GRPOTrainer._compute_loss`` with each term from dapo_ops."""
    check_supported(trainer)
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    forward = {key: inputs[key] for key in _FORWARD_KEYS if inputs.get(key) is not None}
    aux = bool(getattr(trainer, "aux_loss_enabled", False))
    per_token_logps, entropies, aux_loss = trainer._get_per_token_logps_and_entropies(
        model,
        input_ids,
        attention_mask,
        completion_ids.size(1),
        compute_entropy=True,
        compute_aux_loss=aux,
        **forward,
    )
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old
    training = bool(trainer.model.training)
    mode = "train" if training else "eval"
    accum = trainer.current_gradient_accumulation_steps if training else 1
    options = trl_options(trainer)
    objective = trl_objective(trainer.loss_type, options)
    level = options["importance_sampling_level"]
    use_is = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    # TRL multiplies the per-token loss (not the counts) by its two selections
    valid = mask != 0
    selection = None
    threshold = getattr(trainer, "off_policy_mask_threshold", None)
    if threshold is not None:
        sampling = inputs.get("sampling_per_token_logps", old)
        adv = _per_row(inputs["advantages"])[:, :1]
        keep = off_policy_sequence_mask(adv, per_token_logps, sampling, valid, threshold=threshold)
        selection = keep.to(per_token_logps.dtype)
    top = getattr(trainer, "top_entropy_quantile", 1.0)
    entropy_mask = high_entropy_mask(entropies, valid, top_quantile=top) if top < 1.0 else None
    if entropy_mask is not None:
        w = entropy_mask.to(per_token_logps.dtype)
        selection = w if selection is None else selection * w
    loss, _ = trl_policy_loss(
        per_token_logps,
        old,
        inputs["advantages"],
        mask,
        loss_type=trainer.loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        num_items_in_batch=inputs.get("num_items_in_batch"),
        num_processes=trainer.accelerator.num_processes,
        accumulation_steps=trainer.current_gradient_accumulation_steps,
        steps_per_generation=trainer.args.steps_per_generation,
        max_completion_length=trainer.max_completion_length,
        training=training,
        delta=options["delta"],
        beta=trainer.beta,
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        use_bias_correction_kl=bool(getattr(trainer.args, "use_bias_correction_kl", False)),
        importance_sampling_ratio=inputs["importance_sampling_ratio"] if use_is else None,
        importance_sampling_level=level,
        selection=selection,
        objective=objective,
    )
    if getattr(trainer, "_entropy_bonus_enabled", False):
        policy_value = loss.detach() * (accum if trainer.loss_type in _DIVIDED_AFTER else 1)
        metric = trainer.accelerator.gather(policy_value).nanmean()
        trainer._metrics[mode]["policy_loss"].append(float(metric))
        loss = loss + _entropy_term(trainer, entropies, valid, entropy_mask, mode, accum)
    if aux:
        loss = loss + trainer.router_aux_loss_coef * aux_loss / accum
        gathered = trainer.accelerator.gather_for_metrics(aux_loss.detach())
        trainer._metrics[mode]["aux_loss"].append(float(gathered.mean()))
    _log_metrics(trainer, mode, inputs, per_token_logps, old, valid, entropies)
    return loss  # type: ignore[no-any-return]


def _entropy_term(
    trainer: Any,
    entropies: Tensor,
    valid: Tensor,
    entropy_mask: Tensor | None,
    mode: str,
    accum: int,
) -> Tensor:
    """TRL's entropy bonus (a token mean over the micro-batch's selected tokens, divided by
    the accumulation steps) with the coefficient of TRL's adaptive controller, whose state
    (``entropy_coef``, ``_last_world_entropy``, ``_entropy_window_stats``) is TRL's own, so
    TRL's checkpoint save/load of it applies unchanged."""
    args = trainer.args
    effective = valid if entropy_mask is None else valid & entropy_mask
    count = effective.sum().to(torch.float64).clamp(min=1.0) * accum
    adaptive = bool(trainer.use_adaptive_entropy)
    coef = float(trainer.entropy_coef)
    # the coefficient applied during a step: the controller's, while the entropy measured
    # at the end of the previous step was at or below the target (0 before any)
    applied = coef if not adaptive or trainer._last_world_entropy <= args.entropy_target else 0.0
    bonus = entropy_bonus(entropies, effective, coef=applied, normalizer=count)
    if adaptive and mode == "train":
        # exact window totals: every micro-batch's sum and count, all-reduced at the step
        stats = torch.stack(
            [masked(effective, entropies.detach().double()).sum(), effective.sum().double()]
        )
        window = trainer._entropy_window_stats
        trainer._entropy_window_stats = stats if window is None else window + stats
        if trainer.accelerator.sync_gradients:
            totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
            measured = float(totals[0] / totals[1].clamp(min=1.0))
            step = adaptive_entropy_coef(
                coef,
                measured,
                target=args.entropy_target,
                delta=args.entropy_coef_delta,
                coef_min=args.entropy_coef_min,
                coef_max=args.entropy_coef_max,
            )
            trainer.entropy_coef = step.coef
            trainer._last_world_entropy = measured
            trainer._entropy_window_stats = None
    if mode == "train" and trainer.accelerator.sync_gradients:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
    return bonus  # float32 (float64 for float64 entropies): never rounded to bfloat16


def _global_mean(trainer: Any, total: Tensor, count: Tensor) -> float:
    both = torch.stack([total.double(), count.double()])
    both = trainer.accelerator.reduce(both, reduction="sum")
    return float(both[0] / both[1].clamp(min=1.0))


@torch.no_grad()
def _log_metrics(
    trainer: Any,
    mode: str,
    inputs: dict[str, Any],
    logp: Tensor,
    old: Tensor,
    valid: Tensor,
    entropies: Tensor,
) -> None:
    """TRL's metrics under TRL's names: ``entropy``; for the clipped loss types the clip
    ratios (per token, or per row at sequence level; TRL counts the ratio after its
    ``delta`` cap); ``cispo_clip_ratio``; ``vespo/phi_seq_mean``."""
    metrics = trainer._metrics[mode]
    h = masked(valid, entropies.detach())
    metrics["entropy"].append(_global_mean(trainer, h.sum(), valid.sum()))
    adv = _per_row(inputs["advantages"])
    level = getattr(trainer, "importance_sampling_level", "token")
    loss_type = trainer.loss_type
    if level == "sequence":  # TRL counts rows (empty ones included) at sequence level
        log_r = sequence_log_ratio(logp, old, valid)
        rows = torch.ones_like(log_r, dtype=torch.bool)
        adv = adv[:, :1]
    else:
        log_r, rows = masked(valid, logp.detach() - old), valid
    ratio = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if trainer.beta != 0.0:
        metrics["kl"].append(_kl_metric(trainer, inputs, logp, valid, ratio))
    if loss_type in CLIPPED_TYPES:
        delta = getattr(trainer.args, "delta", None)
        if delta is not None:
            ratio = ratio.clamp(max=delta)
        low = (ratio < 1 - trainer.epsilon_low) & (adv < 0) & rows
        high = (ratio > 1 + trainer.epsilon_high) & (adv > 0) & rows
        n = rows.sum()
        for name, flags in (("low", low), ("high", high), ("region", low | high)):
            metrics[f"clip_ratio/{name}_mean"].append(_global_mean(trainer, flags.sum(), n))
        count = rows.sum(-1).double()  # 0 for an empty row: NaN below, as TRL
        low_rows = trainer.accelerator.gather(low.sum(-1).double() / count)
        high_rows = trainer.accelerator.gather(high.sum(-1).double() / count)
        metrics["clip_ratio/low_min"].append(float(_nan_extreme(low_rows, min)))
        metrics["clip_ratio/high_max"].append(float(_nan_extreme(high_rows, max)))
    elif loss_type == "cispo":  # TRL's metric: capped ratios with a positive advantage
        capped = (ratio > trainer.epsilon_high) & (adv > 0) & rows
        metrics["cispo_clip_ratio"].append(_global_mean(trainer, capped.sum(), rows.sum()))
    elif loss_type == "vespo":  # TRL's metric: phi averaged over every row
        objective = trl_objective("vespo", trl_options(trainer))
        assert isinstance(objective, VESPO)
        use_is = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
        ratio_is = inputs["importance_sampling_ratio"] if use_is else None
        terms = trl_terms(objective, "vespo", logp, old, valid, epsilon_high=trainer.epsilon_high,
                          importance_sampling_ratio=ratio_is)  # fmt: skip
        checked, ok, dtype = policy_tensors(logp, terms.old_logp, adv[:, :1], valid)
        x = token_inputs(objective, logp, terms.old_logp, checked, ok, dtype, reference=True)
        phi = objective.weight(x)[:, 0]
        metrics["vespo/phi_seq_mean"].append(
            _global_mean(trainer, phi.sum(), torch.tensor(float(phi.numel())))
        )


def _kl_metric(
    trainer: Any, inputs: dict[str, Any], logp: Tensor, valid: Tensor, ratio: Tensor
) -> float:
    """TRL's ``kl`` metric: the token mean of k3, times the token or sequence ratio with
    ``use_bias_correction_kl``."""
    kl = kl_penalty(logp.detach(), inputs["ref_per_token_logps"], valid, estimator="k3")
    if getattr(trainer.args, "use_bias_correction_kl", False):
        kl = masked(valid, kl * ratio.to(kl.dtype))
    return _global_mean(trainer, kl.sum(), valid.sum())


def _nan_extreme(values: Tensor, pick: Any) -> Tensor:
    """TRL's ``nanmin`` / ``nanmax``: the extreme of the non-NaN values, NaN when none."""
    finite = values[~torch.isnan(values)]
    if finite.numel() == 0:
        return torch.tensor(float("nan"))
    return finite.min() if pick is min else finite.max()
