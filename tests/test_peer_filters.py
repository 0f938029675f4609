"""M2PO's second-moment mask (AReaL), the truncation penalty (NeMo-RL; OpenRLHF's twin is
in tests/integration/test_openrlhf.py) and the difficulty band (ROLL): float64 references
written below from the peers' code (AReaL, NeMo-RL and ROLL cannot be installed here), and
the properties each promises.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d

F64 = torch.float64


# --------------------------------------------------------------------------- M2PO vs AReaL
def areal_m2po(old: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor, tau: float):  # type: ignore[no-untyped-def]
    """AReaL's ``_apply_m2po_masking``: sort the valid tokens' squared log-ratio in
    descending order, drop the first ``k`` where ``k`` is the first index whose tail mean
    is below ``tau`` (``n - 1`` if none), a loop over Python floats."""
    m2 = ((old - prox) ** 2).reshape(-1).tolist()
    flat = mask.reshape(-1).tolist()
    idx = [i for i, v in enumerate(flat) if v]
    out = [False] * len(flat)
    if not idx:
        return torch.tensor(out).view(mask.shape)
    order = sorted(idx, key=lambda i: -m2[i])
    n = len(order)
    k = n - 1
    for i in range(n):
        tail = [m2[j] for j in order[i:]]
        if sum(tail) / len(tail) < tau:
            k = i
            break
    for j in order[k:]:
        out[j] = True
    return torch.tensor(out).view(mask.shape)


def _logps(seed: int, rows: int = 5, seq: int = 7, scale: float = 0.3):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, seq, generator=g, dtype=F64) * 2 - 0.05
    roll = old + torch.randn(rows, seq, generator=g, dtype=F64) * scale
    mask = torch.rand(rows, seq, generator=g) < 0.8
    shift = (roll + 0.01).clamp(min=0.0)  # log-probs <= 0 (checked mode), same log-ratios
    return old - shift, roll - shift, mask


@pytest.mark.parametrize("tau", [0.01, 0.04, 0.2, 5.0])
def test_m2po_is_areals_selection(tau: float) -> None:
    for seed in range(6):
        old, roll, mask = _logps(seed, scale=0.1 + 0.2 * seed)
        want = areal_m2po(old, roll, mask, tau)
        assert torch.equal(d.m2po_mask(old, roll, mask, threshold=tau), want)
        got32 = d.m2po_mask(old.float(), roll.float(), mask, threshold=tau)
        # float32 sums may move the cut by a token only where a tail mean is within
        # rounding of tau: with these draws they do not
        assert torch.equal(got32, want)


@given(seed=st.integers(0, 2**16), tau=st.floats(1e-3, 1.0), scale=st.floats(0.01, 2.0))
def test_m2po_properties(seed: int, tau: float, scale: float) -> None:
    """Kept tokens are valid; their second moment is below tau (or one token is left);
    the cut is the smallest: putting back the smallest dropped token breaks the bound;
    every dropped token's m2 is >= every kept one's."""
    old, roll, mask = _logps(seed, scale=scale)
    keep = d.m2po_mask(old, roll, mask, threshold=tau)
    assert not (keep & ~mask).any()
    m2 = (old - roll) ** 2
    if not mask.any():
        assert not keep.any()
        return
    assert keep.any()
    kept, dropped = m2[keep], m2[mask & ~keep]
    if kept.numel() > 1 or kept.mean() < tau:
        assert kept.mean() < tau
    if dropped.numel():
        assert dropped.min() >= kept.max()
        with_back = torch.cat([kept, dropped.min().view(1)])
        assert with_back.mean() >= tau or kept.mean() >= tau


def test_m2po_masked_garbage_and_nonfinite() -> None:
    old, roll, mask = _logps(3)
    want = d.m2po_mask(old, roll, mask, threshold=0.04)
    junk = old.masked_fill(~mask, float("nan")), roll.masked_fill(~mask, float("inf"))
    assert torch.equal(d.m2po_mask(*junk, mask, threshold=0.04), want)
    bad = roll.clone()
    bad[0, 0] = float("nan")
    full = torch.ones_like(mask)
    with d.checked(False):  # the default path's NaN rule; checked mode refuses the NaN
        keep = d.m2po_mask(old, bad, full, threshold=0.04)
    assert not keep[0, 0]  # a NaN log-ratio ranks largest: dropped
    assert keep.any()


def test_m2po_ties_by_position() -> None:
    old = torch.full((1, 4), -1.0)
    roll = torch.tensor([[0.0, 0.0, -1.0, -1.0]])  # tail means: 0.5, 1/3, 0, 0
    keep = d.m2po_mask(old, roll, torch.ones(1, 4, dtype=torch.bool), threshold=0.4)
    assert keep.tolist() == [[False, True, True, True]]  # the earlier tie is dropped first


# --------------------------------------------------------------------------- truncation penalty
def nemo_rl_stop_properly(rewards: torch.Tensor, truncated: torch.Tensor, coef: float):  # type: ignore[no-untyped-def]
    """NeMo-RL's ``apply_reward_shaping`` with ``stop_properly_penalty_coef`` (in [0, 1])."""
    return torch.where(truncated, rewards * coef, rewards)


