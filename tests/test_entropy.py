"""The entropy bonus and the adaptive entropy coefficient (dapo_ops.engine.entropy)."""

from __future__ import annotations

import math

import pytest
import torch
from _bounds import assert_within, gamma_ref
from _strategies import MODES, make_batch
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d

F64 = torch.float64


def _entropy(batch: int, seq: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.rand(batch, seq, generator=g, dtype=F64)).to(dtype)


@given(
    st.integers(1, 6),
    st.integers(1, 12),
    st.integers(0, 2**31 - 1),
    st.sampled_from(MODES),
    st.sampled_from([0.0, 0.01, -0.3, 2.5]),
)
def test_bonus_is_minus_coef_times_the_aggregate(
    batch: int, seq: int, seed: int, mode: str, coef: float
) -> None:
    """Bitwise ``-(coef * token_level_aggregate(...))``: the same operations."""
    h = _entropy(batch, seq, seed)
    mask = make_batch(batch, seq, seed).mask
    got = d.entropy_bonus(h, mask, coef=coef, mode=mode, max_len=seq + 3)  # type: ignore[arg-type]
    agg = d.token_level_aggregate(h, mask, mode=mode, max_len=seq + 3)  # type: ignore[arg-type]
    assert torch.equal(got, -(coef * agg))
    assert got.dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
def test_bonus_gradcheck_float64(mode: str) -> None:
    b = make_batch(4, 7, 3)
    h = _entropy(4, 7, 3, F64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: d.entropy_bonus(x, b.mask, coef=0.7, mode=mode, max_len=9),  # type: ignore[arg-type]
        (h,),
    )
    c = torch.tensor(0.3, dtype=F64)
    assert torch.autograd.gradcheck(
        lambda x: d.entropy_bonus(x, b.mask, coef=c, mode=mode, normalizer=5.0),  # type: ignore[arg-type]
        (h,),
    )


@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**31 - 1), st.sampled_from(MODES))
def test_masked_garbage_changes_no_bit(batch: int, seq: int, seed: int, mode: str) -> None:
    h = _entropy(batch, seq, seed).requires_grad_()
    mask = make_batch(batch, seq, seed).mask
    clean = d.entropy_bonus(h, mask, coef=0.05, mode=mode)  # type: ignore[arg-type]
    (g_clean,) = torch.autograd.grad(clean, h)
    junk = torch.where(mask, h.detach(), torch.nan).requires_grad_()
    dirty = d.entropy_bonus(junk, mask, coef=0.05, mode=mode)  # type: ignore[arg-type]
    (g_dirty,) = torch.autograd.grad(dirty, junk)
    assert torch.equal(clean, dirty) and torch.equal(g_clean, g_dirty)
    assert bool((g_dirty[~mask] == 0).all())


@given(
    st.integers(2, 8),
    st.integers(1, 10),
    st.integers(0, 2**31 - 1),
    st.sampled_from(MODES),
    st.integers(1, 4),
)
def test_micro_batches_add_up_to_the_batch(
    batch: int, seq: int, seed: int, mode: str, parts: int
) -> None:
    """With ``normalizer=global_normalizer(...)`` the micro-batch bonuses (and gradients) add
    up to the whole batch's. float64: each side is a sum of ``batch * seq`` terms
    ``|c| h / N`` (plus, per row, a division), so both lie within
    ``gamma_ref(batch * seq + 2) * |c| * sum|h| / N``-type bounds of the exact value."""
    h = _entropy(batch, seq, seed, F64)
    mask = make_batch(batch, seq, seed).mask
    coef = 0.37
    whole = d.entropy_bonus(h, mask, coef=coef, mode=mode, max_len=seq)  # type: ignore[arg-type]
    rows = torch.tensor_split(torch.arange(batch), parts)
    norm = d.global_normalizer([mask[r] for r in rows], mode=mode)  # type: ignore[arg-type]
    split = sum(
        d.entropy_bonus(h[r], mask[r], coef=coef, mode=mode, normalizer=norm, max_len=seq)  # type: ignore[arg-type]
        for r in rows
    )
    # the largest weight of one entry is |c| / min(N, |S| * min n_i): |c| * sum |h| bounds it
    scale = coef * float(h.abs().sum()) + 1.0
    assert_within(torch.as_tensor(split), whole, 2 * gamma_ref(batch * seq + 4, F64) * scale)


