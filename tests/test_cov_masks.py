"""Clip-Cov / KL-Cov token selections, and the KL weights that compose KL-Cov's penalty.

The selections are checked against a float64 evaluation of their definition: a token
whose covariance (or ratio) lies within the float32 evaluation's error bound of a
decision boundary may go either way; every other decision is asserted exactly. The
``kl_weights`` option of :func:`dapo_ops.policy_loss` is checked against the float64
formula ``beta * sum kappa * k`` within a derived bound, for exact identities (all-ones
weights are no weights, bit for bit), its gradient (float64 gradcheck), compile and
micro-batch additivity.
"""

from __future__ import annotations

import math

import pytest
import torch
from _bounds import F64, assert_within, func_rel, gamma, unit_roundoff
from _strategies import make_batch
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d
from dapo_ops.correction.cov_masks import clip_cov_candidates

pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")

F32 = torch.float32


def cov_reference(
    logp: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact covariance ``(A - mean A)(logp - mean logp)`` (means over valid tokens)
    and a bound on its error when evaluated in ``dtype``: each mean is a sum of ``n``
    terms and one division (``gamma(n) + u`` relative to the mean of magnitudes), each
    difference one rounding, the product one more."""
    a = adv.to(F64).expand(valid.shape)
    lp = logp.to(F64)
    n = max(int(valid.sum()), 1)
    a_mean = torch.where(valid, a, 0.0).sum() / n
    lp_mean = torch.where(valid, lp, 0.0).sum() / n
    a_abs = torch.where(valid, a.abs(), 0.0).sum() / n
    lp_abs = torch.where(valid, lp.abs(), 0.0).sum() / n
    rel = gamma(n, dtype) + 2 * unit_roundoff(dtype)
    da, dl = a - a_mean, lp - lp_mean
    err_a = rel * (a.abs() + a_abs)
    err_l = rel * (lp.abs() + lp_abs)
    err = da.abs() * err_l + dl.abs() * err_a + err_a * err_l
    cov = da * dl
    return cov, err + 2 * unit_roundoff(dtype) * (cov.abs() + err)


@st.composite
def cov_batches(draw: st.DrawFn) -> tuple[d.PolicyDiagnostics, float, torch.dtype]:
    batch, seq = draw(st.integers(1, 6)), draw(st.integers(1, 20))
    dtype = draw(st.sampled_from([F32, F64]))
    b = make_batch(batch, seq, draw(st.integers(0, 2**31 - 1)), dtype=dtype, spread=2.0)
    adv = b.advantages[:, None] + 0.3 * torch.randn(batch, seq, dtype=F64).to(dtype)
    b.advantages = (3 * adv).to(dtype)
    return b, draw(st.sampled_from([2e-4, 0.05, 0.3, 1.0])), dtype  # type: ignore[return-value]


@given(cov_batches())
def test_kl_cov_mask_selects_the_largest_covariances(case: tuple) -> None:  # type: ignore[type-arg]
    b, fraction, dtype = case
    got = d.kl_cov_mask(b.logp, b.advantages, b.mask, fraction=fraction)
    n = int(b.mask.sum())
    assert not bool((got & ~b.mask).any())
    assert int(got.sum()) == (max(1, math.floor(fraction * n)) if n else 0)
    cov, err = cov_reference(b.logp, b.advantages, b.mask, dtype)
    chosen, others = got, b.mask & ~got
    if bool(chosen.any()) and bool(others.any()):
        lowest_chosen = float((cov + err)[chosen].min())
        highest_other = float((cov - err)[others].max())
        assert lowest_chosen >= highest_other, "a smaller covariance was selected"


def test_kl_cov_mask_ties_go_to_the_first_token() -> None:
    logp = torch.tensor([[-1.0, -1.0, -3.0], [-1.0, -1.0, -3.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [1.0, 1.0, -1.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # covariances: 2.56 for the (-1, -3) token, 0.16 for the four others (a tie)
    got = d.kl_cov_mask(logp, adv, mask, fraction=0.4)  # k = 2 of 5
    assert got.tolist() == [[True, False, True], [False, False, False]]


@given(cov_batches(), st.integers(0, 2**31 - 1))
def test_clip_cov_mask_draws_from_the_candidates(case: tuple, seed: int) -> None:  # type: ignore[type-arg]
    b, fraction, dtype = case
    old = b.old_logp
    kw = {"objective": d.ClipHigher(eps_low=0.2, eps_high=0.28), "cov_low": 0.2, "cov_high": 3.0}
    got = d.clip_cov_mask(
        b.logp, old, b.advantages, b.mask, fraction=fraction,
        generator=torch.Generator().manual_seed(seed), **kw,
    )  # fmt: skip
    again = d.clip_cov_mask(
        b.logp, old, b.advantages, b.mask, fraction=fraction,
        generator=torch.Generator().manual_seed(seed), **kw,
    )  # fmt: skip
    assert torch.equal(got, again), "a seeded generator must reproduce the draw"
    # the exact candidates, and the tokens within rounding of a decision boundary
    cov, err = cov_reference(b.logp, b.advantages, b.mask, dtype)
    adv = b.advantages.to(F64).expand(b.mask.shape)
    r = (b.logp.to(F64) - old.to(F64)).exp()
    clipped = ((adv > 0) & (r > 1.28)) | ((adv < 0) & (r < 0.8))
    r_err = (func_rel(dtype) + unit_roundoff(dtype) * 30) * r
    near = ((r - 1.28).abs() <= r_err) | ((r - 0.8).abs() <= r_err) | (adv == 0)
    near |= ((cov - 0.2).abs() <= err) | ((cov - 3.0).abs() <= err)
    sure = b.mask & ~clipped & (cov > 0.2) & (cov < 3.0) & ~near
    maybe = sure | (b.mask & near)
    assert not bool((got & ~maybe).any()), "a token outside the candidates was selected"
    n = int(b.mask.sum())
    k = max(1, math.floor(fraction * n)) if n else 0
    assert min(k, int(sure.sum())) <= int(got.sum()) <= min(k, int(maybe.sum()))


def test_clip_cov_mask_draws_uniformly() -> None:
    """Six candidates, two drawn per call: over 1,800 seeded calls each is drawn about
    600 times (binomial sd 20; the bound is 5 sd). Deterministic: one seeded generator."""
    logp = torch.tensor([[-0.5, -0.5, -0.5, -4.0, -4.0, -4.0, -2.25, -2.25]])
    adv = torch.tensor([[2.0, 2.0, 2.0, -2.0, -2.0, -2.0, 0.0, 0.0]])
    mask = torch.ones_like(logp, dtype=torch.bool)
    g = torch.Generator().manual_seed(1234)
    counts = torch.zeros(8)
    for _ in range(1800):
        counts += d.clip_cov_mask(
            logp, logp, adv, mask, fraction=0.25, cov_low=1.0, generator=g
        ).float()[0]
    assert counts[6:].sum() == 0  # covariance 0: never a candidate
    assert bool(((counts[:6] - 600).abs() <= 100).all()), counts


def test_clip_cov_candidates_exclude_clipped_tokens() -> None:
    logp = torch.tensor([[0.0, 0.0, -3.0, -3.0]])
    old = torch.tensor([[-1.0, 0.0, -3.0, -2.0]])  # ratios e, 1, 1, 1/e
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]])
    cand, k = clip_cov_candidates(
        logp, old, adv, torch.ones(1, 4, dtype=torch.bool), eps_low=0.2, eps_high=0.2,
        cov_low=-10.0, cov_high=10.0, fraction=1.0, log_ratio_clamp=20.0,
    )  # fmt: skip
    assert cand.tolist() == [[False, True, True, False]] and int(k) == 4


def test_selections_compile_fullgraph() -> None:
    b = make_batch(4, 12, 3, spread=2.0)
    torch._dynamo.reset()
    kl = torch.compile(d.kl_cov_mask, fullgraph=True, backend="aot_eager")
    assert torch.equal(
        kl(b.logp, b.advantages, b.mask, fraction=0.2),
        d.kl_cov_mask(b.logp, b.advantages, b.mask, fraction=0.2),
    )
    clip = torch.compile(d.clip_cov_mask, fullgraph=True, backend="aot_eager")
    opts = {"fraction": 0.2, "cov_low": 0.0, "cov_high": 50.0}
    torch.manual_seed(0)
    got = clip(b.logp, b.old_logp, b.advantages, b.mask, **opts)
    cand, k = clip_cov_candidates(
        b.logp, b.old_logp, b.advantages, b.mask, eps_low=0.2, eps_high=0.2, cov_low=0.0,
        cov_high=50.0, fraction=0.2, log_ratio_clamp=20.0,
    )  # fmt: skip
    assert not bool((got & ~cand).any())
    assert int(got.sum()) == min(int(k), int(cand.sum()))


def test_a_generator_that_is_not_one_is_refused() -> None:
    b = make_batch(2, 4, 0)
    with pytest.raises(d.InputError, match="generator"):
        d.clip_cov_mask(b.logp, b.old_logp, b.advantages, b.mask, generator=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- kl_weights


def _kl_loss(
    b: object, weights: torch.Tensor | None, objective: d.Objective, **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = b.logp.clone().requires_grad_(True)  # type: ignore[attr-defined]
    loss = d.policy_loss(
        objective, logp, b.old_logp, b.advantages, b.mask,  # type: ignore[attr-defined]
        ref_logp=b.old_logp - 0.3, kl=d.KLPenalty(beta=0.7, estimator="k3"),  # type: ignore[attr-defined]
        kl_weights=weights, **kw,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


@pytest.mark.parametrize("objective", [d.ClipHigher(), d.RatioSurrogate(), d.SAPO()])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum"])
def test_unit_kl_weights_are_no_weights_bitwise(objective: d.Objective, mode: str) -> None:
    b = make_batch(5, 17, 1, spread=1.0)
    ones = torch.ones_like(b.logp)
    for got, want in zip(
        _kl_loss(b, ones, objective, mode=mode),
        _kl_loss(b, None, objective, mode=mode),
        strict=True,
    ):
        assert torch.equal(got, want)


def _exact(b: object, kappa: torch.Tensor, n: float) -> tuple[torch.Tensor, ...]:
    """RatioSurrogate + 0.7 k3 against ``old_logp - 0.3``, weighted by ``kappa``, summed
    and divided by ``n``, in float64: loss, gradient, and the per-token magnitudes
    ``(|A| r + 0.7 kappa (e^-x + |x| + 1)) / n`` that bound each term's rounding."""
    valid = b.mask  # type: ignore[attr-defined]
    lp, old = b.logp.double(), b.old_logp.double()  # type: ignore[attr-defined]
    adv = b.advantages.double()[:, None]  # type: ignore[attr-defined]
    r, x = (lp - old).exp(), lp - (old - 0.3)
    kap = torch.where(valid, kappa.double(), 0.0)
    terms = torch.where(valid, -adv * r + 0.7 * kap * ((-x).exp() - 1 + x), 0.0)
    grad = torch.where(valid, -adv * r + 0.7 * kap * (1 - (-x).exp()), 0.0) / n
    mags = torch.where(valid, adv.abs() * r + 0.7 * kap * ((-x).exp() + x.abs() + 1), 0.0) / n
    return terms.sum() / n, grad, mags


def _bounds(mags: torch.Tensor, n_terms: int) -> tuple[float, torch.Tensor]:
    """Each float32 term: exp (FUNC_ULPS) plus a few roundings, ``f`` relative to its
    magnitude; the sum of ``n_terms`` of them ``gamma``; the float64 reference's own."""
    f = func_rel(F32) + 8 * unit_roundoff(F32)
    sum_rel = gamma(n_terms + 2, F32) + gamma(n_terms + 2, F64)
    return (f + sum_rel) * float(mags.sum()), 2 * f * mags


def test_kl_weights_against_the_float64_formula() -> None:
    b = make_batch(6, 23, 2, spread=1.5)
    g = torch.Generator().manual_seed(0)
    kappa = torch.where(
        torch.rand(b.logp.shape, generator=g) < 0.3, 0.0, 2 * torch.rand(b.logp.shape, generator=g)
    )
    kappa = torch.where(b.mask, kappa, torch.nan)  # masked weights are never read
    loss, grad = _kl_loss(b, kappa, d.RatioSurrogate(), normalizer=1.0)
    exact, grad_exact, mags = _exact(b, kappa, 1.0)
    loss_bound, grad_bound = _bounds(mags, int(b.mask.sum()))
    assert_within(loss, exact, loss_bound, "loss")
    assert_within(grad, grad_exact, grad_bound, "gradient")


def test_kl_weights_gradcheck_float64() -> None:
    b = make_batch(3, 7, 4, dtype=F64, spread=1.0)
    kappa = torch.rand(b.logp.shape, dtype=F64, generator=torch.Generator().manual_seed(1))

    def fn(lp: torch.Tensor) -> torch.Tensor:
        return d.policy_loss(
            d.SAPO(), lp, b.old_logp, b.advantages, b.mask, ref_logp=b.old_logp - 0.2,
            kl=d.KLPenalty(beta=0.5, estimator="k2"), kl_weights=kappa,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (b.logp.clone().requires_grad_(True),))
    assert torch.autograd.gradgradcheck(fn, (b.logp.clone().requires_grad_(True),))


def test_kl_weights_micro_batches_add_up() -> None:
    """With the global normaliser, the micro-batches' losses add up to the full batch's
    float64 value (each part within its own bound; the final addition one rounding)."""
    b = make_batch(6, 11, 5, spread=1.0)
    kappa = torch.rand(b.logp.shape, generator=torch.Generator().manual_seed(2))
    n = float(b.mask.sum())
    exact, _, mags = _exact(b, kappa, n)
    parts, bound = [], 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        part = make_batch(6, 11, 5, spread=1.0)
        for name in ("logp", "old_logp", "advantages", "mask"):
            setattr(part, name, getattr(b, name)[rows])
        parts.append(_kl_loss(part, kappa[rows], d.RatioSurrogate(), normalizer=n)[0])
        bound += _bounds(mags[rows], int(part.mask.sum()))[0]
    total = parts[0] + parts[1]
    assert_within(total, exact, bound + unit_roundoff(F32) * float(total.abs()), "micro-batches")


def test_kl_weights_compiled_match_eager() -> None:
    b = make_batch(4, 9, 6, spread=1.0)
    kappa = torch.rand(b.logp.shape, generator=torch.Generator().manual_seed(3))
    n = float(b.mask.sum())
    exact, grad_exact, mags = _exact(b, kappa, n)
    loss_bound, grad_bound = _bounds(mags, int(n))
    torch._dynamo.reset()
    for name, compiled in (("eager", False), ("compiled", True)):
        loss, grad = _kl_loss(b, kappa, d.RatioSurrogate(), compiled=compiled)
        assert_within(loss, exact, loss_bound, f"{name} loss")
        assert_within(grad, grad_exact, grad_bound, f"{name} gradient")


def test_kl_weights_need_a_kl_penalty() -> None:
    b = make_batch(2, 3, 0)
    with pytest.raises(d.InputError, match="kl_weights"):
        d.policy_loss(
            d.ClipHigher(), b.logp, b.old_logp, b.advantages, b.mask,
            kl_weights=torch.ones_like(b.logp),
        )  # fmt: skip
