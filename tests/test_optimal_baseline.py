"""optimal_token_baseline_advantages: against the per-group float64 definition, within the
bound derived in tests/_otb_reference.py; masking, compile, the two alignments. Parity with
verl's own functions is in tests/integration/test_verl_optimal_baseline.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _bounds import F64, assert_within
from _otb_reference import otb_reference
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d

F32 = torch.float32


def otb_batch(
    seed: int, rows: int, seq: int, *, holes: bool, dtype: torch.dtype = F64, sharp: float = 3.0
) -> dict[str, Any]:
    """Consistent inputs: old_logp and sum_pi_squared of one softmax (so w >= 0), ragged
    right-padded rows (some empty), optionally holes inside rows, uneven groups."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, seq + 1, (rows,), generator=g)
    mask = torch.arange(seq) < lengths[:, None]
    if holes:
        mask &= torch.rand(rows, seq, generator=g) > 0.3
    logits = torch.randn(rows, seq, 6, generator=g, dtype=F64) * sharp
    p = logits.softmax(-1)
    tokens = torch.randint(0, 6, (rows, seq), generator=g)
    return {
        "rewards": torch.randn(rows, seq, generator=g, dtype=F64).to(dtype),
        "old_logp": p.gather(-1, tokens[..., None]).squeeze(-1).log().to(dtype),
        "sum_pi_squared": p.square().sum(-1).to(dtype),
        "mask": mask,
        "group_ids": torch.randint(0, max(1, rows // 3), (rows,), generator=g) * 5,
    }


@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 10),
    seq=st.integers(1, 8),
    holes=st.booleans(),
    align=st.sampled_from(["position", "response_token"]),
    zero_tail=st.booleans(),
    with_is=st.booleans(),
    dtype=st.sampled_from([F32, F64]),
)
def test_equals_the_per_group_definition(
    seed: int,
    rows: int,
    seq: int,
    holes: bool,
    align: str,
    zero_tail: bool,
    with_is: bool,
    dtype: torch.dtype,
) -> None:
    b = otb_batch(seed, rows, seq, holes=holes, dtype=dtype)
    rho = None
    if with_is:
        rho = (torch.rand(rows, seq, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    adv, ret = d.optimal_token_baseline_advantages(
        **b, is_weights=rho, align=align, zero_tail=zero_tail
    )
    assert adv.dtype == ret.dtype == dtype
    want, want_ret, bound, ret_bound = otb_reference(
        **b, is_weights=rho, align=align, zero_tail=zero_tail, dtype=dtype
    )
    assert_within(adv, want, bound, f"advantages ({align})")
    assert_within(ret, want_ret, ret_bound, "returns")
    assert bool((adv[~b["mask"]] == 0).all())


@given(seed=st.integers(0, 2**31 - 1), align=st.sampled_from(["position", "response_token"]))
def test_masked_entries_change_nothing(seed: int, align: str) -> None:
    b = otb_batch(seed, 8, 6, holes=True)
    clean = d.optimal_token_baseline_advantages(**b, align=align, is_weights=torch.ones(8, 6))
    dirty = dict(b)
    junk = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(16)[:48].view(8, 6)
    for name in ("rewards", "old_logp", "sum_pi_squared"):
        dirty[name] = torch.where(b["mask"], b[name], junk.double())
    rho = torch.where(b["mask"], 1.0, junk)
    got = d.optimal_token_baseline_advantages(**dirty, align=align, is_weights=rho)
    for x, y in zip(got, clean, strict=True):
        assert torch.equal(x, y)


@given(seed=st.integers(0, 2**31 - 1))
def test_alignments_agree_on_right_padded_rows_that_are_not_empty(seed: int) -> None:
    """Without holes and empty rows, the k-th valid token is at position k: the two
    alignments run the same arithmetic on the same values (bitwise)."""
    b = otb_batch(seed, 9, 7, holes=False)
    b["mask"][:, 0] = True
    pos = d.optimal_token_baseline_advantages(**b)
    tok = d.optimal_token_baseline_advantages(**b, align="response_token")
    assert torch.equal(pos[0], tok[0]) and torch.equal(pos[1], tok[1])


def test_empty_rows_count_in_the_group_only_with_position_alignment() -> None:
    """verl's optimal_token_baseline groups every row (an empty one too: a group of one
    response and one empty row gets a baseline), the tir_ variant only responses."""
    r = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=F64)
    old = torch.full((2, 2), -1.0, dtype=F64)
    s2 = torch.full((2, 2), 0.3, dtype=F64)
    mask = torch.tensor([[True, True], [False, False]])
    ids = torch.tensor([0, 0])
    ret = torch.tensor([[3.0, 2.0], [0.0, 0.0]], dtype=F64)
    for align in ("position", "response_token"):
        # zero tail: the one longest response has no partner from slot 0 on: baseline 0
        adv, _ = d.optimal_token_baseline_advantages(r, old, s2, mask, ids, align=align)
        assert torch.equal(adv, ret)
    pos, _ = d.optimal_token_baseline_advantages(r, old, s2, mask, ids, zero_tail=False)
    tok, _ = d.optimal_token_baseline_advantages(
        r, old, s2, mask, ids, zero_tail=False, align="response_token"
    )
    assert torch.equal(tok, ret)  # a group of one response: no baseline
    assert bool((pos[0].abs() < 1e-6).all())  # its own return as the baseline, up to eps


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, not jaxtyping's
def test_options_are_checked() -> None:
    b = otb_batch(0, 4, 3, holes=False)
    for bad in ({"align": "turn"}, {"eps": -1.0}, {"zero_tail": 1}):
        with pytest.raises(d.InputError, match=next(iter(bad))):
            d.optimal_token_baseline_advantages(**b, **bad)  # type: ignore[arg-type]
    with pytest.raises(d.InputError, match="group_ids"):
        d.optimal_token_baseline_advantages(**{**b, "group_ids": b["group_ids"][:2]})


@pytest.mark.usefixtures("no_runtime_typecheck")  # dynamo cannot trace jaxtyping's checker
@pytest.mark.parametrize("align", ["position", "response_token"])
def test_compiles_without_graph_break(align: str) -> None:
    b = otb_batch(3, 12, 7, holes=True)
    torch._dynamo.reset()
    fn = torch.compile(
        lambda **kw: d.optimal_token_baseline_advantages(**kw, align=align),
        fullgraph=True,
        backend="aot_eager",
    )
    adv, ret = fn(**b)
    want, want_ret, bound, ret_bound = otb_reference(**b, align=align)
    assert_within(adv, want, bound, "compiled advantages")
    assert_within(ret, want_ret, ret_bound, "compiled returns")