def test_entropy_gradient_reaches_the_logits() -> None:
    """The bonus's gradient flows through token_logprobs_and_entropy into the logits:
    float64 gradcheck of the composition."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64).requires_grad_()
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    mask = torch.tensor([[True, True, False], [True, False, False]])

    def f(x: torch.Tensor) -> torch.Tensor:
        out = d.token_logprobs_and_entropy(x, tokens)
        return d.entropy_bonus(out.entropy, mask, coef=0.2)

    assert torch.autograd.gradcheck(f, (logits,))
    (grad,) = torch.autograd.grad(f(logits), logits)
    assert bool((grad[0, :2] != 0).any()) and bool((grad[0, 2] == 0).all())


def test_tensor_coef_matches_the_number() -> None:
    h, mask = _entropy(3, 4, 1), make_batch(3, 4, 1).mask
    for c in (0.0, 0.01, -2.0):
        number = d.entropy_bonus(h, mask, coef=c)
        tensor = d.entropy_bonus(h, mask, coef=torch.tensor(c))
        # one product in float32 either way; the Python number is rounded to float32 once
        assert_within(tensor, number.double(), 3 * 2.0**-24 * abs(float(number)))
    assert d.entropy_bonus(h, mask, coef=torch.tensor(0.5, dtype=F64)).dtype == F64


@pytest.mark.usefixtures("no_runtime_typecheck")  # dynamo cannot trace beartype's checks
def test_bonus_compiles_fullgraph() -> None:
    h, mask = _entropy(3, 4, 2), make_batch(3, 4, 2).mask
    fn = torch.compile(
        lambda x, m, c: d.entropy_bonus(x, m, coef=c, mode="seq_mean_token_mean", normalizer=3.0),
        fullgraph=True,
        backend="eager",
    )
    c = torch.tensor(0.1)
    assert torch.equal(
        fn(h, mask, c),
        d.entropy_bonus(h, mask, coef=c, mode="seq_mean_token_mean", normalizer=3.0),
    )


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, users see
def test_bonus_refuses_bad_coefficients() -> None:
    h, mask = _entropy(2, 3, 0), make_batch(2, 3, 0).mask
    for bad in (math.nan, math.inf, "0.1", torch.ones(2), torch.tensor(1)):
        with pytest.raises(d.InputError, match="coef"):
            d.entropy_bonus(h, mask, coef=bad)  # type: ignore[arg-type]
    with pytest.raises(d.InputError, match="coef"):
        d.entropy_bonus(h, mask, coef=torch.tensor(0.1, requires_grad=True))


# --------------------------------------------------------------------------- the controller


def _skywork(coef: float, entropy: float, t: float, delta: float, lo: float, hi: float) -> float:
    """Skywork-OR1's rule as stated in its paper (sec. 4) and TRL's docs."""
    return min(coef + delta, hi) if entropy <= t else max(coef - delta, lo)


@given(
    st.floats(0.0, 1.0),
    st.floats(0.0, 3.0) | st.just(math.inf),
    st.floats(0.0, 1.0),
    st.floats(0.0, 0.1),
)
def test_controller_step_is_the_rule(coef: float, entropy: float, t: float, delta: float) -> None:
    got = d.adaptive_entropy_coef(coef, entropy, target=t, delta=delta, coef_min=0.0, coef_max=0.5)
    want = _skywork(coef, entropy, t, delta, 0.0, 0.5)
    assert got.coef == want
    assert got.applied == (want if entropy <= t else 0.0)
    assert isinstance(got.coef, float) and isinstance(got.applied, float)
    # the tensor path (float64) runs the same IEEE operations
    tensor = d.adaptive_entropy_coef(
        torch.tensor(coef, dtype=F64),
        torch.tensor(entropy, dtype=F64),
        target=t,
        delta=delta,
        coef_min=0.0,
        coef_max=0.5,
    )
    assert float(tensor.coef) == want and float(tensor.applied) == got.applied


def test_controller_over_steps() -> None:
    """A run: the coefficient climbs while the entropy is low, is switched off above the
    target, and stays within [coef_min, coef_max]."""
    coef, applied = 0.0, 0.0  # before the first measurement nothing is applied (TRL)
    seen = []
    for e in [0.1, 0.1, 0.1, 0.5, 0.5, 0.5, 0.5, 0.1]:
        coef, applied = d.adaptive_entropy_coef(coef, e, target=0.2, delta=0.01, coef_max=0.025)
        seen.append((round(coef, 12), round(applied, 12)))
    assert seen == [
        (0.01, 0.01),
        (0.02, 0.02),
        (0.025, 0.025),
        (0.015, 0.0),
        (0.005, 0.0),
        (0.0, 0.0),
        (0.0, 0.0),
        (0.01, 0.01),
    ]


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_controller_tensors_no_sync_and_nan() -> None:
    c = torch.tensor(0.1)
    out = d.adaptive_entropy_coef(c, torch.tensor(math.nan))
    assert bool(out.coef.isnan()) and bool(out.applied.isnan())  # type: ignore[union-attr]
    fn = torch.compile(
        lambda c, e: d.adaptive_entropy_coef(c, e, target=0.2), fullgraph=True, backend="eager"
    )
    got = fn(c, torch.tensor(0.1))
    assert float(got.coef) == pytest.approx(0.105) and float(got.applied) == float(got.coef)
    with pytest.raises(d.InputError, match="entropy"):
        d.adaptive_entropy_coef(0.1, torch.tensor(0.3, requires_grad=True))


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_controller_refuses_bad_options() -> None:
    for kwargs, name in [
        ({"entropy": math.nan}, "entropy"),
        ({"coef": math.inf}, "coef"),
        ({"delta": -0.1}, "delta"),
        ({"coef_min": 0.5, "coef_max": 0.1}, "coef_min"),
        ({"target": math.nan}, "target"),
    ]:
        args = {"coef": 0.1, "entropy": 0.3, **kwargs}
        with pytest.raises(d.InputError, match=name):
            d.adaptive_entropy_coef(**args)  # type: ignore[arg-type]
