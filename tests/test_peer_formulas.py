"""The objectives and estimators of peers that cannot be installed here (ROLL's TOPR,
SkyRL's MaxRL), against float64 references written below from the peers' formulas, and
the properties of the value loss, KL in the reward and PF-PPO (their verl twins are in
tests/integration/test_verl_value.py).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dapo_ops as d

F64 = torch.float64


def _batch(seed: int, rows: int = 8, seq: int = 6) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, seq, generator=g, dtype=F64) * 2 - 0.05
    old = -(logp + torch.randn(rows, seq, generator=g, dtype=F64) * 0.3).abs()  # log-probs
    adv = torch.randn(rows, generator=g, dtype=F64)
    adv[0] = 0.0
    mask = torch.rand(rows, seq, generator=g) < 0.8
    return logp, old, adv, mask


# --------------------------------------------------------------------------- TOPR vs ROLL
def roll_topr(logp, old, adv, mask, scores, pos, neg):  # type: ignore[no-untyped-def]
    """ROLL's RLVR actor loss with rl_loss_coef=0: the positive samples' ``-logp * A`` and
    the negative ones' ``-clamp(exp(logp.detach() - old), 0, 1) * logp * A``, each
    aggregated as a token mean over its own samples' tokens, times its coefficient."""
    a = adv[:, None].expand_as(logp)
    pos_mask = mask & (scores > 0)[:, None]
    neg_mask = mask & (scores <= 0)[:, None]
    ratio = torch.clamp((logp.detach() - old).exp(), 0, 1)

    def token_mean(x, m):  # type: ignore[no-untyped-def]
        return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)

    return pos * token_mean(-logp * a, pos_mask) + neg * token_mean(-ratio * logp * a, neg_mask)


@pytest.mark.parametrize("coefs", [(1.0, 1.0), (0.5, 2.0)])
def test_topr_is_rolls_loss(coefs: tuple[float, float]) -> None:
    """With the scores as advantages (TOPR without a baseline), ROLL's two token means are
    ``policy_loss(TOPR)`` over each sign's tokens: value and gradient, float64."""
    pos, neg = coefs
    for seed in range(4):
        logp, old, adv, mask = _batch(seed)
        lp_ref = logp.clone().requires_grad_(True)
        want = roll_topr(lp_ref, old, adv, mask, adv, pos, neg)
        lp = logp.clone().requires_grad_(True)
        obj = d.TOPR(pos_coef=pos, neg_coef=neg)
        got = sum(
            d.policy_loss(obj, lp, old, adv, mask & sel[:, None], normalizer="local")
            for sel in (adv > 0, adv <= 0)
        )
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        (g_want,) = torch.autograd.grad(want, lp_ref)
        (g_got,) = torch.autograd.grad(got, lp)
        torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-14)


def test_topr_negative_gradient_never_exceeds_on_policy() -> None:
    logp, old, adv, mask = _batch(9)
    lp = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(d.policy_loss(d.TOPR(), lp, old, adv, mask), lp)
    on = torch.autograd.grad(d.policy_loss(d.PolicyGradient(), lp, old, adv, mask), lp)[0]
    neg = mask & (adv <= 0)[:, None]
    assert (g[neg].abs() <= on[neg].abs() + 1e-15).all()
    torch.testing.assert_close(g[mask & (adv > 0)[:, None]], on[mask & (adv > 0)[:, None]])


# --------------------------------------------------------------------------- MaxRL vs SkyRL
def skyrl_maxrl(scores: torch.Tensor, index: list[int], epsilon: float = 1e-6) -> torch.Tensor:
    """SkyRL's ``compute_maxrl_advantage``, one sample at a time: a one-sample group keeps
    its score, the others ``(s - mean) / (mean + epsilon)``."""
    groups: dict[int, list[float]] = defaultdict(list)
    for s, i in zip(scores.tolist(), index, strict=True):
        groups[i].append(s)
    out = []
    for s, i in zip(scores.tolist(), index, strict=True):
        g = groups[i]
        mean = sum(g) / len(g)
        out.append((s - mean) / (mean + epsilon) if len(g) > 1 else s)
    return torch.tensor(out, dtype=F64)


@given(st.integers(0, 2**31 - 1), st.integers(1, 24))
def test_maxrl_is_skyrls(seed: int, rows: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (rows,), generator=g)
    scores = torch.randint(0, 2, (rows,), generator=g).to(F64)  # pass / fail rewards
    want = skyrl_maxrl(scores, ids.tolist())
    torch.testing.assert_close(d.maxrl_advantages(scores, ids), want, rtol=1e-12, atol=1e-12)


