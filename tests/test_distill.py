"""On-policy distillation (dapo_ops.engine.distill): TeacherKL, distill_loss, distill_advantages and
``policy_loss(..., teacher_logp=, distill=)``.

Properties: the loss is the documented formula (each estimator written out here, float64),
for one teacher and several; micro-batch losses with ``global_normalizer`` add up to the
full batch's, value and gradient, in every mode; NaN/inf at masked positions change
nothing, bit for bit; float64 gradcheck; ``torch.compile(fullgraph=True)`` traces the loss
and the advantages; the options are validated (InputError naming the field).
verl parity: tests/integration/test_verl_distill.py.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from _strategies import MODES
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d
from dapo_ops import InputError, TeacherKL, distill_advantages, distill_loss

F64 = torch.float64
ESTIMATORS = {
    "k1": lambda x: x,
    "k2": lambda x: 0.5 * x * x,
    "k3": lambda x: torch.exp(-x) + x - 1,
    "abs": lambda x: x.abs(),
}


def make(seed: int, rows: int = 5, seq: int = 7, teachers: int = 0, dtype: Any = F64) -> Any:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, seq + 1, (rows,), generator=g)
    lengths[0] = seq
    mask = torch.arange(seq) < lengths[:, None]
    logp = -3 * torch.rand(rows, seq, generator=g, dtype=F64) - 0.01
    shape = (teachers, rows, seq) if teachers else (rows, seq)
    teacher = (logp + 2 * torch.randn(shape, generator=g, dtype=F64)).clamp(max=-1e-3)
    return logp.to(dtype), teacher.to(dtype), mask


def unit_advantage_loss(logp: Any, old: Any, mask: Any, **options: Any) -> Any:
    """ClipHigher's :func:`policy_loss` with advantage 1 on every row, in ``old``'s dtype."""
    ones = torch.ones(mask.shape[0], dtype=old.dtype)
    return d.policy_loss(d.ClipHigher(), logp, old, ones, mask, **options)


def formula(distill: TeacherKL, logp: Any, teacher: Any, mask: Any) -> Any:
    """Per-token ``D`` written out (float64), 0 at masked positions."""
    s, t = logp.to(F64), teacher.to(F64)
    if distill.logp_min is not None:
        s, t = s.clamp(min=distill.logp_min), t.clamp(min=distill.logp_min)
    delta = s - t
    if distill.log_ratio_clamp is not None:
        delta = delta.clamp(-distill.log_ratio_clamp, distill.log_ratio_clamp)
    value = ESTIMATORS[distill.estimator](delta)
    if distill.clamp is not None:
        value = value.clamp(-distill.clamp, distill.clamp)
    if teacher.ndim == 3:
        n = teacher.shape[0]
        w = torch.tensor(distill.weights or [1.0 / n] * n, dtype=F64)
        value = (value * w[:, None, None]).sum(0)
    return torch.where(mask, value, 0.0)


teacher_kls = st.fixed_dictionaries(  # built in the test (beartype checks the fields)
    dict(
        beta=st.sampled_from([1.0, 0.3]),
        estimator=st.sampled_from(["k2", "k3", "abs"]),
        clamp=st.sampled_from([None, 10.0, 0.5]),
        logp_min=st.sampled_from([None, -2.0]),
        straight_through=st.booleans(),
    )
)


@given(options=teacher_kls, seed=st.integers(0, 2**16), mode=st.sampled_from(MODES))
def test_distill_loss_is_the_formula(options: dict[str, Any], seed: int, mode: str) -> None:
    distill = TeacherKL(**options)
    logp, teacher, mask = make(seed)
    got = distill_loss(logp, teacher, mask, distill=distill, mode=mode)  # type: ignore[arg-type]
    want = distill.beta * d.token_level_aggregate(
        formula(distill, logp, teacher, mask), mask, mode=mode
    )  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("weights", [None, (0.25, 0.5, 0.25)])
def test_several_teachers_are_weighted(weights: Any) -> None:
    logp, teacher, mask = make(3, teachers=3)
    distill = TeacherKL(weights=weights)
    got = distill_loss(logp, teacher, mask, distill=distill)
    want = d.token_level_aggregate(formula(distill, logp, teacher, mask), mask)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    single = [distill_loss(logp, t, mask) for t in teacher]
    w = weights or (1 / 3,) * 3
    torch.testing.assert_close(got, sum(wi * s for wi, s in zip(w, single, strict=True)))


def test_policy_loss_adds_the_term() -> None:
    logp, teacher, mask = make(1)
    old, adv = logp - 0.1, torch.randn(5, dtype=F64)
    distill = TeacherKL(beta=0.5, estimator="k2")
    opts: dict[str, Any] = {"mode": "seq_mean_token_mean"}
    lp = logp.clone().requires_grad_(True)
    got = d.policy_loss(
        d.ClipHigher(), lp, old, adv, mask, teacher_logp=teacher, distill=distill, **opts
    )
    (g_got,) = torch.autograd.grad(got, lp)
    lp2 = logp.clone().requires_grad_(True)
    want = d.policy_loss(d.ClipHigher(), lp2, old, adv, mask, **opts) + distill_loss(
        lp2, teacher, mask, distill=distill, **opts
    )
    (g_want,) = torch.autograd.grad(want, lp2)
    assert torch.equal(got, want) and torch.equal(g_got, g_want)
    loss, _ = d.policy_loss_with_diagnostics(
        d.ClipHigher(), logp, old, adv, mask, teacher_logp=teacher, distill=distill, **opts
    )
    assert torch.equal(loss, want.detach())


@given(seed=st.integers(0, 2**16), mode=st.sampled_from(MODES), cuts=st.sets(st.integers(1, 5)))
def test_micro_batches_add_up_with_global_normalizer(seed: int, mode: str, cuts: set[int]) -> None:
    logp, teacher, mask = make(seed, rows=6)
    old, adv = logp - 0.05, torch.randn(6, dtype=F64)  # log-probs stay <= 0
    distill = TeacherKL(estimator="k3", clamp=0.8)
    kw: dict[str, Any] = {"mode": mode, "max_len": 7, "distill": distill}
    lp = logp.clone().requires_grad_(True)
    full = d.policy_loss(
        d.ClipHigher(), lp, old, adv, mask, teacher_logp=teacher, normalizer="local", **kw
    )
    (g_full,) = torch.autograd.grad(full, lp)
    edges = [0, *sorted(cuts), 6]
    parts = [slice(a, b) for a, b in itertools.pairwise(edges)]
    den = d.global_normalizer([mask[p] for p in parts], mode=mode)  # type: ignore[arg-type]
    lp = logp.clone().requires_grad_(True)
    total = sum(
        d.policy_loss(
            d.ClipHigher(),
            lp[p],
            old[p],
            adv[p],
            mask[p],
            teacher_logp=teacher[p],
            normalizer=den,
            **kw,
        )
        for p in parts
    )
    (g_total,) = torch.autograd.grad(total, lp)  # type: ignore[arg-type]
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_total, g_full, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("teachers", [0, 2])
def test_gradcheck_float64(teachers: int) -> None:
    logp, teacher, mask = make(2, rows=3, seq=4, teachers=teachers)
    for distill in (  # not straight_through: its gradient is k2's by design, not its value's
        TeacherKL(clamp=None),
        TeacherKL(estimator="k2", logp_min=-10.0),
        TeacherKL(estimator="abs", beta=0.3),
    ):
        w = (0.3, 0.7) if teachers else None
        distill = TeacherKL(**{**distill.__dict__, "weights": w})
        for mode in MODES:

            def fn(x: Any, distill: TeacherKL = distill, mode: str = mode) -> Any:
                return distill_loss(x, teacher, mask, distill=distill, mode=mode)  # type: ignore[arg-type]

            assert torch.autograd.gradcheck(fn, (logp.clone().requires_grad_(True),))


def test_advantages_are_minus_beta_d_plus_task() -> None:
    logp, teacher, mask = make(4)
    distill = TeacherKL(beta=0.7, estimator="k1", clamp=None)
    lp = logp.clone().requires_grad_(True)
    a = distill_advantages(lp, teacher, mask, distill=distill)
    assert not a.requires_grad and a.shape == logp.shape
    torch.testing.assert_close(
        a, torch.where(mask, -0.7 * (logp - teacher), 0.0), rtol=1e-14, atol=0
    )
    task = torch.randn(5, dtype=F64)
    both = distill_advantages(logp, teacher, mask, distill=distill, task_advantages=task)
    torch.testing.assert_close(both, torch.where(mask, a + task[:, None], 0.0), rtol=1e-14, atol=0)
    # with ratio 1 the policy gradient of A is the gradient of -beta * D's expectation estimate
    loss = d.policy_loss(d.PolicyGradient(), lp, logp, a, mask, mode="seq_mean_token_sum")
    assert torch.isfinite(loss)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_at_masked_positions_changes_nothing(bad: float) -> None:
    logp, teacher, mask = make(5, teachers=2)
    distill = TeacherKL(estimator="k2", logp_min=-5.0, weights=(1.0, 2.0))

    def run(lp0: Any, t: Any) -> Any:
        lp = lp0.clone().requires_grad_(True)
        loss = unit_advantage_loss(lp, logp, mask, teacher_logp=t, distill=distill)
        (g,) = torch.autograd.grad(loss, lp)
        return loss, g, distill_advantages(lp0, t, mask, distill=distill)

    dirty_lp = torch.where(mask, logp, bad)
    dirty_t = torch.where(mask, teacher, bad)
    for got, want in zip(run(dirty_lp, dirty_t), run(logp, teacher), strict=True):
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compile_fullgraph(monkeypatch: pytest.MonkeyPatch) -> None:
    logp, teacher, mask = make(6, dtype=torch.float32)
    distill = TeacherKL(estimator="k3", weights=None)
    torch._dynamo.reset()

    def step(lp: Any) -> Any:
        loss = unit_advantage_loss(lp, logp, mask, teacher_logp=teacher, distill=distill)
        return loss, distill_advantages(
            lp, teacher, mask, distill=distill, task_advantages=torch.ones(5)
        )

    fn = torch.compile(step, fullgraph=True, backend="aot_eager")
    lp = logp.clone().requires_grad_(True)
    loss, adv = fn(lp)
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = logp.clone().requires_grad_(True)
    want_loss, want_adv = step(lp2)
    (g_want,) = torch.autograd.grad(want_loss, lp2)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(g, g_want)
    torch.testing.assert_close(adv, want_adv)
    # compiled=True: the fused pass compiled, the distillation term beside it
    from dapo_ops.engine import _compiled

    original = _compiled.compiled_body
    monkeypatch.setattr(_compiled, "compiled_body", lambda backend: original("aot_eager"))
    got = unit_advantage_loss(
        logp, logp, mask, teacher_logp=teacher, distill=distill, compiled=True
    )
    torch.testing.assert_close(got, want_loss.detach())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"beta": 0.0}, "beta"),
        ({"beta": math.nan}, "beta"),
        ({"estimator": "k9"}, "estimator"),
        ({"clamp": -1.0}, "clamp"),
        ({"clamp": math.inf}, "clamp"),
        ({"logp_min": 0.5}, "logp_min"),
        ({"logp_min": "-1"}, "logp_min"),
        ({"log_ratio_clamp": None}, "log_ratio_clamp"),  # k3 needs it
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
        ({"straight_through": 1}, "straight_through"),
        ({"weights": [0.5, 0.5]}, "weights"),
        ({"weights": (0.0, 0.0)}, "weights"),
        ({"weights": (math.nan,)}, "weights"),
        ({"weights": ()}, "weights"),
    ],
)
def test_teacher_kl_fields_are_validated(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError, match=field):
        TeacherKL(**kwargs)


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks
def test_bad_calls_are_refused() -> None:
    logp, teacher, mask = make(0, teachers=2)
    with pytest.raises(InputError, match="weights"):
        distill_loss(logp, teacher, mask, distill=TeacherKL(weights=(1.0,)))
    with pytest.raises(InputError, match="k1"):
        distill_loss(logp, teacher[0], mask, distill=TeacherKL(estimator="k1"))
    with pytest.raises(InputError, match="teacher_logp"):
        distill_loss(logp, teacher[:, :, :3], mask)
    with pytest.raises(InputError, match="teacher_logp"):
        unit_advantage_loss(logp, logp, mask, distill=TeacherKL())
    with pytest.raises(InputError, match="distill"):
        unit_advantage_loss(logp, logp, mask, teacher_logp=teacher, distill=d.KLPenalty())
    with pytest.raises(InputError, match="teacher_logp"):
        distill_advantages(logp, teacher.requires_grad_(True), mask)
