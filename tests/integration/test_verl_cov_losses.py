"""verl 0.9.1's ``clip_cov`` and ``kl_cov`` against ``dapo_ops_clip_cov`` / ``dapo_ops_kl_cov``.

The same random float64 batch (masked rows, a full row, log-ratios up to +-20, token
advantages) goes to verl's registered function and to ours, with the global RNG seeded
identically before each call, so ``clip_cov``'s random subset is the same draw. Loss,
gradient and metrics must agree; the selections must be the same tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from test_verl_objectives import GLOBAL_INFOS, actor_config  # noqa: E402

import dapo_ops as d  # noqa: E402
from dapo_ops.integrations import verl as integration  # noqa: E402
from dapo_ops.integrations.verl_composed import verl_draw  # noqa: E402

pytestmark = pytest.mark.integration


def batch(seed: int, rows: int = 12, seq: int = 20) -> dict[str, Any]:
    """Log-probs spread wide enough that many covariances fall inside verl's (1, 5)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    lengths[1], lengths[2] = 0, seq  # a fully masked row, a full row
    mask = torch.arange(seq) < lengths[:, None]
    old = -6 * torch.rand(rows, seq, generator=g, dtype=torch.float64) - 1e-3
    logp = old + 0.3 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    old[3, :4] = torch.tensor([-25.0, -3.0, -9.0, -1.0], dtype=torch.float64)  # ratios e^+-20
    logp[3, :4] = old[3, :4] + torch.tensor([20.0, -20.0, 6.0, -6.0], dtype=torch.float64)
    logp = logp.clamp(max=-1e-6)
    adv = 2 * torch.randn(rows, 1, generator=g, dtype=torch.float64)
    adv = adv.expand(rows, seq) + 0.1 * torch.randn(rows, seq, generator=g, dtype=torch.float64)
    return {"logp": logp, "old": old, "adv": torch.where(mask, adv, 0.0), "mask": mask}


