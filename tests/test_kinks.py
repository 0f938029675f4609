"""The kink convention (docs/kinks.md): on a bound the gradient passes, on every path.

Every clip, clamp and cap of the loss path acts only *strictly* beyond its bound: a
ratio, log-ratio or estimate exactly on a bound keeps its gradient. Each case below puts
tokens exactly on the kinks of one configuration (a ratio of exactly 1 against a bound
of ``1 +- 0``, a log-ratio of exactly ``+-log_ratio_clamp``, a log-ratio on GMPO's
bound, a KL estimate on its clamp, ...) and a few strictly beyond them, and every path
must give the gradient the convention states, computed here from its formula.

Each path runs twice: as torch computes it, and under :class:`PoisonedTies`, where
clamp, min/max and abs pass 1/4 at a tie (no torch does). torch 2.13 passes 1 on a
clamp bound, torch 2.14 0 or 1/2, so a path that leaned on any torch op's subgradient at
a tie fails here on every torch.

Tolerance: the paths and the expected value each evaluate at most two elementary
functions (exp; SAPO's sigmoid) and fewer than 32 roundings in float64, so they agree
within ``4 func_rel + gamma(32)`` of the value (tests/_bounds.py); exactly 0 where the
convention says 0. A wrong share at a tie (0, 1/4, 1/2) misses by a factor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from _bounds import F64, assert_within, func_rel, gamma
from _ties import PoisonedTies

from dapo_ops import (
    CISPO,
    DPPO,
    DRO,
    GMPO,
    GSPO,
    SAPO,
    TOPR,
    VESPO,
    ClipHigher,
    KLPenalty,
    PolicyGradient,
    RatioSurrogate,
    TeacherKL,
    clip_higher_surrogate,
    difficulty_band_mask,
    distill_loss,
    dynamic_sample_mask,
    high_entropy_mask,
    kl_penalty,
    linear_policy_loss,
    linear_policy_loss_with_diagnostics,
    off_policy_sequence_mask,
    per_token_loss,
    policy_loss,
    rejection_mask,
    token_level_aggregate,
    token_level_loss,
    truncated_is_weights,
)
from dapo_ops.engine._compiled import compiled_body
from dapo_ops.engine._engine import LossInputs, LossSpec, fused_loss, generic_terms, reference_loss
from dapo_ops.engine.policy import prepare
from dapo_ops.objectives import OBJECTIVES, Objective
from dapo_ops.objectives.base import token_inputs

REL = 4 * func_rel(F64) + gamma(32, F64)
OLD = -2.0  # old log-probs; log-probs OLD + d are exact for the dyadic d used below
C = 1.5  # the log-ratio clamp of the cases that put a token on it
E = math.exp
# compiled paths must compile: "compiled=True ran eagerly" is an error here
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@dataclasses.dataclass(frozen=True)
class Kink:
    """Rows of log-ratios ``d`` and advantages on (and beyond) the kinks of ``objective``
    (and of ``kl`` against ``ref_logp = OLD + d - ref_shift``), and ``d loss / d logp``
    per token by the convention (normaliser 1: the loss is the plain sum)."""

    name: str
    objective: Objective
    d: list[list[float]]
    adv: list[list[float]]
    want: list[list[float]]
    kl: KLPenalty | None = None
    ref_shift: list[list[float]] | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        d = torch.tensor(self.d, dtype=F64)
        logp, old = OLD + d, torch.full_like(d, OLD)
        assert torch.equal(logp - old, d)  # the log-ratios are exactly d
        adv = torch.tensor(self.adv, dtype=F64)
        ref = None if self.ref_shift is None else logp - torch.tensor(self.ref_shift, dtype=F64)
        return logp, old, adv, torch.ones_like(d, dtype=torch.bool), ref


def _sapo_slope(tau: float, d: float) -> float:
    r = E(d)
    s = 1 / (1 + E(-tau * (r - 1)))
    return 4 * s * (1 - s) * r


def _kl_cases() -> list[Kink]:
    """k1/k2/k3/abs on the log-ratio clamp (+-C) and on the estimate's clamp; abs at 0.
    The policy term is PolicyGradient with A = 0 (no gradient of its own), or ClipHigher
    with A = 0, whose CPU kernel adds the KL term block by block."""
    slopes: dict[str, Callable[[float], float]] = {
        "k1": lambda d: 1.0,
        "k2": lambda d: d,
        "k3": lambda d: -math.expm1(-d),
        "abs": lambda d: math.copysign(1.0, d) if d else 0.0,
    }
    value = {"k1": lambda d: d, "k2": lambda d: 0.5 * d * d, "abs": abs}
    cases = []
    for est, slope in slopes.items():
        for obj in (PolicyGradient(), ClipHigher()):
            # raw log-ratio on +-C: passes; beyond: 0 (abs at 0: sign 0)
            shifts = [[C], [-C], [2.0], [0.0]]
            want = [[slope(C)], [slope(-C)], [0.0], [slope(0.0)]]
            pen = KLPenalty(beta=1.0, estimator=est, log_ratio_clamp=C)  # type: ignore[arg-type]
            cases.append(
                Kink(
                    f"{est}-log-ratio-{type(obj).__name__}",
                    obj,
                    [[0.0]] * 4,
                    [[0.0]] * 4,
                    want,
                    pen,
                    shifts,
                )
            )
            if est in value:  # the estimate exactly on its clamp (k3's value is not exact)
                cap = value[est](0.25)
                shifts = [[0.25], [-0.25], [0.5]]
                want = [[slope(0.25)], [slope(-0.25)], [0.0]]
                pen = KLPenalty(beta=1.0, estimator=est, clamp=cap)  # type: ignore[arg-type]
                cases.append(
                    Kink(
                        f"{est}-clamp-{type(obj).__name__}",
                        obj,
                        [[0.0]] * 3,
                        [[0.0]] * 3,
                        want,
                        pen,
                        shifts,
                    )
                )
    return cases


CASES = [
    # ratio 1 on 1 + 0 (A > 0) and 1 - 0 (A < 0); +-C on the log-ratio clamp; beyond
    Kink("clip-bounds", ClipHigher(eps_low=0.0, eps_high=0.0, log_ratio_clamp=C),
         [[0.0], [0.0], [C], [-C], [0.25], [-0.25], [2.0], [-2.0]],
         [[1.0], [-2.0], [-1.0], [1.0], [1.0], [-1.0], [-1.0], [1.0]],
         [[-1.0], [2.0], [E(C)], [-E(-C)], [0.0], [0.0], [0.0], [0.0]]),
    # the DAPO defaults, on either side of their bounds
    Kink("dapo-bounds", ClipHigher(),
         [[0.0], [0.25], [-0.5]], [[1.0], [1.0], [-1.0]], [[-1.0], [0.0], [0.0]]),
    Kink("ratio", RatioSurrogate(log_ratio_clamp=C),
         [[C], [-C], [2.0]], [[1.0], [-1.0], [1.0]], [[-E(C)], [E(-C)], [0.0]]),
    Kink("sapo", SAPO(log_ratio_clamp=C), [[C], [-C], [2.0]], [[1.0], [-1.0], [1.0]],
         [[-_sapo_slope(1.0, C)], [_sapo_slope(1.05, -C)], [0.0]]),
    # sequence ratio 1 on 1 +- 0; with verl's clamp, log s exactly on it (A < 0: no clip)
    Kink("gspo", GSPO(eps_low=0.0, eps_high=0.0), [[0.0], [0.0], [0.25], [-0.25]],
         [[1.0], [-1.0], [1.0], [-1.0]], [[-1.0], [1.0], [0.0], [0.0]]),
    Kink("gspo-verl-clamp", GSPO(eps_high=9.0, seq_log_ratio_clamp=C, verl_clamp=True),
         [[C], [2.0]], [[-1.0], [-1.0]], [[E(C)], [0.0]]),
    # GMPO clips the log-ratio itself: +-0.25 on its bounds; a token with A = 0 carries none
    Kink("gmpo", GMPO(eps_low=0.25, eps_high=0.25), [[0.25], [-0.25], [0.5], [-0.5]],
         [[1.0], [-1.0], [1.0], [-1.0]], [[-E(0.25)], [E(-0.25)], [0.0], [0.0]]),
    Kink("gmpo-token-advantages", GMPO(eps_low=0.25, eps_high=0.25), [[0.0, 0.125]],
         [[0.0, 2.0]], [[0.0, -E(0.0625)]]),
    # detached weights: the clamp picks a value, the gradient is -w A either side
    Kink("cispo", CISPO(eps_low=0.0, eps_high=0.0), [[0.0], [0.25], [-0.25]],
         [[1.0], [1.0], [-1.0]], [[-1.0], [-1.0], [1.0]]),
    Kink("topr", TOPR(), [[0.0], [0.25]], [[-1.0], [-1.0]], [[1.0], [1.0]]),
    Kink("dppo-cap", DPPO(is_cap=1.0, delta_high=0.5, delta_low=0.5), [[0.0], [0.25]],
         [[-1.0], [-1.0]], [[1.0], [1.0]]),
    Kink("vespo", VESPO(), [[0.0]], [[1.0]], [[-1.0]]),
    Kink("dro", DRO(), [[0.0], [0.25]], [[1.0], [1.0]], [[-1.0], [-0.75]]),
    Kink("policy-gradient", PolicyGradient(), [[0.0]], [[2.0]], [[-2.0]]),
    *_kl_cases(),
]  # fmt: skip


def _options(case: Kink) -> dict[str, object]:
    return {"kl": case.kl, "ref_logp": case.tensors()[4]}


def _reference(case: Kink, lp: torch.Tensor) -> torch.Tensor:
    _, old, adv, mask, ref = case.tensors()
    inputs = LossInputs(lp, old, adv, mask, ref)
    return reference_loss(LossSpec(case.objective, case.kl), inputs, torch.tensor(1.0, dtype=F64))


def _composed(case: Kink, lp: torch.Tensor) -> torch.Tensor:
    _, old, adv, mask, ref = case.tensors()
    per_token = per_token_loss(case.objective, lp, old, adv, mask)
    if case.kl is not None and ref is not None:
        k = case.kl
        est = kl_penalty(
            lp, ref, mask, estimator=k.estimator, clamp=k.clamp, log_ratio_clamp=k.log_ratio_clamp
        )
        per_token = per_token + k.beta * est
    return token_level_aggregate(per_token, mask, normalizer=1.0)


def _fused(case: Kink, lp: torch.Tensor) -> torch.Tensor:
    _, old, adv, mask, _ = case.tensors()
    return policy_loss(case.objective, lp, old, adv, mask, normalizer=1.0, **_options(case))  # type: ignore[arg-type]


def _compiled(case: Kink, lp: torch.Tensor) -> torch.Tensor:
    _, old, adv, mask, ref = case.tensors()
    spec, tensors, den = prepare(
        case.objective,
        lp,
        old,
        adv,
        mask,
        mode="token_mean",
        normalizer=1.0,
        max_len=None,
        ref_logp=ref,
        kl=case.kl,
        is_weights=None,
        compiled=False,
    )
    return fused_loss(spec, tensors, den, compiled_body("aot_eager"))


PATHS: dict[str, Callable[[Kink, torch.Tensor], torch.Tensor]] = {
    "reference": _reference,
    "composed": _composed,
    "fused": _fused,  # ClipHigher: its CPU kernel (and the KL's, block by block)
    "compiled": _compiled,
}


def _check(case: Kink, got: torch.Tensor, what: str) -> None:
    want = torch.tensor(case.want, dtype=F64)
    assert_within(got, want, REL * want.abs(), f"{case.name}, {what}")


def test_every_objective_has_a_case() -> None:
    assert {type(case.objective) for case in CASES} == set(OBJECTIVES)


# The compiled body runs its forward without autograd and hands its analytic gradient to
# backward: no torch subgradient to poison there, so it runs once, as torch computes it.
RUNS = [(path, poisoned) for path in PATHS for poisoned in (False, True)]
RUNS.remove(("compiled", True))


@pytest.mark.parametrize(
    ("path", "poisoned"), RUNS, ids=[f"{p}-{'poisoned-ties' if q else 'torch'}" for p, q in RUNS]
)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_gradient_on_a_kink_follows_the_convention(
    case: Kink, path: str, poisoned: bool, request: pytest.FixtureRequest
) -> None:
    if path == "compiled":  # dynamo cannot trace the suite's runtime type checker
        request.getfixturevalue("no_runtime_typecheck")
    lp = case.tensors()[0].requires_grad_(True)
    with PoisonedTies() if poisoned else contextlib.nullcontext():
        loss = PATHS[path](case, lp)
        (got,) = torch.autograd.grad(loss, lp)
    _check(case, got, path)


@pytest.mark.parametrize(
    "case", [c for c in CASES if type(c.objective).grad is not Objective.grad], ids=lambda c: c.name
)
def test_generic_body_on_a_kink(case: Kink) -> None:
    """The where-based body every device runs (and ``torch.compile`` traces), as such."""
    logp, old, adv, mask, ref = case.tensors()
    scale = torch.tensor(1.0, dtype=F64)
    spec = LossSpec(case.objective, case.kl)
    _, got = generic_terms(spec, logp, old, adv, mask, scale, ref, None, True)
    assert got is not None
    _check(case, got, "generic_terms")


CLIP_CASES = [c for c in CASES if isinstance(c.objective, ClipHigher) and c.kl is None]


@pytest.mark.parametrize("poisoned", [False, True], ids=["torch", "poisoned-ties"])
@pytest.mark.parametrize("case", CLIP_CASES, ids=lambda c: c.name)
def test_clip_higher_entry_points_on_a_kink(case: Kink, poisoned: bool) -> None:
    """``token_level_loss`` and the composed ``clip_higher_surrogate`` +
    ``token_level_aggregate``, the paths a DAPO user takes."""
    logp, old, adv, mask, _ = case.tensors()
    o = case.objective
    assert isinstance(o, ClipHigher)
    kw = {
        "eps_low": o.eps_low,
        "eps_high": o.eps_high,
        "dual_clip": o.dual_clip,
        "log_ratio_clamp": o.log_ratio_clamp,
    }
    for what in ("token_level_loss", "clip_higher_surrogate"):
        lp = logp.clone().requires_grad_(True)
        with PoisonedTies() if poisoned else contextlib.nullcontext():
            if what == "token_level_loss":
                loss = token_level_loss(lp, old, adv, mask, normalizer=1.0, **kw)  # type: ignore[arg-type]
            else:
                per_token = clip_higher_surrogate(lp, old, adv, mask, **kw)  # type: ignore[arg-type]
                loss = token_level_aggregate(per_token, mask, normalizer=1.0)
            (got,) = torch.autograd.grad(loss, lp)
        _check(case, got, what)


@pytest.mark.slow
@pytest.mark.usefixtures("no_runtime_typecheck")
def test_inductor_on_a_kink() -> None:
    """``compiled=True`` (inductor: exp and the selections in its own generated code)."""
    case = CLIP_CASES[0]
    logp, old, adv, mask, _ = case.tensors()
    lp = logp.clone().requires_grad_(True)
    loss = policy_loss(case.objective, lp, old, adv, mask, normalizer=1.0, compiled=True)
    (got,) = torch.autograd.grad(loss, lp)
    _check(case, got, "compiled=True")


@pytest.mark.parametrize("poisoned", [False, True], ids=["torch", "poisoned-ties"])
@pytest.mark.usefixtures("no_runtime_typecheck")
def test_dual_clip_bound(poisoned: bool) -> None:
    """A ratio exactly on the dual-clip bound ``c`` (A < 0) keeps ``-A r``; past it, 0. The
    bound is the ratio the library computes (``exp`` of a whole row), so the tie is exact."""
    d = torch.tensor([[1.25, 1.25, 1.5]], dtype=F64)
    logp, old = OLD + d, torch.full_like(d, OLD)
    ratio = torch.exp(logp - old)
    objective = ClipHigher(dual_clip=float(ratio[0, 0]))
    adv = torch.full_like(d, -1.0)
    want = torch.tensor([[float(ratio[0, 0])] * 2 + [0.0]], dtype=F64)
    for name, path in (("reference", _reference), ("fused", _fused), ("compiled", _compiled)):
        case = Kink("dual", objective, d.tolist(), adv.tolist(), want.tolist())
        lp = logp.clone().requires_grad_(True)
        with PoisonedTies() if poisoned else contextlib.nullcontext():
            (got,) = torch.autograd.grad(path(case, lp), lp)
        _check(case, got, name)


@pytest.mark.parametrize("poisoned", [False, True], ids=["torch", "poisoned-ties"])
def test_linear_policy_loss_on_a_kink(poisoned: bool) -> None:
    """From hidden states: ratio 1 on the bounds 1 +- 0 (old = the log-probs the loss
    forms itself) and a log-ratio exactly on the clamp pass ``d loss / d logp`` by the
    convention to ``grad_hidden = G W``, checked against autograd through a plain
    ``log_softmax`` fed that ``d loss / d logp``. Bound: both sides form the softmax (one
    exp each, ``2 func_rel``) and sums over the vocabulary and the hidden size
    (``gamma(V + D)``) of terms at most ``|g| (|W_y| + sum_v p_v |W_v|)``."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 1, 8, generator=g, dtype=F64)
    weight = torch.randn(16, 8, generator=g, dtype=F64)
    tokens, mask = torch.tensor([[1], [5], [9]]), torch.ones(3, 1, dtype=torch.bool)
    adv = torch.tensor([[1.0], [-2.0], [-1.0]], dtype=F64)
    _, seen = linear_policy_loss_with_diagnostics(
        hidden, weight, tokens, torch.full((3, 1), -1.0, dtype=F64), adv, mask
    )
    logp = seen.logp
    old = logp - torch.tensor([[0.0], [0.0], [C]], dtype=F64)
    d = logp - old  # as the engine forms it: row 2's is the clamp's bound
    objective = ClipHigher(eps_low=0.0, eps_high=0.0, log_ratio_clamp=float(d[2, 0]))
    want_logp = torch.cat([-adv[:2], -adv[2:] * d[2:].exp()])
    h = hidden.clone().requires_grad_(True)
    with PoisonedTies() if poisoned else contextlib.nullcontext():
        loss = linear_policy_loss(
            h, weight, tokens, old, adv, mask, objective=objective, normalizer=1.0
        )
        (got,) = torch.autograd.grad(loss, h)
    h2 = hidden.clone().requires_grad_(True)
    lp_all = torch.log_softmax(h2 @ weight.T, dim=-1)
    (want,) = torch.autograd.grad(
        lp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), h2, want_logp
    )
    p = lp_all.detach().exp()
    scale = weight.abs()[tokens] + p @ weight.abs()
    bound = (2 * func_rel(F64) + gamma(16 + 8, F64)) * want_logp.abs().unsqueeze(-1) * scale
    assert_within(got, want, bound, "linear_policy_loss")


