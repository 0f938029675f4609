"""dapo_ops.integrations.verl against the real verl (0.9.1) ``core_algos``.

verl is installed with ``pip install --no-deps verl`` plus the few packages that
``import verl.trainer.ppo.core_algos`` needs (the ``integration`` extra). The policy loss
is compared with verl's ``vanilla`` loss (value, gradient and metrics) for every
``loss_agg_mode``, with local and global batch info and rollout IS weights; the
advantage with ``compute_grpo_outcome_advantage`` on random ragged uid layouts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

import numpy as np  # noqa: E402  (verl's dependency; absent from the test extra)

from dapo_ops import (  # noqa: E402
    ClipHigher,
    group_advantages,
    per_token_loss,
    token_level_aggregate,
)
from dapo_ops.integrations import verl as integration  # noqa: E402

pytestmark = pytest.mark.integration

# Importing the module after verl registers it; register() again in case it was imported
# earlier in this session (doctest collection), before verl.
integration.register()

AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]


def actor_config(**overrides: Any) -> Any:
    from verl.workers.config import ActorConfig

    options: dict[str, Any] = dict(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
    )
    options.update(overrides)
    return ActorConfig(**options)


def random_batch(seed: int, batch: int = 8, seq: int = 12) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    lengths[1] = 0  # a fully masked row (e.g. an overlong-filtered response)
    mask = (torch.arange(seq) < lengths[:, None]).float()
    old = -3 * torch.rand(batch, seq, generator=gen)
    # Log-ratios of std 0.8: many tokens beyond 1 +- eps and some beyond the dual clip c = 3.
    logp = old + 0.8 * torch.randn(batch, seq, generator=gen)
    per_seq = torch.randn(batch, 1, generator=gen)
    advantages = (per_seq * mask) if seed % 2 else torch.randn(batch, seq, generator=gen)
    weights = 0.5 + torch.rand(batch, seq, generator=gen)
    return {"old": old, "logp": logp, "adv": advantages, "mask": mask, "weights": weights}


def _loss_and_grad(fn: Any, b: dict[str, torch.Tensor], mode: str, config: Any, is_w: bool) -> Any:
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = fn(
        old_log_prob=b["old"],
        log_prob=logp,
        advantages=b["adv"],
        response_mask=b["mask"],
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=b["weights"] if is_w else None,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


GLOBAL_INFOS = [
    {},
    {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None, "loss_scale_factor": None},
    {"dp_size": 4, "batch_num_tokens": 137, "global_batch_size": 29, "loss_scale_factor": None},
    {
        "dp_size": 2,
        "batch_num_tokens": torch.tensor(61),
        "global_batch_size": 11,
        "loss_scale_factor": 16,
    },
]


def value_error_bound(b: dict[str, torch.Tensor], mode: str, config: Any, is_w: bool) -> float:
    """The float32 rounding bound of a weighted sum ``sum_t w_t l_t`` computed in any
    order: ``gamma_n * sum_t |w_t l_t|`` with ``gamma_n ~ n eps`` (n terms, eps = 2^-24),
    doubled for the scaling steps. ``sum |w l|`` is evaluated in float64 with the same
    aggregation weights (dapo_ops' mapping of verl's agg mode)."""
    mode_o, normalizer, max_len = integration.verl_aggregation(
        mode, dict(config.global_batch_info), config.loss_scale_factor
    )
    mask = b["mask"].bool()
    clip = ClipHigher(
        eps_low=config.clip_ratio_low,
        eps_high=config.clip_ratio_high,
        dual_clip=config.clip_ratio_c,
    )
    d = {k: v.double() for k, v in b.items()}
    terms = per_token_loss(clip, d["logp"], d["old"], d["adv"], mask).abs()
    if is_w:
        terms = terms * d["weights"]
    size = token_level_aggregate(terms, mask, mode=mode_o, normalizer=normalizer, max_len=max_len)
    n = int(mask.sum()) + mask.shape[0]
    return 2.0 * (n + 4) * 2.0**-24 * float(size)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_policy_loss_equals_verl_vanilla(mode: str) -> None:
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    ours_fn = core_algos.get_policy_loss_fn(integration.LOSS_NAME)
    assert ours_fn is integration.compute_policy_loss
    worst_loss = worst_grad = 0.0
    clipped = dual = 0.0
    for seed in range(4):
        batch = random_batch(seed)
        for info in GLOBAL_INFOS:
            for overrides in [
                {},
                {"clip_ratio_low": 0.1, "clip_ratio_high": 0.4, "clip_ratio_c": 2.0},
            ]:
                for is_w in (False, True):
                    config = actor_config(loss_agg_mode=mode, **overrides)
                    config.global_batch_info.update(info)
                    l_v, g_v, m_v = _loss_and_grad(vanilla, batch, mode, config, is_w)
                    l_o, g_o, m_o = _loss_and_grad(ours_fn, batch, mode, config, is_w)
                    # both float32 values against verl's formula in float64: they sum in
                    # different orders, so each is within the rounding bound of the truth
                    batch64 = {k: v.double() for k, v in batch.items()}
                    l_64, g_64, _ = _loss_and_grad(vanilla, batch64, mode, config, is_w)
                    bound = value_error_bound(batch, mode, config, is_w)
                    assert abs(float(l_o) - float(l_64)) <= bound, (l_o, l_64, bound)
                    assert abs(float(l_v) - float(l_64)) <= bound, (l_v, l_64, bound)
                    # a gradient element is w * (-A) * r: a few float32 roundings each
                    torch.testing.assert_close(g_o, g_v, rtol=1e-6, atol=1e-7)
                    torch.testing.assert_close(g_o.double(), g_64, rtol=1e-6, atol=1e-7)
                    assert m_o.keys() == m_v.keys()
                    for key in m_v:
                        assert m_o[key] == pytest.approx(m_v[key], abs=1e-6), key
                    worst_loss = max(worst_loss, float((l_o - l_v).abs()))
                    worst_grad = max(worst_grad, float((g_o - g_v).abs().max()))
                    clipped += m_v["actor/pg_clipfrac"]
                    dual += m_v["actor/pg_clipfrac_lower"]
    assert clipped > 0 and dual > 0, "the clip and the dual clip must both be exercised"
    print(
        f"\nverl vanilla {mode}: max |loss diff| {worst_loss:.3g}, max |grad diff| {worst_grad:.3g}"
    )


def test_legacy_dictconfig_and_all_masked_batch() -> None:
    from omegaconf import OmegaConf

    vanilla = core_algos.get_policy_loss_fn("vanilla")
    config = OmegaConf.create(
        {
            "clip_ratio": 0.25,
            "clip_ratio_low": None,
            "clip_ratio_high": None,
            "global_batch_info": {},
        }
    )
    batch = random_batch(5)
    for mode in AGG_MODES:
        l_v, g_v, _ = _loss_and_grad(vanilla, batch, mode, config, False)
        l_o, g_o, _ = _loss_and_grad(integration.compute_policy_loss, batch, mode, config, False)
        torch.testing.assert_close(l_o, l_v, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g_o, g_v, rtol=1e-6, atol=1e-7)
    # An all-masked micro-batch: 0 and a zero gradient (verl's token-mean gives NaN here).
    empty = {**batch, "mask": torch.zeros_like(batch["mask"])}
    loss, grad, _ = _loss_and_grad(
        integration.compute_policy_loss, empty, "token-mean", config, False
    )
    assert float(loss) == 0.0 and not grad.any()


def random_uids(rng: np.random.Generator) -> np.ndarray:
    """A shuffled ragged layout: groups of 1..6 responses, string uids as verl's."""
    sizes = rng.integers(1, 7, size=rng.integers(1, 9))
    uids = np.concatenate([[f"uid-{g}"] * int(n) for g, n in enumerate(sizes)]).astype(object)
    return uids[rng.permutation(len(uids))]


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_advantages_equal_verl_grpo(norm_by_std: bool) -> None:
    rng = np.random.default_rng(0)
    worst = 0.0
    singletons = 0
    for trial in range(60):
        uids = random_uids(rng)
        batch, seq = len(uids), 5
        gen = torch.Generator().manual_seed(trial)
        if trial % 3 == 0:
            scores = torch.randint(0, 2, (batch,), generator=gen).float()  # 0/1 accuracy
        else:
            scores = torch.randn(batch, generator=gen) * 3 + 1
        lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
        mask = (torch.arange(seq) < lengths[:, None]).float()
        token_rewards = torch.zeros(batch, seq)
        token_rewards[torch.arange(batch), lengths - 1] = scores  # verl: score on the last token

        expected, returns = core_algos.compute_grpo_outcome_advantage(
            token_rewards.clone(), mask, uids, norm_adv_by_std_in_grpo=norm_by_std
        )
        # The library function, with verl's conventions.
        ids = torch.tensor([int(u.split("-")[1]) for u in uids])
        adv = group_advantages(
            scores, ids, scale="group" if norm_by_std else "none", eps=1e-6, singleton="score"
        )
        torch.testing.assert_close(adv[:, None] * mask, expected, rtol=1e-5, atol=1e-5)
        # The registered estimator, called as verl's trainer calls it.
        estimator = core_algos.get_adv_estimator_fn(integration.ADV_ESTIMATOR_NAME)
        from verl.trainer.config import AlgoConfig

        ours, ours_returns = estimator(
            token_level_rewards=token_rewards,
            response_mask=mask,
            index=uids,
            config=AlgoConfig(norm_adv_by_std_in_grpo=norm_by_std),
        )
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_returns, returns, rtol=1e-5, atol=1e-5)
        worst = max(worst, float((ours - expected).abs().max()))
        _, counts = np.unique(uids, return_counts=True)
        singletons += int((counts == 1).sum())
    assert singletons > 0, "verl's one-sample-group rule was never exercised"
    print(f"\nverl GRPO advantage (norm_by_std={norm_by_std}): max |diff| {worst:.3g}")


