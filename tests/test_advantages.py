"""group_advantages: invariances, zero-sum groups, boundary groups, ragged layout."""

from __future__ import annotations

import math

import pytest
import torch
from _bounds import advantage_bound, assert_within, scale_of, sum_bound
from hypothesis import assume, given
from hypothesis import strategies as st

from dapo_ops import group_advantages
from dapo_ops.advantages.group import ZERO_STD_RTOL

F32, F64 = torch.float32, torch.float64


@st.composite
def reward_groups(draw: st.DrawFn) -> torch.Tensor:
    groups = draw(st.integers(1, 6))
    samples = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["binary", "normal", "ties"]))
    g = torch.Generator().manual_seed(seed)
    if kind == "binary":
        return torch.randint(0, 2, (groups, samples), generator=g).float()
    if kind == "ties":
        return torch.randint(-2, 3, (groups, samples), generator=g).float() * 0.1
    return torch.randn(groups, samples, generator=g)


def loop_reference(
    rewards: torch.Tensor, ids: list[int], *, scale: str, baseline: str
) -> torch.Tensor:
    """Per-group Python loop over a uid list, in float64: the definition."""
    out = torch.zeros(len(ids), dtype=torch.float64)
    r = rewards.double()
    batch_std = r.std() if r.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    for gid in set(ids):
        idx = torch.tensor([i for i, x in enumerate(ids) if x == gid])
        x = r[idx]
        n = len(idx)
        if n < 2 or bool((x == x[0]).all()):
            continue
        if baseline == "mean":
            res = x - x.mean()
        else:
            res = torch.stack([x[i] - (x.sum() - x[i]) / (n - 1) for i in range(n)])
        if scale == "group":
            res = res / x.std()
        elif scale == "batch":
            res = res / batch_std
        out[idx] = res
    return out


def relative_spread(rewards: torch.Tensor) -> torch.Tensor:
    """Each group's (row's) std over its largest |reward|, in float64 (0 for a zero group)."""
    x = rewards.double()
    top = x.abs().amax(dim=1)
    std = x.std(dim=1) if x.shape[1] > 1 else torch.zeros_like(top)
    return torch.where(top > 0, std / top, torch.zeros_like(top))


@given(
    reward_groups(),
    st.floats(0.01, 100.0),
    st.floats(-100.0, 100.0),
    st.sampled_from(["group", "batch"]),
)
def test_invariant_to_affine_rewards(r: torch.Tensor, a: float, b: float, scale: str) -> None:
    r64 = r.double()
    shifted = r64 * a + b
    # The documented exception: a large shift b can bring a real spread within the
    # rounding tolerance of the rewards' magnitude (ZERO_STD_RTOL) and turn the group into
    # a constant one (advantage 0); the loop reference zeroes exactly equal rewards only.
    # So every group is drawn either constant or clear of that tolerance, shifted or not.
    spread, spread_shifted = relative_spread(r64), relative_spread(shifted)
    clear = (spread > 4 * ZERO_STD_RTOL) & (spread_shifted > 4 * ZERO_STD_RTOL)
    assume(bool(((spread == 0) | clear).all()))
    base = group_advantages(r64, scale=scale)  # type: ignore[arg-type]
    moved = group_advantages(shifted, scale=scale)  # type: ignore[arg-type]
    # Both against the exact advantages of r (which r * a + b shares, a > 0). The shifted
    # rewards carry two roundings (r * a, + b) and have magnitude up to a max|r| + |b|, on
    # the scale a s.
    ids = [g for g in range(r.shape[0]) for _ in range(r.shape[1])]
    want = loop_reference(r.flatten(), ids, scale=scale, baseline="mean").view_as(r)
    s = scale_of(r, ids, scale)
    assert_within(base, want, advantage_bound(r64, want, s, F64), "base")
    magnitude = a * r64.abs() + abs(b)
    bound = advantage_bound(magnitude, want, a * s, F64, input_roundings=2)
    assert_within(moved, want, bound, "shifted")


@given(
    reward_groups(),
    st.sampled_from(["group", "batch", "none"]),
    st.sampled_from(["mean", "leave_one_out"]),
)
def test_groups_sum_to_zero_and_match_loop(r: torch.Tensor, scale: str, baseline: str) -> None:
    adv = group_advantages(r, scale=scale, baseline=baseline)  # type: ignore[arg-type]
    assert adv.shape == r.shape and adv.dtype == torch.float32
    assert bool(torch.isfinite(adv).all())
    ids = [g for g in range(r.shape[0]) for _ in range(r.shape[1])]
    want = loop_reference(r.flatten(), ids, scale=scale, baseline=baseline).view_as(r)
    bound = advantage_bound(r, want, scale_of(r, ids, scale))
    assert_within(adv, want, bound, "advantages")
    # a group's exact advantages sum to 0; the float32 sum adds its own rounding
    zero_bound = bound.sum(dim=1) + sum_bound(adv.double().abs().sum(dim=1), r.shape[1], F32)
    assert_within(adv.sum(dim=1), torch.zeros(r.shape[0], dtype=F64), zero_bound, "group sums")


