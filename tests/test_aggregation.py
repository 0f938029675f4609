"""Aggregation modes: token weights, padding invariance, partial sums, normaliser."""

from __future__ import annotations

import pytest
import torch
from _bounds import assert_within, gamma, gamma_ref, unit_roundoff
from _strategies import MODES, make_batch
from hypothesis import given
from hypothesis import strategies as st

from dapo_ops import aggregate_partial, token_level_aggregate

F32 = torch.float32


def reference(loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int) -> torch.Tensor:
    """Each mode written as its definition, with a Python loop over sequences, in float64."""
    seqs = [loss[i][mask[i]].double() for i in range(loss.shape[0])]
    seqs = [s for s in seqs if s.numel() > 0]
    if not seqs:
        return torch.tensor(0.0, dtype=torch.float64)
    if mode == "token_mean":
        return torch.cat(seqs).mean()
    if mode == "seq_mean_token_mean":
        return torch.stack([s.mean() for s in seqs]).mean()
    if mode == "seq_mean_token_sum":
        return torch.stack([s.sum() for s in seqs]).mean()
    return torch.stack([s.sum() for s in seqs]).sum() / (len(seqs) * max_len)


@given(st.integers(1, 6), st.integers(1, 20), st.integers(0, 2**31 - 1), st.sampled_from(MODES))
def test_modes_match_their_definition(batch: int, seq: int, seed: int, mode: str) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, seq, generator=g)
    mask = torch.rand(batch, seq, generator=g) < 0.6
    got = token_level_aggregate(loss, mask, mode=mode, max_len=32)  # type: ignore[arg-type]
    assert got.dtype == torch.float32 and got.shape == ()
    assert_within(got, reference(loss, mask, mode, 32), aggregate_bound(loss, mask, mode, 32))


def aggregate_bound(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, max_len: int, extra_terms: int = 0
) -> torch.Tensor:
    """Float32 error bound of any evaluation of a mode: each is a positive combination of
    the masked losses, a sum over at most ``batch * seq`` terms (rows then sequences, or
    all at once; any order, plus ``extra_terms`` further additions), and at most two
    divisions by exact counts: ``gamma(batch * seq + 2 + extra) * mode(|loss|)``."""
    n = loss.numel() + 2 + extra_terms
    return gamma_ref(n, F32) * reference(loss.abs(), mask, mode, max_len)


@given(st.integers(1, 5), st.integers(1, 12), st.integers(0, 12), st.integers(0, 2**31 - 1))
def test_token_mean_ignores_padding(batch: int, seq: int, pad: int, seed: int) -> None:
    b = make_batch(batch, seq, seed)
    loss = b.logp.clone().requires_grad_(True)
    base = token_level_aggregate(loss, b.mask)
    (grad,) = torch.autograd.grad(base, loss)
    # Garbage (NaN) in the masked positions changes nothing, gradient included: bitwise.
    garbage = torch.where(b.mask, b.logp, torch.tensor(float("nan"))).requires_grad_(True)
    same = token_level_aggregate(garbage, b.mask)
    (same_grad,) = torch.autograd.grad(same, garbage)
    assert torch.equal(same, base) and torch.equal(same_grad, grad)
    # Extra padding columns change the shape, so the sum may run in another order: the
    # padded loss and the plain mean of the valid tokens are within the float32 bound of
    # the exact mean.
    padded = torch.cat([b.logp, torch.full((batch, pad), float("nan"))], dim=1)
    padded_mask = torch.cat([b.mask, torch.zeros(batch, pad, dtype=torch.bool)], dim=1)
    with_padding = token_level_aggregate(padded, padded_mask)
    valid = b.logp[b.mask].double()
    if valid.numel() == 0:
        assert base.item() == with_padding.item() == 0.0  # documented: 0, never NaN
        return
    bound = gamma_ref(padded.numel() + 2, F32) * valid.abs().mean()
    assert_within(base, valid.mean(), bound, "token_mean")
    assert_within(with_padding, valid.mean(), bound, "token_mean, padded")
    assert_within(b.logp[b.mask].mean(), valid.mean(), bound, "mean of the valid tokens")


def token_weights(lengths: list[int], mode: str) -> torch.Tensor:
    """d loss / d per_token_loss: the weight each token gets."""
    seq = max(lengths)
    mask = torch.arange(seq) < torch.tensor(lengths)[:, None]
    loss = torch.zeros(len(lengths), seq, requires_grad=True)
    token_level_aggregate(loss, mask, mode=mode).backward()  # type: ignore[arg-type]
    assert loss.grad is not None
    return loss.grad


