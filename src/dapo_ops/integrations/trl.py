"""TRL integration: dapo_ops' loss inside ``trl.GRPOTrainer``, the overlong penalty as a reward.

- :class:`DapoGRPOTrainer` (built on first access, so importing this module does not import
  TRL) is a ``trl.GRPOTrainer`` whose ``compute_loss`` calls :func:`dapo_ops.token_level_loss`
  with the trainer's own settings: ``epsilon`` / ``epsilon_high`` become ``eps_low`` /
  ``eps_high``, ``loss_type`` picks the aggregation and its normaliser, ``beta`` the k3 KL
  term (with TRL's ``use_bias_correction_kl``), ``delta`` the dual clip, and vLLM's importance-sampling correction the ``is_weights``.
  Everything else (generation, rewards, advantages, logging, checkpoints) is TRL's.
  With ``dynamic_sampling=True`` it also drops the groups whose metric is constant and
  generates more until the batch is full (:mod:`dapo_ops.integrations.trl_sampling`).
- :class:`OverlongReward` is :func:`dapo_ops.overlong_reward` with the signature TRL expects
  of a reward function.
- :func:`trl_policy_loss` is the mapping itself, as a pure function of tensors.

Tested against TRL 1.16 (``tests/integration/test_trl.py``): the loss and its gradient
equal ``GRPOTrainer``'s own for every supported ``loss_type`` on the same batch.

Example:
    >>> reward = OverlongReward(max_len=20, cache_len=4)
    >>> reward(completion_ids=[[7] * 10, [7] * 18, [7] * 20, [7] * 25])
    [0.0, -0.5, -1.0, -1.0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from dapo_ops._engine import policy_tensors, token_inputs
from dapo_ops._validate import InputError
from dapo_ops.aggregation import AggregationMode, token_level_aggregate
from dapo_ops.diagnostics import PolicyDiagnostics
from dapo_ops.integrations.trl_sampling import DynamicSampling, SamplingReport
from dapo_ops.kl import KLPenalty, kl_penalty
from dapo_ops.masks import high_entropy_mask, off_policy_sequence_mask
from dapo_ops.objectives import CISPO, GSPO, SAPO, VESPO, ClipHigher, Objective
from dapo_ops.policy import policy_loss_with_diagnostics
from dapo_ops.rewards import overlong_reward
from dapo_ops.surrogate import LOG_RATIO_CLAMP

#: TRL ``loss_type`` values reproduced here, and the dapo_ops aggregation of each.
TRL_LOSS_TYPES: dict[str, AggregationMode] = {
    "dapo": "token_mean",
    "bnpo": "token_mean",
    "grpo": "seq_mean_token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "cispo": "token_mean",
    "sapo": "seq_mean_token_mean",
    "vespo": "token_mean",
    "luspo": "seq_mean_token_sum",
}

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


def trl_normalizer(
    loss_type: str,
    mask: Tensor,
    *,
    num_items_in_batch: Tensor | float | None = None,
    num_processes: int = 1,
    accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
) -> Tensor | float:
    """The ``normalizer=`` that makes :func:`dapo_ops.token_level_loss` equal TRL's ``loss_type``.

    ``"dapo"`` and ``"cispo"``: TRL's ``num_items_in_batch`` is the loss-token count of the whole
    generation batch over all processes; one accumulation window holds
    ``accumulation_steps / steps_per_generation`` of it, and DDP averages over processes,
    so the normaliser is ``N / num_processes * accumulation_steps / steps_per_generation``
    (``N / num_processes`` in eval). With TRL's default ``steps_per_generation ==
    gradient_accumulation_steps`` this is exactly :func:`dapo_ops.global_normalizer` over
    the step's micro-batches. ``"bnpo"``: this micro-batch's token count times the
    accumulation steps. ``"grpo"``, ``"sapo"``, ``"dr_grpo"``: all rows of the micro-batch (fully
    masked ones included) times the accumulation steps. Counts are clamped to >= 1 as TRL
    does.
    """
    if loss_type not in TRL_LOSS_TYPES:
        raise InputError(f"loss_type must be one of {sorted(TRL_LOSS_TYPES)}, got {loss_type!r}")
    accum = accumulation_steps if training else 1
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise InputError(
                f"loss_type={loss_type!r} needs num_items_in_batch (TRL puts it in the inputs)"
            )
        total = torch.as_tensor(num_items_in_batch, dtype=torch.float64).clamp(min=1.0)
        norm = total / num_processes
        return norm * accumulation_steps / steps_per_generation if training else norm
    if loss_type == "bnpo":
        return mask.sum().to(torch.float64).clamp(min=1.0) * accum
    return float(max(mask.shape[0], 1) * accum)


def _option(config: Any, name: str, default: Any) -> Any:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def trl_objective(loss_type: str, config: Any = None) -> Objective:
    """The objective value of TRL's ``loss_type``, reading TRL's option names from ``config``.

    ``config`` is anything with TRL's attribute names (the trainer, its ``GRPOConfig``, a
    dict): ``epsilon_low``/``epsilon_high`` (else ``epsilon``), ``delta``,
    ``importance_sampling_level``, ``sapo_temperature_pos``/``_neg``, ``vespo_k_pos``,
    ``vespo_lambda_pos``, ``vespo_k_neg``, ``vespo_lambda_neg``; missing ones take TRL's
    defaults. ``dapo``/``bnpo``/``grpo``/``dr_grpo``: :class:`ClipHigher` (``delta`` as
    its dual clip), or :class:`GSPO` with ``importance_sampling_level="sequence"``;
    ``luspo``: :class:`GSPO`; ``cispo``: :class:`CISPO` with TRL's cap ``epsilon_high``
    (TRL clamps the ratio at ``epsilon_high`` itself, from above only); ``sapo``:
    :class:`SAPO`; ``vespo``: :class:`VESPO`.

    Example:
        >>> trl_objective("cispo", {"epsilon_high": 5.0})
        CISPO(log_ratio_clamp=20.0, eps_low=1.0, eps_high=4.0)
    """
    if loss_type not in TRL_LOSS_TYPES:
        raise InputError(
            f"loss_type={loss_type!r} is not reproduced by dapo_ops; supported: {sorted(TRL_LOSS_TYPES)}"
        )
    eps = float(_option(config, "epsilon", 0.2))
    low = float(_option(config, "epsilon_low", eps))
    high = float(_option(config, "epsilon_high", eps))
    delta = _option(config, "delta", None)
    level = _option(config, "importance_sampling_level", "token")
    sequence = level == "sequence" or loss_type == "luspo"
    if loss_type in ("cispo", "sapo", "vespo"):
        if delta is not None:
            raise InputError(f"delta applies to TRL's clipped loss types, not {loss_type!r}")
        if level != "token":
            raise InputError(f"loss_type={loss_type!r} takes importance_sampling_level='token'")
    if loss_type == "sapo":
        tau_pos = float(_option(config, "sapo_temperature_pos", 1.0))
        return SAPO(tau_pos=tau_pos, tau_neg=float(_option(config, "sapo_temperature_neg", 1.05)))
    if loss_type == "vespo":
        return VESPO(
            k_pos=float(_option(config, "vespo_k_pos", 2.0)),
            lambda_pos=float(_option(config, "vespo_lambda_pos", 3.0)),
            k_neg=float(_option(config, "vespo_k_neg", 3.0)),
            lambda_neg=float(_option(config, "vespo_lambda_neg", 2.0)),
        )
    if loss_type == "cispo":
        if not high >= 1.0:
            raise InputError(
                f"loss_type='cispo' caps the ratio at epsilon_high={high}; dapo_ops needs a "
                "cap >= 1 (TRL recommends 5.0)"
            )
        return CISPO(eps_low=1.0, eps_high=high - 1.0)
    if sequence:
        if delta is not None:
            raise InputError("delta (a token-ratio cap) does not apply to sequence-level ratios")
        return GSPO(eps_low=low, eps_high=high)
    if delta is not None and not delta > 1.0 + high:
        raise InputError(
            f"delta={delta} must be > 1 + epsilon_high={1.0 + high} to map to dual_clip"
        )
    return ClipHigher(eps_low=low, eps_high=high, dual_clip=delta)


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
    objective: Objective | None = None,
) -> tuple[Tensor, PolicyDiagnostics]:
    """``GRPOTrainer``'s policy loss for a ``loss_type`` of :data:`TRL_LOSS_TYPES`, via dapo_ops.

    The arguments are TRL's names: ``per_token_logps`` etc. ``[B, T]``, ``advantages``
    ``[B]`` or ``[B, T]``, ``mask`` the completion (times tool) mask. ``delta`` (TRL's
    two-sided clipping) is dapo_ops' ``dual_clip``: identical, value and gradient, for
    ``delta > 1 + epsilon_high``, as TRL recommends. ``importance_sampling_ratio`` (vLLM
    correction, ``[B, T]`` or ``[B, 1]``) becomes ``is_weights``. With ``beta != 0`` the
    per-token k3 KL to ``ref_per_token_logps`` is added, multiplied by the (differentiable)
    token ratio when ``use_bias_correction_kl`` (TRL's default); the aggregation is linear,
    so that term is aggregated on its own with the same mode and normaliser. Returns
    ``(loss, diagnostics)``, the loss already divided for gradient accumulation as TRL's
    is.

    One deliberate difference: dapo_ops clamps the log-ratio to +-20 before ``exp``
    (TRL does not), so the two differ only for tokens whose probability moved by a factor
    above e^20 since sampling, where TRL's value overflows.
    """
    if objective is None:
        options = {"epsilon_low": epsilon_low, "epsilon_high": epsilon_high, "delta": delta}
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
    is_weights = None
    if importance_sampling_ratio is not None:
        is_weights = importance_sampling_ratio.expand_as(per_token_logps)
    max_len = max_completion_length if mode == "seq_mean_token_sum_norm" else None
    kl_in_loss = beta != 0.0 and not use_bias_correction_kl
    loss, diagnostics = policy_loss_with_diagnostics(
        objective,
        per_token_logps,
        old_per_token_logps,
        advantages,
        mask,
        mode=mode,
        normalizer=normalizer,
        max_len=max_len,
        ref_logp=ref_per_token_logps if kl_in_loss else None,
        kl=KLPenalty(beta=beta, estimator="k3") if kl_in_loss else None,
        is_weights=is_weights,
    )
    if beta != 0.0 and ref_per_token_logps is not None and use_bias_correction_kl:
        kl = kl_penalty(per_token_logps, ref_per_token_logps, mask, estimator="k3")
        # `where`, not a product: garbage at masked positions must not reach the gradient.
        delta_logp = torch.where(mask != 0, per_token_logps - old_per_token_logps, 0.0)
        log_ratio = delta_logp.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        if objective.level == "sequence":  # TRL weights by the (differentiable) sequence ratio
            count = (mask != 0).sum(dim=-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
            log_ratio = log_ratio.sum(dim=-1, keepdim=True) / count
        weighted = beta * kl * torch.exp(log_ratio.to(kl.dtype))
        loss = loss + token_level_aggregate(
            weighted, mask, mode=mode, normalizer=normalizer, max_len=max_len
        )
    return loss, diagnostics


class OverlongReward:
    """DAPO's soft overlong punishment as a TRL reward function (``reward_funcs=[...]``).

    Calls :func:`dapo_ops.overlong_reward` on ``len(ids)`` of each completion (TRL's
    completion ids end with the EOS token when there is one, so the EOS counts, as in
    dapo_ops). Equal to ``trl.rewards.get_soft_overlong_punishment(max_len, cache_len)``
    for ``factor=1``; ``factor`` scales the penalty (verl's ``penalty_factor``). A plain
    class, so it pickles for TRL's async reward workers.
    """

    __name__ = "overlong_reward"

    def __init__(self, max_len: int, cache_len: int, factor: float = 1.0) -> None:
        # Validate the options now rather than at the first reward call.
        overlong_reward(torch.zeros(0), max_len=max_len, cache_len=cache_len, factor=factor)
        self.max_len = max_len
        self.cache_len = cache_len
        self.factor = factor

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.long)
        penalty = overlong_reward(
            lengths, max_len=self.max_len, cache_len=self.cache_len, factor=self.factor
        )
        return [float(x) for x in penalty.tolist()]

    def __repr__(self) -> str:
        return (
            f"OverlongReward(max_len={self.max_len}, cache_len={self.cache_len}, "
            f"factor={self.factor})"
        )


def unsupported_settings(trainer: Any) -> list[str]:
    """The trainer settings :class:`DapoGRPOTrainer` does not reproduce (empty when all are)."""
    problems = []
    if trainer.loss_type not in TRL_LOSS_TYPES:
        problems.append(f"loss_type={trainer.loss_type!r} (supported: {sorted(TRL_LOSS_TYPES)})")
    else:
        try:
            trl_objective(trainer.loss_type, trl_options(trainer))
        except InputError as err:
            problems.append(str(err))
    vllm_is = getattr(trainer, "use_vllm", False) and getattr(
        trainer, "vllm_importance_sampling_correction", False
    )
    if trainer.loss_type == "vespo" and vllm_is:
        problems.append(
            "vLLM importance-sampling correction with loss_type='vespo' (folded into phi)"
        )
    if getattr(trainer, "_entropy_bonus_enabled", False):
        problems.append("entropy_coef / use_adaptive_entropy")
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append("router_aux_loss_coef (MoE aux loss)")
    return problems


def trl_options(trainer: Any) -> dict[str, Any]:
    """The trainer's options that :func:`trl_objective` reads, under TRL's names."""
    args = trainer.args
    names = (
        "delta",
        "sapo_temperature_pos",
        "sapo_temperature_neg",
        "vespo_k_pos",
        "vespo_lambda_pos",
        "vespo_k_neg",
        "vespo_lambda_neg",
    )
    options = {name: getattr(args, name, None) for name in names}
    options["epsilon_low"] = trainer.epsilon_low
    options["epsilon_high"] = trainer.epsilon_high
    options["importance_sampling_level"] = getattr(trainer, "importance_sampling_level", "token")
    return options


def _check_supported(trainer: Any) -> None:
    problems = unsupported_settings(trainer)
    if problems:
        raise ValueError(
            f"{type(trainer).__name__} computes the loss with dapo_ops and does not reproduce: "
            + "; ".join(problems)
            + ". Use trl.GRPOTrainer for these settings."
        )


def _dapo_compute_loss(trainer: Any, model: Any, inputs: dict[str, Any]) -> Tensor:
    """``GRPOTrainer._compute_loss`` with the loss itself from :func:`trl_policy_loss`."""
    _check_supported(trainer)
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    forward = {key: inputs[key] for key in _FORWARD_KEYS if inputs.get(key) is not None}
    per_token_logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True, **forward
    )
    old = inputs.get("old_per_token_logps")
    old = per_token_logps.detach() if old is None else old
    training = bool(trainer.model.training)
    use_is = bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction)
    objective = trl_objective(trainer.loss_type, trl_options(trainer))
    # TRL multiplies the per-token loss (not the counts) by its selections and vLLM's
    # correction: all three are weights of the objective's term
    weights = inputs["importance_sampling_ratio"] if use_is else None
    selections = []
    threshold = getattr(trainer, "off_policy_mask_threshold", None)
    if threshold is not None:
        adv = inputs["advantages"]
        adv = adv.unsqueeze(-1) if adv.ndim == 1 else adv[:, :1]
        sampling = inputs.get("sampling_per_token_logps", old)
        selections.append(
            off_policy_sequence_mask(adv, per_token_logps, sampling, mask != 0, threshold=threshold)
        )
    top = getattr(trainer, "top_entropy_quantile", 1.0)
    if top < 1.0:
        selections.append(high_entropy_mask(entropies, mask != 0, top_quantile=top))
    for selection in selections:
        w = selection.to(per_token_logps.dtype)
        weights = w if weights is None else weights * w
    loss, diag = trl_policy_loss(
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
        delta=getattr(trainer.args, "delta", None),
        beta=trainer.beta,
        ref_per_token_logps=inputs.get("ref_per_token_logps"),
        use_bias_correction_kl=bool(getattr(trainer.args, "use_bias_correction_kl", False)),
        importance_sampling_ratio=weights,
        objective=objective,
    )
    mode = "train" if training else "eval"
    row_clips = None
    if objective.level == "sequence":
        with torch.no_grad():
            adv = inputs["advantages"]
            adv = adv.unsqueeze(-1) if adv.ndim == 1 else adv
            checked, valid, dtype = policy_tensors(per_token_logps, old, adv[:, :1], mask != 0)
            x = token_inputs(objective, per_token_logps, old, checked, valid, dtype, reference=True)
            low, high, _ = objective.clipped(x)
            row_clips = (low.any(dim=-1), high.any(dim=-1))
    _log_metrics(trainer, mode, mask, entropies, diag, row_clips)
    if trainer.loss_type == "vespo":  # TRL's metric: phi averaged over every row
        with torch.no_grad():
            assert isinstance(objective, VESPO)
            adv = inputs["advantages"]
            adv = adv.unsqueeze(-1) if adv.ndim == 1 else adv
            checked, valid, dtype = policy_tensors(per_token_logps, old, adv[:, :1], mask != 0)
            x = token_inputs(objective, per_token_logps, old, checked, valid, dtype, reference=True)
            phi = objective.weight(x)[:, 0]
            totals = torch.stack([phi.sum(), torch.tensor(float(phi.numel()))]).double()
            totals = trainer.accelerator.reduce(totals, reduction="sum")
            trainer._metrics[mode]["vespo/phi_seq_mean"].append(
                float(totals[0] / totals[1].clamp(min=1.0))
            )
    if trainer.loss_type == "cispo":  # TRL's metric: capped tokens with a positive advantage
        with torch.no_grad():
            log_ratio = torch.where(mask != 0, per_token_logps - old, 0.0)
            adv = inputs["advantages"]
            adv = adv.unsqueeze(-1) if adv.ndim == 1 else adv
            capped = (log_ratio.exp() > trainer.epsilon_high) & (adv > 0) & (mask != 0)
            totals = torch.stack([capped.sum(), (mask != 0).sum()]).to(torch.float64)
            totals = trainer.accelerator.reduce(totals, reduction="sum")
            trainer._metrics[mode]["cispo_clip_ratio"].append(
                float(totals[0] / totals[1].clamp(min=1.0))
            )
    return loss


@torch.no_grad()
def _log_metrics(
    trainer: Any,
    mode: str,
    mask: Tensor,
    entropies: Tensor,
    diag: PolicyDiagnostics,
    row_clips: tuple[Tensor, Tensor] | None = None,
) -> None:
    """TRL's entropy and clip-ratio metrics (same names), from dapo_ops' diagnostics; the
    clip ratios only for the loss types TRL logs them for (not cispo, sapo)."""
    valid = mask.bool()
    entropy_sum = torch.where(valid, entropies, torch.zeros_like(entropies)).sum()
    clip = (diag.valid_tokens, diag.clipped_low, diag.clipped_high)
    if row_clips is not None:  # TRL counts sequence-level clips per row, empty rows included
        rows = torch.tensor(float(valid.shape[0]), dtype=torch.float64, device=valid.device)
        clip = (rows, row_clips[0].sum().double(), row_clips[1].sum().double())
    totals = torch.stack([entropy_sum.to(torch.float64), valid.sum().to(torch.float64)])
    totals = trainer.accelerator.reduce(totals, reduction="sum")
    metrics = trainer._metrics[mode]
    metrics["entropy"].append(float(totals[0] / totals[1].clamp(min=1.0)))
    if trainer.loss_type in ("cispo", "sapo", "vespo"):
        return
    counts = trainer.accelerator.reduce(torch.stack(list(clip)), reduction="sum")
    count = counts[0].clamp(min=1.0)
    metrics["clip_ratio/low_mean"].append(float(counts[1] / count))
    metrics["clip_ratio/high_mean"].append(float(counts[2] / count))
    metrics["clip_ratio/region_mean"].append(float((counts[1] + counts[2]) / count))


def _build_trainer_class() -> type:
    from trl import GRPOTrainer  # type: ignore[attr-defined]

    class DapoGRPOTrainer(GRPOTrainer):  # type: ignore[misc, valid-type]
        """``trl.GRPOTrainer`` whose policy loss is computed by :func:`dapo_ops.token_level_loss`.

        Same constructor and config as ``GRPOTrainer``. Supported ``loss_type``: ``"dapo"``
        (default; the global token normaliser), ``"bnpo"``, ``"grpo"``, ``"dr_grpo"``,
        ``"cispo"`` (cap ``epsilon_high`` >= 1) and ``"sapo"`` (its two temperatures); with
        ``epsilon``/``epsilon_high`` (Clip-Higher), ``beta`` (k3 KL), ``delta`` (dual clip),
        ``mask_truncated_completions`` and vLLM importance-sampling correction. Settings it
        does not reproduce (other loss types, sequence-level importance sampling, entropy
        masks and bonuses, off-policy masks, MoE aux loss) raise ``ValueError`` at
        construction.

        Dynamic sampling (DAPO's fourth technique, which TRL lacks), keyword-only options
        after TRL's (details: :mod:`dapo_ops.integrations.trl_sampling`):

        - ``dynamic_sampling`` (default ``False``): drop every group whose metric is
          constant and generate more prompts until the batch is full or the cap is reached;
          advantages are then computed on the kept groups only. Training only.
        - ``max_generation_batches`` (int >= 1, default 10 with ``dynamic_sampling=True``):
          generation batches per step, the first included. At the cap the step trains on
          what was kept (the rest masked out, ``dynamic_sampling/partial_batch`` logged).
        - ``sampling_metric`` (default ``"accuracy"``): the reward function whose raw
          output decides, by its name in ``reward_func_names`` (``"accuracy"`` also finds
          TRL's ``accuracy_reward``).

        Either option given with ``dynamic_sampling=False`` raises ``InputError``.
        ``last_dynamic_sampling`` holds the :class:`~dapo_ops.integrations.trl_sampling.SamplingReport`
        of the last generation.

        Example (``model``, ``config``, ``dataset`` and an ``accuracy`` reward function
        defined as for ``GRPOTrainer``)::

            trainer = DapoGRPOTrainer(
                model=model,
                reward_funcs=[accuracy, OverlongReward(max_len=4096, cache_len=512)],
                args=config,
                train_dataset=dataset,
                dynamic_sampling=True,
                max_generation_batches=5,
                sampling_metric="accuracy",
            )
        """

        def __init__(
            self,
            *args: Any,
            dynamic_sampling: bool = False,
            max_generation_batches: int | None = None,
            sampling_metric: str | None = None,
            **kwargs: Any,
        ) -> None:
            sampling = DynamicSampling.from_options(
                dynamic_sampling, max_generation_batches, sampling_metric
            )
            super().__init__(*args, **kwargs)
            _check_supported(self)
            self._dapo_sampling = None if sampling is None else sampling.bind(self)
            self._dapo_rewards: Tensor | None = None
            self.last_dynamic_sampling: SamplingReport | None = None

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Tensor:
            rewards = super()._calculate_rewards(*args, **kwargs)
            self._dapo_rewards = rewards  # [rows of all processes, reward functions]
            return rewards  # type: ignore[no-any-return]

        def _generate_and_score_completions(self, inputs: list[Any]) -> dict[str, Any]:
            if getattr(self, "_dapo_sampling", None) is None or not self.model.training:
                return super()._generate_and_score_completions(inputs)  # type: ignore[no-any-return]
            score = super()._generate_and_score_completions
            return self._dapo_sampling.generate(self, inputs, score)  # type: ignore[union-attr]

        def compute_loss(
            self,
            model: Any,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Tensor:
            if return_outputs:
                raise ValueError("The GRPOTrainer does not support returning outputs")
            return _dapo_compute_loss(self, model, inputs)

    # Importable (and picklable) as dapo_ops.integrations.trl.DapoGRPOTrainer.
    DapoGRPOTrainer.__module__ = __name__
    DapoGRPOTrainer.__qualname__ = "DapoGRPOTrainer"
    return DapoGRPOTrainer


def __getattr__(name: str) -> Any:
    """Builds :class:`DapoGRPOTrainer` (importing TRL) on first access."""
    if name == "DapoGRPOTrainer":
        cls = _build_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# DapoGRPOTrainer is public too, but built on first access (it needs TRL), so it is not
# in __all__: ``from dapo_ops.integrations.trl import *`` must work without TRL.
__all__ = [
    "TRL_LOSS_TYPES",
    "OverlongReward",
    "trl_normalizer",
    "trl_objective",
    "trl_options",
    "trl_policy_loss",
    "unsupported_settings",
]
