"""Advantage estimators (dapo_ops.advantages.estimators, dapo_ops.advantages.returns): properties; peer parity is in
tests/integration."""

from __future__ import annotations

import pytest
import torch
from _bounds import F64, advantage_bound, assert_within, gamma, unit_roundoff
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d


@st.composite
def groups(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    n = draw(st.integers(2, 30))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, draw(st.integers(1, 6)), (n,), generator=g)
    scores = torch.randint(0, 4, (n,), generator=g).to(torch.float64)
    return scores, ids


@given(groups())
def test_opo_with_equal_lengths_is_group_centring(sg: tuple[torch.Tensor, torch.Tensor]) -> None:
    scores, ids = sg
    got = d.opo_advantages(scores, torch.full_like(ids, 5), ids)
    want = d.group_advantages(scores, ids, scale="none", singleton="score")
    # two float64 evaluations of score - group mean: each within advantage_bound (s = 1)
    one = torch.ones_like(want)
    assert_within(got, want, 2 * advantage_bound(scores, want, one, F64), "opo")


@given(groups())
def test_gpg_centres_each_group(sg: tuple[torch.Tensor, torch.Tensor]) -> None:
    scores, ids = sg
    got = d.gpg_advantages(scores, ids)
    alpha = scores.numel() / max(int((scores != 0).sum()), 1)
    centred = d.group_advantages(scores, ids, scale="none", singleton="score")
    want = alpha * centred
    # as above, scaled by alpha, plus the product's and alpha's roundings
    one = torch.ones_like(want)
    bound = (
        alpha * 2 * advantage_bound(scores, centred, one, F64) + 4 * unit_roundoff(F64) * want.abs()
    )
    assert_within(got, want, bound, "gpg")


@given(groups(), st.booleans())
def test_passk_rewards_only_the_best(sg: tuple[torch.Tensor, torch.Tensor], scale: bool) -> None:
    scores, ids = sg
    if bool((torch.bincount(ids)[ids] < 2).any()):
        with pytest.raises(d.InputError, match="2 samples"):
            d.passk_advantages(scores, ids, scale=scale)
        return
    adv = d.passk_advantages(scores, ids, scale=scale)
    for gid in ids.unique():
        members = (ids == gid).nonzero().flatten()
        nonzero = members[adv[members] != 0]
        assert nonzero.numel() <= 1
        top = torch.topk(scores[members], 2).values
        if nonzero.numel() == 1:
            assert float(scores[nonzero[0]]) == float(top[0])
        else:
            assert float(top[0] - top[1]) == 0.0


def test_gae_without_values_is_the_return_to_go() -> None:
    rewards = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    adv, ret = d.gae_advantages(rewards, torch.zeros(1, 4), mask, whiten=False)
    # small integers and gamma = 0.5: every value is exact
    assert torch.equal(adv, torch.tensor([[3.0, 3.0, 2.0, 0.0]]))
    assert torch.equal(ret, adv)
    adv_pp, ret_pp = d.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    assert torch.equal(ret_pp, torch.tensor([[1.0, 2.0, 2.0, 0.0]]))
    # whitened: mean 0 up to the whitening's float32 sums over 3 values
    top = float(adv_pp[mask].abs().max())
    assert abs(float(adv_pp[mask].double().mean())) <= gamma(10, torch.float32) * top
    assert float(adv_pp[0, 3]) == 0.0


@pytest.mark.parametrize("fn", ["gae", "rpp", "whiten"])
def test_token_estimators_ignore_masked_garbage(fn: str) -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    junk = torch.where(mask, rewards, torch.tensor(float("nan")))
    calls = {
        "gae": lambda r: d.gae_advantages(r, values, mask, gamma=0.9, lam=0.8)[0],
        "rpp": lambda r: d.reinforce_pp_advantages(r, mask, gamma=0.9)[0],
        "whiten": lambda r: d.masked_whiten(r, mask),
    }
    assert torch.equal(calls[fn](rewards), calls[fn](junk))
