"""Token and sequence selections (dapo_ops.correction.masks): properties against plain torch."""

from __future__ import annotations

import pytest
import torch
from _strategies import PolicyBatch, policy_batches
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d


@given(policy_batches(), st.sampled_from([0.05, 0.2, 0.5, 1.0]))
def test_high_entropy_mask_is_the_quantile_rule(b: PolicyBatch, top: float) -> None:
    entropies = -b.logp  # any per-token values
    got = d.high_entropy_mask(entropies, b.mask, top_quantile=top)
    assert bool((got <= b.mask).all())
    if not bool(b.mask.any()):
        assert not bool(got.any())
        return
    threshold = torch.quantile(entropies[b.mask].float(), 1.0 - top)
    assert torch.equal(got, (entropies >= threshold) & b.mask)
    junk = torch.where(b.mask, entropies, torch.tensor(float("nan")))
    assert torch.equal(d.high_entropy_mask(junk, b.mask, top_quantile=top), got)


@given(policy_batches(), st.floats(0.0, 0.5))
def test_off_policy_mask_keeps_positive_advantages_and_close_rows(b: PolicyBatch, t: float) -> None:
    sampling = b.old_logp
    keep = d.off_policy_sequence_mask(b.advantages, b.logp, sampling, b.mask, threshold=t)
    n = b.mask.sum(-1).clamp(min=1)
    mean_kl = torch.where(b.mask, sampling - b.logp, 0.0).sum(-1) / n
    want = ((b.advantages >= 0) | (mean_kl <= t))[:, None] & b.mask
    assert torch.equal(keep, want)


def test_selection_options_name_the_argument() -> None:
    h, m = torch.rand(2, 3), torch.ones(2, 3, dtype=torch.bool)
    for top in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_quantile"):
            d.high_entropy_mask(h, m, top_quantile=top)
    with pytest.raises(ValueError, match="threshold"):
        d.off_policy_sequence_mask(torch.ones(2), h, h, m, threshold=float("nan"))
