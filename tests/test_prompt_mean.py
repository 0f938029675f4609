"""SkyRL's ``prompt_mean`` aggregation: definition, micro-batches, masking, gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d


def _reference(loss: torch.Tensor, mask: torch.Tensor, uid: torch.Tensor) -> float:
    """The definition, in Python: the mean over prompts of each prompt's token mean."""
    per_prompt: dict[int, list[float]] = {}
    for i, g in enumerate(uid.tolist()):
        vals = [float(v) for v, m in zip(loss[i].tolist(), mask[i].tolist(), strict=True) if m]
        per_prompt.setdefault(g, []).extend(vals)
    means = [sum(v) / len(v) for v in per_prompt.values() if v]
    return sum(means) / len(means) if means else 0.0


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ragged masks (empty rows and whole empty prompts included), ids of any value and
    order, groups of uneven size."""
    batch = draw(st.integers(1, 9))
    seq = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, seq, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, seq, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    ids = draw(st.lists(st.integers(-5, 1000), min_size=batch, max_size=batch))
    return loss, mask, torch.tensor(ids)


@given(batches())
def test_equals_the_definition(case: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    loss, mask, uid = case
    got = d.prompt_mean_aggregate(loss, mask, uid)
    assert got.dtype == torch.float64
    assert math.isclose(float(got), _reference(loss, mask, uid), rel_tol=1e-12, abs_tol=1e-12)


@given(batches(), st.integers(1, 4), st.randoms(use_true_random=False))
def test_micro_batches_add_up_with_the_steps_weights(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor], parts: int, rnd: object
) -> None:
    """Rows dealt to micro-batches in any order (prompts split across them): the weighted
    token sums of the micro-batches add up to the step's loss."""
    loss, mask, uid = case
    w = d.prompt_mean_weights(mask, uid, dtype=torch.float64)
    order = list(range(loss.shape[0]))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    shares = [
        d.token_level_aggregate(loss[rows] * w[rows], mask[rows], normalizer=1)
        for rows in (torch.tensor(order[k::parts], dtype=torch.int64) for k in range(parts))
        if len(rows)
    ]
    full = d.prompt_mean_aggregate(loss, mask, uid)
    assert math.isclose(float(sum(shares)), float(full), rel_tol=1e-12, abs_tol=1e-12)


@given(batches())
def test_whole_prompt_micro_batches_add_up_with_the_global_prompt_count(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    loss, mask, uid = case
    prompts = sorted(set(uid.tolist()))
    count = sum(1 for p in prompts if mask[uid == p].any())
    if count == 0:
        return
    total = sum(
        d.prompt_mean_aggregate(loss[uid == p], mask[uid == p], uid[uid == p], num_prompts=count)
        for p in prompts
    )
    assert math.isclose(float(total), float(d.prompt_mean_aggregate(loss, mask, uid)), rel_tol=1e-12, abs_tol=1e-12)  # fmt: skip


@given(batches())
def test_weights_sum_to_one_per_prompt_over_valid_tokens(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    _, mask, uid = case
    w = d.prompt_mean_weights(mask, uid, dtype=torch.float64)
    assert w.shape == (mask.shape[0], 1)
    per_row = (w[:, 0] * mask.sum(-1)).tolist()
    totals: dict[int, float] = {}
    for g, v in zip(uid.tolist(), per_row, strict=True):
        totals[g] = totals.get(g, 0.0) + v
    live = [t for g, t in totals.items() if mask[uid == g].any()]
    for t in live:
        assert math.isclose(t, 1.0 / len(live), rel_tol=1e-12)
    assert all(float(w[i]) == 0.0 for i in range(len(uid)) if not mask[uid == uid[i]].any())


def test_skyrl_example_and_padding_rows() -> None:
    """SkyRL's own test example (rows 0, 1 -> p0; 2, 3 -> p1: (2.0 + 6.5) / 2), and rows
    of a prompt with no valid token carry no weight and are not counted as prompts."""
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [0, 0]])
    uid = torch.tensor([0, 0, 1, 1, 2])
    assert float(d.prompt_mean_aggregate(loss, mask, uid)) == 4.25
    assert float(d.prompt_mean_weights(mask, uid)[4, 0]) == 0.0
    assert float(d.prompt_mean_aggregate(loss, torch.zeros_like(mask), uid)) == 0.0


def test_masked_garbage_changes_nothing_bitwise() -> None:
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) < 0.6
    uid = torch.tensor([3, 1, 3, 1, 7, 7])
    junk = torch.tensor([math.nan, math.inf, -math.inf]).repeat(30)[: int((~mask).sum())]
    dirty = loss.clone()
    dirty[~mask] = junk
    a, b = loss.clone().requires_grad_(), dirty.clone().requires_grad_()
    la, lb = d.prompt_mean_aggregate(a, mask, uid), d.prompt_mean_aggregate(b, mask, uid)
    la.backward()
    lb.backward()
    assert torch.equal(la, lb)
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, b.grad)
    assert torch.equal(a.grad[~mask], torch.zeros_like(a.grad[~mask]))


def test_gradcheck() -> None:
    g = torch.Generator().manual_seed(1)
    loss = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 4, generator=g) < 0.7
    uid = torch.tensor([2, 0, 2, 0, 9])
    assert torch.autograd.gradcheck(lambda x: d.prompt_mean_aggregate(x, mask, uid), (loss,))


def test_float32_in_float32_out_and_bf16_upcast() -> None:
    mask = torch.ones(2, 3, dtype=torch.bool)
    uid = torch.tensor([0, 1])
    assert d.prompt_mean_aggregate(torch.ones(2, 3), mask, uid).dtype == torch.float32
    assert d.prompt_mean_aggregate(torch.ones(2, 3, dtype=torch.bfloat16), mask, uid).dtype == torch.float32  # fmt: skip
    assert d.prompt_mean_weights(mask, uid).dtype == torch.float32


def test_policy_loss_composition_matches_folding_into_advantages() -> None:
    """SkyRL folds w_i into the advantages and sums: the same for PPO's clip (positively
    homogeneous in the advantage)."""
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(6, 5, generator=g, dtype=torch.float64) - 0.5
    logp = (old + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)).clamp(max=-0.01)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=g) < 0.8
    uid = torch.tensor([0, 0, 0, 4, 4, 4])
    obj = d.ClipHigher()
    ours = d.prompt_mean_aggregate(d.per_token_loss(obj, logp, old, adv, mask), mask, uid)
    w = d.prompt_mean_weights(mask, uid, dtype=torch.float64)[:, 0]
    folded = d.policy_loss(obj, logp, old, adv * w, mask, normalizer=1)
    assert math.isclose(float(ours), float(folded), rel_tol=1e-12)


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_compiles_fullgraph_with_its_backward() -> None:
    torch._dynamo.reset()
    fn = torch.compile(d.prompt_mean_aggregate, fullgraph=True, backend="aot_eager")
    loss = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    mask, uid = torch.rand(4, 3) < 0.5, torch.tensor([5, 2, 5, 2])
    got = fn(loss, mask, uid)
    (grad,) = torch.autograd.grad(got, loss)
    want = d.prompt_mean_aggregate(loss, mask, uid)
    (want_grad,) = torch.autograd.grad(want, loss)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)


def test_local_count_refused_under_multi_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    mask, uid = torch.ones(2, 2, dtype=torch.bool), torch.tensor([0, 1])
    with pytest.raises(d.InputError, match="num_prompts"):
        d.prompt_mean_weights(mask, uid)
    assert d.prompt_mean_weights(mask, uid, num_prompts="local").shape == (2, 1)
