"""dapo_ops.integrations.openrlhf against OpenRLHF 0.11.2's own ``PolicyLoss``.

OpenRLHF is installed with ``--no-deps`` (``.ci/integration``); only its loss module is
loaded: ``openrlhf/models/__init__.py`` imports the actor (DeepSpeed, flash-attn), so the
``openrlhf.models`` package is stood in by an empty package pointing at the installed
directory, and ``openrlhf/models/utils.py``'s top-level ``import deepspeed`` (used only by
``set_z3_leaf_modules``, which the loss never calls) by an empty module while the loss
module loads. Both stand-ins are removed afterwards.

Every case feeds the same float64 inputs to both: ragged masks (empty rows, one-token
rows, full rows), finite garbage at masked positions, per-token advantages that vary along
the row, token log-ratios of +-20 (and +-25 where both clamp), and compares the loss, its
gradient and the four metrics (1e-6 relative; OpenRLHF's sequence mean divides by
``n + 1e-8``, a relative 1e-8 / n).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("openrlhf")

from dapo_ops import InputError, entropy_bonus, token_level_aggregate
from dapo_ops.integrations.openrlhf import (
    PolicyLossOptions,
    openrlhf_kl,
    openrlhf_policy_loss,
    policy_loss_module,
)

pytestmark = pytest.mark.integration

F64 = torch.float64


@pytest.fixture(scope="module")
def peer() -> Any:
    """``openrlhf.models.loss``, loaded without the heavy package ``__init__``."""
    spec = importlib.util.find_spec("openrlhf")
    assert spec is not None and spec.submodule_search_locations
    models_dir = Path(next(iter(spec.submodule_search_locations))) / "models"
    added = []
    if "openrlhf.models" not in sys.modules:
        pkg = types.ModuleType("openrlhf.models")
        pkg.__path__ = [str(models_dir)]
        sys.modules["openrlhf.models"] = pkg
        added.append("openrlhf.models")
    if importlib.util.find_spec("deepspeed") is None:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")
        added.append("deepspeed")
    try:
        loss = importlib.import_module("openrlhf.models.loss")
        loss.compute_approx_kl = importlib.import_module("openrlhf.models.utils").compute_approx_kl
    finally:
        for name in added:
            sys.modules.pop(name, None)
    yield loss
    for name in ("openrlhf.models.loss", "openrlhf.models.utils"):
        sys.modules.pop(name, None)


def batch(seed: int, *, extreme: float = 20.0, const_adv: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 1 + seed % 37
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    lengths[0], lengths[1], lengths[-1] = t, 0, min(1, t)
    mask = torch.arange(t) < lengths[:, None]
    old = -torch.rand(b, t, generator=g, dtype=F64) * 5 - 1e-3
    spread = (0.05, 0.5, 3.0)[seed % 3]
    logp = old + spread * torch.randn(b, t, generator=g, dtype=F64)
    far = torch.rand(b, t, generator=g) < 0.1  # probabilities moved by e^+-extreme
    sign = torch.where(torch.rand(b, t, generator=g) < 0.5, -1.0, 1.0).double()
    logp = torch.where(far, old + sign * extreme, logp)
    rollout = old + (0.3 * torch.randn(b, t, generator=g, dtype=F64)).clamp(-0.5, 0.5)
    # rollout/trainer mismatches the correction filters (not on the far tokens, so that a
    # gspo ratio against the rollout stays within +-20)
    off = (torch.rand(b, t, generator=g) < 0.15) & ~far
    rollout = torch.where(off, old + 3.0 * sign, rollout)
    adv = torch.randn(b, t, generator=g, dtype=F64)
    if const_adv:
        adv = adv[:, :1].expand(b, t).clone()
    junk = 3 * torch.randn(
        4, b, t, generator=g, dtype=F64
    )  # garbage where masked (finite: OpenRLHF multiplies exp of it by 0)
    logp, old, rollout, adv = (
        torch.where(mask, x, j) for x, j in zip((logp, old, rollout, adv), junk, strict=True)
    )
    return {"logp": logp, "old": old, "rollout": rollout, "adv": adv, "mask": mask}


CLIPS = [
    {"clip_eps_low": 0.2, "clip_eps_high": 0.2},
    {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": 3.0},
    {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "dual_clip": 1.1},
]
CORRECTIONS = [
    {},
    {"is_correction_level": "token"},
    {"is_correction_level": "token", "is_correction_mode": "clip", "is_correction_threshold": (0.8, 1.25)},
    {"is_correction_level": "seq", "is_correction_threshold": (0.8, 1.25)},
    {"is_correction_level": "token", "is_correction_gating": "binary_kl", "is_correction_threshold": (0.0, 0.02)},
    {"is_correction_level": "seq", "is_correction_gating": "tv", "is_correction_threshold": (-1.0, 0.1)},
]  # fmt: skip
SCALES = [
    {},
    {"dp_size": 2, "batch_num_tokens": 57.0, "global_batch_size": 9.0},
]


def _cases() -> list[Any]:
    out = []
    for kind, token_level, clip, corr, scale in itertools.product(
        ["ppo", "gspo"], [True, False], CLIPS, CORRECTIONS, SCALES
    ):
        if kind == "gspo" and not token_level:
            continue  # gspo forces the sequence mean whatever token_level_loss says
        opts = {"policy_loss_type": kind, "token_level_loss": token_level, **clip, **corr}
        out.append(pytest.param(opts, scale, id=f"{kind}-{token_level}-{len(out)}"))
    return out


def _both(peer: Any, opts: dict[str, Any], scale: dict[str, Any], b: dict[str, Any]) -> Any:
    results = []
    for impl in ("openrlhf", "dapo_ops"):
        logp = b["logp"].clone().requires_grad_()
        args = (logp, b["old"], b["adv"])
        kwargs = {"rollout_log_probs": b["rollout"], **scale}
        if impl == "openrlhf":
            out = peer.PolicyLoss(**opts)(*args, action_mask=b["mask"], **kwargs)
        else:
            out = openrlhf_policy_loss(
                *args, b["mask"], options=PolicyLossOptions(**opts), **kwargs
            )
        (grad,) = torch.autograd.grad(out[0], logp)
        results.append((out, grad))
    return results


def _close(ours: Any, theirs: Any, what: str) -> None:
    if theirs is None or ours is None:
        assert ours is None and theirs is None, what
        return
    o, t = float(ours.detach()), float(theirs.detach())
    if math.isnan(t):  # OpenRLHF's metric of an empty set; ours is 0
        assert o == 0.0, what
        return
    assert abs(o - t) <= 1e-6 * max(1.0, abs(t)), f"{what}: ours {o!r}, OpenRLHF {t!r}"


@pytest.mark.parametrize(("opts", "scale"), _cases())
def test_policy_loss_matches_openrlhf(
    peer: Any, opts: dict[str, Any], scale: dict[str, Any]
) -> None:
    exercised: set[str] = set()
    for seed in range(6):
        # gspo's ratio is unclamped in OpenRLHF: keep its mean log-ratio (to the old or, with
        # a correction, the rollout log-probs, 0.5 away at most) within our +-20
        b = batch(seed, extreme=19.5 if opts["policy_loss_type"] == "gspo" else 25.0,
                  const_adv=seed % 2 == 1)  # fmt: skip
        (theirs, g_theirs), (ours, g_ours) = _both(peer, opts, scale, b)
        what = f"seed {seed} {opts} {scale}"
        _close(ours.loss, theirs[0], f"loss, {what}")
        scale_g = max(1.0, float(g_theirs.abs().max()))
        err = float((g_ours - g_theirs).abs().max())
        assert err <= 1e-6 * scale_g, f"gradient off by {err:.3g}, {what}"
        for name, t in zip(
            ("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), theirs[1:], strict=True
        ):
            _close(getattr(ours, name), t, f"{name}, {what}")
            if t is not None and 0 < float(t) < 1:
                exercised.add(name)
        exercised.add("gradient") if float(g_theirs.abs().max()) > 1e-3 else None
    # the comparison is not vacuous: the clip, the correction's filter and the gradient acted
    wanted = {"clip_ratio", "gradient"} | (
        {"is_filter_ratio"}
        if opts.get("is_correction_level", "off") != "off" and opts["policy_loss_type"] == "ppo"
        else set()
    )
    assert wanted <= exercised, (wanted, exercised)


def test_the_module_is_a_drop_in(peer: Any) -> None:
    b = batch(7)
    opts = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": 3.0,
            "is_correction_level": "token", "is_correction_threshold": [0.5, 5.0]}  # fmt: skip
    ours = policy_loss_module(**opts)(
        b["logp"], b["old"], b["adv"], action_mask=b["mask"], rollout_log_probs=b["rollout"]
    )
    theirs = peer.PolicyLoss(**opts)(
        b["logp"], b["old"], b["adv"], action_mask=b["mask"], rollout_log_probs=b["rollout"]
    )
    assert len(ours) == len(theirs) == 5
    for o, t in zip(ours, theirs, strict=True):
        _close(o, t, "drop-in")


@pytest.mark.parametrize(
    "bad",
    [
        {"dual_clip": 1.0},
        {"is_correction_level": "sequence"},
        {"is_correction_mode": "clip", "is_correction_level": "seq"},
        {"is_correction_level": "token", "is_correction_gating": "tv"},  # band (0.5, 5) from below
    ],
)
def test_refused_options_are_openrlhfs(peer: Any, bad: dict[str, Any]) -> None:
    with pytest.raises((AssertionError, ValueError)):
        peer.PolicyLoss(**bad)
    with pytest.raises(InputError):
        PolicyLossOptions(**bad)


def test_documented_differences(peer: Any) -> None:
    """An all-masked micro-batch: 0 where OpenRLHF gives NaN. A GSPO mean log-ratio beyond
    +-20: our ratio is e^+-20, OpenRLHF's is not clamped."""
    b = batch(3)
    empty = torch.zeros_like(b["mask"])
    theirs = peer.PolicyLoss()(b["logp"], b["old"], b["adv"], action_mask=empty)
    ours = openrlhf_policy_loss(b["logp"], b["old"], b["adv"], empty, options=PolicyLossOptions())
    assert math.isnan(float(theirs[0])) and float(ours.loss) == 0.0
    logp = torch.tensor([[-30.0, -30.0]], dtype=F64)
    old = torch.tensor([[-1.0, -1.0]], dtype=F64)
    adv, mask = -torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool)
    opts = PolicyLossOptions(policy_loss_type="gspo", clip_eps_low=0.2, clip_eps_high=0.2)
    ours = openrlhf_policy_loss(logp, old, adv, mask, options=opts)
    theirs = peer.PolicyLoss(policy_loss_type="gspo")(logp, old, adv, action_mask=mask)
    assert float(ours.loss) == pytest.approx(0.8)  # -A clamp(e^-20, 0.8, inf) = 0.8 both
    assert float(theirs[0]) == pytest.approx(0.8)
    logp, old = old, torch.full((1, 2), -30.0, dtype=F64)
    ours = openrlhf_policy_loss(logp, old, adv, mask, options=opts)
    theirs = peer.PolicyLoss(policy_loss_type="gspo")(logp, old, adv, action_mask=mask)
    # mean log-ratio +29: OpenRLHF's loss is e^29, ours e^20
    assert float(ours.loss) == pytest.approx(math.exp(20.0))
    assert float(theirs[0]) == pytest.approx(math.exp(29.0))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("with_old", [False, True])
