"""verl's ``bypass_mode``: the rollout's log-probs as the old policy, corrected in the loss.

verl 0.9.1 (``loss_mode: bypass_mode``) skips the trainer's recomputation of
``old_log_prob`` and passes the rollout engine's log-probs in its place; the loss then
computes the IS weights (:func:`dapo_ops.truncated_is_weights` of the detached
``log_prob`` against them) and the rejection mask (:func:`dapo_ops.rejection_mask`, one
per ``rollout_rs`` option, and-ed) from ``policy_loss.rollout_correction``, and
``loss_type="reinforce"``: ``policy_loss(PolicyGradient(), ..., mask=kept,
is_weights=w)``, or ``"ppo_clip"``: verl's vanilla loss (``dapo_ops_vanilla``) on the
kept tokens, no IS weights (the ratio to the rollout already is the correction).
:func:`bypass_step` is the step of the ``bypass_mode`` row of
:data:`dapo_ops.integrations.verl_losses.TWINS` (registered as ``dapo_ops_bypass_mode``);
tested against verl in ``tests/integration/test_verl_bypass.py``.

Example:
    >>> rollout_rs_criteria("token_k1,seq_mean_k3", "0.5_2.0,0.1")[1]
    {'level': 'seq_mean', 'statistic': 'k3', 'upper': 0.1, 'lower': None}
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.correction.offpolicy import offpolicy_metrics
from dapo_ops.integrations._verl_common import (
    CLIP_METRICS,
    Call,
    _config_value,
    kl_raw,
    policy_loss_option,
)
from dapo_ops.integrations._verl_rollout_corr import rollout_is, rollout_rs


def _threshold_pair(spec: Any, field: str) -> tuple[float, float | None]:
    """verl's ``"lower_upper"`` or a number -> ``(upper, lower or None)``."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise InputError(
            f"{field} must be a number or a 'lower_upper' string, got {spec!r}"
        ) from None
    text = str(spec).strip()
    try:
        if "_" in text:
            low, high = text.split("_", 1)
            return float(high), float(low)
        return float(text), None
    except ValueError:
        raise InputError(
            f"{field} must be a number or a 'lower_upper' string, got {spec!r}"
        ) from None


def rollout_rs_criteria(rollout_rs: str, threshold: Any) -> list[dict[str, Any]]:
    """verl's ``rollout_rs`` (comma-separated ``<level>_<statistic>``) and
    ``rollout_rs_threshold`` (one threshold, or one per option) as
    :func:`dapo_ops.rejection_mask` keyword sets, duplicates dropped as verl does."""
    field = "rollout_correction.rollout_rs_threshold"
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    if not options:
        raise InputError(f"rollout_correction.rollout_rs has no option: {rollout_rs!r}")
    if threshold is None:
        raise InputError(f"{field} is required with rollout_rs={rollout_rs!r} (verl has none)")
    specs = [p.strip() for p in str(threshold).split(",") if p.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise InputError(
            f"{field} gives {len(specs)} thresholds for {len(options)} rollout_rs options "
            f"{options}: give one for all or one per option"
        )
    criteria = []
    for option, spec in zip(options, specs, strict=True):
        level, _, statistic = option.rpartition("_")
        upper, lower = _threshold_pair(spec, field)
        if lower is not None and statistic != "k1":
            raise InputError(f"{field} for {option!r} takes one upper bound, got {spec!r}")
        criteria.append({"level": level, "statistic": statistic, "upper": upper, "lower": lower})
    return criteria


#: verl's value of each per-sequence metric for a sequence with no valid token (verl
#: averages over every row, :func:`dapo_ops.offpolicy_metrics` over non-empty ones).
_EMPTY_ROW = {
    "training_ppl": 1.0, "training_log_ppl": 0.0, "rollout_ppl": 1.0, "rollout_log_ppl": 0.0,
    "log_ppl_diff": 0.0, "log_ppl_abs_diff": 0.0, "ppl_ratio": 1.0, "chi2_seq": 0.0,
}  # fmt: skip


def verl_offpolicy_metrics(current: Tensor, rollout: Tensor, mask: Tensor) -> dict[str, float]:
    """verl's off-policy metrics (unprefixed): those of :func:`dapo_ops.offpolicy_metrics`,
    with empty rows counted as verl counts them."""
    gap = {k: float(v) for k, v in offpolicy_metrics(current, rollout, mask)._asdict().items()}
    del gap["is_ess"]  # verl's ESS is a statistic of its IS weights (rollout_is)
    rows = mask.shape[0]
    empty = rows - int(mask.any(dim=-1).sum())
    if empty:
        for key, value in _EMPTY_ROW.items():
            gap[key] = (gap[key] * (rows - empty) + value * empty) / rows
        gap["log_ppl_diff_max"] = max(gap["log_ppl_diff_max"], 0.0)
        gap["log_ppl_diff_min"] = min(gap["log_ppl_diff_min"], 0.0)
    return gap


def bypass_step(call: Call) -> Call:
    """verl's ``bypass_mode``: ``old_log_prob`` is the rollout's log-prob; the IS weights
    and rejection mask come from ``config.policy_loss.rollout_correction`` (verl ignores
    ``rollout_is_weights`` here, and so do we). The loss's metrics are ``vanilla``'s
    (``ppo_clip``) or ``actor/ppo_kl`` (``reinforce``), plus every ``rollout_corr/``
    metric verl logs: the off-policy gap (:func:`dapo_ops.offpolicy_metrics`), the IS
    weights' statistics and each rejection option's (``_verl_rollout_corr``).
    verl raises on an all-masked micro-batch; this gives a loss of 0, finite metrics."""
    corr = policy_loss_option(call.config, "rollout_correction", None)
    if corr is None:
        raise InputError(
            "loss_mode='bypass_mode' needs policy_loss.rollout_correction in the actor config"
        )
    loss_type = _config_value(corr, "loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise InputError(
            f"rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got {loss_type!r}"
        )
    mask, rollout = call.mask, call.old_log_prob
    current = call.log_prob.detach()
    weights, kept, stats = None, mask, dict[str, float]()
    level = _config_value(corr, "rollout_is", None)
    if level is not None:
        threshold = _config_value(corr, "rollout_is_threshold", 2.0)
        cap, lower = _threshold_pair(threshold, "rollout_correction.rollout_is_threshold")
        normalize = bool(_config_value(corr, "rollout_is_batch_normalize", False))
        weights, stats = rollout_is(
            current, rollout, mask, level=level, cap=cap, lower=lower, normalize=normalize
        )
    rs = _config_value(corr, "rollout_rs", None)
    if rs is not None:
        criteria = rollout_rs_criteria(rs, _config_value(corr, "rollout_rs_threshold", None))
        kept, rejection = rollout_rs(current, rollout, mask, criteria)
        stats |= rejection
    stats |= verl_offpolicy_metrics(current, rollout, mask)
    reinforce = loss_type == "reinforce"  # ppo_clip: the ratio to the rollout is the correction
    return call._replace(
        mask=kept,
        is_weights=weights if reinforce else None,
        metrics={"actor/ppo_kl": kl_raw} if reinforce else CLIP_METRICS,
        extra={f"rollout_corr/{k}": v for k, v in stats.items()},
    )
