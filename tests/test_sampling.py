"""dynamic_sample_mask and the helpers that size the next generation round."""

from __future__ import annotations

import pytest
import torch
from _bounds import unit_roundoff
from hypothesis import given
from hypothesis import strategies as st

from dapo_ops import (
    dynamic_sample_mask,
    group_advantages,
    kept_group_fraction,
    overlong_reward,
    prompts_to_generate,
)


@given(
    st.integers(1, 8),
    st.integers(1, 8),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["bool", "int", "float"]),
)
def test_kept_iff_spread_dense(groups: int, samples: int, seed: int, dtype: str) -> None:
    g = torch.Generator().manual_seed(seed)
    acc = torch.rand(groups, samples, generator=g) < torch.rand(groups, 1, generator=g)
    metric = {"bool": acc, "int": acc.long(), "float": acc.float()}[dtype]
    keep = dynamic_sample_mask(metric)
    assert keep.shape == (groups,) and keep.dtype == torch.bool
    for k in range(groups):
        correct = int(acc[k].sum())
        assert bool(keep[k]) == (0 < correct < samples)
        # a kept group carries gradient; a dropped one has all-zero advantages
        adv = group_advantages(acc[k : k + 1].float())
        assert bool((adv != 0).any()) == bool(keep[k])


@given(st.integers(1, 40), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_kept_iff_spread_flat(batch: int, max_id: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max_id, (batch,), generator=g) * 5 + 11
    acc = torch.randint(0, 2, (batch,), generator=g)
    keep = dynamic_sample_mask(acc, ids)
    assert keep.shape == (batch,)
    for i in range(batch):
        same = acc[ids == ids[i]]
        assert bool(keep[i]) == (same.numel() > 1 and bool((same != same[0]).any()))
    n_groups = len(set(ids.tolist()))
    kept_groups = len({int(x) for x, k in zip(ids, keep, strict=True) if k})
    # float32 counts are exact; their quotient is rounded once
    fraction = kept_group_fraction(keep, ids).item()
    assert fraction == pytest.approx(kept_groups / n_groups, rel=unit_roundoff(torch.float32))


def test_filter_on_accuracy_not_on_shaped_reward() -> None:
    # all four answers wrong, but of different lengths: the overlong penalty gives the
    # shaped reward a spread; the group must still be dropped (a known peer bug)
    acc = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    lengths = torch.tensor([10, 19, 20, 30])
    shaped = acc + overlong_reward(lengths, max_len=20, cache_len=4)
    assert bool(dynamic_sample_mask(shaped)[0])  # what filtering the shaped reward would do
    assert not bool(dynamic_sample_mask(acc)[0])


def test_tolerance_and_singletons() -> None:
    metric = torch.tensor([[0.5, 0.5 + 1e-9], [0.1, 0.9]], dtype=torch.float64)
    assert dynamic_sample_mask(metric).tolist() == [True, True]
    assert dynamic_sample_mask(metric, atol=1e-6).tolist() == [False, True]
    assert dynamic_sample_mask(torch.tensor([[1.0], [0.0]])).tolist() == [False, False]
    assert dynamic_sample_mask(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([3, 3, 8])).tolist() == [
        True,
        True,
        False,
    ]


def test_kept_fraction_and_next_round() -> None:
    keep = torch.tensor([True, False, False, True])
    assert kept_group_fraction(keep).item() == 0.5
    assert prompts_to_generate(96, 0.4, max_prompts=512) == 240
    assert prompts_to_generate(96, 0.0, max_prompts=512) == 512  # capped
    assert prompts_to_generate(0, 0.3, max_prompts=512) == 0
    with pytest.raises(ValueError, match="kept_fraction"):
        prompts_to_generate(4, 1.5, max_prompts=8)


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"groups_needed": _NAN}, "groups_needed"),
        ({"groups_needed": _INF}, "groups_needed"),
        ({"groups_needed": 2.5}, "groups_needed"),
        ({"kept_fraction": _NAN}, "kept_fraction"),
        ({"kept_fraction": _INF}, "kept_fraction"),
        ({"min_fraction": _NAN}, "min_fraction"),
        ({"max_prompts": _NAN}, "max_prompts"),
        ({"max_prompts": _INF}, "max_prompts"),
    ],
)
def test_prompts_to_generate_refuses_nan_and_inf(kwargs: dict[str, float], name: str) -> None:
    """NaN/inf options raise InputError naming the argument, not a raw ValueError or
    OverflowError from math.ceil (issue 15, item 4)."""
    from dapo_ops import InputError

    args: dict[str, float] = {"groups_needed": 96, "kept_fraction": 0.4, "max_prompts": 512}
    with pytest.raises(InputError, match=name):
        prompts_to_generate(**{**args, **kwargs})  # type: ignore[arg-type]
