"""What every verl twin shares: verl's config reads, its aggregation, its metrics.

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

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import compute_dtype
from dapo_ops._core._validate import InputError
from dapo_ops.engine.aggregation import AggregationMode
from dapo_ops.engine.surrogate import LOG_RATIO_CLAMP
from dapo_ops.objectives.base import Objective, TokenInputs, per_sequence_advantages, token_inputs

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


def clip_range(config: Any) -> tuple[float, float]:
    """verl's ``(clip_ratio_low, clip_ratio_high)``, each falling back to ``clip_ratio``."""
    clip_ratio = _config_value(config, "clip_ratio", 0.2)
    low = float(_config_value(config, "clip_ratio_low", clip_ratio))
    return low, float(_config_value(config, "clip_ratio_high", clip_ratio))


def policy_loss_option(config: Any, name: str, default: Any) -> Any:
    """``config.policy_loss.<name>``, ``default`` when absent or None."""
    return _config_value(_config_value(config, "policy_loss", None), name, default)


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
    divides by ``global_batch_info["loss_scale_factor"]`` (verl's losses read it only
    there, never from the actor config's own field), else by ``loss_scale_factor`` when
    given, else by the padded width (dapo_ops' ``max_len``).
    """
    if loss_agg_mode not in VERL_AGG_MODES:
        raise InputError(
            f"loss_agg_mode must be one of {sorted(VERL_AGG_MODES)}, got {loss_agg_mode!r}"
        )
    info = dict(global_batch_info or {})
    dp_size = info.get("dp_size") or 1
    scale = info.get("loss_scale_factor")
    scale = loss_scale_factor if scale is None else scale
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


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """verl's ``masked_mean`` for a metric, a host read: the sum over ``mask`` divided by
    the count ``+ 1e-8`` (0 for an empty mask), in float64."""
    with torch.no_grad():
        total = torch.where(mask, values.detach().to(torch.float64), 0.0).sum()
        return float(total / (mask.sum().to(torch.float64) + 1e-8))


def ppo_kl(log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> float:
    """verl's ``actor/ppo_kl`` metric: the masked mean of ``old - new`` (k1), the log-ratio
    clamped to ``+-20`` as verl's ``vanilla`` clamps it; a host read."""
    dtype = compute_dtype(log_prob, old_log_prob)  # float64 stays float64
    log_ratio = (log_prob.to(dtype) - old_log_prob.to(dtype)).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    return masked_mean(-log_ratio, mask)


_NONE: Mapping[str, Any] = MappingProxyType({})


class Call(NamedTuple):
    """One call of a verl twin as its steps see it (a step returns it ``_replace``-d)."""

    log_prob: Tensor
    old_log_prob: Tensor
    advantages: Tensor  # verl's [batch, seq]
    mask: Tensor  # bool: the tokens the loss and the metrics count
    config: Any
    is_weights: Tensor | None
    options: Mapping[str, Any] = _NONE  # more policy_loss options (kl, ref_logp, kl_weights)
    selection: Tensor | None = None  # the tokens a composed loss selects
    metrics: Mapping[str, Metric] | None = None  # replaces the row's metrics (bypass_mode)
    extra: Mapping[str, float] = _NONE  # metrics the step computed itself


#: A verl metric: per-token values whose masked mean (verl's, ``+1e-8``) is logged.
Metric = Callable[[Objective, TokenInputs, Call], Tensor]


def clipped(*fields: str) -> Metric:
    """The tokens the objective clips (:meth:`Objective.clipped`), the named kinds or-ed."""

    def metric(objective: Objective, x: TokenInputs, call: Call) -> Tensor:
        kinds = objective.clipped(x)
        out = torch.zeros_like(x.valid)
        for field in fields:
            out = out | getattr(kinds, field)
        return out

    return metric


def zero(objective: Objective, x: TokenInputs, call: Call) -> Tensor:
    """verl's constant 0.0 metric (kept for its dashboards)."""
    return torch.zeros_like(x.logp)


def kl_clamped(objective: Objective, x: TokenInputs, call: Call) -> Tensor:
    """``old - new``, the log-ratio clamped to ``+-20`` first (verl's PPO-style losses)."""
    return -x.clamped


def kl_raw(objective: Objective, x: TokenInputs, call: Call) -> Tensor:
    """``old - new``, not clamped (verl's ``gspo``, ``geo_mean``, ``dro``, ``clip_cov``)."""
    return -x.log_ratio


#: verl's ``vanilla`` metrics (and ``bypass_mode``'s with ``loss_type="ppo_clip"``).
CLIP_METRICS: Mapping[str, Metric] = MappingProxyType({
    "actor/pg_clipfrac": clipped("low", "high"),
    "actor/ppo_kl": kl_clamped,
    "actor/pg_clipfrac_lower": clipped("dual"),
})  # fmt: skip


def evaluate(metrics: Mapping[str, Metric], objective: Objective, call: Call) -> dict[str, Any]:
    """Each metric's masked mean over ``call.mask``, then the step's own ``extra``."""
    logp = call.log_prob.detach()
    adv, valid, dtype = policy_tensors(
        logp, call.old_log_prob, call.advantages, call.mask,
        per_sequence=per_sequence_advantages(objective),
    )  # fmt: skip
    x = token_inputs(objective, logp, call.old_log_prob, adv, valid, dtype, reference=True)
    out: dict[str, Any] = {k: masked_mean(f(objective, x, call), valid) for k, f in metrics.items()}
    out.update(call.extra)
    return out
