"""Objectives against the real verl 0.9.1 policy losses, value and gradient, float64.

The same random inputs (masked rows, short and long rows, log-ratios up to +-20) go to
verl's registered loss function and to ``policy_loss`` with the objective value that
states verl's formula; each pair must agree to 1e-9 (float64) or differ as documented.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

import dapo_ops as d  # noqa: E402
from dapo_ops.integrations import verl as integration  # noqa: E402

pytestmark = pytest.mark.integration


def actor_config(**overrides: Any) -> Any:
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    options: dict[str, Any] = {
        "strategy": "fsdp",
        "rollout_n": 4,
        "ppo_micro_batch_size_per_gpu": 2,
    }
    policy_loss = overrides.pop("policy_loss", None)
    options.update(overrides)
    if policy_loss:
        options["policy_loss"] = PolicyLossConfig(**policy_loss)
    return ActorConfig(**options)


def batch(seed: int, rows: int = 9, seq: int = 14, spread: float = 0.8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    lengths[1] = 0  # a fully masked row
    lengths[2] = seq  # a full row
    mask = torch.arange(seq) < lengths[:, None]
    old = -4 * torch.rand(rows, seq, generator=g, dtype=torch.float64) - 1e-3
    logp = old + spread * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    old[3, :4] = torch.tensor([-25.0, -3.0, -9.0, -1.0], dtype=torch.float64)  # ratios e^+-20
    logp[3, :4] = old[3, :4] + torch.tensor([20.0, -20.0, 6.0, -6.0], dtype=torch.float64)
    logp = logp.clamp(max=-1e-6)  # log-probs
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64)
    return {"logp": logp, "old": old, "adv": adv, "mask": mask}


def verl_loss(name: str, b: dict[str, Any], mode: str, config: Any) -> tuple[Any, Any]:
    fn = core_algos.get_policy_loss_fn(name)
    logp = b["logp"].clone().requires_grad_(True)
    adv = b["adv"].expand_as(logp) * b["mask"]
    loss, _ = fn(
        old_log_prob=b["old"],
        log_prob=logp,
        advantages=adv,
        response_mask=b["mask"].to(torch.float64),
        loss_agg_mode=mode,
        config=config,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def ours(objective: d.Objective, b: dict[str, Any], mode: str, **kw: Any) -> tuple[Any, Any]:
    agg, normalizer, max_len = integration.verl_aggregation(mode)
    logp = b["logp"].clone().requires_grad_(True)
    kw.setdefault("normalizer", normalizer)
    loss = d.policy_loss(
        objective,
        logp,
        b["old"],
        b["adv"],
        b["mask"],
        mode=kw.pop("agg", agg),
        max_len=max_len,
        **kw,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


CASES: list[tuple[str, dict[str, Any], Callable[[], d.Objective], str]] = [
    ("sapo", {}, lambda: d.SAPO(), "seq-mean-token-mean"),
    (
        "sapo",
        {"tau_pos": 2.0, "tau_neg": 0.5},
        lambda: d.SAPO(tau_pos=2.0, tau_neg=0.5),
        "seq-mean-token-mean",
    ),
    # verl's ActorConfig sets clip_ratio_c=3.0, so that is its DPPO cap unless changed
    ("dppo_tv", {}, lambda: d.DPPO(divergence="tv", is_cap=3.0), "token-mean"),
    ("dppo_tv", {"clip_ratio_c": 20.0}, lambda: d.DPPO(divergence="tv"), "token-mean"),
    (
        "dppo_tv",
        {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1, "clip_ratio_c": 3.0},
        lambda: d.DPPO(divergence="tv", delta_low=0.05, delta_high=0.1, is_cap=3.0),
        "seq-mean-token-sum",
    ),
    ("dppo_kl", {}, lambda: d.DPPO(divergence="kl", is_cap=3.0), "token-mean"),
    (
        "dppo_kl",
        {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02, "clip_ratio_c": 20.0},
        lambda: d.DPPO(divergence="kl", delta_low=0.01, delta_high=0.02),
        "seq-mean-token-mean",
    ),
    ("gpg", {}, lambda: d.PolicyGradient(), "token-mean"),
    ("dro", {"policy_loss": {"dro_beta": 0.3}}, lambda: d.DRO(beta=0.3), "token-mean"),
    (
        "cispo",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
        lambda: d.CISPO(eps_low=0.2, eps_high=0.28),
        "token-mean",
    ),
    (
        "gspo",
        {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
        lambda: d.GSPO(verl_clamp=True),
        "seq-mean-token-mean",
    ),
]


@pytest.mark.parametrize(("name", "config", "objective", "mode"), CASES)
def test_objective_equals_verl(
    name: str, config: dict[str, Any], objective: Callable[[], d.Objective], mode: str
) -> None:
    cfg = actor_config(**config)
    for seed in range(3):
        b = batch(seed)
        if name == "sapo":  # verl's SAPO aggregates with seq-mean-token-mean, whatever the mode
            want = verl_loss(name, b, "token-mean", cfg)
        else:
            want = verl_loss(name, b, mode, cfg)
        obj = objective()
        got = ours(obj, b, mode)
        atol = 1e-12
        if mode == "seq-mean-token-mean" or name == "sapo":
            # verl divides each row's sum by (n_i + 1e-8): a relative 1e-8 / n_i per row,
            # so the loss moves by at most 1e-8 * max |per-token loss| (and so does each
            # gradient element, relative to its own size)
            terms = d.per_token_loss(obj, b["logp"], b["old"], b["adv"], b["mask"])
            atol = 2e-8 * float(terms.abs().max())
        torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=atol)
        torch.testing.assert_close(got[1], want[1], rtol=1e-7, atol=1e-12)


def test_gmpo_equals_verl_geo_mean_over_every_row() -> None:
    """verl's geo_mean averages over every row, the empty one included: ``normalizer``
    = rows reproduces it; its ``+1e-8`` in the denominators is within 1e-8 relative."""
    cfg = actor_config(clip_ratio_low=0.4, clip_ratio_high=0.4)
    for seed in range(3):
        b = batch(seed, spread=0.3)
        want = verl_loss("geo_mean", b, "token-mean", cfg)
        rows = b["logp"].shape[0]
        got = ours(
            d.GMPO(eps_low=0.4, eps_high=0.4),
            b,
            "token-mean",
            agg="seq_mean_token_mean",
            normalizer=rows,
        )
        torch.testing.assert_close(got[0], want[0], rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(got[1], want[1], rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize(
    ("verl_name", "penalty"),
    [
        ("k1", d.KLPenalty(beta=1.0, estimator="k1")),
        ("kl", d.KLPenalty(beta=1.0, estimator="k1")),
        ("abs", d.KLPenalty(beta=1.0, estimator="abs")),
        ("k2", d.KLPenalty(beta=1.0, estimator="k2")),
        ("mse", d.KLPenalty(beta=1.0, estimator="k2")),
        ("low_var_kl", d.KLPenalty(beta=1.0, estimator="k3", clamp=10.0)),
        ("k3", d.KLPenalty(beta=1.0, estimator="k3", clamp=10.0)),
        ("k3+", d.KLPenalty(beta=1.0, estimator="k3", clamp=10.0, straight_through=True)),
        ("low_var_kl+", d.KLPenalty(beta=1.0, estimator="k3", clamp=10.0, straight_through=True)),
        ("k1+", d.KLPenalty(beta=1.0, estimator="k1", straight_through=True)),
        ("abs+", d.KLPenalty(beta=1.0, estimator="abs", straight_through=True)),
    ],
)
def test_kl_estimators_equal_verl(verl_name: str, penalty: d.KLPenalty) -> None:
    """verl's ``kl_penalty`` per token (value and gradient) against ``KLPenalty`` through
    ``policy_loss`` (zero advantages, so the loss is the KL term alone) and ``kl_penalty``."""
    for seed in range(3):
        b = batch(seed, spread=2.0)  # log-ratios past +-10: verl's k3 value clamp acts
        ref = b["old"]
        mask = b["mask"]
        logp = b["logp"].clone().requires_grad_(True)
        want = core_algos.kl_penalty(logp, ref, verl_name)
        (g_want,) = torch.autograd.grad((want * mask).sum(), logp)
        lp = b["logp"].clone().requires_grad_(True)
        got = d.kl_penalty(
            lp,
            ref,
            mask,
            estimator=penalty.estimator,
            clamp=penalty.clamp,
            straight_through=penalty.straight_through,
        )
        (g_got,) = torch.autograd.grad(got.sum(), lp)
        torch.testing.assert_close(got, want * mask, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g_got, g_want * mask, rtol=1e-12, atol=1e-14)
        # the fused loss path: token-sum of the same per-token penalty
        lp = b["logp"].clone().requires_grad_(True)
        zero = torch.zeros(mask.shape[0], dtype=torch.float64)
        loss = d.policy_loss(
            d.ClipHigher(), lp, b["logp"], zero, mask, normalizer=1.0, ref_logp=ref, kl=penalty
        )
        (g_loss,) = torch.autograd.grad(loss, lp)
        torch.testing.assert_close(loss, (want * mask).sum(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g_loss, g_want * mask, rtol=1e-12, atol=1e-14)


REGISTERED = [
    ("vanilla", {}),
    ("sapo", {"tau_pos": 1.5, "tau_neg": 0.9}),
    ("dppo_tv", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1}),
    ("dppo_kl", {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02, "clip_ratio_c": 20.0}),
    ("gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
    ("gpg", {}),
    ("dro", {"policy_loss": {"dro_beta": 0.3}}),
    ("cispo", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
    ("geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}),
]
GLOBAL_INFOS = [
    {},
    {"dp_size": 4, "batch_num_tokens": 137, "global_batch_size": 29, "loss_scale_factor": None},
]


@pytest.mark.parametrize(("loss_mode", "config"), REGISTERED)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_registered_dapo_ops_losses_equal_verl(
    loss_mode: str, config: dict[str, Any], agg: str
) -> None:
    """``loss_mode: dapo_ops_<name>`` gives verl's numbers: same config fields, same
    aggregation (global batch info included), same rollout IS weights."""
    integration.register()
    theirs = core_algos.get_policy_loss_fn(loss_mode)
    ours_fn = core_algos.get_policy_loss_fn(f"dapo_ops_{loss_mode}")
    for info in GLOBAL_INFOS:
        cfg = actor_config(**config)
        cfg.global_batch_info.update(info)
        for seed in range(2):
            b = batch(seed, spread=0.3 if loss_mode == "geo_mean" else 0.8)
            g = torch.Generator().manual_seed(seed)
            weights = 0.5 + torch.rand(b["logp"].shape, generator=g, dtype=torch.float64)
            results = []
            for fn in (theirs, ours_fn):
                logp = b["logp"].clone().requires_grad_(True)
                loss, metrics = fn(
                    old_log_prob=b["old"],
                    log_prob=logp,
                    advantages=b["adv"].expand_as(logp) * b["mask"],
                    response_mask=b["mask"].to(torch.float64),
                    loss_agg_mode=agg,
                    config=cfg,
                    rollout_is_weights=None if loss_mode == "geo_mean" else weights,
                )
                (grad,) = torch.autograd.grad(loss, logp)
                results.append((loss.detach(), grad, metrics))
            (l_v, g_v, m_v), (l_o, g_o, m_o) = results
            # verl's +1e-8 in per-sequence denominators: 1e-8 relative per row
            torch.testing.assert_close(l_o, l_v, rtol=1e-7, atol=1e-9)
            torch.testing.assert_close(g_o, g_v, rtol=1e-7, atol=1e-9)
            if "actor/ppo_kl" in m_v:  # verl's gpg returns no metrics
                assert m_o["actor/ppo_kl"] == pytest.approx(m_v["actor/ppo_kl"], rel=1e-6, abs=1e-9)
