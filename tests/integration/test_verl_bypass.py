"""verl 0.9.1's ``bypass_mode`` against ``dapo_ops_bypass_mode``, float64.

``old_log_prob`` is the rollout's log-prob; the IS weights and the rejection mask come
from ``policy_loss.rollout_correction``. Loss and gradient must agree, and the metric dicts
must have the same keys and values: the IS weights' and rejection statistics to float64
rounding, the off-policy gap (from :func:`dapo_ops.offpolicy_metrics`, which divides by
counts where verl divides by count ``+1e-8``, then exponentiates: a log-perplexity of 22
moves by 2e-7 relative) to 1e-6 relative; for
both loss types, token and sequence IS, two-sided thresholds, batch normalisation, and
several rejection criteria at once, on a batch with an empty row and ratios of e^+-20.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from test_verl_objectives import GLOBAL_INFOS, actor_config  # noqa: E402

from dapo_ops import InputError  # noqa: E402
from dapo_ops.integrations import verl as integration  # noqa: E402
from dapo_ops.integrations.verl_bypass import rollout_rs_criteria  # noqa: E402

pytestmark = pytest.mark.integration


def batch(seed: int, rows: int = 10, seq: int = 16) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    lengths[1], lengths[2] = 0, seq
    mask = torch.arange(seq) < lengths[:, None]
    rollout = -3 * torch.rand(rows, seq, generator=g, dtype=torch.float64) - 1e-3
    logp = rollout + 0.3 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    rollout[3, :3] = torch.tensor([-25.0, -3.0, -2.0], dtype=torch.float64)  # ratios e^+-20
    logp[3, :3] = rollout[3, :3] + torch.tensor([20.0, -20.0, 3.0], dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, seq)
    return {"logp": logp, "roll": rollout, "adv": torch.where(mask, adv, 0.0), "mask": mask}


CORRECTIONS = [
    {"loss_type": "ppo_clip"},
    {"loss_type": "ppo_clip", "rollout_rs": "token_k1", "rollout_rs_threshold": 1.5},
    {"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0},
    {"loss_type": "reinforce", "rollout_is": "sequence", "rollout_is_threshold": 5.0},
    {
        "loss_type": "reinforce",
        "rollout_is": "token",
        "rollout_is_threshold": "0.5_2.0",
        "rollout_is_batch_normalize": True,
        "rollout_rs": "seq_mean_k3,token_k2",
        "rollout_rs_threshold": "0.05,0.2",
    },
    {
        "loss_type": "reinforce",
        "rollout_rs": "seq_sum_k1,seq_max_k3",
        "rollout_rs_threshold": "0.3_2.0,0.5",
    },
    {"loss_type": "reinforce"},  # plain REINFORCE, no weights, no rejection
    {
        "loss_type": "ppo_clip",
        "rollout_is": "sequence",
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_mean_k1,seq_max_k3",
        "rollout_rs_threshold": "3.0",  # k1: lower bound 1/3
    },
]


def config(correction: dict[str, Any]) -> Any:
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    fields = {"bypass_mode": True, "rollout_is": None, **correction}  # verl's default: sequence
    return actor_config(
        policy_loss={
            "loss_mode": "bypass_mode",
            "rollout_correction": RolloutCorrectionConfig(**fields),
        }
    )


def run(fn: Any, b: dict[str, Any], agg: str, cfg: Any) -> Any:
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=b["roll"],
        log_prob=logp,
        advantages=b["adv"],
        response_mask=b["mask"].to(torch.float64),
        loss_agg_mode=agg,
        config=cfg,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("correction", range(len(CORRECTIONS)))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_bypass_mode_equals_verl(correction: int, agg: str) -> None:
    integration.register()
    theirs = core_algos.get_policy_loss_fn("bypass_mode")
    ours = core_algos.get_policy_loss_fn("dapo_ops_bypass_mode")
    for info in GLOBAL_INFOS:
        cfg = config(CORRECTIONS[correction])
        cfg.global_batch_info.update(info)
        for seed in range(3):
            b = batch(seed)
            l_v, g_v, m_v = run(theirs, b, agg, cfg)
            l_o, g_o, m_o = run(ours, b, agg, cfg)
            torch.testing.assert_close(l_o, l_v, rtol=1e-7, atol=1e-10)
            torch.testing.assert_close(g_o, g_v, rtol=1e-7, atol=1e-12)
            assert sorted(m_o) == sorted(m_v)
            for key, value in m_v.items():
                exact = key.startswith(("rollout_corr/rollout_is_", "rollout_corr/rollout_rs_"))
                rel = 1e-12 if exact else 1e-6  # exp(log-ppl ~ 22 * (1 + 1e-8)): 2e-7
                assert m_o[key] == pytest.approx(value, rel=rel, abs=rel), key


def test_rejection_criteria_follow_verls_parsing() -> None:
    got = rollout_rs_criteria("token_k1, seq_mean_k3,token_k1", "0.5_2.0,0.1")
    assert got == [
        {"level": "token", "statistic": "k1", "upper": 2.0, "lower": 0.5},
        {"level": "seq_mean", "statistic": "k3", "upper": 0.1, "lower": None},
    ]
    assert rollout_rs_criteria("seq_max_k2,token_k3", 0.4)[1]["upper"] == 0.4
    for rs, threshold, field in [
        ("token_k1,token_k2", "1,2,3", "rollout_rs_threshold"),
        ("token_k2", "0.1_0.5", "rollout_rs_threshold"),
        ("token_k2", None, "rollout_rs_threshold"),
        (" , ", 1.0, "rollout_rs"),
        ("token_k2", "abc", "rollout_rs_threshold"),
    ]:
        with pytest.raises(InputError, match=field):
            rollout_rs_criteria(rs, threshold)


def test_bypass_mode_needs_its_config() -> None:
    integration.register()
    ours = core_algos.get_policy_loss_fn("dapo_ops_bypass_mode")
    b = batch(0)
    with pytest.raises(InputError, match="rollout_correction"):
        run(ours, b, "token-mean", {"policy_loss": {"loss_mode": "bypass_mode"}})
    with pytest.raises(InputError, match="loss_type"):
        run(ours, b, "token-mean", config({"loss_type": "ppo"}))


def test_all_masked_batch_gives_zero_and_finite_metrics() -> None:
    """verl raises on an all-masked micro-batch; the twin gives a loss of 0 and the same
    metric keys as on any batch, all finite, whatever the masked positions hold."""
    integration.register()
    ours = core_algos.get_policy_loss_fn("dapo_ops_bypass_mode")
    for correction in CORRECTIONS:
        cfg = config(correction)
        b = batch(0)
        keys = set(run(ours, b, "token-mean", cfg)[2])
        b["mask"] = torch.zeros_like(b["mask"])
        b["roll"] = torch.full_like(b["roll"], float("nan"))
        loss, grad, metrics = run(ours, b, "token-mean", cfg)
        assert float(loss) == 0.0 and not grad.any()
        assert set(metrics) == keys
        assert all(math.isfinite(v) for v in metrics.values()), metrics
