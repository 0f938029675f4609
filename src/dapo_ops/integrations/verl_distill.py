"""verl 0.9.1's single-sample distillation losses, registered as ``dapo_ops_<loss_mode>``.

verl's ``compute_distillation_loss_reverse_kl_estimator`` (``distillation.distillation_loss.
loss_mode`` one of ``kl``, ``k1``, ``abs``, ``mse``, ``k2``, ``low_var_kl``, ``k3``) computes
``kl_penalty(student_logp, teacher_logp, loss_mode)`` per token and the metric
``distillation/abs_loss``; verl's ``distillation_loss`` then clamps it to
``+-loss_max_clamp`` and aggregates it, or feeds ``-loss`` as the advantage of a PPO loss
(``use_policy_gradient``). :func:`compute_distillation_loss` has that function's signature
and computes the per-token loss with :class:`dapo_ops.TeacherKL` (:func:`teacher_kl_for`
states each name), so every one of verl's clamps and combinations around it is verl's own.
``loss_mode=forward_kl_topk``: verl computes its per-token top-k loss in the model's logits
processor (``compute_topk_loss``, from the student's logits) and passes it to the registered
function, which clamps it at 0 and logs the top-k masses and the student/teacher overlap;
:func:`compute_forward_kl_topk` is that function, registered as ``dapo_ops_forward_kl_topk``
(``use_topk=True``). Outside verl, :func:`dapo_ops.linear_distill_loss` computes the same loss
from the hidden states without the logits.

Differences: the loss is exactly 0 at masked positions (verl's holds whatever the padding
gives; every consumer masks it); ``abs_loss`` of an all-masked micro-batch is 0, not NaN;
``dapo_ops_k1`` / ``dapo_ops_kl`` with ``use_policy_gradient=False`` raise (verl refuses
``k1`` so, not ``kl``, the same estimator). Tested against verl's own in float64
(``tests/integration/test_verl_distill.py``): per-token loss, gradient and metrics, and
verl's whole ``distillation_ppo_loss`` with either name.

Example:
    >>> teacher_kl_for("low_var_kl")
    TeacherKL(beta=1.0, estimator='k3', clamp=10.0, logp_min=None, log_ratio_clamp=20.0, straight_through=False, weights=None)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.engine.distill import TeacherKL
from dapo_ops.integrations._verl_common import _config_value

#: verl's estimator names -> dapo_ops' estimator (verl's ``kl_penalty_forward``).
ESTIMATORS = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}
PREFIX = "dapo_ops_"
#: The names registered in verl's distillation registry (single-sample estimators).
DISTILL_NAMES = tuple(PREFIX + name for name in ESTIMATORS)
#: verl's top-k loss mode, registered as ``dapo_ops_forward_kl_topk``.
TOPK_NAME = "forward_kl_topk"
#: Every verl distillation ``loss_mode`` with a twin.
DISTILL_MODES = (*ESTIMATORS, TOPK_NAME)


def teacher_kl_for(loss_mode: str) -> TeacherKL:
    """The :class:`TeacherKL` of verl's ``loss_mode`` (with or without ``dapo_ops_``).

    verl's k3 clamps ``teacher - student`` to +-20 and the estimate to +-10; its other
    estimators clamp nothing (``loss_max_clamp`` acts later, in verl's
    ``distillation_loss``). ``beta`` 1: verl applies ``distillation_loss_coef`` itself.
    """
    name = loss_mode[len(PREFIX) :] if loss_mode.startswith(PREFIX) else loss_mode
    if name not in ESTIMATORS:
        raise InputError(
            f"loss_mode must be one of {sorted(ESTIMATORS)} (or with {PREFIX!r}); got {loss_mode!r}"
        )
    k3 = ESTIMATORS[name] == "k3"
    return TeacherKL(
        beta=1.0,
        estimator=ESTIMATORS[name],  # type: ignore[arg-type]
        clamp=10.0 if k3 else None,
        log_ratio_clamp=20.0 if k3 else None,
    )


def teacher_kl_from_config(loss_config: Any) -> TeacherKL:
    """The :class:`TeacherKL` of a verl ``DistillationLossConfig``: its estimator, its
    ``loss_max_clamp`` (with k3's own +-10, the smaller bound) and ``beta`` =
    ``distillation_loss_coef`` when ``use_task_rewards``, else 1 (verl's rule).

    ``distill_loss(..., distill=teacher_kl_from_config(cfg))`` is verl's distillation term
    for ``use_policy_gradient=False``; ``distill_advantages`` its advantage otherwise.
    """
    base = teacher_kl_for(str(_config_value(loss_config, "loss_mode", "k3")))
    cap = _config_value(loss_config, "loss_max_clamp", None)
    clamp = base.clamp if cap is None else min(float(cap), base.clamp or math.inf)
    coef = float(_config_value(loss_config, "distillation_loss_coef", 1.0))
    beta = coef if _config_value(loss_config, "use_task_rewards", True) else 1.0
    return dataclasses.replace(base, beta=beta, clamp=clamp)


def compute_distillation_loss(
    config: Any,
    distillation_config: Any,
    model_output: Any,
    data: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """verl ``DistillationLossFn``: the per-token loss ``[bsz, resp_len]`` and metrics.

    Reads ``model_output["log_probs"]`` and ``data["teacher_logprobs"]`` (unpadded, as
    verl's) and ``data["response_mask"]``; returns ``(loss, {"distillation/abs_loss":
    Metric(MEAN, ...)})`` as verl's ``compute_distillation_loss_reverse_kl_estimator``.
    """
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    loss_config = _config_value(distillation_config, "distillation_loss", None)
    loss_mode = str(_config_value(loss_config, "loss_mode", ""))
    distill = teacher_kl_for(loss_mode)
    if distill.estimator == "k1" and not _config_value(loss_config, "use_policy_gradient", True):
        raise InputError(
            f"loss_mode={loss_mode!r} with use_policy_gradient=False: k1's gradient does not "
            "depend on the teacher; use it with use_policy_gradient=True, or k3"
        )
    student = no_padding_2_padding(model_output["log_probs"], data)
    teacher = no_padding_2_padding(data["teacher_logprobs"], data).squeeze(-1)
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(0) if mask.is_nested else mask).bool()
    if teacher.shape != student.shape or mask.shape != student.shape:
        raise InputError(
            f"teacher_logprobs {list(teacher.shape)}, log_probs {list(student.shape)} and "
            f"response_mask {list(mask.shape)} must have one shape once padded"
        )
    losses = per_token(distill, student, teacher.detach(), mask)
    with torch.no_grad():
        count = mask.sum().clamp(min=1).to(losses.dtype)
        abs_mean = torch.where(mask, losses.abs(), 0.0).sum() / count
    return losses, {"distillation/abs_loss": Metric(AggregationType.MEAN, abs_mean)}


def compute_forward_kl_topk(
    config: Any,
    distillation_config: Any,
    model_output: Any,
    data: Any,
) -> tuple[Tensor, dict[str, Any]]:
    """verl ``DistillationLossFn`` for ``forward_kl_topk``: the logits processor's per-token
    loss (``model_output["distillation_losses"]``, unpadded) clamped at 0 (top-k masses do
    not sum to 1), and verl's metrics over the valid tokens: ``distillation/student_mass`` and
    ``teacher_mass`` (mean, host floats as verl's), their min and max (``Metric``), and,
    when the processor gave them, ``overlap_ratio`` (the mean overlap count over ``topk``)
    and ``overlap_token_advantage`` (mean over the tokens with an overlap, 0 without).
    Host syncs: the means, as verl's."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    def padded(key: str) -> Tensor:
        return no_padding_2_padding(model_output[key], data)  # type: ignore[no-any-return]

    mask = data["response_mask"]
    valid = mask.bool().to_padded_tensor(False) if mask.is_nested else mask.bool()
    losses = padded("distillation_losses")
    metrics: dict[str, Any] = {}
    for who in ("student", "teacher"):
        mass = padded(f"{who}_mass")[valid]
        metrics[f"distillation/{who}_mass"] = mass.mean().item()
        metrics[f"distillation/{who}_mass_min"] = Metric(AggregationType.MIN, mass.min())
        metrics[f"distillation/{who}_mass_max"] = Metric(AggregationType.MAX, mass.max())
    if model_output.get("overlap_count") is not None and model_output.get("overlap_token_advantage") is not None:  # fmt: skip
        count, adv = padded("overlap_count"), padded("overlap_token_advantage")
        k = _config_value(
            _config_value(distillation_config, "distillation_loss", None), "topk", None
        )
        if k is None:
            raise InputError("distillation_loss.topk must be set for the overlap metrics; got None")
        metrics["distillation/overlap_ratio"] = (count[valid].float().mean() / k).item()
        hit = valid & (count > 0)
        metrics["distillation/overlap_token_advantage"] = (
            adv[hit].mean().item() if bool(hit.any()) else 0.0
        )
    return losses.clamp(min=0.0), metrics


def per_token(distill: TeacherKL, student: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """``D`` per token (``beta`` 1), 0 at masked positions, differentiable in ``student``."""
    dtype = torch.float64 if torch.float64 in (student.dtype, teacher.dtype) else torch.float32
    return distill.terms(student, teacher, mask, dtype)


def register_distillation() -> None:
    """Register :func:`compute_distillation_loss` in verl's distillation registry under
    :data:`DISTILL_NAMES` (single-sample estimators) and :func:`compute_forward_kl_topk` as
    ``dapo_ops_forward_kl_topk`` (``use_topk=True``). Idempotent: replaces the entries.
    Imports ``verl.trainer.distillation.losses`` (which needs Pillow)."""
    from verl.trainer.distillation import losses

    for name in DISTILL_NAMES:  # register_distillation_loss refuses a second function
        losses.DISTILLATION_LOSS_REGISTRY.pop(name, None)
        losses.DISTILLATION_SETTINGS_REGISTRY.pop(name, None)
    topk = PREFIX + TOPK_NAME
    losses.DISTILLATION_LOSS_REGISTRY.pop(topk, None)
    losses.DISTILLATION_SETTINGS_REGISTRY.pop(topk, None)
    settings = losses.DistillationLossSettings(names=list(DISTILL_NAMES), use_estimator=True)
    losses.register_distillation_loss(settings)(compute_distillation_loss)
    topk_settings = losses.DistillationLossSettings(names=[topk], use_topk=True)
    losses.register_distillation_loss(topk_settings)(compute_forward_kl_topk)


# Imported on its own inside a verl process (VERL_USE_EXTERNAL_MODULES): register every
# twin, these included, now or once verl's core_algos is loaded. Imported here, after the
# definitions: registering imports dapo_ops.integrations.verl, which imports this module.
from dapo_ops.integrations.verl_plugin import register_when_ready  # noqa: E402

register_when_ready()

__all__ = [
    "DISTILL_MODES",
    "DISTILL_NAMES",
    "ESTIMATORS",
    "TOPK_NAME",
    "compute_distillation_loss",
    "compute_forward_kl_topk",
    "register_distillation",
    "teacher_kl_for",
    "teacher_kl_from_config",
]
