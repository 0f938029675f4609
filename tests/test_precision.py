"""Integer and range precision (issue 15, item 3): integers stay integers, sums cannot
overflow, and extreme-but-finite inputs give the exact answer, not a rounded or
overflowed one."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d

F64 = torch.float64


# --------------------------------------------------------------------------- overlong_reward


@given(
    base=st.integers(2**24, 2**62),
    cache_len=st.integers(1, 64),
    offsets=st.lists(st.integers(-70, 70), min_size=1, max_size=8),
)
def test_overlong_reward_exact_for_lengths_above_2_24(
    base: int, cache_len: int, offsets: list[int]
) -> None:
    """Integer lengths are compared with the budget in int64: one token past the free
    length costs exactly ``1 / cache_len`` even when lengths are far above 2**24."""
    max_len = base + cache_len
    lengths = [base + o for o in offsets]
    got = d.overlong_reward(torch.tensor(lengths), max_len=max_len, cache_len=cache_len)
    want = [-min(max(length - base, 0), cache_len) / cache_len for length in lengths]
    assert got.dtype == torch.float32
    assert got.tolist() == torch.tensor(want, dtype=torch.float32).tolist()


def test_overlong_reward_one_token_over_2_24() -> None:
    # float32 rounds 2**24 + 1 to 2**24: the old computation gave 0 for the last answer
    base = 2**24 + 1
    got = d.overlong_reward(torch.tensor([base, base + 1]), max_len=base + 2, cache_len=2)
    assert got.tolist() == [0.0, -0.5]


def test_overlong_reward_float64_lengths_exact() -> None:
    base = 2.0**40
    lengths = torch.tensor([base + 1, base + 2, base + 3], dtype=F64)
    got = d.overlong_reward(lengths, max_len=int(base) + 4, cache_len=4)
    assert got.dtype == F64
    assert got.tolist() == [-0.25, -0.5, -0.75]


# --------------------------------------------------------------------------- dynamic_sample_mask


@given(
    base=st.integers(-(2**63) + 2, 2**63 - 3),
    delta=st.integers(0, 2),
    atol=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
)
def test_dynamic_sample_mask_int64_exact(base: int, delta: int, atol: float) -> None:
    """int64 metrics one apart near 2**60 (float64 rounds them together) still differ."""
    metric = torch.tensor([[base, base + delta]], dtype=torch.int64)
    assert d.dynamic_sample_mask(metric, atol=atol).tolist() == [delta > atol]
    flat = d.dynamic_sample_mask(metric.flatten(), torch.tensor([5, 5]), atol=atol)
    assert flat.tolist() == [delta > atol] * 2


def test_dynamic_sample_mask_full_int64_range() -> None:
    lo, hi = -(2**63), 2**63 - 1  # the spread (2**64 - 1) does not fit in int64
    metric = torch.tensor([[lo, hi], [hi, hi], [2**60, 2**60 + 1]])
    assert d.dynamic_sample_mask(metric).tolist() == [True, False, True]
    assert d.dynamic_sample_mask(metric, atol=2.0**63).tolist() == [True, False, False]
    assert d.dynamic_sample_mask(metric, atol=2.0**65).tolist() == [False, False, False]


def test_dynamic_sample_mask_float64_extremes() -> None:
    metric = torch.tensor([[-1.7e308, 1.7e308], [1e300, 1e300]], dtype=F64)
    assert d.dynamic_sample_mask(metric).tolist() == [True, False]


# --------------------------------------------------------------------------- batch_diagnostics


def test_batch_diagnostics_float16_lengths_do_not_overflow() -> None:
    lengths = torch.full((40,), 60000.0, dtype=torch.float16)  # sum 2.4e6 > fp16 max
    out = d.batch_diagnostics(lengths, max_len=65536)
    assert out.response_tokens.item() == 40 * 60000.0
    assert out.overlong_samples.item() == 0.0
    assert math.isfinite(out.mean_response_length.item())


def test_batch_diagnostics_float32_lengths_sum_exactly() -> None:
    lengths = torch.tensor([2.0**24, 1.0, 1.0], dtype=torch.float32)  # fp32 sum: 2**24
    assert d.batch_diagnostics(lengths, max_len=10).response_tokens.item() == 2.0**24 + 2


def test_batch_diagnostics_int_lengths_and_max_len_exact() -> None:
    big = 2**40
    lengths = torch.tensor([big, big + 1, 3])
    out = d.batch_diagnostics(lengths, max_len=big + 1)
    assert out.overlong_samples.item() == 1.0  # float32 would round big + 1 to big
    assert out.response_tokens.item() == 2 * big + 4
    f32 = torch.tensor([2.0**24, 2.0**24 + 2], dtype=torch.float32)
    assert d.batch_diagnostics(f32, max_len=2**24 + 1).overlong_samples.item() == 1.0


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own check, not the annotation's
@pytest.mark.parametrize("max_len", [0, -5, 2.5, True, "20", None, 2**63])
def test_batch_diagnostics_validates_max_len(max_len: object) -> None:
    with pytest.raises(d.InputError, match="max_len"):
        d.batch_diagnostics(torch.tensor([1, 2]), max_len=max_len)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- group_advantages


@given(
    exponent=st.integers(-300, 300),
    scale=st.sampled_from(["group", "batch", "none"]),
    baseline=st.sampled_from(["mean", "leave_one_out"]),
    seed=st.integers(0, 2**16),
)
def test_group_advantages_invariant_to_power_of_two_scale(
    exponent: int, scale: str, baseline: str, seed: int
) -> None:
    """float64 rewards of any magnitude: ``group``/``batch`` advantages of ``R * 2**k``
    equal those of ``R`` bit for bit (no overflowed variance, no underflow); ``none``
    scales with the rewards."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(3, 4, generator=g, dtype=F64)
    r[1] = 0.5  # a constant group
    k = math.ldexp(1.0, exponent)
    base = d.group_advantages(r, scale=scale, baseline=baseline)  # type: ignore[arg-type]
    big = d.group_advantages(r * k, scale=scale, baseline=baseline)  # type: ignore[arg-type]
    assert bool(torch.isfinite(big).all())
    want = base * k if scale == "none" else base
    assert torch.equal(big, want)


