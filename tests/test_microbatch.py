"""Micro-batch split invariance of the aggregated loss (single process).

Property: however a batch is cut into micro-batches (and however each micro-batch is
padded), passing ``normalizer=global_normalizer(micro_masks, mode=mode)`` makes the
micro-batch losses add up to the full-batch loss, for every mode, and so do their
gradients w.r.t. ``logp``; the summed ``aggregate_partial`` pairs give the same value.
The naive per-micro-batch count (``normalizer="local"``, averaged over micro-batches)
does not, which the fixed example at the bottom pins down with exact numbers.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from _bounds import assert_within, func_rel, loss_reference, unit_roundoff
from _strategies import MODES
from hypothesis import given
from hypothesis import strategies as st

from dapo_ops import (
    PartialLoss,
    aggregate_partial,
    clip_higher_surrogate,
    global_normalizer,
    token_level_aggregate,
    token_level_loss,
)

MAX_CONTENT = 7  # longest response (valid span) of a row
MAX_PAD = 3  # extra right padding a micro-batch may carry
MAX_LEN = MAX_CONTENT + MAX_PAD + 1  # Dr. GRPO's constant L, >= every padded length
#: Relative error bound of the fixed example's float32 values: one exp (of 0), sums of
#: exact integers, at most four roundings (see tests/_bounds.py).
REL = func_rel(torch.float32) + 4 * unit_roundoff(torch.float32)


@dataclass
class Split:
    """A batch of ``rows`` responses and a partition of its rows into micro-batches."""

    content: list[int]  # valid span of each row, 0 = empty row
    mask_kind: list[str]  # "full" span, "holes" inside the span, or "none" (all masked)
    bounds: list[tuple[int, int]]  # [start, stop) rows of each micro-batch
    pads: list[int]  # extra padding of each micro-batch
    full_pad: int  # extra padding of the full batch
    masked_micro: int | None  # a micro-batch whose mask is entirely False
    seed: int
    dtype: torch.dtype


@st.composite
def splits(draw: st.DrawFn) -> Split:
    rows = draw(st.integers(1, 8))
    content = draw(st.lists(st.integers(0, MAX_CONTENT), min_size=rows, max_size=rows))
    mask_kind = draw(
        st.lists(st.sampled_from(["full", "holes", "none"]), min_size=rows, max_size=rows)
    )
    cuts = draw(st.sets(st.integers(1, rows - 1), max_size=3)) if rows > 1 else set()
    edges = [0, *sorted(cuts), rows]
    bounds = list(itertools.pairwise(edges))
    pads = draw(st.lists(st.integers(0, MAX_PAD), min_size=len(bounds), max_size=len(bounds)))
    masked_micro = draw(st.none() | st.integers(0, len(bounds) - 1))
    return Split(
        content=content,
        mask_kind=mask_kind,
        bounds=bounds,
        pads=pads,
        full_pad=draw(st.integers(0, MAX_PAD)),
        masked_micro=masked_micro,
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
    )


def build(split: Split) -> tuple[dict[str, torch.Tensor], list[int], int]:
    """Row-major tensors of width MAX_LEN, the padded length of each micro-batch and of
    the full batch; positions past a row's span hold garbage that the mask must hide."""
    gen = torch.Generator().manual_seed(split.seed)
    rows = len(split.content)
    span = torch.arange(MAX_LEN) < torch.tensor(split.content)[:, None]
    holes = torch.rand(rows, MAX_LEN, generator=gen) > 0.3
    kind = split.mask_kind
    mask = torch.stack(
        [
            span[i] & holes[i] if kind[i] == "holes" else span[i] & (kind[i] == "full")
            for i in range(rows)
        ]
    )
    if split.masked_micro is not None:
        start, stop = split.bounds[split.masked_micro]
        mask[start:stop] = False
    logp = -3 * torch.rand(rows, MAX_LEN, generator=gen, dtype=split.dtype)
    tensors = {
        "logp": logp,
        "old_logp": -(
            logp + 0.4 * torch.randn(rows, MAX_LEN, generator=gen, dtype=split.dtype)
        ).abs(),
        "advantages": torch.randn(rows, generator=gen, dtype=split.dtype),
        "mask": mask,
    }
    # Each micro-batch is padded to its own longest span plus its own extra padding.
    lengths = [
        max(split.content[start:stop]) + pad
        for (start, stop), pad in zip(split.bounds, split.pads, strict=True)
    ]
    lengths = [max(length, 1) for length in lengths]
    full_len = max(max(split.content) + split.full_pad, 1)
    return tensors, lengths, full_len


