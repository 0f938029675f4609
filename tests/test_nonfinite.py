"""The documented results for NaN and inf at *valid* positions, where a function gives a
value instead of an ``InputError`` (``tests/test_bad_inputs.py`` checks that every other
case raises). Each test states the documented rule and checks it exactly."""

from __future__ import annotations

import math

import torch
from _strategies import PolicyBatch, policy_batches
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d


@given(st.integers(1, 4), st.integers(2, 5), st.integers(0, 2**16), st.booleans())
def test_passk_nan_score_makes_its_group_nan(
    groups: int, samples: int, seed: int, scale: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(groups, samples, generator=gen)
    bad = int(torch.randint(0, groups, (), generator=gen))
    scores[bad, int(torch.randint(0, samples, (), generator=gen))] = math.nan
    adv = d.passk_advantages(scores, scale=scale)
    assert bool(adv[bad].isnan().all())
    others = torch.arange(groups) != bad
    clean = d.passk_advantages(scores[others], scale=scale)
    assert torch.equal(adv[others], clean)  # other groups are untouched


# The next three tests pin the default path's documented NaN semantics; checked mode
# refuses a NaN advantage or log-prob instead (tests/test_checked.py).
@given(policy_batches(), st.sampled_from([d.ClipHigher(), d.CISPO(), d.GSPO()]))
@d.checked(False)
def test_diagnostics_nan_advantage_gives_nan_clip_counts(
    b: PolicyBatch, objective: d.Objective
) -> None:
    """A NaN advantage has no sign: clipped or not is undefined, so the counts are NaN;
    the rest of the diagnostics (ratio, KL) do not depend on advantages and stay finite."""
    rows = b.mask.any(dim=-1)
    if not bool(rows.any()):
        return
    row = int(rows.nonzero()[0, 0])
    adv = b.advantages.clone()
    adv[row] = math.nan
    diag = d.objective_diagnostics(objective, b.logp.detach(), b.old_logp, adv, b.mask)
    clean = d.objective_diagnostics(objective, b.logp.detach(), b.old_logp, b.advantages, b.mask)
    for field in ("clipped_low", "clipped_high", "clipped_dual"):
        assert bool(getattr(diag, field).isnan()), field
    for field in ("valid_tokens", "ratio_sum", "ratio_min", "ratio_max", "approx_kl_sum"):
        assert torch.equal(getattr(diag, field), getattr(clean, field)), field


@given(policy_batches(), st.sampled_from(["token", "seq_sum", "seq_mean", "seq_max"]))
@d.checked(False)
def test_rejection_mask_rejects_nan(b: PolicyBatch, level: str) -> None:
    valid = b.mask.bool()
    if not bool(valid.any()):
        return
    i, t = (int(x) for x in valid.nonzero()[0])
    old = b.old_logp.clone()
    old[i, t] = math.nan
    statistic = "k1" if level != "seq_max" else "k3"
    keep = d.rejection_mask(old, b.old_logp, b.mask, statistic=statistic, level=level, upper=2.0)
    assert not bool(keep[i, t])
    if level != "token":
        assert not bool(keep[i].any())  # the whole sequence


@given(st.integers(0, 2**16), st.floats(0.05, 1.0))
def test_high_entropy_mask_leaves_nan_out(seed: int, top: float) -> None:
    """A NaN entropy is neither selected nor counted: the mask equals the one computed with
    that token masked out."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.rand(3, 6, generator=gen) * 2
    mask = torch.rand(3, 6, generator=gen) > 0.2
    mask[0, 0] = True
    h[0, 0] = math.nan
    without = mask.clone()
    without[0, 0] = False
    got = d.high_entropy_mask(h, mask, top_quantile=top)
    assert torch.equal(got, d.high_entropy_mask(h.nan_to_num(0.0), without, top_quantile=top))


@d.checked(False)
def test_off_policy_mask_nan_advantage_follows_trl() -> None:
    """TRL keeps a row when ``A >= 0`` or its drift is within the threshold; NaN >= 0 is
    False, so a NaN-advantage row is kept exactly when it is close."""
    lp = torch.log(torch.full((2, 3), 0.2))
    sampling = lp + torch.tensor([[0.1], [2.0]])  # row 0 close, row 1 far
    adv = torch.tensor([math.nan, math.nan])
    keep = d.off_policy_sequence_mask(
        adv, lp, sampling, torch.ones(2, 3, dtype=torch.bool), threshold=0.5
    )
    assert keep[0].all() and not keep[1].any()
