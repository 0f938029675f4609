"""token_level_loss: composition, dtypes, masking, diagnostics."""

from __future__ import annotations

import math

import pytest
import torch
from _bounds import (
    F64,
    assert_within,
    func_rel,
    gamma_ref,
    loss_reference,
    sum_bound,
    unit_roundoff,
)
from _strategies import MODES, PolicyBatch, make_batch, policy_batches
from hypothesis import given
from hypothesis import strategies as st

from dapo_ops import (
    clip_higher_surrogate,
    policy_diagnostics,
    token_level_aggregate,
    token_level_loss,
)


@given(policy_batches(), st.sampled_from(MODES), st.sampled_from([None, 3.0]))
def test_is_surrogate_then_aggregate(b: PolicyBatch, mode: str, dual_clip: float | None) -> None:
    got = token_level_loss(b.logp, b.old_logp, b.advantages, b.mask, mode=mode, dual_clip=dual_clip)  # type: ignore[call-overload]
    per_token = clip_higher_surrogate(b.logp, b.old_logp, b.advantages, b.mask, dual_clip=dual_clip)
    composed = token_level_aggregate(per_token, b.mask, mode=mode)  # type: ignore[arg-type]
    assert got.dtype == torch.float32 and got.shape == ()
    # both within the derived bound of the float64 value (they sum in different orders)
    want = loss_reference(
        b.logp, b.old_logp, b.advantages, b.mask, dtype=torch.float32, dual_clip=dual_clip,
        mode=mode,
    )  # fmt: skip
    assert_within(got, want.loss, want.loss_err, "token_level_loss")
    assert_within(composed, want.loss, want.loss_err, "surrogate then aggregate")


def test_on_policy_loss_is_minus_mean_advantage() -> None:
    # at the first PPO epoch logp == old_logp: ratio 1, loss = -token mean of A
    b = make_batch(4, 6, 0)
    loss = token_level_loss(b.logp, b.logp, b.advantages, b.mask)
    a_tok = b.advantages[:, None].expand_as(b.logp)[b.mask].double()
    # ratio exp(0) = 1 exactly, so each token's loss is exactly -A: only the mean rounds
    n = a_tok.numel()
    bound = sum_bound(a_tok.abs().sum(), n + 1, torch.float32) / n
    assert_within(loss, -a_tok.mean(), bound, "on-policy loss")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype: torch.dtype) -> None:
    b = make_batch(4, 9, 1)
    logp = b.logp.to(dtype).requires_grad_(True)
    old = b.old_logp.to(dtype)
    loss = token_level_loss(logp, old, b.advantages.to(dtype), b.mask)
    loss.backward()
    assert loss.dtype == torch.float32
    assert logp.grad is not None and logp.grad.dtype == dtype
    # equals the float32 computation on the same (rounded) inputs
    ref_logp = logp.detach().float().requires_grad_(True)
    ref = token_level_loss(ref_logp, old.float(), b.advantages.to(dtype).float(), b.mask)
    ref.backward()
    assert torch.equal(loss, ref)  # the same float32 arithmetic on the same values
    assert ref_logp.grad is not None
    assert torch.equal(logp.grad, ref_logp.grad.to(dtype))  # then rounded once to dtype