def run(fn: Any, b: dict[str, Any], agg: str, cfg: Any, weights: Any, seed: int) -> Any:
    logp = b["logp"].clone().requires_grad_(True)
    torch.manual_seed(seed)  # clip_cov draws its subset from the global RNG
    loss, metrics = fn(
        old_log_prob=b["old"],
        log_prob=logp,
        advantages=b["adv"],
        response_mask=b["mask"].to(torch.float64),
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=weights,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


CONFIGS = {
    "clip_cov": [
        {"policy_loss": {"clip_cov_ratio": 0.02}},  # k < #candidates: the draw matters
        {
            "clip_ratio_low": 0.1,
            "clip_ratio_high": 0.3,
            "policy_loss": {"clip_cov_ratio": 0.5, "clip_cov_lb": 0.5, "clip_cov_ub": 8.0},
        },
        {},  # verl's defaults: k = 1
    ],
    "kl_cov": [
        {"policy_loss": {"kl_cov_ratio": 0.05}},
        {"policy_loss": {"kl_cov_ratio": 0.3, "ppo_kl_coef": 0.25}},
        {},  # verl's defaults: k = 1, coef 1
    ],
}
CASES = [(mode, i) for mode, configs in CONFIGS.items() for i in range(len(configs))]


@pytest.mark.parametrize(("loss_mode", "config"), CASES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_cov_losses_equal_verl(loss_mode: str, config: int, agg: str, with_weights: bool) -> None:
    integration.register()
    theirs = core_algos.get_policy_loss_fn(loss_mode)
    ours = core_algos.get_policy_loss_fn(f"dapo_ops_{loss_mode}")
    for info in GLOBAL_INFOS:
        cfg = actor_config(**{k: v for k, v in CONFIGS[loss_mode][config].items()})
        cfg.global_batch_info.update(info)
        for seed in range(3):
            b = batch(seed)
            g = torch.Generator().manual_seed(100 + seed)
            weights = 0.5 + torch.rand(b["logp"].shape, generator=g, dtype=torch.float64)
            w = weights if with_weights else None
            l_v, g_v, m_v = run(theirs, b, agg, cfg, w, seed)
            l_o, g_o, m_o = run(ours, b, agg, cfg, w, seed)
            # verl divides per-sequence sums by (n_i + 1e-8): each row's mean moves by 1e-8
            # relative, so the loss by at most 1e-8 max |per-token term| (|A| r + coef
            # |log r|, times the IS weight); its covariance means by (n + 1e-8) move no
            # selection here (none is within 1e-8 of a bound or a tie)
            log_ratio = b["logp"] - b["old"]
            terms = (b["adv"].abs() * log_ratio.exp() + log_ratio.abs()) * weights.max()
            atol = 2e-8 * float(torch.where(b["mask"], terms, 0.0).max())
            torch.testing.assert_close(l_o, l_v, rtol=1e-9, atol=atol)
            torch.testing.assert_close(g_o, g_v, rtol=1e-7, atol=1e-12)
            assert m_o.keys() == m_v.keys()
            for key in m_v:
                assert m_o[key] == pytest.approx(m_v[key], rel=1e-9, abs=1e-12), key


def _selected_by_verl_clip_cov(b: dict[str, Any], cfg: Any, seed: int) -> torch.Tensor:
    """The tokens verl's clip_cov zeroes: its gradient is exactly 0 there and its loss
    term vanishes; recovered as the valid tokens whose per-token loss verl drops."""
    logp = b["logp"].clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss, metrics = core_algos.get_policy_loss_fn("clip_cov")(
        old_log_prob=b["old"],
        log_prob=logp,
        advantages=b["adv"],
        response_mask=b["mask"].to(torch.float64),
        loss_agg_mode="seq-mean-token-sum",
        config=cfg,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return metrics["actor/pg_clipfrac"], grad


def test_clip_cov_selection_is_verls_draw() -> None:
    """``clip_cov_candidates`` + ``verl_draw`` select what verl's randperm selects: the
    same count, and ours zeroes exactly the gradients verl zeroes beyond its clip."""
    from dapo_ops.correction.cov_masks import clip_cov_candidates

    cfg = actor_config(policy_loss={"clip_cov_ratio": 0.02})
    for seed in range(5):
        b = batch(seed)
        frac, grad = _selected_by_verl_clip_cov(b, cfg, seed)
        candidates, k = clip_cov_candidates(
            b["logp"], b["old"], b["adv"], b["mask"], eps_low=0.2, eps_high=0.2, cov_low=1.0,
            cov_high=5.0, fraction=0.02, log_ratio_clamp=20.0,
        )  # fmt: skip
        torch.manual_seed(seed)
        sel = verl_draw(candidates, k)
        n = int(b["mask"].sum())
        assert int(sel.sum()) == min(int(k), int(candidates.sum()))
        assert frac == pytest.approx(int(sel.sum()) / (n + 1e-8), rel=1e-12)
        # a selected token is not clipped (a candidate), so only the selection zeroes it
        assert bool((grad[sel] == 0).all())
        unclipped_others = candidates & ~sel
        assert bool((grad[unclipped_others] != 0).all())


def test_kl_cov_mask_selects_verls_topk() -> None:
    """``kl_cov_mask`` picks the tokens of verl's ``torch.topk`` over the valid
    covariances (no ties in random float64 data)."""
    for seed in range(5):
        b = batch(seed)
        valid = b["mask"]
        adv, lp = b["adv"][valid], b["logp"][valid]
        cov = (adv - adv.mean()) * (lp - lp.mean())
        k = max(1, int(cov.numel() * 0.1))
        flat = torch.zeros(valid.numel(), dtype=torch.bool)
        flat[valid.reshape(-1).nonzero().squeeze(1)[torch.topk(cov, k).indices]] = True
        got = d.kl_cov_mask(b["logp"], b["adv"], valid, fraction=0.1)
        assert torch.equal(got, flat.view(valid.shape))
