"""verl 0.9.1's optimal_token_baseline and tir_optimal_token_baseline against ours, float64.

The same random batches (right-padded rows, empty rows, holes inside rows as a multi-turn
rollout's tool tokens, one-sample groups, ties for the longest response, with and without
rollout IS weights, and extreme values: near-deterministic tokens with w ~ 0, probabilities
of e^-700, rewards of 1e6, IS weights of 1e3) go to verl's registered estimators and to
:func:`dapo_ops.optimal_token_baseline_advantages`, directly and through our registered
``dapo_ops_*`` functions. Each result must lie within the rounding bound of
tests/_otb_reference.py around the per-group float64 definition (the same bound for verl's
result and ours: two float64 evaluations of one formula, summed in different orders).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _bounds import F64, assert_within
from _otb_reference import otb_reference

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

import dapo_ops as d  # noqa: E402
from dapo_ops.integrations import verl as integration  # noqa: E402
from dapo_ops.integrations import verl_estimators  # noqa: E402

pytestmark = pytest.mark.integration

integration.register()

NAMES = {"optimal_token_baseline": "position", "tir_optimal_token_baseline": "response_token"}


def batch(seed: int, rows: int = 16, seq: int = 9, *, extreme: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, seq + 1, (rows,), generator=g)
    lengths[0], lengths[1] = 0, seq  # an empty row and a full one
    mask = torch.arange(seq) < lengths[:, None]
    if seed % 2:  # holes: tool tokens inside a response
        mask &= torch.rand(rows, seq, generator=g) > 0.3
    ids = torch.randint(0, 5, (rows,), generator=g)
    ids[2] = 77  # a one-sample group
    ids[3] = ids[4] = 88  # a group of two with tied lengths
    lengths[3] = lengths[4] = 5
    mask[3], mask[4] = torch.arange(seq) < 5, torch.arange(seq) < 5
    logits = torch.randn(rows, seq, 6, generator=g, dtype=F64) * (40.0 if extreme else 3.0)
    p = logits.softmax(-1)
    tokens = torch.randint(0, 6, (rows, seq), generator=g)
    old = p.gather(-1, tokens[..., None]).squeeze(-1).log()
    s2 = p.square().sum(-1)
    rewards = torch.randn(rows, seq, generator=g, dtype=F64)
    rho = torch.rand(rows, seq, generator=g, dtype=F64) * 2
    if extreme:
        old[5] = -700.0  # pi = e^-700: w = 1 + sum pi^2
        old[6] = 0.0  # pi = 1 with sum pi^2 = 1: w = 0 exactly, W = 0 (den = eps)
        s2[6] = 1.0
        rewards[7] *= 1e6
        rho[8] = 1e3
    return {
        "mask": mask,
        "ids": ids,
        "uids": np.array([f"u{int(i)}" for i in ids], dtype=object),
        "rewards": rewards,
        "old": old,
        "s2": s2,
        "rho": rho,
    }


def check(name: str, got: tuple[torch.Tensor, torch.Tensor], b: dict[str, Any], **kw: Any) -> None:
    want, want_ret, bound, ret_bound = otb_reference(
        b["rewards"], b["old"], b["s2"], b["mask"], b["ids"], align=NAMES[name], **kw
    )
    assert_within(got[0], want, bound, f"{name} advantages")
    assert_within(got[1], want_ret, ret_bound, f"{name} returns")


@pytest.mark.parametrize("name", list(NAMES))
@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("extreme", [False, True])
def test_equal_to_verl(name: str, zero_tail: bool, with_is: bool, extreme: bool) -> None:
    verl_fn = core_algos.get_adv_estimator_fn(name)
    ours_fn = core_algos.get_adv_estimator_fn(verl_estimators.ESTIMATOR_NAMES[name])
    assert ours_fn is verl_estimators.ESTIMATORS[name]
    for seed in range(4):
        b = batch(seed, extreme=extreme)
        rho = b["rho"] if with_is else None
        kw = {"is_weights": rho, "zero_tail": zero_tail}
        mask = b["mask"].to(F64)
        # as verl's trainer calls the estimator (ray_trainer.compute_advantage)
        call = {
            "token_level_rewards": b["rewards"], "response_mask": mask, "index": b["uids"],
            "old_log_probs": b["old"], "sum_pi_squared": b["s2"], "rollout_is_weights": rho,
            "handle_zero_tail": zero_tail, "config": None,
        }  # fmt: skip
        check(name, verl_fn(**call), b, **kw)
        check(name, ours_fn(**call), b, **kw)
        direct = d.optimal_token_baseline_advantages(
            b["rewards"], b["old"], b["s2"], b["mask"], b["ids"], align=NAMES[name],
            is_weights=rho, zero_tail=zero_tail,
        )  # fmt: skip
        check(name, direct, b, **kw)


def test_the_trainer_without_sum_pi_squared_is_refused_with_the_reason() -> None:
    """verl's trainer passes old_log_probs and sum_pi_squared only to verl's two names."""
    b = batch(0)
    fn = core_algos.get_adv_estimator_fn("dapo_ops_optimal_token_baseline")
    with pytest.raises(d.InputError, match="replace_verl=True"):
        fn(token_level_rewards=b["rewards"], response_mask=b["mask"].double(), index=b["uids"])


def test_replace_verl_puts_ours_under_verl_names_and_back() -> None:
    saved = {n: core_algos.ADV_ESTIMATOR_REGISTRY[n] for n in NAMES}
    try:
        verl_estimators.register_estimators(replace_verl=True)
        for name in NAMES:
            assert core_algos.get_adv_estimator_fn(name) is verl_estimators.ESTIMATORS[name]
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY.update(saved)