def test_long_answer_weighs_20x_under_token_mean_and_equal_under_grpo() -> None:
    # a weight is 1 over exact counts, at most two roundings; the ratio of the row sums
    # adds the float32 sums of 200 and 10 weights and one division
    one = 2 * unit_roundoff(F32)
    ratio = gamma(199 + 9 + 1, F32) + one
    w = token_weights([200, 10], "token_mean")
    assert w[0, 0].item() == pytest.approx(1 / 210, rel=one)
    assert w[1, 0].item() == pytest.approx(1 / 210, rel=one)
    assert (w[0].sum() / w[1].sum()).item() == pytest.approx(20.0, rel=ratio)
    w = token_weights([200, 10], "seq_mean_token_mean")
    assert w[0, 0].item() == pytest.approx(1 / 400, rel=one)
    assert w[1, 0].item() == pytest.approx(1 / 20, rel=one)
    assert (w[0].sum() / w[1].sum()).item() == pytest.approx(1.0, rel=ratio)


@pytest.mark.parametrize("mode", MODES)
def test_all_masked_gives_zero_loss_and_zero_grad(mode: str) -> None:
    loss = torch.full((3, 4), float("nan"), requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = token_level_aggregate(loss, mask, mode=mode)  # type: ignore[arg-type]
    out.backward()
    assert out.item() == 0.0
    assert loss.grad is not None and bool((loss.grad == 0).all())


@pytest.mark.parametrize("mode", MODES)
def test_partial_sums_add_up(mode: str) -> None:
    b = make_batch(7, 9, 3)
    whole = token_level_aggregate(b.logp, b.mask, mode=mode, max_len=9)  # type: ignore[arg-type]
    parts = [
        aggregate_partial(b.logp[s], b.mask[s], mode=mode, max_len=9)  # type: ignore[arg-type]
        for s in (slice(0, 2), slice(2, 3), slice(3, 7))
    ]
    total = parts[0] + parts[1] + parts[2]
    # the parts sum in another order than the whole batch: each within the bound
    exact = reference(b.logp, b.mask, mode, 9)
    bound = aggregate_bound(b.logp, b.mask, mode, 9, extra_terms=2)
    assert_within(whole, exact, bound, "whole batch")
    assert_within(total.value(), exact, bound, "sum of the parts")
    assert torch.equal(total.denominator, aggregate_partial(b.logp, b.mask, mode=mode).denominator)
    with_norm = sum(
        token_level_aggregate(
            b.logp[s],
            b.mask[s],
            mode=mode,  # type: ignore[arg-type]
            normalizer=total.denominator,
            max_len=9,
        )
        for s in (slice(0, 2), slice(2, 3), slice(3, 7))
    )
    assert isinstance(with_norm, torch.Tensor)
    assert_within(with_norm, exact, bound, "parts with the global normaliser")


def test_integer_masks_accepted_float_masks_refused() -> None:
    loss = torch.randn(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expect = token_level_aggregate(loss, mask.bool())
    for dtype in (torch.uint8, torch.int32, torch.int64):  # the same bool mask: bitwise
        assert torch.equal(token_level_aggregate(loss, mask.to(dtype)), expect)
    with pytest.raises(ValueError, match="mask"):
        token_level_aggregate(loss, mask.float())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "sum"}, "mode"),
        ({"normalizer": 0}, "normalizer"),
        ({"normalizer": -3.0}, "normalizer"),
        ({"normalizer": torch.ones(2)}, "normalizer"),
        ({"mode": "seq_mean_token_sum_norm", "max_len": 0}, "max_len"),
    ],
)
def test_bad_options(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        token_level_aggregate(torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool), **kwargs)  # type: ignore[arg-type]


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="mask"):
        token_level_aggregate(torch.randn(2, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask"):
        token_level_aggregate(torch.randn(2, 3), torch.ones(3, dtype=torch.bool))  # no broadcast


def test_gradcheck_float64() -> None:
    b = make_batch(3, 5, 4, dtype=torch.float64)
    for mode in MODES:
        x = b.logp.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(
            lambda t, m=mode: token_level_aggregate(t, b.mask, mode=m),  # type: ignore[misc]
            (x,),
        )