def test_kl_loss_matches_openrlhf(
    peer: Any, estimator: str, unbiased: bool, with_old: bool
) -> None:
    """``compute_approx_kl`` and the actor's KL loss (its token mean over the step's tokens):
    value and gradient, log-ratios up to +-25 (both clamp the estimate to +-10)."""
    for seed in range(4):
        b = batch(seed, extreme=25.0)
        ref = b["rollout"]  # a reference policy near the old one
        old = b["old"] if with_old else None
        grads = []
        for impl in ("openrlhf", "dapo_ops"):
            logp = b["logp"].clone().requires_grad_()
            if impl == "openrlhf":
                kl = peer.compute_approx_kl(logp, ref, log_probs_old=old, kl_estimator=estimator,
                                            unbiased_gradient=unbiased)  # fmt: skip
                loss = peer.aggregate_loss(kl, b["mask"], dp_size=2, batch_num_tokens=40.0)
            else:
                kl = openrlhf_kl(logp, ref, b["mask"], kl_estimator=estimator, log_probs_old=old,
                                 unbiased_gradient=unbiased)  # fmt: skip
                loss = token_level_aggregate(kl, b["mask"], normalizer=20.0)
            grads.append((loss, torch.autograd.grad(loss, logp)[0]))
        (theirs, g_theirs), (ours, g_ours) = grads
        _close(ours, theirs, f"KL loss {estimator} seed {seed}")
        err = float((g_ours - g_theirs).abs().max())
        assert err <= 1e-6 * max(1.0, float(g_theirs.abs().max())), (estimator, seed, err)


@pytest.mark.parametrize("token_level", [True, False])
def test_entropy_bonus_matches_openrlhfs_entropy_loss(peer: Any, token_level: bool) -> None:
    """OpenRLHF's actor: ``loss -= entropy_coef * aggregate_loss(entropy, mask, **info)``,
    always its token mean (``aggregate_loss``'s default), whatever the policy loss's."""
    b = batch(11)
    h = b["old"].abs().clone().requires_grad_()  # any non-negative per-token values
    theirs = -0.01 * peer.aggregate_loss(h, b["mask"], dp_size=2, batch_num_tokens=33.0)
    ours = entropy_bonus(h, b["mask"], coef=0.01, normalizer=33.0 / 2)
    _close(ours, theirs, "entropy bonus")
    (g_t,) = torch.autograd.grad(theirs, h)
    (g_o,) = torch.autograd.grad(ours, h)
    assert float((g_o - g_t).abs().max()) <= 1e-12