def test_zero_variance_group_is_exactly_zero_where_verl_amplifies_rounding() -> None:
    """group_advantages' documented difference: a spread of float rounding gives 0, not
    noise; the twin ``dapo_ops_grpo`` is verl's formula and gives verl's noise."""
    scores = torch.tensor([0.1, 0.1, 0.1 + 3e-8, 1.0, 0.0])
    uids = np.array(["a", "a", "a", "b", "b"], dtype=object)
    token_rewards, mask = scores[:, None].clone(), torch.ones(5, 1)
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(token_rewards.clone(), mask, uids)
    ours = group_advantages(scores, torch.tensor([0, 0, 0, 1, 1]), eps=1e-6, singleton="score")
    assert ours[:3].abs().max() == 0.0 < verl_adv[:3].abs().max()
    torch.testing.assert_close(ours[3:], verl_adv[3:, 0])
    twin, _ = integration.compute_grpo_outcome_advantage(token_rewards, mask, uids)
    torch.testing.assert_close(twin, verl_adv)


def test_external_modules_env_registers_in_a_fresh_verl_process() -> None:
    code = (
        "import verl.trainer.ppo.core_algos as c; "
        "import dapo_ops.integrations.verl as v; "
        "assert c.get_policy_loss_fn('dapo_ops') is v.compute_policy_loss; "
        "assert c.get_adv_estimator_fn('dapo_ops_grpo') is v.compute_grpo_outcome_advantage"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "dapo_ops.integrations.verl"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
