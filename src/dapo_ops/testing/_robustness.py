"""Conformance checks of robustness: compile, low precision, all-masked batches, inputs
left unchanged, double backward, refused constants, validated fields."""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
from torch import Tensor

from dapo_ops._core._rules import AggregationMode
from dapo_ops._core._validate import InputError
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.engine.policy import policy_loss
from dapo_ops.objectives.base import Objective
from dapo_ops.testing._base import (
    F64_RTOL,
    Batch,
    _assert_exact,
    _assert_within,
    _bind,
    _default,
    _loss_and_grad,
    _name,
    make_batch,
    reference_loss,
    reference_with_bounds,
)


def check_compile(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    backend: str = "aot_eager",
    compiled_option: bool = False,
) -> None:
    """``torch.compile(fullgraph=True, backend=backend)`` around a function calling
    :func:`policy_loss` traces with no graph break, and its loss and gradient, like eager's,
    lie within :func:`reference_with_bounds` of the float64 reference; with
    ``compiled_option=True``, the eager call ``policy_loss(..., compiled=True)`` (inductor)
    instead, which must not fall back to eager. Resets ``torch._dynamo``'s caches first
    (each objective value is a new graph)."""
    import torch._dynamo

    b = _default(objective, batch, torch.float32)
    args = (b.old_logp, b.advantages, b.mask)

    def step(lp: Tensor) -> Tensor:
        return policy_loss(objective, lp, *args, mode=mode, compiled=compiled_option)

    torch._dynamo.reset()
    if compiled_option:
        run, how = step, "compiled=True"
    else:
        run, how = torch.compile(step, fullgraph=True, backend=backend), f"torch.compile({backend})"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dapo_ops: compiled=True ran eagerly")
        got = _loss_and_grad(run, b.logp)
    eager = _loss_and_grad(_bind(policy_loss, objective), b.logp, *args, mode=mode)
    ref = reference_with_bounds(objective, b, mode=mode)
    for name, (loss, grad) in ((how, got), ("eager", eager)):
        what = f"{_name(objective)}, mode={mode}, {name}"
        _assert_within(loss, ref.loss, ref.loss_err, f"{what}: loss vs the float64 reference")
        _assert_within(grad, ref.grad, ref.grad_err, f"{what}: gradient vs the reference")


def check_compiled_policy_loss(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    backend: str = "inductor",
    kl_and_is_weights: bool = True,
) -> None:
    """:class:`~dapo_ops.CompiledPolicyLoss` (the body exported once and compiled ahead of
    time) gives a loss and gradient within :func:`reference_with_bounds`, with a KL penalty
    and IS weights (``kl_and_is_weights=False``: without). An objective without an
    analytic ``grad`` is refused by it with ``InputError``, which this check expects.
    ``backend``: ``CompiledPolicyLoss.backend`` (``"inductor"``, ``"eager"``, or
    ``"triton"`` for an objective with a Triton term, on CUDA or under Triton's
    interpreter)."""
    from dapo_ops.engine.compiled_loss import CompiledPolicyLoss

    if type(objective).grad is Objective.grad:
        try:
            CompiledPolicyLoss(objective)
        except InputError:
            return
        raise AssertionError(f"{_name(objective)}: CompiledPolicyLoss accepted no analytic grad")
    b = _default(objective, batch, torch.float32)
    g = torch.Generator().manual_seed(3)
    noise = 0.3 * torch.randn(b.logp.shape, generator=g, dtype=b.logp.dtype)
    ref_logp = -(b.logp + noise).abs()  # reflected at 0: log-probs
    rho = (torch.rand(b.logp.shape, generator=g) + 0.5).to(b.logp.dtype)
    kl = KLPenalty(beta=0.1) if kl_and_is_weights else None
    ref_or_none, rho_or_none = (ref_logp, rho) if kl else (None, None)
    run = CompiledPolicyLoss(objective, mode=mode, kl=kl, backend=backend)  # type: ignore[arg-type]
    got = _loss_and_grad(
        lambda lp: run(lp, *b[1:], ref_logp=ref_or_none, is_weights=rho_or_none), b.logp
    )
    ref = reference_with_bounds(
        objective, b, mode=mode, kl=kl, ref_logp=ref_or_none, is_weights=rho_or_none
    )
    what = f"{_name(objective)}, mode={mode}, CompiledPolicyLoss({backend})" + (
        ", KL and IS weights" if kl else ""
    )
    _assert_within(got[0], ref.loss, ref.loss_err, f"{what}: loss vs the float64 reference")
    _assert_within(got[1], ref.grad, ref.grad_err, f"{what}: gradient vs the reference")


