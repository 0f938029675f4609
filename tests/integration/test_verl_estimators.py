"""Advantage estimators against verl 0.9.1's registry, float64, ragged uid layouts.

verl's whitening divides its masked means by ``count + 1e-8`` (a relative 1e-8 / count):
hence ``RTOL`` for the whitened estimators; the others agree to float64 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

import dapo_ops as d  # noqa: E402

pytestmark = pytest.mark.integration

RTOL, ATOL = 1e-7, 1e-9  # verl's +1e-8 in masked-mean denominators


def batch(seed: int, rows: int = 24, seq: int = 10) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    mask = (torch.arange(seq) < lengths[:, None]).to(torch.float64)
    ids = torch.randint(0, 7, (rows,), generator=g)
    ids[0] = 99  # a one-sample group
    scores = torch.randint(0, 3, (rows,), generator=g).to(torch.float64)
    token_rewards = torch.zeros(rows, seq, dtype=torch.float64)
    token_rewards[torch.arange(rows), lengths - 1] = scores  # outcome reward on the last token
    dense = torch.randn(rows, seq, generator=g, dtype=torch.float64) * mask
    values = torch.randn(rows, seq, generator=g, dtype=torch.float64)
    return {
        "mask": mask,
        "ids": ids,
        "uids": np.array([f"u{int(i)}" for i in ids], dtype=object),
        "scores": scores,
        "outcome": token_rewards,
        "dense": dense,
        "values": values,
        "lengths": lengths,
    }


def algo(**kw: Any) -> Any:
    from verl.trainer.config import AlgoConfig

    return AlgoConfig(**kw)


@pytest.mark.parametrize("gamma_lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae(gamma_lam: tuple[float, float]) -> None:
    gamma, lam = gamma_lam
    for seed in range(3):
        b = batch(seed)
        want_a, want_r = core_algos.compute_gae_advantage_return(
            b["dense"],
            b["values"],
            b["mask"],
            torch.tensor(gamma, dtype=torch.float64),
            torch.tensor(lam, dtype=torch.float64),
        )
        got_a, got_r = d.gae_advantages(
            b["dense"], b["values"], b["mask"].bool(), gamma=gamma, lam=lam
        )
        m = b["mask"].bool()
        torch.testing.assert_close(got_a[m], want_a[m], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got_r[m], want_r[m], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(gamma: float) -> None:
    for seed in range(3):
        b = batch(seed)
        want_a, want_r = core_algos.compute_reinforce_plus_plus_outcome_advantage(
            b["dense"], b["mask"], config=algo(gamma=gamma)
        )
        got_a, got_r = d.reinforce_pp_advantages(b["dense"], b["mask"].bool(), gamma=gamma)
        torch.testing.assert_close(got_a, want_a, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got_r, want_r, rtol=1e-9, atol=1e-12)


def test_reinforce_plus_plus_baseline_is_a_composition() -> None:
    """verl's ``reinforce_plus_plus_baseline``: group-centred score (a lone sample keeps its
    score), broadcast over the response, whitened over the batch's tokens."""
    for seed in range(3):
        b = batch(seed)
        want, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
            b["outcome"], b["mask"], b["uids"]
        )
        centred = d.group_advantages(b["scores"], b["ids"], scale="none", singleton="score")
        got = d.masked_whiten(centred[:, None] * b["mask"], b["mask"].bool())
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_rloo_is_group_advantages_with_leave_one_out() -> None:
    for seed in range(3):
        b = batch(seed)
        want, _ = core_algos.compute_rloo_outcome_advantage(b["outcome"], b["mask"], b["uids"])
        got = d.group_advantages(
            b["scores"], b["ids"], scale="none", baseline="leave_one_out", singleton="score"
        )
        torch.testing.assert_close(got[:, None] * b["mask"], want, rtol=1e-9, atol=1e-12)


def test_opo() -> None:
    for seed in range(3):
        b = batch(seed)
        want, _ = core_algos.compute_opo_outcome_advantage(b["outcome"], b["mask"], b["uids"])
        got = d.opo_advantages(b["scores"], b["lengths"], b["ids"])
        torch.testing.assert_close(got[:, None] * b["mask"], want, rtol=1e-9, atol=1e-12)


