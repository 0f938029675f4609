"""Conformance suite: every objective the library exports, and two written here as user code.

The objectives are discovered from ``dapo_ops.objectives.OBJECTIVES``: each class runs at
its defaults and as one non-default value (:data:`VARIANTS`; a class missing there runs
with ``log_ratio_clamp=5``), so a new objective is tested by these tests as soon as it is
listed. Two objectives defined below in user code (:class:`ClippedReinforce`, ``term``
only; :class:`PenalisedRatio`, ``term`` and ``grad``) show that one written outside the
library gets every property from the engine. Each property is a check of
:mod:`dapo_ops.testing`, the module users run on their own objectives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import dapo_ops
from dapo_ops import testing
from dapo_ops.objectives import (
    CISPO,
    DPPO,
    DRO,
    GMPO,
    GSPO,
    OBJECTIVES,
    SAPO,
    TOPR,
    VESPO,
    ClipHigher,
    Objective,
    PolicyGradient,
    TokenInputs,
)
from dapo_ops.objectives.base import check_field, check_number

# slow: every objective through every conformance check (README's fast subset, -m "not slow and not distributed", leaves it out)
pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------- user objectives
@dataclasses.dataclass(frozen=True)
class ClippedReinforce(Objective):
    """User code, ``term`` only: REINFORCE through an importance ratio capped from above,
    ``-A min(r, cap)`` (autograd differentiates it; no fused path)."""

    cap: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        cap = check_number(self, "cap")
        check_field(self, "cap", 1.0 <= cap < math.inf, "must be finite and >= 1")

    def term(self, x: TokenInputs) -> Tensor:
        return -x.adv * torch.clamp(x.ratio, max=self.cap)


@dataclasses.dataclass(frozen=True)
class PenalisedRatio(Objective):
    """User code, ``term`` and ``grad``: the unclipped ratio objective with DRO's quadratic
    log-ratio penalty, ``-A r + beta/2 (log r)^2``, on the fused path."""

    beta: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        beta = check_number(self, "beta")
        check_field(self, "beta", 0.0 <= beta < math.inf, "must be finite and >= 0")

    def term(self, x: TokenInputs) -> Tensor:
        return -x.adv * x.ratio + (0.5 * self.beta) * x.log_ratio.square()

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        # d r / d logp = r where the log-ratio clamp does not act (clamp's autograd passes
        # the gradient on its bounds too), 0 where it does
        ratio_slope = torch.where(x.clamped == x.log_ratio, -x.adv * x.ratio, 0.0)
        return weight * (ratio_slope + self.beta * x.log_ratio)


# --------------------------------------------------------------------------- the objectives

#: One non-default value per shipped class (its other documented configuration).
VARIANTS: dict[type[Objective], Objective] = {
    ClipHigher: ClipHigher(eps_high=0.2, dual_clip=3.0),
    GSPO: GSPO(verl_clamp=True),
    CISPO: CISPO(eps_low=0.5, eps_high=0.1),
    SAPO: SAPO(tau_pos=2.0, tau_neg=0.5),
    DPPO: DPPO(divergence="kl", delta_low=0.1, delta_high=0.3),
    GMPO: GMPO(eps_low=0.2, eps_high=0.3),
    DRO: DRO(beta=0.3),
    PolicyGradient: PolicyGradient(log_ratio_clamp=5.0),
    VESPO: VESPO(k_pos=1.5, lambda_pos=2.0, k_neg=2.5, lambda_neg=1.5),
    TOPR: TOPR(pos_coef=0.5, neg_coef=2.0),
}

#: Objectives that detach part of their value on purpose (``-sg[w] A log pi``): the value
#: is not the integral of the gradient, so gradcheck of the value cannot apply. Their
#: gradient is compared with autograd's of the reference definition instead.
STOP_GRADIENT: tuple[type[Objective], ...] = (CISPO, DPPO, VESPO, TOPR)


def _shipped() -> Iterator[Any]:
    for cls in OBJECTIVES:
        default = cls()
        yield pytest.param(default, id=f"{cls.__name__}-default")
        yield pytest.param(VARIANTS.get(cls, default.replace(log_ratio_clamp=5.0)),
                           id=f"{cls.__name__}-variant")  # fmt: skip


USER = [
    pytest.param(ClippedReinforce(), id="user-ClippedReinforce"),
    pytest.param(PenalisedRatio(beta=0.3), id="user-PenalisedRatio"),
]
ALL = [*_shipped(), *USER]
#: One value per class for the slow (inductor) check.
ONE_PER_CLASS = [pytest.param(cls(), id=cls.__name__) for cls in OBJECTIVES] + USER

MODES = list(testing.MODES)


def stop_gradient(objective: Objective) -> bool:
    return isinstance(objective, STOP_GRADIENT)


@st.composite
def batches(draw: st.DrawFn, objective: Objective, dtypes: tuple[torch.dtype, ...]) -> Any:
    """A ragged batch (the first row full, the last empty when batch > 1): any size,
    log-ratio spread (30: the +-20 clamp acts), dtype, per-token advantages for token-level
    objectives, and some advantages exactly 0."""
    b = testing.make_batch(
        objective,
        draw(st.integers(1, 6)),
        draw(st.integers(1, 16)),
        seed=draw(st.integers(0, 2**31 - 1)),
        dtype=draw(st.sampled_from(dtypes)),
        spread=draw(st.sampled_from([0.01, 0.3, 2.0, 30.0])),
        per_token_advantages=draw(st.booleans()),
    )
    if draw(st.booleans()):
        zero = torch.rand(b.advantages.shape, generator=torch.Generator().manual_seed(3)) < 0.3
        b = b._replace(advantages=torch.where(zero, 0.0, b.advantages))
    return b


# --------------------------------------------------------------------------- discovery


def test_every_objective_is_exported_and_listed() -> None:
    """``OBJECTIVES`` holds every objective class of the library, each a top-level name."""
    for cls in OBJECTIVES:
        assert getattr(dapo_ops, cls.__name__) is cls, cls
        assert cls.__name__ in dapo_ops.__all__, cls
    defined: set[type[Objective]] = set()
    todo = list(Objective.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("dapo_ops."):
            defined.add(cls)
    assert defined == set(OBJECTIVES), f"not in OBJECTIVES: {defined - set(OBJECTIVES)}"


@pytest.mark.parametrize("cls", [*OBJECTIVES, ClippedReinforce, PenalisedRatio])
def test_fields_are_validated(cls: type[Objective]) -> None:
    """A bad value of each field (``dataclasses.fields``) raises ``InputError`` naming it."""
    for objective in (cls(), VARIANTS.get(cls, cls())):
        testing.check_fields(objective)


@pytest.mark.parametrize("cls", OBJECTIVES)
def test_numeric_fields_refuse_infinity(cls: type[Objective]) -> None:
    """No shipped option is meaningful at +-inf: every numeric field refuses both."""
    for field in dataclasses.fields(cls):
        value = getattr(cls(), field.name)
        if isinstance(value, bool) or not (value is None or isinstance(value, float)):
            continue
        for wrong in (math.inf, -math.inf):
            with pytest.raises(dapo_ops.InputError, match=field.name):
                cls(**{field.name: wrong})


# --------------------------------------------------------------------------- the properties


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ALL)
def test_gradcheck_float64(objective: Objective, mode: str) -> None:
    # gradcheck compares the analytical gradient with a finite difference of the loss
    # *value*. CISPO, DPPO and VESPO detach part of their value on purpose (the value
    # holds -sg[w] A log pi: not an objective estimate, only its gradient is), so for
    # them the gradient is checked against autograd's gradient of the reference
    # definition (term under autograd) in float64 instead (stop_gradient=True).
    testing.check_gradcheck(objective, mode=mode, stop_gradient=stop_gradient(objective))


@pytest.mark.parametrize("objective", ALL)
@given(data=st.data())
def test_fused_gradient_equals_autograd_of_the_reference(objective: Objective, data: Any) -> None:
    b = data.draw(batches(objective, (torch.float64, torch.float32)))
    testing.check_fused_gradient(objective, b, mode=data.draw(st.sampled_from(MODES)))


@pytest.mark.parametrize("objective", [p for p in ALL if isinstance(p.values[0], ClipHigher)])
@given(data=st.data())
def test_clip_higher_fused_gradient_is_bitwise_autograd(objective: Objective, data: Any) -> None:
    """float32, token_mean, plain backward: the same roundings in the same order."""
    b = data.draw(batches(objective, (torch.float32,)))
    testing.check_fused_gradient(objective, b, mode="token_mean", bitwise=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ALL)
def test_kl_penalty_and_is_weights(objective: Objective, mode: str) -> None:
    testing.check_fused_gradient(objective, mode=mode, kl_and_is_weights=True)


@pytest.mark.parametrize("objective", ALL)
@given(data=st.data())
def test_masked_garbage_changes_nothing(objective: Objective, data: Any) -> None:
    """NaN or +-inf at masked positions of any of logp, old_logp and the advantages (the
    empty rows' advantage when per sequence): the same loss and gradient, exactly."""
    b = data.draw(batches(objective, (torch.float32, torch.float64, torch.bfloat16)))
    names = ("logp", "old_logp", "advantages")
    where = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    testing.check_masked_garbage(
        objective,
        b,
        mode=data.draw(st.sampled_from(MODES)),
        junk=data.draw(st.sampled_from([math.nan, math.inf, -math.inf])),
        where=tuple(where),
    )


@pytest.mark.parametrize("objective", ALL)
def test_gradient_zeros_keep_their_sign(objective: Objective) -> None:
    """The strictest reading of "bitwise": the sign of a zero counts too. Every zero of
    the gradient has the sign of the reference's zero (autograd: +0.0), and inf in masked
    positions changes no bit. The batch has advantages > 0 (so -A < 0) with clipped
    tokens (spread 0.5), and an empty last row whose advantage is < 0."""
    b = testing.make_batch(objective, 4, 8, seed=5, dtype=torch.float32, spread=0.5)
    b = b._replace(advantages=b.advantages.abs() * torch.tensor([1.0, 1.0, 1.0, -1.0]))
    grads = []
    for loss in (dapo_ops.policy_loss, testing.reference_loss):
        logp = b.logp.clone().requires_grad_(True)
        loss(objective, logp, b.old_logp, b.advantages, b.mask).backward()
        assert logp.grad is not None
        grads.append(logp.grad)
    fused, ref = grads
    zero = (fused == 0) | (ref == 0)
    assert torch.equal(fused[zero].signbit(), ref[zero].signbit()), (fused, ref)
    testing.check_masked_garbage(objective, b, junk=math.inf, signed_zeros=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ALL)
def test_micro_batches_add_up_with_the_global_normalizer(objective: Objective, mode: str) -> None:
    testing.check_micro_batches(objective, mode=mode)
    b32 = testing.make_batch(objective, 7, 12, seed=4, dtype=torch.float32)
    testing.check_micro_batches(objective, b32, mode=mode, sizes=(3, 1))


#: One mode per value (a trace takes about half a second): the per-row weights of
#: seq_mean_token_mean and the 0-dim weight of token_mean, alternately.
COMPILE_CASES = [
    pytest.param(*p.values, ("seq_mean_token_mean", "token_mean")[i % 2], id=p.id)
    for i, p in enumerate(ALL)
]


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize(("objective", "mode"), COMPILE_CASES)
def test_torch_compile_fullgraph_equals_eager(objective: Objective, mode: str) -> None:
    """aot_eager traces forward and backward as inductor does, without code generation."""
    testing.check_compile(objective, mode=mode, backend="aot_eager")


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize("objective", ONE_PER_CLASS)
def test_compiled_option_with_inductor_equals_eager(objective: Objective) -> None:
    b = testing.make_batch(objective, 6, 20, seed=9, dtype=torch.float32)
    testing.check_compile(objective, b, mode="seq_mean_token_mean", compiled_option=True)


@dataclasses.dataclass(frozen=True)
class HostConstant(Objective):
    """A user objective whose term makes a tensor constant from a Python number (the
    common ``x.adv.new_tensor(c)``): an exported graph lifts it to an input of its own."""

    def term(self, x: TokenInputs) -> Tensor:
        return -x.adv * x.ratio * x.adv.new_tensor(0.5)

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        dr = torch.where(x.clamped == x.log_ratio, x.ratio, 0.0)
        return weight * -x.adv * dr * x.adv.new_tensor(0.5)


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize(
    "objective", [*ONE_PER_CLASS, pytest.param(HostConstant(), id="user-HostConstant")]
)
def test_compiled_policy_loss_with_inductor(objective: Objective) -> None:
    """CompiledPolicyLoss (torch.export + inductor) on every objective, KL and IS weights
    too (SAPO and VESPO once failed here: their constants were lifted graph inputs)."""
    testing.check_compiled_policy_loss(objective, mode="seq_mean_token_mean")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("objective", ALL)
def test_low_precision_inputs_compute_in_float32(objective: Objective, dtype: torch.dtype) -> None:
    for mode in ("token_mean", "seq_mean_token_mean"):
        testing.check_low_precision(objective, dtype=dtype, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ALL)
def test_all_masked_gives_zero(objective: Objective, mode: str) -> None:
    testing.check_all_masked(objective, mode=mode)


@pytest.mark.parametrize("objective", ALL)
def test_inputs_never_modified(objective: Objective) -> None:
    testing.check_inputs_unchanged(objective)
    per_token = testing.make_batch(
        objective, seed=2, dtype=torch.float32, per_token_advantages=True
    )
    testing.check_inputs_unchanged(objective, per_token)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ALL)
