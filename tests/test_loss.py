"""token_level_loss: composition, dtypes, masking, diagnostics."""

from __future__ import annotations

import pytest
import torch
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
    torch.testing.assert_close(got, token_level_aggregate(per_token, b.mask, mode=mode))  # type: ignore[arg-type]
    assert got.dtype == torch.float32 and got.shape == ()


def test_on_policy_loss_is_minus_mean_advantage() -> None:
    # at the first PPO epoch logp == old_logp: ratio 1, loss = -token mean of A
    b = make_batch(4, 6, 0)
    loss = token_level_loss(b.logp, b.logp, b.advantages, b.mask)
    a_tok = b.advantages[:, None].expand_as(b.logp)
    torch.testing.assert_close(loss, -a_tok[b.mask].mean())


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
    torch.testing.assert_close(loss, ref)
    assert ref_logp.grad is not None
    torch.testing.assert_close(logp.grad.float(), ref_logp.grad.to(dtype).float())


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
    torch.testing.assert_close(dirty, clean)
    torch.testing.assert_close(dirty_logp.grad, clean_logp.grad)


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
        import math

        assert d.ratio_mean.item() == pytest.approx(sum(r for r, _ in rows) / n, rel=1e-5)
        assert d.ratio_min.item() == pytest.approx(min(r for r, _ in rows), rel=1e-5)
        assert d.ratio_max.item() == pytest.approx(max(r for r, _ in rows), rel=1e-5)
        kl = sum((r - 1) - math.log(r) for r, _ in rows) / n
        assert d.approx_kl.item() == pytest.approx(kl, rel=1e-4, abs=1e-6)
        assert d.approx_kl.item() >= 0


def test_diagnostics_add_across_micro_batches() -> None:
    b = make_batch(6, 5, 4, spread=1.0)
    whole = policy_diagnostics(b.logp, b.old_logp, b.advantages, b.mask)
    parts = [
        policy_diagnostics(b.logp[s], b.old_logp[s], b.advantages[s], b.mask[s])
        for s in (slice(0, 1), slice(1, 6))
    ]
    total = parts[0] + parts[1]
    for name in whole._fields:
        torch.testing.assert_close(getattr(total, name), getattr(whole, name))
    torch.testing.assert_close(total.clip_frac_low, whole.clip_frac_low)
    assert not any(t.requires_grad for t in total)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(mode: str) -> None:
    b = make_batch(3, 4, 5, dtype=torch.float64, spread=0.3)
    logp = b.logp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda lp: token_level_loss(lp, b.old_logp, b.advantages, b.mask, mode=mode, dual_clip=3.0),  # type: ignore[call-overload]
        (logp,),
    )
