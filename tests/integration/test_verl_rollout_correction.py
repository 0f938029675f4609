"""Rollout correction against verl 0.9.1's ``rollout_corr_helper``, float64.

verl divides its masked means by ``count + 1e-8``: our exact means agree to that relative
1e-8 (the tolerance below), and decisions (kept tokens) agree exactly on inputs that sit
no closer than that to a threshold.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")

import dapo_ops as d  # noqa: E402

pytestmark = pytest.mark.integration

REL = 1e-7  # verl's +1e-8 in every masked-mean denominator, with margin


def batch(seed: int, rows: int = 10, seq: int = 16, empty_row: bool = True) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    if empty_row:
        lengths[1] = 0
    mask = torch.arange(seq) < lengths[:, None]
    rollout = -3 * torch.rand(rows, seq, generator=g, dtype=torch.float64) - 1e-3
    old = rollout + 0.3 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    old[2, :3] = rollout[2, :3] + torch.tensor([25.0, -25.0, 3.0], dtype=torch.float64)
    return {"old": old, "roll": rollout, "mask": mask}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 5.0, "0.5_2.0"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_equal_verl(level: str, threshold: Any, normalize: bool) -> None:
    for seed in range(4):
        b = batch(seed)
        log_ratio = b["old"] - b["roll"]
        want, _ = helper.compute_rollout_correction_weights(
            log_ratio,
            b["mask"].to(torch.float64),
            rollout_is=level,
            rollout_is_threshold=threshold,
            rollout_is_batch_normalize=normalize,
        )
        if isinstance(threshold, str):
            lower, cap = (float(x) for x in threshold.split("_"))
        else:
            lower, cap = None, float(threshold)
        got = d.truncated_is_weights(
            b["old"], b["roll"], b["mask"], level=level, cap=cap, lower=lower,
            batch_normalize=normalize,
        )  # fmt: skip
        torch.testing.assert_close(got, want * b["mask"], rtol=REL, atol=1e-12)


RS_OPTIONS = [
    ("token_k1", 1.5),
    ("token_k2", 0.02),
    ("token_k3", 0.02),
    ("seq_sum_k1", 3.0),
    ("seq_sum_k2", 0.5),
    ("seq_sum_k3", 0.5),
    ("seq_mean_k1", 1.1),
    ("seq_mean_k2", 0.05),
    ("seq_mean_k3", 0.05),
    ("seq_max_k2", 0.2),
    ("seq_max_k3", 0.2),
]


@pytest.mark.parametrize(("option", "upper"), RS_OPTIONS)
def test_rejection_masks_equal_verl(option: str, upper: float) -> None:
    level, statistic = option.rsplit("_", 1)
    kept = 0
    for seed in range(4):
        b = batch(seed)
        log_ratio = b["old"] - b["roll"]
        want, _ = helper.compute_rollout_rejection_mask(
            log_ratio, b["mask"].to(torch.float64), rollout_rs=option, rollout_rs_threshold=upper
        )
        got = d.rejection_mask(
            b["old"], b["roll"], b["mask"], statistic=statistic, level=level, upper=upper
        )
        assert torch.equal(got, want.bool()), option
        kept += int(got.sum())
    total = sum(int(batch(seed)["mask"].sum()) for seed in range(4))
    assert 0 < kept < total, f"{option}: the threshold must keep some tokens and drop others"


def test_offpolicy_metrics_equal_verl() -> None:
    for seed in range(4):
        b = batch(seed, empty_row=False)  # verl counts empty rows in its sequence means
        want = helper.compute_offpolicy_metrics(b["old"], b["roll"], b["mask"].to(torch.float64))
        got = d.offpolicy_metrics(b["old"], b["roll"], b["mask"])._asdict()
        for key, value in want.items():
            assert float(got[key]) == pytest.approx(value, rel=REL, abs=1e-12), key


def test_effective_sample_size_equals_verl() -> None:
    for seed in range(4):
        b = batch(seed)
        log_ratio = b["old"] - b["roll"]
        mask = b["mask"].to(torch.float64)
        weights, metrics = helper.compute_rollout_correction_weights(
            log_ratio, mask, rollout_is="token", rollout_is_threshold=2.0
        )
        got = d.offpolicy_metrics(b["old"], b["roll"], b["mask"], is_weights=weights)
        assert float(got.is_ess) == pytest.approx(metrics["rollout_is_eff_sample_size"], rel=1e-6)
