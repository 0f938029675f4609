"""Conformance checks for policy objectives: run the library's own tests on yours.

Every objective :func:`dapo_ops.policy_loss` composes gets masking, exact global
normalisation, ``torch.compile``, low-precision inputs and double backward from the
engine; these checks verify that it does, for one objective value::

    from dapo_ops.testing import check_objective

    check_objective(MyObjective())                     # every check, a few seconds
    check_objective(MyObjective(), with_compile=False)  # skip the torch.compile checks

Each ``check_*`` function tests one property and raises ``AssertionError`` naming the
objective, the property and the worst entry; :data:`CHECKS` maps their names to them.
They build a small batch themselves (:func:`make_batch`) or take yours. The library's
suite (tests/test_objectives.py) runs them over every class of
``dapo_ops.objectives.OBJECTIVES``.

Bounds. Every value that is not promised exactly is compared with the float64 reference
on the same input values (:func:`reference_loss` under autograd: ``term``, then the
aggregation), within a stated bound (:func:`reference_with_bounds`): the computation's
own rounding, :data:`F64_RTOL` or :data:`F32_RTOL` of each entry plus the largest entry
(the second term covers sums that cancel, such as DRO's ``beta log r - A``), plus a sum's
``gamma(n) sum |x|``; in float32 also the definition's own float32 error (measured) and
the jump of any decision within rounding of its bound. A wrong formula misses by far
more.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from dapo_ops._core._validate import InputError
from dapo_ops.objectives.base import Objective
from dapo_ops.testing._base import (
    F32_RTOL,
    F64_RTOL,
    KINK_ULPS,
    MODES,
    Batch,
    Reference,
    make_batch,
    reference_loss,
    reference_with_bounds,
)
from dapo_ops.testing._gradients import (
    check_fused_gradient,
    check_gradcheck,
    check_masked_garbage,
    check_micro_batches,
)
from dapo_ops.testing._linear import check_linear_loss, check_token_local
from dapo_ops.testing._robustness import (
    check_all_masked,
    check_compile,
    check_compiled_policy_loss,
    check_constants_refused,
    check_double_backward,
    check_fields,
    check_inputs_unchanged,
    check_low_precision,
)

__all__ = [
    "CHECKS",
    "F32_RTOL",
    "F64_RTOL",
    "KINK_ULPS",
    "Batch",
    "Reference",
    "check_all_masked",
    "check_compile",
    "check_compiled_policy_loss",
    "check_constants_refused",
    "check_double_backward",
    "check_fields",
    "check_fused_gradient",
    "check_gradcheck",
    "check_inputs_unchanged",
    "check_linear_loss",
    "check_low_precision",
    "check_masked_garbage",
    "check_micro_batches",
    "check_objective",
    "check_token_local",
    "make_batch",
    "reference_loss",
    "reference_with_bounds",
]


def _every_mode(check: Callable[..., None]) -> Callable[..., None]:
    def run(objective: Objective, **kw: Any) -> None:
        for mode in MODES:
            check(objective, mode=mode, **kw)

    return run


#: Every check by name, each taking the objective (and, for ``gradcheck``,
#: ``stop_gradient=``): what :func:`check_objective` runs.
CHECKS: Mapping[str, Callable[..., None]] = {
    "fields": check_fields,
    "gradcheck": _every_mode(check_gradcheck),
    "fused_gradient": _every_mode(check_fused_gradient),
    "kl_and_is_weights": _every_mode(
        functools.partial(check_fused_gradient, kl_and_is_weights=True)
    ),
    "masked_garbage": _every_mode(check_masked_garbage),
    "micro_batches": _every_mode(check_micro_batches),
    "low_precision": check_low_precision,
    "all_masked": _every_mode(check_all_masked),
    "inputs_unchanged": check_inputs_unchanged,
    "double_backward": check_double_backward,
    "constants_refused": check_constants_refused,
    "compile": check_compile,
    "compiled_policy_loss": check_compiled_policy_loss,
    "linear_loss": _every_mode(check_linear_loss),
    "token_local": check_token_local,
}


def check_objective(
    objective: Objective, *, stop_gradient: bool = False, with_compile: bool = True
) -> None:
    """Run every check of :data:`CHECKS` on ``objective`` (every aggregation mode where
    it matters); ``AssertionError`` at the first failure.

    ``stop_gradient``: see :func:`check_gradcheck`. ``with_compile=False`` skips the
    ``torch.compile`` and ``CompiledPolicyLoss`` checks (the slowest ones).

    Example:
        >>> from dapo_ops import ClipHigher
        >>> check_objective(ClipHigher(dual_clip=3.0), with_compile=False)
    """
    if not isinstance(objective, Objective):
        raise InputError(f"objective must be an Objective value, got {objective!r}")
    for name, check in CHECKS.items():
        if name in ("compile", "compiled_policy_loss") and not with_compile:
            continue
        if name == "gradcheck":
            check(objective, stop_gradient=stop_gradient)
        else:
            check(objective)
