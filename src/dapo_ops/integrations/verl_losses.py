"""verl's policy losses as one table of twins, registered as ``dapo_ops_<loss_mode>``.

Each row of :data:`TWINS` says, for one verl 0.9.1 ``loss_mode``, what its loss is made
of: the objective value built from verl's actor config (read exactly as verl's own loss
function reads it), the aggregation when verl forces one, the step that composes a token
selection or rollout correction (``clip_cov``, ``kl_cov``: :mod:`verl_composed`;
``bypass_mode``: :mod:`verl_bypass`; ``geo_mean``'s per-sequence IS weight) and verl's
metric names with what each averages. :func:`policy_loss_fn` is the one twin body: verl's
``PolicyLossFn`` signature, :func:`dapo_ops.policy_loss` with the row's parts, the
aggregation from ``loss_agg_mode`` and ``global_batch_info``. Adding a twin is one row.
Switching ``policy_loss.loss_mode: sapo`` to ``dapo_ops_sapo`` changes the
implementation, not the numbers (``tests/integration/test_verl_differential.py``).

At an exact tie (a ratio on a clip bound, a log-ratio on verl's clamp at 20) the twins
pass the gradient, on every torch (docs/kinks.md). verl's own losses follow their torch's
``clamp``: the same on torch <= 2.13, except at the dual-clip bound ``r = clip_ratio_c``,
where ``torch.min`` halves it on every torch; on torch 2.14 half at the clip bounds and
GMPO's (``geo_mean``) log-ratio bounds, 0 on the log-ratio clamp.

Example:
    >>> verl_objective("sapo", {"tau_pos": 1.0, "tau_neg": 1.05})
    SAPO(log_ratio_clamp=20.0, tau_pos=1.0, tau_neg=1.05)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._validate import InputError, check_float, check_same_shape
from dapo_ops.engine.policy import policy_loss
from dapo_ops.integrations._peer_names import VERL_POLICY_LOSS, peer_names
from dapo_ops.integrations._verl_common import (
    CLIP_METRICS,
    Call,
    Metric,
    _config_value,
    clip_range,
    clipped,
    evaluate,
    kl_clamped,
    kl_raw,
    policy_loss_option,
    verl_aggregation,
    zero,
)
from dapo_ops.integrations.verl_bypass import bypass_step
from dapo_ops.integrations.verl_composed import (
    CLIP_COV_METRICS,
    KL_COV_METRICS,
    clip_cov_step,
    kl_cov_step,
)
from dapo_ops.objectives import (
    CISPO,
    DPPO,
    DRO,
    GMPO,
    GSPO,
    SAPO,
    ClipHigher,
    Objective,
    PolicyGradient,
    RatioSurrogate,
)
from dapo_ops.objectives.base import TokenInputs

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Any]]]

#: ``Twin.agg`` of a loss that averages one value per row over every row (``geo_mean``).
ROWS = "rows"


@dataclasses.dataclass(frozen=True)
class Twin:
    """One verl ``loss_mode``: its objective from the config, its verl metrics, the
    aggregation verl forces (else ``loss_agg_mode``, whose default is ``default_agg``),
    and an optional step that composes selections or weights before the loss."""

    objective: Callable[[Any], Objective]
    metrics: Mapping[str, Metric]
    agg: str | None = None
    default_agg: str = "token-mean"
    step: Callable[[Call], Call] | None = None


def _vanilla(config: Any) -> Objective:
    dual = float(_config_value(config, "clip_ratio_c", 3.0))
    return ClipHigher(*clip_range(config), dual_clip=dual)


def _dppo(divergence: str) -> Callable[[Any], Objective]:
    def build(config: Any) -> Objective:
        low, high = clip_range(config)
        cap = float(_config_value(config, "clip_ratio_c", 20.0))
        return DPPO(divergence=divergence, delta_low=low, delta_high=high, is_cap=cap)  # type: ignore[arg-type]

    return build


def _dro(config: Any) -> Objective:
    beta = policy_loss_option(config, "dro_beta", None)
    if beta is None:
        raise InputError("loss_mode='dro' needs policy_loss.dro_beta > 0 (verl has no default)")
    return DRO(beta=float(beta))


def _sapo(config: Any) -> Objective:
    tau_pos = float(_config_value(config, "tau_pos", 1.0))
    return SAPO(tau_pos=tau_pos, tau_neg=float(_config_value(config, "tau_neg", 1.05)))


def _bypass(config: Any) -> Objective:
    correction = policy_loss_option(config, "rollout_correction", None)
    if _config_value(correction, "loss_type", "ppo_clip") == "reinforce":
        return PolicyGradient()
    return _vanilla(config)


def _dppo_lower(objective: Objective, x: TokenInputs, call: Call) -> Tensor:
    """verl's DPPO ``pg_clipfrac_lower``: kept tokens whose ratio the IS cap truncates."""
    assert isinstance(objective, DPPO)
    return objective.inside(x) & (x.ratio > objective.is_cap)


def _geo_mean_weights(call: Call) -> Call:
    """verl's ``geo_mean`` turns the token IS weights into one per sequence, their
    geometric mean over the valid tokens: ``exp(sum log(w + 1e-10) / (n + 1e-8))``."""
    w = call.is_weights
    if w is None:
        return call
    n = call.mask.sum(dim=-1, keepdim=True).to(w.dtype)
    log_w = torch.where(call.mask, torch.log(w + 1e-10), 0.0).sum(dim=-1, keepdim=True)
    return call._replace(is_weights=torch.exp(log_w / (n + 1e-8)).expand_as(w))