def check_low_precision(
    objective: Objective,
    batch: Batch | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    mode: AggregationMode = "token_mean",
) -> None:
    """``dtype`` (bfloat16, float16) inputs: a float32 loss equal, bit for bit, to the
    float32 call on the same (rounded) values, and a gradient in ``dtype`` equal to that
    call's float32 gradient rounded once to ``dtype``."""
    b = _default(objective, batch, torch.float32)
    low = [t.to(dtype) for t in b[:3]]
    loss = _bind(policy_loss, objective)
    got = _loss_and_grad(loss, *low, b.mask, mode=mode)
    want = _loss_and_grad(loss, *(t.float() for t in low), b.mask, mode=mode)
    what = f"{_name(objective)}, mode={mode}, {dtype} inputs"
    assert got[0].dtype == torch.float32, f"{what}: loss dtype {got[0].dtype}, want float32"
    assert got[1].dtype == dtype, f"{what}: gradient dtype {got[1].dtype}, want {dtype}"
    _assert_exact(got[0], want[0], f"{what}: loss vs float32 on the rounded inputs")
    _assert_exact(got[1], want[1].to(dtype), f"{what}: gradient vs float32's, rounded")


def check_all_masked(objective: Objective, *, mode: AggregationMode = "token_mean") -> None:
    """An all-masked batch (NaN everywhere) and an empty one give loss 0 and gradient 0."""
    nan = torch.full((3, 4), math.nan)
    empty = torch.zeros(0, 4)
    for logp, mask in ((nan, torch.zeros(3, 4, dtype=torch.bool)), (empty, empty.bool())):
        adv = torch.ones(logp.shape[0])
        loss, grad = _loss_and_grad(_bind(policy_loss, objective), logp, logp, adv, mask, mode=mode)
        what = f"{_name(objective)}, mode={mode}, all masked {list(logp.shape)}"
        assert loss.shape == () and float(loss) == 0.0, f"{what}: loss {loss}, want 0"
        assert grad.shape == logp.shape and not bool(grad.any()), f"{what}: gradient {grad}"


def check_inputs_unchanged(objective: Objective, batch: Batch | None = None) -> None:
    """Forward and backward (with a KL penalty, IS weights, a normaliser tensor and NaN in
    masked positions) leave every input as it was, bit for bit."""
    b = _default(objective, batch, torch.float32)
    mask = b.mask.bool()
    logp = torch.where(mask, b.logp, math.nan).requires_grad_(True)
    inputs = {
        "old_logp": b.old_logp,
        "advantages": b.advantages,
        "mask": b.mask,
        "ref_logp": b.old_logp - 0.1,
        "is_weights": torch.rand_like(b.logp) + 0.5,
        "normalizer": torch.tensor(7.0),
    }
    before = {k: v.clone() for k, v in inputs.items()} | {"logp": logp.detach().clone()}
    loss = policy_loss(
        objective, logp, inputs["old_logp"], inputs["advantages"], inputs["mask"],
        ref_logp=inputs["ref_logp"], kl=KLPenalty(), is_weights=inputs["is_weights"],
        normalizer=inputs["normalizer"],
    )  # fmt: skip
    loss.backward()  # type: ignore[no-untyped-call]
    for name, value in (inputs | {"logp": logp.detach()}).items():
        what = f"{_name(objective)}: {name} after forward and backward"
        _assert_exact(value, before[name], what, signed_zeros=True)