def test_double_backward_differentiates_the_definition(objective: Objective, mode: str) -> None:
    testing.check_double_backward(objective, mode=mode)


@pytest.mark.parametrize("objective", ALL)
def test_constants_requiring_grad_are_refused(objective: Objective) -> None:
    testing.check_constants_refused(objective)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("objective", ALL)
def test_linear_policy_loss_equals_the_composition(objective: Objective, mode: str) -> None:
    """The entry point from hidden states (dapo_ops.linear_policy_loss): loss and
    gradients w.r.t. hidden, weight and bias as the composition's, one chunk and chunks
    of 3 tokens, with KL, IS weights and an entropy bonus."""
    testing.check_linear_loss(objective, mode=mode)


# --------------------------------------------------------------------------- the checks bite


@dataclasses.dataclass(frozen=True)
class _WrongGrad(PenalisedRatio):
    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return 2.0 * super().grad(x, weight)


@dataclasses.dataclass(frozen=True)
class _UnmaskedRowSum(Objective):
    """A sequence objective that forgets to mask its row reduction."""

    level = "sequence"

    def _weight(self, x: TokenInputs) -> Tensor:
        return x.clamped.sum(dim=-1, keepdim=True).exp().detach()  # masked() forgotten

    def term(self, x: TokenInputs) -> Tensor:
        return -x.adv * self._weight(x) * x.logp

    def grad(self, x: TokenInputs, weight: Tensor) -> Tensor:
        return weight * -x.adv * self._weight(x)