_PPO_KL: Mapping[str, Metric] = MappingProxyType({"actor/ppo_kl": kl_raw})
_DPPO_METRICS = {**CLIP_METRICS, "actor/pg_clipfrac_lower": _dppo_lower}
_RATIO_METRICS = {**CLIP_METRICS, "actor/pg_clipfrac_lower": zero}  # gspo, cispo: no dual

#: verl ``loss_mode`` -> its twin here; each registered as ``dapo_ops_<loss_mode>``.
TWINS: Mapping[str, Twin] = MappingProxyType({
    "vanilla": Twin(_vanilla, CLIP_METRICS),
    "dppo_tv": Twin(_dppo("tv"), _DPPO_METRICS),
    "dppo_kl": Twin(_dppo("kl"), _DPPO_METRICS),
    "gspo": Twin(lambda c: GSPO(*clip_range(c), verl_clamp=True),
                 {**_RATIO_METRICS, "actor/ppo_kl": kl_raw}, default_agg="seq-mean-token-mean"),
    "sapo": Twin(_sapo, {"actor/pg_clipfrac": zero, "actor/ppo_kl": kl_clamped,
                         "actor/pg_clipfrac_lower": zero}, agg="seq-mean-token-mean",
                 default_agg="seq-mean-token-mean"),
    "gpg": Twin(lambda c: PolicyGradient(), {}),
    "geo_mean": Twin(lambda c: GMPO(*clip_range(c)), {"actor/pg_clipfrac": clipped("high"),
                     "actor/ppo_kl": kl_raw, "actor/pg_clipfrac_lower": clipped("low")},
                     agg=ROWS, step=_geo_mean_weights),
    "dro": Twin(_dro, _PPO_KL),
    "cispo": Twin(lambda c: CISPO(*clip_range(c)), _RATIO_METRICS),
    "clip_cov": Twin(lambda c: ClipHigher(*clip_range(c)), CLIP_COV_METRICS, step=clip_cov_step),
    "kl_cov": Twin(lambda c: RatioSurrogate(), KL_COV_METRICS, step=kl_cov_step),
    "bypass_mode": Twin(_bypass, CLIP_METRICS, step=bypass_step),
})  # fmt: skip

#: The verl ``loss_mode`` values that have a twin.
VERL_LOSS_MODES = tuple(TWINS)


def verl_objective(loss_mode: str, config: Any) -> Objective:
    """The objective of verl's ``loss_mode`` with the options verl reads from ``config``."""
    if loss_mode not in TWINS:
        raise InputError(f"verl loss_mode {loss_mode!r} has no dapo_ops objective; see VERL_LOSS_MODES")  # fmt: skip
    return TWINS[loss_mode].objective(config)


def _aggregation(agg: str, call: Call) -> dict[str, Any]:
    if agg == ROWS:  # verl: torch.mean over every row, empty ones included; no dp scaling
        return {"mode": "seq_mean_token_mean", "normalizer": float(call.mask.shape[0])}
    info = _config_value(call.config, "global_batch_info", {})
    mode, normalizer, max_len = verl_aggregation(agg, info)
    return {"mode": mode, "normalizer": normalizer, "max_len": max_len}


def policy_loss_fn(loss_mode: str, name: str | None = None) -> PolicyLossFn:
    """A verl ``PolicyLossFn`` computing verl's ``loss_mode`` with dapo_ops: the one twin
    body, driven by the row ``TWINS[loss_mode]``."""
    if loss_mode not in TWINS:
        raise InputError(f"loss_mode must be one of {VERL_LOSS_MODES}, got {loss_mode!r}")
    row = TWINS[loss_mode]

    def compute(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str | None = None,
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        if config is None:
            raise InputError(f"dapo_ops_{loss_mode} needs verl's actor config (config=...)")
        with peer_names(VERL_POLICY_LOSS):  # errors name verl's arguments (log_prob, ...)
            mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
            policy_tensors(log_prob, old_log_prob, advantages, mask)  # before any step
            if rollout_is_weights is not None:
                check_float("is_weights", rollout_is_weights)
                check_same_shape("is_weights", rollout_is_weights, "logp", log_prob)
            objective = row.objective(config)
            call = Call(log_prob, old_log_prob, advantages, mask, config, rollout_is_weights)
            if row.step is not None:
                call = row.step(call)
            loss = policy_loss(
                objective, log_prob, old_log_prob, call.advantages, call.mask,
                is_weights=call.is_weights, **call.options,
                **_aggregation(row.agg or loss_agg_mode or row.default_agg, call),
            )  # fmt: skip
            return loss, evaluate(
                row.metrics if call.metrics is None else call.metrics, objective, call
            )

    compute.__name__ = compute.__qualname__ = name or f"compute_policy_loss_dapo_ops_{loss_mode}"
    compute.__doc__ = (
        f"verl's ``{loss_mode}`` policy loss (``PolicyLossFn``) by dapo_ops: the row "
        f"``TWINS[{loss_mode!r}]`` of :mod:`dapo_ops.integrations.verl_losses`."
    )
    return compute


def register_all() -> None:
    """Register ``dapo_ops_<loss_mode>`` in verl for every mode of :data:`VERL_LOSS_MODES`."""
    from verl.trainer.ppo import core_algos

    for loss_mode in VERL_LOSS_MODES:
        core_algos.register_policy_loss(f"dapo_ops_{loss_mode}")(policy_loss_fn(loss_mode))
