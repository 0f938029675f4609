"""overlong_reward and overlong_filter."""

from __future__ import annotations

import torch
from _bounds import unit_roundoff
from hypothesis import given
from hypothesis import strategies as st

from dapo_ops import overlong_filter, overlong_reward


@st.composite
def budgets(draw: st.DrawFn) -> tuple[int, int, float]:
    max_len = draw(st.integers(1, 30000))
    cache_len = draw(st.integers(1, max_len))
    factor = draw(st.sampled_from([1.0, 0.5, 2.0, 0.0]))
    return max_len, cache_len, factor


@given(budgets())
def test_exact_at_the_three_boundaries(b: tuple[int, int, float]) -> None:
    max_len, cache_len, factor = b
    lengths = torch.tensor([0, max_len - cache_len, max_len, max_len + 1, 10 * max_len])
    got = overlong_reward(lengths, max_len=max_len, cache_len=cache_len, factor=factor)
    assert got.tolist() == [0.0, 0.0, -factor, -factor, -factor]


@given(budgets())
def test_continuous_and_non_increasing(b: tuple[int, int, float]) -> None:
    max_len, cache_len, factor = b
    lengths = torch.arange(0, max_len + 3)
    r = overlong_reward(lengths, max_len=max_len, cache_len=cache_len, factor=factor).double()
    steps = r[1:] - r[:-1]
    # exactly non-increasing: (expected - length) / cache_len, clamp, * factor is a chain
    # of monotone operations, and correctly rounded +, /, * are monotone too
    assert bool((steps <= 0).all())
    # one token more never costs more than factor / cache_len: no jump anywhere. Each
    # value is the exact one within two float32 roundings (/ then *): 2 u factor.
    slack = 2 * 2 * unit_roundoff(torch.float32) * factor
    assert bool((steps.abs() <= factor / cache_len + slack).all())
    # fractional lengths on the line: the formula itself, exact (half-integer lengths and
    # factors in {0, 0.5, 1, 2}: every intermediate is a representable float64)
    x = torch.tensor([max_len - cache_len + 0.5 * cache_len], dtype=torch.float64)
    got = overlong_reward(x, max_len=max_len, cache_len=cache_len, factor=factor).item()
    assert got == -0.5 * factor


def test_paper_numbers() -> None:
    lengths = torch.tensor([16384, 18432, 20480, 25000])
    got = overlong_reward(lengths, max_len=20480, cache_len=4096)
    assert got.tolist() == [0.0, -0.5, -1.0, -1.0]
    assert got.dtype == torch.float32


def test_filter_drops_truncated_samples_only() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    out = overlong_filter(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[True, True, False], [False, False, False], [True, False, False]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]  # not modified
