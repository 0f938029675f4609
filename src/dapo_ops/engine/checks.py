"""The argument checks every policy-loss entry point shares (metadata only, no host sync).

:func:`dapo_ops.policy_loss`, :func:`dapo_ops.linear_policy_loss` and
:func:`dapo_ops.distill_loss` take the same options (objective, aggregation mode,
``max_len``, a KL penalty with its reference log-probs, detached per-token constants, a
normaliser); each rule is written here once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import AGGREGATION_MODES
from dapo_ops._core._validate import (
    InputError,
    check_float,
    check_no_grad,
    check_option,
    check_same_device,
    check_same_shape,
)
from dapo_ops.engine.aggregation import check_max_len, check_normalizer
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.objectives.base import Objective, check_objective_value, per_sequence_advantages


def check_paired(
    name: str, value: object, kind: type, example: str, tensor_name: str, tensor: object, needs: str
) -> None:
    """``value`` (a ``kind`` or None) and ``tensor`` are given together or not at all."""
    if value is not None and not isinstance(value, kind):
        raise InputError(
            f"{name} must be a {kind.__name__} (e.g. {example}) or None; got {value!r}"
        )
    if (value is None) != (tensor is None):
        raise InputError(
            f"{name} and {tensor_name} go together: {needs}, and {tensor_name} is unused "
            f"without it; got {name}={value!r} and "
            f"{tensor_name}={'a tensor' if tensor is not None else None}"
        )


def check_loss_options(
    objective: object,
    *,
    mode: str,
    max_len: int | None,
    kl: KLPenalty | None,
    ref_logp: Tensor | None,
) -> None:
    """The options of the loss itself: the objective value, the aggregation ``mode`` and
    ``max_len``, and the KL penalty ``kl`` with its ``ref_logp``."""
    check_objective_value(objective)
    check_option("mode", mode, AGGREGATION_MODES)
    check_max_len(max_len)
    check_paired(
        "kl", kl, KLPenalty, "KLPenalty(beta=0.04)", "ref_logp", ref_logp,
        "a KL penalty needs the reference policy's log-probs",
    )  # fmt: skip


def objective_inputs(
    objective: Objective,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    device_of: tuple[str, Tensor],
    names: tuple[str, str] = ("logp", "old_logp"),
) -> tuple[Tensor, Tensor, torch.dtype]:
    """:func:`~dapo_ops._core._inputs.policy_tensors` for ``objective`` (per-sequence
    advantages where it needs them), with ``old_logp``, ``advantages`` and ``mask`` on
    ``device_of``'s device and the two constants not requiring grad."""
    per_sequence = per_sequence_advantages(objective)
    adv, valid, dtype = policy_tensors(
        logp, old_logp, advantages, mask, names=names, per_sequence=per_sequence
    )
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        check_same_device(name, t, *device_of)
    check_no_grad("old_logp", old_logp)
    check_no_grad("advantages", advantages)
    return adv, valid, dtype


def check_constants(
    tensors: Iterable[tuple[str, Tensor | None]],
    *,
    shape_of: tuple[str, Tensor],
    device_of: tuple[str, Tensor],
) -> None:
    """Each given per-token constant (``ref_logp``, ``is_weights``, ...) is a float tensor
    of ``shape_of``'s shape, on ``device_of``'s device, not requiring grad."""
    for name, t in tensors:
        if t is not None:
            check_float(name, t)
            check_same_shape(name, t, *shape_of)
            check_same_device(name, t, *device_of)
            check_no_grad(name, t)


def normalizer_tensor(
    normalizer: object, dtype: torch.dtype, device: torch.device, name: str = "normalizer"
) -> Tensor | None:
    """``normalizer`` checked (a detached count), as a 0-dim tensor of ``dtype`` on
    ``device``; None for the local count."""
    given = check_normalizer(normalizer, name)
    if given is None:
        return None
    if isinstance(given, Tensor):
        check_no_grad(name, given)
        return given.to(device=device, dtype=dtype)
    return torch.full((), given, dtype=dtype, device=device)  # filled there: no host copy