def test_group_advantages_spread_1e200_is_not_zero() -> None:
    r = torch.tensor([[1e200, -1e200, 3e200, -3e200]], dtype=F64)
    got = d.group_advantages(r)
    want = d.group_advantages(r / 1e200)
    torch.testing.assert_close(got, want, rtol=4 * 2.0**-52, atol=0.0)
    assert got.abs().min() > 0.3
    near_max = torch.tensor([[1.7e308, -1.7e308], [1e308, 1.5e308]], dtype=F64)
    got = d.group_advantages(near_max, scale="batch")
    assert bool(torch.isfinite(got).all()) and bool((got != 0).all())


def test_group_advantages_subnormal_rewards() -> None:
    r = torch.tensor([[1e-310, 3e-310]], dtype=F64)
    big = r * 2.0**1000 * 2.0**30  # exact: powers of two
    assert d.group_advantages(r).tolist() == d.group_advantages(big).tolist()
    assert d.group_advantages(r).abs().min() > 0.5


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_int64_spread_compiles_fullgraph() -> None:
    """The int64 spread of dynamic_sample_mask traces with fullgraph=True (no host sync,
    no graph break) and gives the eager verdicts. (test_compile.py traces the other
    functions changed here: group_advantages, overlong_reward, batch_diagnostics.)"""
    metric = torch.tensor([[2**60, 2**60 + 1], [2**60, 2**60], [-(2**63), 2**63 - 1]])
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda m: d.dynamic_sample_mask(m, atol=0.5), fullgraph=True, backend="aot_eager"
    )
    assert compiled(metric).tolist() == [True, False, True]