@pytest.mark.parametrize("mode", MODES)
def test_garbage_in_masked_positions_changes_nothing(mode: str) -> None:
    b = make_batch(5, 8, 2)
    clean_logp = b.logp.clone().requires_grad_(True)
    clean = token_level_loss(clean_logp, b.old_logp, b.advantages, b.mask, mode=mode)  # type: ignore[call-overload]
    clean.backward()
    nan, inf = torch.tensor(float("nan")), torch.tensor(float("inf"))
    dirty_logp = torch.where(b.mask, b.logp, nan).requires_grad_(True)
    dirty = token_level_loss(
        dirty_logp, torch.where(b.mask, b.old_logp, -inf), b.advantages, b.mask, mode=mode
    )  # type: ignore[call-overload]
    dirty.backward()
    assert torch.equal(dirty, clean)  # documented: masked positions change no bit
    assert dirty_logp.grad is not None and clean_logp.grad is not None
    assert torch.equal(dirty_logp.grad, clean_logp.grad)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_batch(mode: str) -> None:
    logp = torch.full((2, 3), float("nan"), requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, diag = token_level_loss(
        logp, logp.detach(), torch.ones(2), mask, mode=mode, return_diagnostics=True
    )  # type: ignore[call-overload]
    loss.backward()
    assert loss.item() == 0.0 and bool((logp.grad == 0).all())
    assert diag.valid_tokens.item() == 0 and diag.clip_frac_high.item() == 0.0
    assert diag.ratio_mean.item() == 0.0 and diag.approx_kl.item() == 0.0


def test_inputs_not_modified() -> None:
    b = make_batch(3, 4, 3)
    copies = [t.clone() for t in (b.logp, b.old_logp, b.advantages, b.mask)]
    token_level_loss(b.logp, b.old_logp, b.advantages, b.mask, return_diagnostics=True)
    for t, c in zip((b.logp, b.old_logp, b.advantages, b.mask), copies, strict=True):
        assert torch.equal(t, c)


@given(policy_batches(), st.sampled_from([None, 2.0]))
def test_diagnostics_match_a_loop(b: PolicyBatch, dual_clip: float | None) -> None:
    _, d = token_level_loss(
        b.logp, b.old_logp, b.advantages, b.mask, dual_clip=dual_clip, return_diagnostics=True
    )
    rows = [
        (float(torch.exp(b.logp[i, t] - b.old_logp[i, t])), float(b.advantages[i]))
        for i in range(b.logp.shape[0])
        for t in range(b.logp.shape[1])
        if b.mask[i, t]
    ]
    n = len(rows)
    assert d.valid_tokens.item() == n
    assert d.clipped_low.item() == sum(1 for r, a in rows if a < 0 and r < 0.8)
    assert d.clipped_high.item() == sum(1 for r, a in rows if a > 0 and r > 1.28)
    if dual_clip is not None:
        assert d.clipped_dual.item() == sum(1 for r, a in rows if a < 0 and r > dual_clip)
    if n:
        # The loop's r is a scalar float32 exp, ours a vectorised one: each within f of
        # exp. ratio_sum is a float32 sum of n terms (then float64, divided by n); min/max
        # pick one r. The loop's values are then averaged in float64: gamma_ref adds that.
        f, u = func_rel(torch.float32), unit_roundoff(torch.float32)
        r64 = torch.tensor([r for r, _ in rows], dtype=F64)
        bound_mean = (2 * f + gamma_ref(n, torch.float32)) * float(r64.abs().mean())
        assert_within(d.ratio_mean, r64.mean(), bound_mean, "ratio_mean")
        assert_within(d.ratio_min, r64.min(), 2 * f * float(r64.min()), "ratio_min")
        assert_within(d.ratio_max, r64.max(), 2 * f * float(r64.max()), "ratio_max")
        # k3 per token, (r - 1) - log r: r off by 2f relative between the two, log r by
        # f + u/r^... : bounded by (2 f + 3 u)(r + |log r| + 1) per token, then the sum
        # (the float64 loop's own log and three roundings: f64 + 3 u64 of the same terms)
        kl_t = (r64 - 1) - r64.log()
        rel_t = 2 * f + 3 * u + func_rel(F64) + 3 * unit_roundoff(F64)
        per_token = rel_t * (r64 + r64.log().abs() + 1) + 2 * f * (r64 - 1).abs()
        bound_kl = (float(per_token.sum()) + gamma_ref(n, torch.float32) * float(kl_t.sum())) / n
        assert_within(d.approx_kl, kl_t.mean(), bound_kl, "approx_kl")
        assert d.approx_kl.item() >= 0
        assert math.isfinite(d.approx_kl.item())


def test_diagnostics_add_across_micro_batches() -> None:
    b = make_batch(6, 5, 4, spread=1.0)
    whole = policy_diagnostics(b.logp, b.old_logp, b.advantages, b.mask)
    parts = [
        policy_diagnostics(b.logp[s], b.old_logp[s], b.advantages[s], b.mask[s])
        for s in (slice(0, 1), slice(1, 6))
    ]
    total = parts[0] + parts[1]
    # counts and extremes are exact; the float32 sums differ by summation order only
    for name in ("valid_tokens", "clipped_low", "clipped_high", "clipped_dual"):
        assert torch.equal(getattr(total, name), getattr(whole, name)), name
    for name in ("ratio_min", "ratio_max", "entropy_sum", "entropy_tokens"):
        assert torch.equal(getattr(total, name), getattr(whole, name)), name
    n = int(b.mask.sum())
    r = torch.exp(b.logp.double() - b.old_logp.double())[b.mask]
    f = func_rel(torch.float32)
    for name, terms in (("ratio_sum", r), ("approx_kl_sum", (r - 1) - r.log())):
        # each part and the whole: per-token float32 evaluation (within (2f + 3u)(r +
        # |log r| + 1)) and a sum of at most n terms, plus one addition of the parts
        per_token = (2 * f + 3 * unit_roundoff(torch.float32)) * (r + r.log().abs() + 1)
        bound = float(per_token.sum()) + sum_bound(terms.abs().sum(), n + 1, torch.float32)
        for value in (getattr(total, name), getattr(whole, name)):
            assert_within(value, terms.sum(), bound, name)
    assert torch.equal(total.clip_frac_low, total.clipped_low / total.valid_tokens)
    assert not any(t.requires_grad for t in total)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(mode: str) -> None:
    b = make_batch(3, 4, 5, dtype=torch.float64, spread=0.3)
    logp = b.logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda lp: token_level_loss(lp, b.old_logp, b.advantages, b.mask, mode=mode, dual_clip=3.0),  # type: ignore[call-overload]
        (logp,),
    )