def _masks_at_their_thresholds() -> dict[str, tuple[torch.Tensor, list[bool]]]:
    """Each threshold mask on inputs exactly at its threshold (and one either side), and
    the side docs/kinks.md states for the tie."""
    one = torch.ones(1, 3, dtype=torch.bool)
    lp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    d = torch.tensor([[0.25, 0.5, 0.125]], dtype=F64)
    w = truncated_is_weights(
        lp, lp - torch.tensor([[0.0, 0.25, -0.25]], dtype=F64), one, cap=1.0, lower=1.0
    )
    x = token_inputs(
        ClipHigher(eps_low=0.0, eps_high=0.0),
        lp,
        lp,
        torch.tensor([[1.0, -1.0, 1.0]], dtype=F64),
        one,
        F64,
        reference=False,
    )
    clipped = ClipHigher(eps_low=0.0, eps_high=0.0).clipped(x)
    p, q = (lp - d).exp(), lp.exp()
    dppo = DPPO(delta_low=float((q - p)[0, 0]), delta_high=0.5)
    x = token_inputs(
        dppo, lp - d, lp, torch.full((1, 3), -1.0, dtype=F64), one, F64, reference=False
    )
    acc = torch.tensor([[0.0, 0.5], [0.25, 0.25], [0.0, 1.0]], dtype=F64)
    band = torch.tensor([[0.0, 0.5], [0.75, 0.75], [0.5, 0.5]], dtype=F64)
    return {
        # kept on the bound: rho = 1 = lower = cap; the others out of [1, 1]
        "truncated_is_weights(lower=, cap=)": (w != 0, [True, False, False]),
        # k2 = delta^2 / 2 exactly on upper = 0.25^2 / 2
        "rejection_mask(statistic='k2')": (
            rejection_mask(lp, lp - d, one, statistic="k2", upper=0.03125),
            [True, False, True],
        ),
        # k1: log ratio 0 on log(lower) = log(upper) = 0
        "rejection_mask(statistic='k1')": (
            rejection_mask(
                lp,
                lp - torch.tensor([[0.0, 0.25, -0.25]], dtype=F64),
                one,
                statistic="k1",
                upper=1.0,
                lower=1.0,
            ),
            [True, False, False],
        ),
        "high_entropy_mask (equal entropies)": (
            high_entropy_mask(torch.ones(1, 3, dtype=F64), one, top_quantile=0.25),
            [True, True, True],
        ),
        # mean drift 0.25 on the threshold 0.25 (A < 0): kept
        "off_policy_sequence_mask": (
            off_policy_sequence_mask(
                torch.tensor([-1.0], dtype=F64), lp, lp + 0.25, one, threshold=0.25
            ),
            [True, True, True],
        ),
        "DPPO.inside (TV on delta_low)": (dppo.inside(x), [True, False, True]),
        # ratio 1 on 1 +- 0: not counted as clipped
        "ClipHigher.clipped": (clipped.low | clipped.high, [False, False, False]),
        # spread 0.5 on atol 0.5: no spread, dropped; 0.0; 1.0 > 0.5: kept
        "dynamic_sample_mask(atol=0.5)": (dynamic_sample_mask(acc, atol=0.5), [False, False, True]),
        # means 0.25 (on low), 0.75 (on high), 0.5: the band is open
        "difficulty_band_mask(low=0.25, high=0.75)": (
            difficulty_band_mask(band, low=0.25, high=0.75),
            [False, False, True],
        ),
    }