def rows_of(t: dict[str, torch.Tensor], start: int, stop: int, seq: int) -> dict[str, torch.Tensor]:
    return {
        "logp": t["logp"][start:stop, :seq],
        "old_logp": t["old_logp"][start:stop, :seq],
        "advantages": t["advantages"][start:stop],
        "mask": t["mask"][start:stop, :seq],
    }


def loss_of(part: dict[str, torch.Tensor], mode: str, normalizer: object) -> torch.Tensor:
    return token_level_loss(
        part["logp"],
        part["old_logp"],
        part["advantages"],
        part["mask"],
        mode=mode,
        normalizer=normalizer,
        max_len=MAX_LEN,
    )


@given(split=splits())
def test_micro_batch_losses_add_up_to_full_batch(split: Split) -> None:
    base, lengths, full_len = build(split)
    for mode in MODES:
        leaf = base["logp"].clone().requires_grad_(True)
        t = {**base, "logp": leaf}
        micro = [
            rows_of(t, start, stop, seq)
            for (start, stop), seq in zip(split.bounds, lengths, strict=True)
        ]
        full = rows_of(t, 0, len(split.content), full_len)
        # Every evaluation (full batch, micro-batches, partial pairs) against the exact
        # full-batch loss and gradient, within the bound of its float32 (float64) math;
        # the micro-batch losses are summed: up to len(micro) more additions.
        exact = loss_reference(
            full["logp"],
            full["old_logp"],
            full["advantages"],
            full["mask"],
            dtype=split.dtype,
            extra_terms=len(micro),
            mode=mode,
            max_len=MAX_LEN,
        )
        grad_exact = torch.zeros_like(leaf, dtype=torch.float64)
        grad_exact[:, :full_len] = exact.grad
        grad_err = torch.zeros_like(grad_exact)
        grad_err[:, :full_len] = exact.grad_err

        # Full batch in one call, local count.
        full_loss = loss_of(full, mode, None)
        (full_grad,) = torch.autograd.grad(full_loss, leaf)

        # Micro-batches with the global normaliser: the losses and gradients add up.
        norm = global_normalizer([m["mask"] for m in micro], mode=mode)
        micro_losses = [loss_of(m, mode, norm) for m in micro]
        total = torch.stack(micro_losses).sum()
        (micro_grad,) = torch.autograd.grad(total, leaf)
        assert_within(full_loss, exact.loss, exact.loss_err, f"{mode}: full batch")
        assert_within(total, exact.loss, exact.loss_err, f"{mode}: sum of micro-batches")
        assert_within(full_grad, grad_exact, grad_err, f"{mode}: full-batch gradient")
        assert_within(micro_grad, grad_exact, grad_err, f"{mode}: micro-batch gradient")
        assert torch.isfinite(micro_grad).all()

        # Exact (numerator, denominator) pairs add up too.
        parts = [
            aggregate_partial(
                clip_higher_surrogate(m["logp"], m["old_logp"], m["advantages"], m["mask"]),
                m["mask"],
                mode=mode,
                max_len=MAX_LEN,
            )
            for m in micro
        ]
        summed = sum(parts[1:], parts[0])
        assert isinstance(summed, PartialLoss)
        assert_within(summed.value(), exact.loss, exact.loss_err, f"{mode}: partial pairs")
        # denominators are exact counts
        assert torch.equal(summed.denominator, norm.to(summed.denominator.dtype))


