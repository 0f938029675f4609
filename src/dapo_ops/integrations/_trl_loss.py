"""TRL 1.16's ``loss_type`` and options as dapo_ops objectives and normalisers (for
:mod:`dapo_ops.integrations.trl`; the batch's terms and loss: ``_trl_policy``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._rules import AggregationMode
from dapo_ops._core._validate import InputError
from dapo_ops.objectives import CISPO, SAPO, VESPO, ClipHigher, Objective, PolicyGradient

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
#: The loss types of TRL's clipped (PPO) branch, where ``delta`` applies.
CLIPPED_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo", "luspo")


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

    ``"dapo"``, ``"cispo"``, ``"vespo"``: TRL's ``num_items_in_batch`` is the loss-token
    count of the whole generation batch over all processes; one accumulation window holds
    ``accumulation_steps / steps_per_generation`` of it, and DDP averages over processes,
    so the normaliser is ``N / num_processes * accumulation_steps / steps_per_generation``
    (``N / num_processes`` in eval). With TRL's default ``steps_per_generation ==
    gradient_accumulation_steps`` this is exactly :func:`dapo_ops.global_normalizer` over
    the step's micro-batches. ``"bnpo"``: this micro-batch's token count times the
    accumulation steps. ``"grpo"``, ``"sapo"``, ``"dr_grpo"``, ``"luspo"``: all rows of the
    micro-batch (fully masked ones included) times the accumulation steps. Counts are
    clamped to >= 1 as TRL does.
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
    defaults.

    - ``dapo``/``bnpo``/``grpo``/``dr_grpo``/``luspo``: :class:`ClipHigher`. TRL's
      ``delta`` caps the ratio before the clipped minimum, which for any ``delta > 1`` is
      ``ClipHigher(eps_high=min(delta, 1 + eps_high) - 1, dual_clip=max(delta, 1 + eps_high))``
      (the usual dual clip for ``delta > 1 + epsilon_high``, as TRL recommends).
    - ``cispo``: :class:`CISPO` capping the weight at ``epsilon_high`` from above only (TRL
      clamps the ratio at ``epsilon_high`` itself); a cap below 1 (TRL's default
      ``epsilon_high = epsilon = 0.2``) is :class:`PolicyGradient` with the capped ratio as
      an importance weight (:func:`trl_policy_loss` applies it).
    - ``sapo``: :class:`SAPO` (its two temperatures); ``vespo``: :class:`VESPO`.

    ``importance_sampling_level="sequence"`` keeps the same objective: :func:`trl_policy_loss`
    evaluates it on each row's sequence ratio (the GSPO-token form), as TRL does for every
    loss type but ``vespo`` (whose weight is per sequence already).

    Example:
        >>> trl_objective("cispo", {"epsilon_high": 5.0})
        CISPO(log_ratio_clamp=20.0, eps_low=1.0, eps_high=4.0)
        >>> trl_objective("dapo", {"epsilon": 0.2, "epsilon_high": 0.28, "delta": 1.2})
        ClipHigher(log_ratio_clamp=20.0, eps_low=0.2, eps_high=0.19999999999999996, dual_clip=1.28)
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
    if level not in ("token", "sequence"):
        raise InputError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    if delta is not None and loss_type not in CLIPPED_TYPES:
        raise InputError(
            f"delta={delta} with loss_type={loss_type!r}: TRL applies delta only to the clipped "
            f"loss types {list(CLIPPED_TYPES)} and ignores it here; unset it"
        )
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
        if not high > 0.0:
            raise InputError(
                f"loss_type='cispo' caps the ratio at epsilon_high={high}; it must be > 0"
            )
        return CISPO(eps_low=1.0, eps_high=high - 1.0) if high >= 1.0 else PolicyGradient()
    if delta is None:
        return ClipHigher(eps_low=low, eps_high=high)
    cap = float(delta)
    if not 1.0 < cap < math.inf:
        raise InputError(
            f"delta={delta} must be a finite number > 1 (TRL caps the ratio at delta; a cap "
            "at or below 1 stops every positive-advantage token below the old policy)"
        )
    return ClipHigher(
        eps_low=low, eps_high=min(cap, 1.0 + high) - 1.0, dual_clip=max(cap, 1.0 + high)
    )


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


def unsupported_settings(trainer: Any) -> list[str]:
    """The trainer settings :class:`DapoGRPOTrainer` does not reproduce (empty when all are)."""
    if trainer.loss_type not in TRL_LOSS_TYPES:
        return [f"loss_type={trainer.loss_type!r} (supported: {sorted(TRL_LOSS_TYPES)})"]
    try:
        trl_objective(trainer.loss_type, trl_options(trainer))
    except InputError as err:
        return [str(err)]
    return []