@given(seed=st.integers(0, 2**16), coef=st.floats(0.0, 1.0))
def test_truncation_penalty_is_nemo_rls(seed: int, coef: float) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(9, generator=g, dtype=F64)
    truncated = torch.rand(9, generator=g) < 0.4
    got = d.truncation_penalty(rewards, truncated, coef=coef)
    assert got.dtype == F64
    assert torch.equal(got, nemo_rl_stop_properly(rewards, truncated, coef))
    assert torch.equal(got[~truncated], rewards[~truncated])  # untouched, bit for bit
    one = d.truncation_penalty(rewards.float(), truncated, coef=1.0)
    assert one.dtype == torch.float32 and torch.equal(one, rewards.float())


def test_truncation_penalty_negative_coef_overrides() -> None:
    rewards = torch.tensor([1.0, float("nan"), 0.3], dtype=torch.bfloat16)
    truncated = torch.tensor([False, True, True])
    got = d.truncation_penalty(rewards, truncated, coef=-0.5)
    assert got.dtype == torch.float32
    assert got.tolist() == [1.0, -0.5, -0.5]
    with pytest.raises(d.InputError, match="coef"):
        d.truncation_penalty(rewards, truncated, coef=1.5)


# --------------------------------------------------------------------------- difficulty band
def roll_difficulty_mask(scores: torch.Tensor, n_sample: int, low: float, high: float):  # type: ignore[no-untyped-def]
    """ROLL's ``difficulty_mask``: each sample carries its group's verdict
    ``low < mean < high`` over contiguous groups of ``n_sample``."""
    mean = scores.reshape(-1, n_sample).mean(dim=-1, keepdim=True).expand(-1, n_sample)
    return ((mean > low) & (mean < high)).reshape(-1)


@given(
    seed=st.integers(0, 2**16),
    samples=st.integers(2, 8),
    band=st.tuples(st.floats(-0.5, 1.0), st.floats(0.0, 1.5)).filter(lambda b: b[0] < b[1]),
)
def test_difficulty_band_is_rolls(seed: int, samples: int, band: tuple[float, float]) -> None:
    low, high = band
    g = torch.Generator().manual_seed(seed)
    acc = (torch.rand(6, samples, generator=g) < torch.rand(6, 1, generator=g)).to(F64)
    want = roll_difficulty_mask(acc.flatten(), samples, low, high)
    dense = d.difficulty_band_mask(acc, low=low, high=high)
    assert torch.equal(dense.repeat_interleave(samples), want)
    # ragged: shuffled samples with their group ids give each sample its group's verdict
    perm = torch.randperm(acc.numel(), generator=g)
    ids = torch.arange(6).repeat_interleave(samples)[perm]
    flat = d.difficulty_band_mask(acc.flatten()[perm], ids, low=low, high=high)
    assert torch.equal(flat, want[perm])
    # integer metrics: the same verdicts
    assert torch.equal(d.difficulty_band_mask(acc.long(), low=low, high=high), dense)


def test_difficulty_band_bounds_and_dynamic_sampling() -> None:
    tenth = torch.tensor([[1] + [0] * 9])
    assert not d.difficulty_band_mask(tenth, low=0.1, high=0.95).item()  # mean == low: out
    ninety5 = torch.tensor([[1] * 19 + [0]])
    assert not d.difficulty_band_mask(ninety5, low=0.1, high=0.95).item()  # mean == high: out
    g = torch.Generator().manual_seed(0)
    acc01 = (torch.rand(40, 4, generator=g) < torch.rand(40, 1, generator=g)).long()
    # with 0/1 metrics, the band (0, 1) is DAPO's dynamic sampling
    assert torch.equal(
        d.difficulty_band_mask(acc01, low=0.0, high=1.0), d.dynamic_sample_mask(acc01)
    )
    with pytest.raises(d.InputError, match="low"):
        d.difficulty_band_mask(acc01, low=0.5, high=0.5)
    with pytest.raises(d.InputError, match="metric"):
        d.difficulty_band_mask(torch.tensor([[0.5, float("nan")]]))


def test_m2po_default_threshold_is_the_authors_budget() -> None:
    """M2PO's own scripts run with ``M2_budget=0.04``: the default."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    roll = (old + 0.4 * torch.randn(4, 6, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.rand(4, 6, generator=g) < 0.8
    assert torch.equal(d.m2po_mask(old, roll, mask), d.m2po_mask(old, roll, mask, threshold=0.04))