def test_naive_local_normaliser_differs_on_uneven_split() -> None:
    """Micro-batch A: 1 response of 3 tokens, advantage +1. Micro-batch B: 3 responses
    of 100 tokens, advantage -1. logp == old_logp, so every token's loss is -A (ratio 1):
    -1 in A, +1 in B, and its gradient w.r.t. logp is -A times the token's weight."""
    a_mask = torch.ones(1, 3, dtype=torch.bool)
    b_mask = torch.ones(3, 100, dtype=torch.bool)
    a = {"logp": torch.full((1, 3), -1.0), "advantages": torch.tensor([1.0]), "mask": a_mask}
    b = {"logp": torch.full((3, 100), -1.0), "advantages": -torch.ones(3), "mask": b_mask}
    max_len = 100
    # Full-batch values (equal to the global-normaliser sums, checked below):
    # token_mean (300 - 3) / 303; seq_mean_token_mean (1 + 1 + 1 - 1) / 4;
    # seq_mean_token_sum (300 - 3) / 4; seq_mean_token_sum_norm (300 - 3) / (4 * 100).
    # Naive: the mean over the two micro-batches of each one's locally normalised loss.
    expected = {
        "token_mean": ((300 - 3) / 303, (1 - 1) / 2),
        "seq_mean_token_mean": ((3 - 1) / 4, (1 - 1) / 2),
        "seq_mean_token_sum": ((300 - 3) / 4, (100 - 3) / 2),
        "seq_mean_token_sum_norm": ((300 - 3) / 400, (1 - 0.03) / 2),
    }
    # Weight of one token of A and one of B in the gradient (d loss / d logp = -A * weight).
    weights = {
        "token_mean": ((1 / 303, 1 / 303), (1 / 6, 1 / 600)),
        "seq_mean_token_mean": ((1 / 12, 1 / 400), (1 / 6, 1 / 600)),
        "seq_mean_token_sum": ((1 / 4, 1 / 4), (1 / 2, 1 / 6)),
        "seq_mean_token_sum_norm": ((1 / 400, 1 / 400), (1 / 200, 1 / 600)),
    }
    for mode in MODES:
        norm = global_normalizer([a_mask, b_mask], mode=mode)
        results = []
        for normalizer in (norm, "local"):
            leaves = [m["logp"].clone().requires_grad_(True) for m in (a, b)]
            losses = [
                token_level_loss(
                    leaf,
                    leaf.detach(),
                    m["advantages"],
                    m["mask"],
                    mode=mode,
                    normalizer=normalizer,
                    max_len=max_len,
                )
                for leaf, m in zip(leaves, (a, b), strict=True)
            ]
            total = sum(losses) if normalizer is norm else sum(losses) / len(losses)
            total.backward()
            w_a = -float(leaves[0].grad[0, 0])  # A = +1: grad = -weight
            w_b = float(leaves[1].grad[0, 0])  # A = -1: grad = +weight
            results.append((float(total.detach()), (w_a, w_b)))
        (global_loss, global_w), (naive_loss, naive_w) = results
        want_global, want_naive = expected[mode]
        # float32: the ratio exp(0) (one function evaluation), sums of +-1 (exact) and at
        # most four roundings (divisions by counts, * A, the mean of two): rel <= f + 4u.
        # The naive value (1 - 1) / 2 may cancel: its error is rel times the terms, <= 1.
        assert global_loss == pytest.approx(want_global, rel=REL)
        assert naive_loss == pytest.approx(want_naive, rel=REL, abs=REL)
        assert global_w == pytest.approx(weights[mode][0], rel=REL)
        assert naive_w == pytest.approx(weights[mode][1], rel=REL)
        assert abs(global_loss - naive_loss) > 0.2 * abs(global_loss)
        # The global path equals the one-call full batch (padding A to 100 tokens).
        full_mask = torch.cat([torch.nn.functional.pad(a_mask, (0, 97)), b_mask])
        full_loss = token_level_aggregate(
            torch.cat([torch.full((1, 100), -1.0), torch.ones(3, 100)]),
            full_mask,
            mode=mode,
            max_len=max_len,
        )
        assert float(full_loss) == pytest.approx(want_global, rel=REL)