def test_threshold_masks_at_their_thresholds() -> None:
    for name, (got, want) in _masks_at_their_thresholds().items():
        assert got.reshape(-1).tolist() == want, name


@pytest.mark.parametrize("poisoned", [False, True], ids=["torch", "poisoned-ties"])
def test_teacher_kl_on_a_kink(poisoned: bool) -> None:
    """On-policy distillation's per-token KL (k2: gradient ``delta`` where no clamp acts
    beyond its bound): the student on ``logp_min``, the estimate on ``clamp``, the
    log-ratio on ``log_ratio_clamp``; and one of each strictly beyond (gradient 0)."""
    student = torch.tensor([[-3.0, -3.5, -2.0, -1.5, -0.5, -0.25]], dtype=F64)
    teacher = torch.tensor([[-2.75, -2.75, -2.25, -2.0, -2.0, -2.0]], dtype=F64)
    mask = torch.ones_like(student, dtype=torch.bool)
    configs = [  # (distill, the columns it covers, their gradients)
        (TeacherKL(estimator="k2", clamp=None, logp_min=-3.0), [0, 1], [-0.25, 0.0]),
        (TeacherKL(estimator="k2", clamp=0.03125), [2, 3], [0.25, 0.0]),
        (TeacherKL(estimator="k2", clamp=None, log_ratio_clamp=C), [4, 5], [C, 0.0]),
    ]
    for distill, cols, want in configs:
        lp = student[:, cols].clone().requires_grad_(True)
        with PoisonedTies() if poisoned else contextlib.nullcontext():
            loss = distill_loss(
                lp, teacher[:, cols], mask[:, cols], distill=distill, normalizer=1.0
            )
            (got,) = torch.autograd.grad(loss, lp)
        assert got.tolist() == [want], distill
