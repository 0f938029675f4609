"""Clip-Higher surrogate: formula, band, exact-zero gradients where the clip is active."""

from __future__ import annotations

import pytest
import torch
from _bounds import F64, assert_within, func_rel, unit_roundoff
from _strategies import PolicyBatch, make_batch, policy_batches
from hypothesis import given
from hypothesis import strategies as st

from dapo_ops import clip_higher_surrogate


def reference(
    b: PolicyBatch, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> torch.Tensor:
    """The paper's formula, written independently in float64."""
    r = torch.exp(b.logp.double() - b.old_logp.double())
    a = b.advantages.double()[:, None].expand_as(r)
    loss = -torch.min(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
    if dual_clip is not None:
        loss = torch.where(a < 0, torch.min(loss, -dual_clip * a), loss)
    return torch.where(b.mask, loss, 0.0)


def bound(b: PolicyBatch, eps_high: float = 0.28, dual_clip: float | None = None) -> torch.Tensor:
    """Per-token bound on a float32 evaluation's distance to :func:`reference`: ``d =
    logp - old`` rounds by ``u |d|``, ``exp`` adds ``f``, the clamp is exact, the product
    with ``A`` and the negation round once; min/max of two such values keep the bound
    (float64's own terms added). Magnitude: ``|A| max(r, 1 + eps_high, dual_clip)``."""
    d = (b.logp.double() - b.old_logp.double()).abs()
    r = d.exp()
    top = max(1 + eps_high, dual_clip or 0.0)
    mag = b.advantages.double().abs()[:, None] * torch.maximum(r, torch.tensor(top, dtype=F64))
    rel = sum(func_rel(dt) + unit_roundoff(dt) * (d + 3) for dt in (torch.float32, F64))
    return torch.where(b.mask, rel * mag, 0.0)


@given(policy_batches(), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_matches_formula(b: PolicyBatch, eps_low: float, eps_high: float) -> None:
    got = clip_higher_surrogate(
        b.logp, b.old_logp, b.advantages, b.mask, eps_low=eps_low, eps_high=eps_high
    )
    assert got.dtype == torch.float32
    assert_within(got, reference(b, eps_low, eps_high), bound(b, eps_high), "surrogate")


@given(policy_batches(), st.floats(1.5, 10.0))
def test_dual_clip_matches_formula(b: PolicyBatch, c: float) -> None:
    got = clip_higher_surrogate(b.logp, b.old_logp, b.advantages, b.mask, dual_clip=c)
    assert_within(got, reference(b, 0.2, 0.28, c), bound(b, 0.28, c), "dual-clip surrogate")
    # the dual bound caps the loss of negative-advantage tokens at c * |A| (computed in
    # float32: c * |A| rounds once, so the cap holds up to 2 u relative)
    cap = c * b.advantages.abs()[:, None].expand_as(got)
    neg = b.mask & (b.advantages[:, None] < 0)
    assert bool((got[neg] <= cap[neg] * (1 + 2 * unit_roundoff(torch.float32))).all())


@given(policy_batches(max_batch=4, max_seq=12))
def test_equals_plain_policy_gradient_inside_band(b: PolicyBatch) -> None:
    # squeeze the ratio into the band: then the surrogate is -r * A exactly
    logp = b.old_logp + (b.logp - b.old_logp).clamp(-0.15, 0.2)
    got = clip_higher_surrogate(logp, b.old_logp, b.advantages, b.mask)
    inside = PolicyBatch(logp, b.old_logp, b.advantages, b.mask)
    plain = -torch.exp(logp.double() - b.old_logp.double()) * b.advantages.double()[:, None]
    assert_within(got, torch.where(b.mask, plain, 0.0), bound(inside), "inside the band")


@given(policy_batches(), st.sampled_from([None, 3.0]))
def test_gradient_zero_exactly_where_clip_active(b: PolicyBatch, dual_clip: float | None) -> None:
    logp = b.logp.clone().requires_grad_(True)
    clip_higher_surrogate(
        logp, b.old_logp, b.advantages, b.mask, dual_clip=dual_clip
    ).sum().backward()
    assert logp.grad is not None
    # the exact ratio (float64, same inputs); the float32 one the loss decides with is
    # within r_rel = f + u (|d| + 1) of it (d = logp - old rounds by u |d|, exp adds f;
    # float64's own terms added), and each bound rounds to float32 by u: where the exact
    # ratio lies that close to a bound, the decision may go either way, so skip it
    dd = b.logp.double() - b.old_logp.double()
    r = dd.exp()
    a = b.advantages.double()[:, None].expand_as(r)
    active = ((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8))
    if dual_clip is not None:
        active |= (a < 0) & (r > dual_clip)
    r_rel = sum(func_rel(dt) + unit_roundoff(dt) * (dd.abs() + 1) for dt in (torch.float32, F64))
    u = unit_roundoff(torch.float32)
    near = torch.zeros_like(active)
    for edge in (0.8, 1.28, *(() if dual_clip is None else (dual_clip,))):
        near |= (r - edge).abs() <= r_rel * r + u * edge
    free = b.mask & ~active & ~near & (a != 0)
    assert bool((logp.grad[b.mask & active & ~near] == 0).all())
    assert bool((logp.grad[free] != 0).all())
    assert bool((logp.grad[~b.mask] == 0).all())


def test_clip_higher_is_asymmetric() -> None:
    # Rare token (old p = 0.01), A > 0: may rise to 0.0128 with eps_high=0.28, to 0.012 with 0.2
    old = torch.log(torch.tensor([[0.01]]))
    new = torch.log(torch.tensor([[0.05]]))
    a = torch.tensor([1.0])
    # the clip is active, so the loss is exactly -A (1 + eps_high), rounded once to float32
    assert torch.equal(clip_higher_surrogate(new, old, a), torch.tensor([[-1.28]]))
    assert torch.equal(clip_higher_surrogate(new, old, a, eps_high=0.2), torch.tensor([[-1.2]]))


@pytest.mark.parametrize("adv_shape", ["seq", "col", "token"])
def test_advantage_layouts_agree(adv_shape: str) -> None:
    b = make_batch(3, 5, 0)
    adv = {
        "seq": b.advantages,
        "col": b.advantages[:, None],
        "token": b.advantages[:, None].expand(3, 5).contiguous(),
    }[adv_shape]
    got = clip_higher_surrogate(b.logp, b.old_logp, adv, b.mask)
    want = clip_higher_surrogate(b.logp, b.old_logp, b.advantages, b.mask)
    assert torch.equal(got, want)  # the same values broadcast: the same arithmetic


def test_garbage_in_masked_positions_changes_nothing() -> None:
    b = make_batch(4, 7, 1)
    logp = b.logp.clone().requires_grad_(True)
    clean = clip_higher_surrogate(logp, b.old_logp, b.advantages, b.mask)
    clean.sum().backward()
    clean_grad = logp.grad.clone()  # type: ignore[union-attr]
    dirty_logp = torch.where(b.mask, b.logp, torch.tensor(float("nan"))).requires_grad_(True)
    dirty_old = torch.where(b.mask, b.old_logp, torch.tensor(float("inf")))
    adv_tok = torch.where(b.mask, b.advantages[:, None], torch.tensor(float("-inf")))
    dirty = clip_higher_surrogate(dirty_logp, dirty_old, adv_tok, b.mask)
    dirty.sum().backward()
    assert torch.equal(dirty, clean)  # documented: masked positions change no bit
    assert dirty_logp.grad is not None and torch.equal(dirty_logp.grad, clean_grad)


def test_extreme_log_ratio_stays_finite() -> None:
    logp = torch.tensor([[0.0, -200.0]], dtype=torch.float16, requires_grad=True)
    old = torch.tensor([[-200.0, 0.0]], dtype=torch.float16)
    out = clip_higher_surrogate(logp, old, torch.tensor([-1.0]))
    out.sum().backward()
    assert bool(torch.isfinite(out).all())
    assert logp.grad is not None and bool(torch.isfinite(logp.grad).all())
    assert logp.grad.dtype == torch.float16


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_gradcheck_float64(dual_clip: float | None) -> None:
    b = make_batch(3, 4, 2, dtype=torch.float64, spread=0.3)
    logp = b.logp.clone().requires_grad_(True)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return clip_higher_surrogate(lp, b.old_logp, b.advantages, b.mask, dual_clip=dual_clip)

    assert torch.autograd.gradcheck(f, (logp,))
    # advantages are a constant of the objective: a gradient through them is refused
    with pytest.raises(ValueError, match=r"advantages.*detach"):
        f_adv = b.advantages.clone().requires_grad_(True)
        clip_higher_surrogate(logp, b.old_logp, f_adv, b.mask)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"eps_low": 1.0}, "eps_low"),
        ({"eps_low": -0.1}, "eps_low"),
        ({"eps_high": -0.01}, "eps_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
    ],
)
def test_bad_options_name_the_argument(kwargs: dict[str, float], match: str) -> None:
    b = make_batch(2, 3, 0)
    with pytest.raises(ValueError, match=match):
        clip_higher_surrogate(b.logp, b.old_logp, b.advantages, b.mask, **kwargs)
