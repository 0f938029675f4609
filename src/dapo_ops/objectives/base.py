"""What an objective is: a frozen value with one definition of its per-token math.

:func:`dapo_ops.policy_loss` composes any :class:`Objective` the same way::

    objective term -> x IS weights -> + KL penalty -> aggregation (mode, normalizer)

and gives it, with no code of its own: masking (a masked position never reaches the loss
or a gradient, whatever it holds), exact global normalisation, the fused analytic
gradient (when :meth:`Objective.grad` is defined), ``compiled=True``, double backward,
diagnostics and the conformance tests (tests/test_objectives.py).

An objective states, on the inputs of :class:`TokenInputs`:

- :meth:`Objective.term`: the per-token loss, written with differentiable torch ops; it
  is the reference definition (autograd differentiates it) and the fused forward;
- :meth:`Objective.grad` (optional): ``weight * d term / d logp``, the analytic
  derivative the fused path computes in the forward pass instead of building a graph;
- :meth:`Objective.clipped` (optional): the tokens whose gradient the objective clips,
  for :func:`dapo_ops.policy_loss_with_diagnostics`.

Fields are validated in ``__post_init__`` (``InputError`` naming the field); an option
an objective would ignore is simply not a field of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import LOG_RATIO_CLAMP, clip, masked
from dapo_ops._core._validate import InputError


class TokenInputs(NamedTuple):
    """Per-token inputs of an objective, all ``[batch, seq]`` in the compute dtype.

    ``adv`` is ``[batch, 1]`` (per-sequence advantages) or ``[batch, seq]``. At masked
    positions the values are arbitrary (finite or not): the engine removes them after
    :meth:`Objective.term` and :meth:`Objective.grad`, except where a term reduces over a
    row (sequence objectives), which must mask with ``valid`` itself
    (:func:`dapo_ops._core._rules.masked`).
    """

    logp: Tensor  # log pi_theta of the sampled tokens (the differentiated input)
    old_logp: Tensor  # log pi_old of the same tokens (a constant)
    log_ratio: Tensor  # logp - old_logp, not clamped
    clamped: Tensor  # log_ratio clamped to +-log_ratio_clamp (gradient 1 on the bounds)
    ratio: Tensor  # exp(clamped): never inf
    adv: Tensor  # advantages, [batch, 1] or [batch, seq]
    valid: Tensor  # bool mask


class Clipped(NamedTuple):
    """Bool ``[batch, seq]`` masks of the tokens an objective clips (for diagnostics)."""

    low: Tensor  # below the lower bound
    high: Tensor  # above the upper bound
    dual: Tensor  # beyond the dual-clip bound (negative advantages)


@dataclasses.dataclass(frozen=True)
class Objective:
    """Base class of the policy objectives: a frozen dataclass of validated options.

    Subclass it with ``@dataclasses.dataclass(frozen=True)``, give every field a default
    from its paper or peer, check the fields in ``__post_init__`` (call
    ``super().__post_init__()``), and define :meth:`term` (and, for the fused path,
    :meth:`grad`). ``log_ratio_clamp`` (keyword-only, on every objective) bounds the
    token log-ratio before ``exp``.

    ``level`` is ``"token"``, or ``"sequence"`` for objectives whose ratio is per
    sequence (GSPO): those take one advantage per sequence unless the class sets
    ``token_advantages = True`` (its :meth:`term` reads ``[batch, seq]`` advantages
    per token, as GSPO-token and GMPO do). ``token_local = True`` in the class body
    declares a per-token loss that reads only its own token.
    """

    level: ClassVar[Literal["token", "sequence"]] = "token"
    #: A sequence-level objective that also takes ``[batch, seq]`` advantages.
    token_advantages: ClassVar[bool] = False
    #: True when :meth:`term` and :meth:`grad` at a token read only that token's inputs
    #: (no reduction over its row), so :func:`dapo_ops.linear_policy_loss` may cut a
    #: sequence anywhere between chunks. Only a class that *declares* it counts (see
    #: :func:`is_token_local`): a subclass that reduces over the row must not inherit it.
    #: :func:`dapo_ops.testing.check_token_local` holds a declaring class to it.
    token_local: ClassVar[bool] = False

    log_ratio_clamp: float = dataclasses.field(default=LOG_RATIO_CLAMP, kw_only=True)

    def __post_init__(self) -> None:
        clamp = check_number(self, "log_ratio_clamp")
        check_field(
            self,
            "log_ratio_clamp",
            0 < clamp < math.inf,
            "must be finite and > 0 (the ratio is exp of the clamped log-ratio)",
        )

    def term(self, x: TokenInputs) -> Tensor:
        """Per-token loss (to be minimised), ``[batch, seq]``; differentiable in ``x.logp``
        through ``x.logp``, ``x.log_ratio``, ``x.clamped`` and ``x.ratio``."""
        raise NotImplementedError(f"{type(self).__name__} must define term()")

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor | None:
        """``weight * d term / d logp`` per token, or None (then autograd differentiates
        :meth:`term`). ``weight`` is 0-dim, ``[batch, 1]`` or ``[batch, seq]``."""
        return None

    def clipped(self, x: TokenInputs) -> Clipped:
        """The tokens whose gradient this objective clips; none by default."""
        none = torch.zeros_like(x.valid)
        return Clipped(none, none, none)

    def replace(self, **changes: object) -> Objective:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def per_sequence_advantages(objective: Objective) -> bool:
    """Whether ``objective`` takes only ``[batch]`` / ``[batch, 1]`` advantages."""
    return objective.level == "sequence" and not objective.token_advantages


def is_token_local(objective: Objective) -> bool:
    """Whether ``type(objective)`` itself declares ``token_local = True`` (not inherited)."""
    return bool(vars(type(objective)).get("token_local", False))


def check_objective_value(objective: object, name: str = "objective") -> None:
    """``InputError`` unless ``objective`` is an :class:`Objective` value."""
    if not isinstance(objective, Objective):
        raise InputError(
            f"{name} must be a dapo_ops objective value such as ClipHigher(), GSPO() or "
            f"CISPO() (a subclass of dapo_ops.objectives.Objective); got {objective!r}"
        )


def check_field(objective: object, name: str, ok: bool, expected: str) -> None:
    """Raise ``InputError`` naming ``Type.name`` and its value unless ``ok``."""
    if not ok:
        value = getattr(objective, name)
        raise InputError(f"{type(objective).__name__}.{name} {expected}; got {value!r}")


def check_positive(
    objective: object, *names: str, zero_ok: bool = False, none_ok: bool = False
) -> None:
    """Each field a finite number > 0 (``zero_ok``: >= 0; ``none_ok``: or None), else
    ``InputError`` naming ``Type.name`` and its value."""
    bound = ">= 0" if zero_ok else "> 0"
    for name in names:
        if none_ok and getattr(objective, name) is None:
            continue
        value = check_number(objective, name)
        ok = (value >= 0.0 if zero_ok else value > 0.0) and value < math.inf
        check_field(objective, name, ok, f"must be finite and {bound}{' (or None)' * none_ok}")


def check_number(objective: object, name: str) -> float:
    """The field as a float; ``InputError`` unless it is a real number (not a bool)."""
    value = getattr(objective, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(
            f"{type(objective).__name__}.{name} must be a number, got {value!r} "
            f"(a {type(value).__name__})"
        )
    return float(value)


def token_inputs(
    objective: Objective,
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    valid: Tensor,
    dtype: torch.dtype,
    *,
    reference: bool,
) -> TokenInputs:
    """The objective's inputs. ``reference``: differentiable, with masked positions set to
    0 first (so no NaN reaches autograd); else raw (the engine masks the results)."""
    lp, old = logp.to(dtype), old_logp.to(dtype)
    log_ratio = lp - old
    a = adv.to(dtype)
    if reference:
        lp, old, log_ratio = masked(valid, lp), masked(valid, old), masked(valid, log_ratio)
        a = masked(valid, a)
    clamped = clip(log_ratio, -objective.log_ratio_clamp, objective.log_ratio_clamp)
    return TokenInputs(lp, old, log_ratio, clamped, clamped.exp(), a, valid)