@dataclasses.dataclass(frozen=True)
class _Unvalidated(Objective):
    scale: float = 1.0

    def term(self, x: TokenInputs) -> Tensor:
        return -self.scale * x.adv * x.ratio


def test_check_objective_passes_a_user_objective() -> None:
    testing.check_objective(PenalisedRatio(), with_compile=False)
    testing.check_objective(ClippedReinforce(cap=3.0), with_compile=False)


@pytest.mark.parametrize(
    ("objective", "check", "message"),
    [
        (_WrongGrad(), "fused_gradient", "gradient vs the float64 reference"),
        (_WrongGrad(), "gradcheck", "not the derivative of the loss value"),
        (CISPO(), "gradcheck", "stop_gradient=True"),
        (_UnmaskedRowSum(), "masked_garbage", "in masked"),
        (_Unvalidated(), "fields", "scale='x'"),
    ],
)
def test_the_checks_catch_broken_objectives(objective: Objective, check: str, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        testing.CHECKS[check](objective)


def test_check_objective_refuses_a_non_objective(checker: str) -> None:
    with pytest.raises(ValueError, match="Objective"):
        testing.check_objective(ClipHigher)


@given(
    st.integers(0, 2**16),
    st.sampled_from(MODES),
    st.booleans(),
    st.sampled_from([None, 3.0]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_token_level_loss_is_policy_loss_of_clip_higher_bitwise(
    seed: int, mode: str, kl_is: bool, dual_clip: float | None, dtype: torch.dtype
) -> None:
    """The mission's entry point is exactly ``policy_loss(ClipHigher(...))``: the same
    bits of loss and gradient, with and without KL and IS weights."""
    objective = ClipHigher(eps_low=0.2, eps_high=0.28, dual_clip=dual_clip)
    b = testing.make_batch(objective, 3, 7, seed=seed, dtype=dtype)
    ref = b.old_logp - 0.05
    w = torch.rand(b.logp.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    extra: dict[str, Any] = {"ref_logp": ref, "is_weights": w} if kl_is else {}
    kl = dapo_ops.KLPenalty(beta=0.04) if kl_is else None
    results = []
    for call in ("token_level_loss", "policy_loss"):
        logp = b.logp.clone().requires_grad_(True)
        if call == "token_level_loss":
            loss = dapo_ops.token_level_loss(
                logp, b.old_logp, b.advantages, b.mask, mode=mode,  # type: ignore[arg-type]
                dual_clip=dual_clip, kl_beta=0.04 if kl_is else 0.0, max_len=7, **extra,
            )  # fmt: skip
        else:
            loss = dapo_ops.policy_loss(
                objective, logp, b.old_logp, b.advantages, b.mask, mode=mode,  # type: ignore[arg-type]
                kl=kl, max_len=7, **extra,
            )  # fmt: skip
        loss.backward()
        assert logp.grad is not None
        results.append((loss.detach(), logp.grad))
    (l1, g1), (l2, g2) = results
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert torch.equal(g1.signbit(), g2.signbit())