def check_double_backward(
    objective: Objective, batch: Batch | None = None, *, mode: AggregationMode = "token_mean"
) -> None:
    """``torch.autograd.grad(loss, logp, create_graph=True)`` gives a gradient whose own
    derivative (of a weighted ``sum g^2``) equals the reference definition's (both in
    float64, within :data:`F64_RTOL` of each entry plus the largest)."""
    b = _default(objective, batch, torch.float64)
    assert b.logp.dtype == torch.float64, "the double-backward check needs a float64 batch"
    weights = torch.rand(b.logp.shape, generator=torch.Generator().manual_seed(1)).to(b.logp)
    results = []
    for fn in (policy_loss, reference_loss):
        lp = b.logp.detach().clone().requires_grad_(True)
        loss = fn(objective, lp, b.old_logp, b.advantages, b.mask, mode=mode)  # type: ignore[operator]
        (g,) = torch.autograd.grad(loss, lp, create_graph=True)
        if g.requires_grad:
            (h,) = torch.autograd.grad((weights * g * g).sum(), lp, allow_unused=True)
        else:  # constant gradient (no graph): its derivative is 0
            h = None
        results.append((g.detach(), torch.zeros_like(lp) if h is None else h))
    (g_f, h_f), (g_r, h_r) = results
    what = f"{_name(objective)}, mode={mode}"
    _assert_within(g_f, g_r, F64_RTOL * (g_r.abs() + g_r.abs().max()), f"{what}: gradient")
    h_err = F64_RTOL * (h_r.abs() + h_r.abs().max())
    _assert_within(h_f, h_r, h_err, f"{what}: double backward vs the reference's")


def check_constants_refused(objective: Objective) -> None:
    """``old_logp`` or ``advantages`` that require grad raise ``InputError`` naming them."""
    b = make_batch(objective, 2, 3, dtype=torch.float32)
    for name in ("old_logp", "advantages"):
        args = {"old_logp": b.old_logp, "advantages": b.advantages}
        args[name] = args[name].clone().requires_grad_(True)
        lp = b.logp.clone().requires_grad_(True)
        try:
            policy_loss(objective, lp, args["old_logp"], args["advantages"], b.mask)
        except InputError as err:
            assert name in str(err), f"{_name(objective)}: the error does not name {name}: {err}"
        else:
            raise AssertionError(f"{_name(objective)}: {name} requiring grad was accepted")


#: What no numeric option accepts: not a number at all, and NaN.
BAD_NUMBERS: tuple[object, ...] = ("x", math.nan)


def check_fields(objective: Objective) -> None:
    """Every option is validated at construction: a bad value of each field (not a number,
    NaN; a non-bool for a bool field; an unknown option for a string field) raises
    ``InputError`` naming ``Type.field``. Fields are discovered with ``dataclasses.fields``
    and classified by their current value."""
    cls = type(objective)
    for field in dataclasses.fields(objective):
        value = getattr(objective, field.name)
        if isinstance(value, bool):
            bad: tuple[object, ...] = ("yes", 1.5)
        elif isinstance(value, str):
            bad = ("no such option",)
        elif value is None or isinstance(value, (int, float)):
            bad = BAD_NUMBERS
        else:
            continue
        for wrong in bad:
            try:
                dataclasses.replace(objective, **{field.name: wrong})  # type: ignore[arg-type]
            except InputError as err:
                assert field.name in str(err), (
                    f"{cls.__name__}({field.name}={wrong!r}): the error does not name the "
                    f"field: {err}"
                )
            else:
                raise AssertionError(
                    f"{cls.__name__}({field.name}={wrong!r}) was accepted: validate the field "
                    "in __post_init__ (dapo_ops.objectives.base.check_number / check_field)"
                )