def test_maxrl_binary_weights() -> None:
    """K of G right: a right sample gets (G - K) / K, a wrong one -1 (eps = 0)."""
    scores = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [0.0] * 5], dtype=F64)
    got = d.maxrl_advantages(scores, eps=0.0)
    want = torch.tensor([[1.5, 1.5, -1.0, -1.0, -1.0], [0.0] * 5], dtype=F64)
    torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- value loss
def test_value_loss_gradcheck_and_masking() -> None:
    g = torch.Generator().manual_seed(3)
    v, old, ret = (torch.randn(4, 5, generator=g, dtype=F64) for _ in range(3))
    mask = torch.rand(4, 5, generator=g) < 0.7
    for clip in (0.2, None):
        for mode in ("token_mean", "seq_mean_token_mean"):

            def f(x: torch.Tensor, clip: float | None = clip, mode: str = mode) -> torch.Tensor:
                return d.value_loss(x, old, ret, mask, clip=clip, mode=mode).loss  # type: ignore[arg-type]

            assert torch.autograd.gradcheck(f, (v.clone().requires_grad_(True),))
    base = d.value_loss(v, old, ret, mask)
    garbage = torch.where(mask, v, torch.nan)
    again = d.value_loss(garbage, torch.where(mask, old, torch.inf), ret, mask)
    assert torch.equal(base.loss, again.loss) and torch.equal(base.clip_frac, again.clip_frac)


def test_value_loss_without_clip_is_half_mse() -> None:
    v, ret = torch.tensor([[1.0, 3.0]], dtype=F64), torch.tensor([[0.0, 1.0]], dtype=F64)
    out = d.value_loss(v, v, ret, torch.ones(1, 2, dtype=torch.bool), clip=None)
    assert float(out.loss) == pytest.approx(0.5 * (1 + 4) / 2)
    assert float(out.clip_frac) == 0.0


# --------------------------------------------------------------------------- KL in reward
def test_kl_reward_is_scores_minus_beta_kl() -> None:
    logp, ref, _, mask = _batch(5)
    scores = torch.randn(logp.shape, dtype=F64)
    for est in ("k1", "k2", "k3", "abs"):
        out = d.kl_reward(scores, logp, ref, mask, coef=0.3, estimator=est)
        kl = d.kl_penalty(logp, ref, mask, estimator=est)
        torch.testing.assert_close(out.rewards, torch.where(mask, scores - 0.3 * kl, 0.0))
        rows = kl.sum(-1) / mask.sum(-1).clamp(min=1)
        torch.testing.assert_close(out.kl_mean, rows.mean())
        tensor_coef = d.kl_reward(scores, logp, ref, mask, coef=torch.tensor(0.3, dtype=F64))
        assert tensor_coef.rewards.dtype == F64


def test_adaptive_kl_coef_moves_towards_target() -> None:
    assert d.adaptive_kl_coef(0.1, 0.5, n_steps=100, target=0.1, horizon=100) == pytest.approx(0.12)
    assert d.adaptive_kl_coef(0.1, 0.0, n_steps=100, target=0.1, horizon=100) == pytest.approx(0.08)
    assert d.adaptive_kl_coef(0.1, 0.1, n_steps=100, target=0.1, horizon=100) == pytest.approx(0.1)
    t = d.adaptive_kl_coef(
        torch.tensor(0.1), torch.tensor(0.5), n_steps=100, target=0.1, horizon=100
    )
    assert isinstance(t, torch.Tensor) and float(t) == pytest.approx(0.12)
    nan = d.adaptive_kl_coef(0.1, torch.tensor(float("nan")), n_steps=10)
    assert isinstance(nan, torch.Tensor) and torch.isnan(nan)


# --------------------------------------------------------------------------- PF-PPO
def test_pf_ppo_weights_and_resample() -> None:
    s = torch.tensor([2.0, -1.0, 0.0, 2.0, 1.0], dtype=F64)
    torch.testing.assert_close(d.pf_ppo_weights(s), s.abs() ** 2)
    torch.testing.assert_close(
        d.pf_ppo_weights(s, method="max_min"), torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0], dtype=F64)
    )
    torch.testing.assert_close(
        d.pf_ppo_weights(s, method="max_random"), torch.tensor([0.4, 0.1, 0.1, 0.4, 0.1], dtype=F64)
    )
    idx = d.pf_ppo_resample(s, method="max_min", generator=torch.Generator().manual_seed(1))
    assert idx.shape == (5,) and set(idx.tolist()) <= {0, 1, 3}
    same = d.pf_ppo_resample(s, method="max_min", generator=torch.Generator().manual_seed(1))
    assert torch.equal(idx, same)
    with pytest.raises(d.InputError, match="NaN or infinite"):
        d.pf_ppo_resample(torch.tensor([1.0, float("nan")]))