@given(st.integers(1, 40), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_ragged_flat_layout_matches_loop(batch: int, max_id: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max_id, (batch,), generator=g) * 7 - 3  # non-contiguous, negative too
    rewards = torch.randint(0, 3, (batch,), generator=g).float()
    adv = group_advantages(rewards, ids)
    want = loop_reference(rewards, ids.tolist(), scale="group", baseline="mean")
    bound = advantage_bound(rewards, want, scale_of(rewards, ids.tolist(), "group"))
    assert_within(adv, want, bound, "advantages")


def test_dense_and_flat_layouts_agree_under_permutation() -> None:
    r = torch.randn(5, 4)
    dense = group_advantages(r)
    ids = torch.arange(5).repeat_interleave(4)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    flat = group_advantages(r.flatten()[perm], ids[perm])
    # both layouts against the exact values (they may sum each group in another order)
    want = loop_reference(r.flatten(), ids.tolist(), scale="group", baseline="mean")
    bound = advantage_bound(r, want, scale_of(r, ids.tolist(), "group"))
    assert_within(dense.flatten(), want, bound, "dense")
    assert_within(flat, want[perm], bound[perm], "flat, permuted")


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_singleton_and_constant_groups_are_zero(scale: str, baseline: str) -> None:
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.7])
    ids = torch.tensor([4, 4, 4, 9, 2, 2])
    adv = group_advantages(rewards, ids, scale=scale, baseline=baseline)  # type: ignore[arg-type]
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert adv[4] > 0 > adv[5]
    assert group_advantages(torch.tensor([[3.0]]), scale=scale).item() == 0.0  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0.1, 1000.1, -3.3e5, 1e-30])
def test_float_rounding_spread_does_not_blow_up(value: float) -> None:
    # 16 copies of a value that float32 arithmetic does not sum exactly, plus rewards
    # that differ by one float32 ulp: no real spread, so advantages must be 0
    r = torch.full((2, 16), value, dtype=torch.float32)
    r[1, ::2] = torch.nextafter(r[1, ::2], torch.tensor(float("inf")))
    for eps in (0.0, 1e-6):
        adv = group_advantages(r, eps=eps)
        assert bool((adv == 0).all()), adv


def test_real_small_spread_is_kept() -> None:
    r = torch.tensor([[0.0, 1e-3, 0.0, 1e-3]])
    adv = group_advantages(r)
    half = math.sqrt(3) / 2  # (x - mean) / std for two equal halves: +-sqrt(3) / 2
    want = torch.tensor([[-half, half, -half, half]], dtype=F64)
    assert_within(adv, want, advantage_bound(r, want, scale_of(r, [0] * 4, "group")))


def test_peer_eps_reproduces_std_plus_eps() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0]])
    r64 = r.double()  # the peers' formula, evaluated in float64
    for eps in (1e-6, 1e-4):
        want = (r64 - r64.mean()) / (r64.std() + eps)
        s = scale_of(r, [0] * 3, "group", eps=eps)
        assert_within(group_advantages(r, eps=eps), want, advantage_bound(r, want, s))
    biased = (r64 - r64.mean()) / r64.std(unbiased=False)
    s = scale_of(r, [0] * 3, "group", unbiased=False)
    assert_within(group_advantages(r, unbiased=False), biased, advantage_bound(r, biased, s))


def test_inputs_not_modified_and_low_precision_inputs() -> None:
    r = torch.tensor([[1.0, 0.0, 0.5, 0.0]], dtype=torch.bfloat16)
    before = r.clone()
    adv = group_advantages(r)
    assert torch.equal(r, before) and adv.dtype == torch.float32
    # bfloat16 and float32 hold the same values, which are upcast to float64: bitwise
    assert torch.equal(adv, group_advantages(r.float()))


@given(st.integers(1, 40), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_direct_and_sorted_group_index_agree_bitwise(batch: int, max_id: int, seed: int) -> None:
    """Ids spanning fewer values than samples index the groups directly (eager CPU); wide
    ids go through the stable sort. Both sum each group's samples in sample order: the
    same bits."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max_id, (batch,), generator=g)
    rewards = torch.randn(batch, generator=g)
    for scale in ("group", "batch", "none"):
        for singleton in ("zero", "score"):
            kw = {"scale": scale, "singleton": singleton, "baseline": "leave_one_out"}
            near = group_advantages(rewards, ids, **kw)  # type: ignore[arg-type]
            wide = group_advantages(rewards, ids * 10**12 - 5, **kw)  # type: ignore[arg-type]
            assert torch.equal(near, wide)
            assert torch.equal(near.signbit(), wide.signbit())


@pytest.mark.parametrize("power", [-600, -301, 0, 299, 301, 600])
def test_power_of_two_rescaling_changes_no_bit(power: int) -> None:
    """The per-group power-of-two scaling is exact: rewards times 2^k give the same
    advantages bit for bit, whether the scaling runs (|R| beyond 2^+-300) or is skipped."""
    g = torch.Generator().manual_seed(power + 1000)
    r = torch.randn(6, 5, generator=g, dtype=F64)
    r[2] = 0.5  # a constant group
    for scale in ("group", "batch"):
        want = group_advantages(r, scale=scale)  # type: ignore[arg-type]
        got = group_advantages(r * 2.0**power, scale=scale)  # type: ignore[arg-type]
        assert torch.equal(got, want)
        assert torch.equal(got.signbit(), want.signbit())


def test_constant_groups_have_finite_gradients() -> None:
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 2.0], [5.0, 0.0, 0.0]], requires_grad=True)
    group_advantages(r).square().sum().backward()
    assert r.grad is not None and bool(torch.isfinite(r.grad).all())
    assert bool((r.grad[0] == 0).all())
    flat = torch.tensor([1.0, 1.0, 0.0, 2.0, 4.0], requires_grad=True)
    ids = torch.tensor([0, 0, 1, 1, 2])
    for scale in ("group", "batch", "none"):
        flat.grad = None
        group_advantages(flat, ids, scale=scale, singleton="score").square().sum().backward()  # type: ignore[arg-type]
        assert flat.grad is not None and bool(torch.isfinite(flat.grad).all())