def test_gpg() -> None:
    for seed in range(3):
        b = batch(seed)
        want, _ = core_algos.compute_gpg_outcome_advantage(b["outcome"], b["mask"], b["uids"])
        got = d.gpg_advantages(b["scores"], b["ids"])
        # verl's alpha = bsz / count_nonzero(scores) is an int tensor division: float32
        # (one rounding, 6e-8 relative); ours is in the scores' dtype
        torch.testing.assert_close(got[:, None] * b["mask"], want, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_passk(scale: bool) -> None:
    for seed in range(3):
        b = batch(seed)
        counts = torch.bincount(b["ids"])
        keep = counts[b["ids"]] >= 2  # pass@k needs two samples per group
        uids = b["uids"][keep.numpy()]
        want, _ = core_algos.compute_grpo_passk_outcome_advantage(
            b["outcome"][keep], b["mask"][keep], uids, config=algo(norm_adv_by_std_in_grpo=scale)
        )
        got = d.passk_advantages(b["scores"][keep], b["ids"][keep], scale=scale)
        torch.testing.assert_close(got[:, None] * b["mask"][keep], want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized", "rloo", "rloo_vectorized"])
def test_registry_variants_of_grpo_and_rloo(name: str) -> None:
    fn = core_algos.get_adv_estimator_fn(name)
    for seed in range(3):
        b = batch(seed)
        want, _ = fn(b["outcome"], b["mask"], b["uids"], config=algo())
        # the vectorised RLOO gives a lone sample 0 (the loop keeps its score); the vectorised
        # GRPO computes the group statistics in float32 (hence its tolerance)
        singleton = "zero" if name == "rloo_vectorized" else "score"
        if name.startswith("grpo"):
            got = d.group_advantages(b["scores"], b["ids"], eps=1e-6, singleton=singleton)
        else:
            got = d.group_advantages(
                b["scores"], b["ids"], scale="none", baseline="leave_one_out", singleton=singleton
            )
        rtol = 1e-6 if name == "grpo_vectorized" else 1e-7
        torch.testing.assert_close(got[:, None] * b["mask"], want, rtol=rtol, atol=1e-9)


def test_remax() -> None:
    for seed in range(3):
        b = batch(seed)
        base = torch.randn(b["mask"].shape[0], generator=torch.Generator().manual_seed(seed))
        base = base.to(torch.float64)
        want_a, want_r = core_algos.compute_remax_outcome_advantage(b["dense"], base, b["mask"])
        got_a, got_r = d.remax_advantages(b["dense"], base, b["mask"].bool())
        m = b["mask"].bool()
        torch.testing.assert_close(got_a, want_a, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got_r[m], want_r[m], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("weights", [None, [0.3, 1.7]])
def test_gdpo(weights: list[float] | None) -> None:
    for seed in range(3):
        b = batch(seed)
        g = torch.Generator().manual_seed(seed + 10)
        rows = b["mask"].shape[0]
        comps = torch.randint(0, 2, (rows, 2), generator=g).to(torch.float64)
        lengths = b["lengths"]
        non_tensor = {"fmt": comps[:, 0].numpy(), "acc": comps[:, 1].numpy()}
        prompts = torch.zeros(rows, 3)
        attention = torch.cat([torch.ones(rows, 3), b["mask"]], dim=1).long()
        cfg = algo(gdpo_reward_keys=["fmt", "acc"], gdpo_reward_weights=weights)
        want, _ = core_algos.compute_gdpo_outcome_advantage(
            b["outcome"], b["mask"], b["uids"], config=cfg, non_tensor_batch=non_tensor,
            batch={"prompts": prompts, "attention_mask": attention},
        )  # fmt: skip
        w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
        got = d.gdpo_advantages(comps, b["ids"], b["mask"].bool(), weights=w)
        assert lengths.shape[0] == rows
        # verl casts each component to float32 and whitens with its +1e-8 denominators
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-6)
