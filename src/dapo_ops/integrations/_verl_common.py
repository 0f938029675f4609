"""What every verl twin shares: verl's config reads, its aggregation, its ``ppo_kl`` metric.

The twin modules (:mod:`dapo_ops.integrations.verl_losses`, ``verl_composed``,
``verl_bypass``, ``verl_advantages``) import from here, never from
:mod:`dapo_ops.integrations.verl`, which imports them all to register them: so no module
of the integration imports another that is still being initialised, whatever the import
order (verl first, dapo_ops first, or a twin module directly).

Example:
    >>> verl_aggregation("token-mean", {"dp_size": 2, "batch_num_tokens": 30})
    ('token_mean', tensor(15., dtype=torch.float64), None)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from dapo_ops._core._rules import compute_dtype
from dapo_ops._core._validate import InputError
from dapo_ops.engine.aggregation import AggregationMode
from dapo_ops.engine.surrogate import LOG_RATIO_CLAMP

#: verl's ``loss_agg_mode`` values and the dapo_ops mode that computes each.
VERL_AGG_MODES: dict[str, AggregationMode] = {
    "token-mean": "token_mean",
    "token-sum": "token_mean",  # with normaliser 1 / dp_size
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}


def _config_value(config: Any, name: str, default: Any) -> Any:
    """``config.name`` for verl's ``ActorConfig``, an omegaconf ``DictConfig`` or a dict."""
    if config is None:
        return default
    getter = getattr(config, "get", None)
    value = getter(name, None) if callable(getter) else getattr(config, name, None)
    return default if value is None else value


def verl_aggregation(
    loss_agg_mode: str,
    global_batch_info: Mapping[str, Any] | None = None,
    loss_scale_factor: int | None = None,
) -> tuple[AggregationMode, Tensor | float | Literal["local"], int | None]:
    """``(mode, normalizer, max_len)`` for :func:`dapo_ops.token_level_loss` that give verl's ``agg_loss``.

    verl (0.9) divides a micro-batch's loss sum by the *global* count of the mini-batch
    (``batch_num_tokens`` for ``token-mean``, ``global_batch_size`` sequences for the
    ``seq-mean-*`` modes) and multiplies by ``dp_size`` because FSDP averages gradients
    over ranks: that is dapo_ops' ``normalizer = count / dp_size``, what
    :func:`dapo_ops.global_normalizer` returns. Without those counts (``dp_size == 1``)
    verl uses the micro-batch's own count: ``normalizer="local"``. ``token-sum`` is the
    plain sum times ``dp_size`` (``normalizer = 1 / dp_size``). ``seq-mean-token-sum-norm``
    divides by ``loss_scale_factor``, else by the padded width (dapo_ops' ``max_len``).
    """
    if loss_agg_mode not in VERL_AGG_MODES:
        raise InputError(
            f"loss_agg_mode must be one of {sorted(VERL_AGG_MODES)}, got {loss_agg_mode!r}"
        )
    info = dict(global_batch_info or {})
    dp_size = info.get("dp_size") or 1
    scale = info.get("loss_scale_factor") or loss_scale_factor
    mode = VERL_AGG_MODES[loss_agg_mode]
    if loss_agg_mode == "token-sum":
        return mode, 1.0 / float(dp_size), None
    count = info.get("batch_num_tokens" if mode == "token_mean" else "global_batch_size")
    if count is None:
        if int(dp_size) > 1:
            raise InputError(
                f"verl's global_batch_info lacks the global count with dp_size={dp_size}"
            )
        normalizer: Tensor | float | Literal["local"] = "local"
    else:
        normalizer = torch.as_tensor(count, dtype=torch.float64) / float(dp_size)
    max_len = int(scale) if mode == "seq_mean_token_sum_norm" and scale is not None else None
    return mode, normalizer, max_len


def ppo_kl(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> float:
    """verl's ``actor/ppo_kl`` metric: the masked mean of ``old - new`` (k1), a host read."""
    with torch.no_grad():
        dtype = compute_dtype(log_prob, old_log_prob)  # float64 stays float64
        log_ratio = (log_prob.to(dtype) - old_log_prob.to(dtype)).clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
        )
        neg = torch.where(mask, -log_ratio, torch.zeros_like(log_ratio)).sum()
        return float(neg / mask.sum().clamp(min=1))
