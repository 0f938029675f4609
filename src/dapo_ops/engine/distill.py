r"""On-policy distillation: a teacher's per-token KL on the student's own samples, as a value.

:class:`TeacherKL` is the teacher term; it is used two ways (verl 0.9.1's
``distillation.distillation_loss``):

- as a loss term: :func:`distill_loss`, or beside any objective with
  ``policy_loss(..., teacher_logp=t, distill=TeacherKL(...))`` (verl's
  ``use_policy_gradient=False``, the supervised form of GKD, arXiv:2306.13649);
- as the advantage: :func:`distill_advantages` gives ``-stopgrad(beta * D)`` per token, fed
  to any objective (verl's ``use_policy_gradient=True``, the Thinking Machines recipe).

The estimators are :class:`dapo_ops.KLPenalty`'s, against the teacher instead of a reference.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import (
    LOG_RATIO_CLAMP,
    AggregationMode,
    Normalizer,
    clip,
    compute_dtype,
    masked,
)
from dapo_ops._core._validate import (
    InputError,
    check_float,
    check_no_grad,
    check_option,
    check_same_device,
    shape_str,
)
from dapo_ops.engine.aggregation import loss_scale, scaled_sum
from dapo_ops.engine.checks import check_paired
from dapo_ops.engine.kl import KL_ESTIMATORS, KLEstimator, KLPenalty
from dapo_ops.objectives.base import check_field, check_number, check_positive

__all__ = ["TeacherKL", "distill_advantages", "distill_loss"]


@dataclasses.dataclass(frozen=True)
class TeacherKL:
    r"""``beta`` times a per-token estimate of :math:`KL(\pi_\theta\,\|\,\pi_T)` on the
    student's samples: on-policy distillation's reverse KL to a teacher ``T``.

    With :math:`s = \max(\log\pi_\theta, m)`, :math:`t = \max(\log\pi_T, m)` (``m`` =
    ``logp_min``, no floor when None) and :math:`\delta = s - t` clamped to
    ``+-log_ratio_clamp`` (None: not clamped), the per-token loss is
    :math:`D = \mathrm{clip}(k(\delta), -c, c)` with ``k`` the ``estimator`` of
    :class:`~dapo_ops.KLPenalty` (``k1`` = :math:`\delta`, ``k2`` = :math:`\delta^2/2`,
    ``k3`` = :math:`e^{-\delta}+\delta-1`, ``abs`` = :math:`|\delta|`) and ``c`` = ``clamp``
    (None: not clamped); ``straight_through`` takes k2's gradient as ``KLPenalty`` does.
    Several teachers: ``teacher_logp`` of shape ``[teachers, batch, seq]`` and
    :math:`D = \sum_j w_j D_j` with ``weights`` ``w`` (one per teacher; None: ``1/teachers``
    each). verl routes each sample to one teacher instead: gather each row's teacher
    log-probs into one ``[batch, seq]`` tensor.

    Defaults are verl 0.9.1's ``DistillationLossConfig``: ``estimator="k3"`` (its
    ``loss_mode``), ``clamp=10.0`` (``loss_max_clamp``), ``beta=1.0``
    (``distillation_loss_coef``), ``log_ratio_clamp=20`` (its k3's); verl's
    ``log_prob_min_clamp=-10`` acts only on its top-k loss, hence ``logp_min=None``.
    ``k1`` as a *loss term* is refused (its gradient, 1 per token, ignores the teacher,
    as verl refuses); it is the estimator for :func:`distill_advantages`.

    Example:
        >>> TeacherKL(estimator="k1").estimator
        'k1'
    """

    beta: float = 1.0
    estimator: KLEstimator = "k3"
    clamp: float | None = 10.0
    logp_min: float | None = None
    log_ratio_clamp: float | None = LOG_RATIO_CLAMP
    straight_through: bool = False
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        check_positive(self, "beta")
        check_option("TeacherKL.estimator", self.estimator, KL_ESTIMATORS)
        check_positive(self, "clamp", "log_ratio_clamp", none_ok=True)
        check_field(
            self,
            "log_ratio_clamp",
            self.log_ratio_clamp is not None or self.estimator != "k3",
            "must be a number for estimator='k3' (exp(-delta) overflows unclamped)",
        )
        if self.logp_min is not None:
            low = check_number(self, "logp_min")
            check_field(self, "logp_min", -math.inf < low < 0.0, "must be finite and < 0 (or None)")
        check_field(
            self, "straight_through", isinstance(self.straight_through, bool), "must be a bool"
        )
        if self.weights is not None:
            w = self.weights
            ok = isinstance(w, tuple) and len(w) > 0
            ok = ok and all(not isinstance(x, bool) and isinstance(x, (int, float)) for x in w)
            ok = ok and all(0.0 <= x < math.inf for x in w) and sum(w) > 0
            check_field(
                self, "weights", ok, "must be a non-empty tuple of finite numbers >= 0, not all 0"
            )

    @property
    def penalty(self) -> KLPenalty:
        """The estimator as a :class:`~dapo_ops.KLPenalty` (``beta`` 1): its math, reused."""
        return KLPenalty(1.0, self.estimator, self.clamp, straight_through=self.straight_through)

    def terms(
        self, logp: Tensor, teacher_logp: Tensor, valid: Tensor, dtype: torch.dtype
    ) -> Tensor:
        """Per-token ``D`` (before ``beta``) ``[batch, seq]``, 0 at masked positions, under
        autograd in ``logp``; ``teacher_logp`` ``[batch, seq]`` or ``[teachers, batch, seq]``."""
        student, teacher = logp.to(dtype), teacher_logp.to(dtype)
        if self.logp_min is not None:
            student, teacher = clip(student, self.logp_min), clip(teacher, self.logp_min)
        raw = masked(valid, student - teacher)  # valid broadcasts over teachers
        c = self.log_ratio_clamp
        per_token = masked(valid, self.penalty.penalty(raw, raw if c is None else clip(raw, -c, c)))
        if teacher_logp.ndim == 2:
            return per_token
        n = teacher_logp.shape[0]
        w = torch.tensor(self.weights or (1.0 / n,) * n, dtype=dtype, device=logp.device)
        return (per_token * rearrange(w, "teachers -> teachers 1 1")).sum(dim=0)


def check_pair(distill: object, teacher_logp: object) -> None:
    """``distill`` and ``teacher_logp`` go together (policy_loss's keywords)."""
    check_paired(
        "distill", distill, TeacherKL, "TeacherKL()", "teacher_logp", teacher_logp,
        "the distillation term needs the teacher's log-probs",
    )  # fmt: skip


def _inputs(
    distill: object, logp: Tensor, teacher_logp: Tensor, mask: Tensor
) -> tuple[TeacherKL, Tensor, torch.dtype]:
    """Check the inputs (metadata only); return the value, the bool mask, the dtype."""
    if not isinstance(distill, TeacherKL):
        raise InputError(f"distill must be a TeacherKL (e.g. TeacherKL()); got {distill!r}")
    check_float("teacher_logp", teacher_logp)
    _, valid, _ = policy_tensors(logp, logp, None, mask, names=("logp", "logp"))
    if teacher_logp.ndim not in (2, 3) or tuple(teacher_logp.shape[-2:]) != tuple(logp.shape):
        raise InputError(
            "teacher_logp must have shape [batch, seq] or [teachers, batch, seq] matching logp "
            f"{shape_str(logp)}; got {shape_str(teacher_logp)}"
        )
    teachers = teacher_logp.shape[0] if teacher_logp.ndim == 3 else 1
    if distill.weights is not None and len(distill.weights) != teachers:
        raise InputError(
            f"TeacherKL.weights has {len(distill.weights)} entries for {teachers} teacher(s) "
            f"(teacher_logp {shape_str(teacher_logp)}); got weights={distill.weights!r}"
        )
    check_same_device("teacher_logp", teacher_logp, "logp", logp)
    check_same_device("mask", mask, "logp", logp)
    check_no_grad("teacher_logp", teacher_logp)
    return distill, valid, compute_dtype(logp, teacher_logp)


def _task(adv: Tensor, logp: Tensor) -> Tensor:
    """``task_advantages`` checked, as ``[batch, 1]`` or ``[batch, seq]``."""
    check_float("task_advantages", adv)
    batch, seq = logp.shape
    if adv.ndim == 1 and adv.shape[0] == batch:
        adv = rearrange(adv, "batch -> batch 1")
    elif not (adv.ndim == 2 and adv.shape[0] == batch and adv.shape[1] in (1, seq)):
        raise InputError(
            f"task_advantages must have shape [batch]=[{batch}], [batch, 1] or [batch, seq]="
            f"[{batch}, {seq}] to match logp {shape_str(logp)}; got {shape_str(adv)}"
        )
    check_same_device("task_advantages", adv, "logp", logp)
    check_no_grad("task_advantages", adv)
    return adv


@checks_values
def distill_loss(
    logp: Float[Tensor, "batch seq"],
    teacher_logp: Float[Tensor, "batch seq"] | Float[Tensor, "teachers batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    distill: TeacherKL = TeacherKL(),
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
) -> Float[Tensor, ""]:
    r"""The distillation loss :math:`\beta \sum_{i,t} w_{i,t}\, m_{i,t}\, D_{i,t}`.

    ``D`` the per-token loss of ``distill`` (:class:`TeacherKL`) against ``teacher_logp``,
    ``w`` the aggregation weights of ``mode`` with the local count or ``normalizer`` (the
    global count from :func:`global_normalizer`: micro-batch losses then add up exactly to
    the full batch's), as :func:`policy_loss`, which adds this term when given
    ``teacher_logp`` and ``distill``. verl's ``use_policy_gradient=False``. Differentiable
    in ``logp``; ``teacher_logp`` is a constant (one that requires grad is refused).
    Masked positions never touch the value or the gradient; computed in float32 (float64
    if an input is).

    Shapes: logp, mask ``[batch, seq]``; teacher_logp ``[batch, seq]`` or
    ``[teachers, batch, seq]``. Returns a 0-dim tensor.

    Defaults: ``mode="token_mean"`` (verl's ``loss_agg_mode`` default), ``distill`` verl's.

    Example:
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> distill_loss(logp, torch.tensor([[-1.0, -1.0]]), torch.tensor([[True, True]]))
        tensor(0.3591, grad_fn=<MulBackward0>)
    """
    d, valid, dtype = _inputs(distill, logp, teacher_logp, mask)
    if d.estimator == "k1" and not d.straight_through:
        raise InputError(
            "distill=TeacherKL(estimator='k1') as a loss term: its gradient (1 per token) does "
            "not depend on the teacher; use it as the advantage (distill_advantages), or k3, "
            "or straight_through=True"
        )
    scale = loss_scale(valid, mode=mode, normalizer=normalizer, max_len=max_len, dtype=dtype)
    rows = d.terms(logp, teacher_logp, valid, dtype).sum(dim=-1)
    return d.beta * scaled_sum(rows, scale)


@checks_values
def distill_advantages(
    logp: Float[Tensor, "batch seq"],
    teacher_logp: Float[Tensor, "batch seq"] | Float[Tensor, "teachers batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    distill: TeacherKL = TeacherKL(),
    task_advantages: Float[Tensor, " batch"]
    | Float[Tensor, "batch 1"]
    | Float[Tensor, "batch seq"]
    | None = None,
) -> Float[Tensor, "batch seq"]:
    r"""Per-token advantages :math:`A_{i,t} = A^{task}_{i,t} - \beta\,\mathrm{sg}(D_{i,t})`.

    ``D`` the per-token loss of ``distill`` (:class:`TeacherKL`, usually ``estimator="k1"``:
    the reward :math:`\log\pi_T - \log\pi_\theta`), detached, so any objective
    (``policy_loss(ClipHigher(), logp, old_logp, A, mask)``) turns it into a policy gradient:
    verl's ``use_policy_gradient=True``, the Thinking Machines recipe. ``task_advantages``
    (``[batch]``, ``[batch, 1]`` or ``[batch, seq]``; None: 0, verl's
    ``use_task_rewards=False``) adds the task's advantages, ``beta`` weighting the teacher
    as verl's ``distillation_loss_coef``. verl sums two clipped losses instead, one per
    advantage: ``policy_loss(obj, ..., A_task, ...) + policy_loss(obj, ..., distill_advantages(...), ...)``
    is that form (equal to this one while the ratio is 1, i.e. on-policy).

    Shapes: logp, mask ``[batch, seq]``; teacher_logp ``[batch, seq]`` or
    ``[teachers, batch, seq]``. Returns ``[batch, seq]``, 0 at masked positions, no grad.

    Defaults: ``distill`` verl's (``k3``); verl recommends ``k1`` here.

    Example:
        >>> distill_advantages(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]),
        ...                    torch.tensor([[True, False]]), distill=TeacherKL(estimator="k1"))
        tensor([[-0.5000,  0.0000]])
    """
    d, valid, dtype = _inputs(distill, logp, teacher_logp, mask)
    task = None if task_advantages is None else _task(task_advantages, logp)
    if task is not None:
        dtype = compute_dtype(logp, teacher_logp, task)
    with torch.no_grad():
        reward = -d.beta * d.terms(logp.detach(), teacher_logp, valid, dtype)
        if task is not None:
            reward = reward + task.to(dtype)
        return masked(valid, reward)
