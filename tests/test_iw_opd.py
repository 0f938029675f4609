"""IW-OPD's prefix weights: definition, range, masking, compile."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d


def _reference(adv: torch.Tensor, mask: torch.Tensor, gamma: float, eps: float) -> torch.Tensor:
    """The definition, a Python loop over each row's valid tokens."""
    out = torch.zeros_like(adv, dtype=torch.float64)
    for i in range(adv.shape[0]):
        a = [abs(float(x)) if m else 0.0 for x, m in zip(adv[i], mask[i], strict=True)]
        total, before = max(sum(a), eps), 0.0
        for t, m in enumerate(mask[i].tolist()):
            if m:
                out[i, t] = 1.0 + gamma * (1.0 - before / total)
            before += a[t]
    return out


@given(
    st.integers(1, 5), st.integers(1, 8), st.integers(0, 2**31 - 1),
    st.sampled_from([0.0, 0.5, 2.0]), st.sampled_from([1e-8, 0.5]),
)  # fmt: skip
def test_equals_the_definition_and_stays_in_range(
    batch: int, seq: int, seed: int, gamma: float, eps: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(batch, seq, generator=g, dtype=torch.float64)
    adv[torch.rand(batch, seq, generator=g) < 0.2] = 0.0
    mask = torch.rand(batch, seq, generator=g) < 0.7
    w = d.iw_opd_weights(adv, mask, gamma=gamma, eps=eps)
    torch.testing.assert_close(w, _reference(adv, mask, gamma, eps), rtol=1e-12, atol=1e-12)
    assert bool((w[mask] >= 1.0 - 1e-12).all()) and bool((w[mask] <= 1.0 + gamma + 1e-12).all())
    assert bool((w[~mask] == 0).all())


def test_masked_garbage_changes_nothing_bitwise() -> None:
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.6
    dirty = adv.clone()
    dirty[~mask] = torch.tensor([math.nan, math.inf, -math.inf]).repeat(8)[: int((~mask).sum())]
    assert torch.equal(d.iw_opd_weights(adv, mask), d.iw_opd_weights(dirty, mask))


def test_constants_of_the_loss_and_dtypes() -> None:
    adv = torch.randn(2, 3, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    w = d.iw_opd_weights(adv, mask)
    assert not w.requires_grad and w.dtype == torch.float32
    assert d.iw_opd_weights(adv.detach().bfloat16(), mask).dtype == torch.float32
    assert d.iw_opd_weights(adv.detach().double(), mask).dtype == torch.float64
    zero = d.iw_opd_weights(torch.zeros(1, 3), mask[:1], gamma=0.5)
    assert torch.equal(zero, torch.full((1, 3), 1.5))


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compiles_fullgraph() -> None:
    torch._dynamo.reset()
    fn = torch.compile(d.iw_opd_weights, fullgraph=True, backend="aot_eager")
    adv, mask = torch.randn(3, 5), torch.rand(3, 5) < 0.7
    torch.testing.assert_close(fn(adv, mask, gamma=0.7), d.iw_opd_weights(adv, mask, gamma=0.7))
