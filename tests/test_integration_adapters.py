"""The TRL / verl adapters' pure parts, without TRL or verl installed.

tests/integration/ compares them with the real packages; these tests pin the mappings
and the masking contract in the default suite.
"""

from __future__ import annotations

import importlib
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_ops import InputError, global_normalizer, token_level_loss
from dapo_ops.integrations import trl as trl_adapter
from dapo_ops.integrations import verl as verl_adapter
from dapo_ops.integrations.verl_losses import VERL_LOSS_MODES, policy_loss_fn


def test_importing_the_adapters_imports_no_trainer() -> None:
    code = (
        "import sys, dapo_ops.integrations.trl, dapo_ops.integrations.verl, "
        "dapo_ops.integrations.openrlhf; "
        "loaded = [m for m in ('trl', 'verl', 'transformers', 'openrlhf') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_trl_normalizers() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    dapo = trl_adapter.trl_normalizer(
        "dapo",
        mask,
        num_items_in_batch=torch.tensor(24),
        num_processes=2,
        accumulation_steps=2,
        steps_per_generation=4,
    )
    assert float(dapo) == 24 / 2 * 2 / 4
    assert float(trl_adapter.trl_normalizer("bnpo", mask, accumulation_steps=3)) == 3 * 3
    assert trl_adapter.trl_normalizer("grpo", mask, accumulation_steps=2) == 3 * 2
    assert trl_adapter.trl_normalizer("dr_grpo", mask, training=False) == 3
    with pytest.raises(InputError, match="num_items_in_batch"):
        trl_adapter.trl_normalizer("dapo", mask)
    with pytest.raises(InputError, match="loss_type"):
        trl_adapter.trl_normalizer("cispo", mask)


def test_trl_dapo_normaliser_is_the_global_normaliser() -> None:
    micro = [torch.rand(3, 7) > 0.4, torch.rand(5, 4) > 0.4]
    total = sum(int(m.sum()) for m in micro)
    norm = trl_adapter.trl_normalizer(
        "dapo", micro[0], num_items_in_batch=total, accumulation_steps=2, steps_per_generation=2
    )
    assert float(norm) == float(global_normalizer(micro))


def test_trl_policy_loss_ignores_masked_garbage_with_kl() -> None:
    torch.manual_seed(0)
    logp = (-3 * torch.rand(2, 4)).requires_grad_()  # log-probs: <= 0
    old = -(logp.detach() + 0.3 * torch.randn(2, 4)).abs()
    ref = logp.detach() - 0.2
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    old[0, 3], ref[1, 3] = float("nan"), float("inf")
    loss, _ = trl_adapter.trl_policy_loss(
        logp, old, torch.tensor([1.0, -1.0]), mask, beta=0.1, ref_per_token_logps=ref,
        num_items_in_batch=5,
    )  # fmt: skip
    loss.backward()
    assert logp.grad is not None and torch.isfinite(loss)
    assert bool(torch.isfinite(logp.grad).all()) and not logp.grad[mask == 0].any()


def test_trl_delta_is_the_dual_clip() -> None:
    torch.manual_seed(1)
    logp, old = -torch.randn(4, 6).abs(), -torch.randn(4, 6).abs()  # log-probs: <= 0
    adv, mask = torch.randn(4), torch.ones(4, 6, dtype=torch.bool)
    loss, _ = trl_adapter.trl_policy_loss(
        logp, old, adv, mask, loss_type="bnpo", delta=2.0, epsilon_high=0.28
    )
    expected = token_level_loss(logp, old, adv, mask, dual_clip=2.0, eps_high=0.28)
    assert torch.equal(loss, expected)  # the adapter calls the same loss: the same bits
    for bad in (1.0, 0.5):
        with pytest.raises(InputError, match="delta"):
            trl_adapter.trl_policy_loss(logp, old, adv, mask, loss_type="bnpo", delta=bad)


def _trl_clipped_f64(logp, old, adv, mask, low, high, delta, level="token"):  # type: ignore[no-untyped-def]
    """TRL's clipped per-token loss in float64, from its documented formula:
    -min(min(r, delta) A, clip(r, 1 - low, 1 + high) A), r the token or sequence ratio."""
    lr = torch.where(mask, logp - old, 0.0)
    if level == "sequence":
        lr = (lr.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(lr)
    r = lr.exp()
    a = adv[:, None]
    capped = r if delta is None else r.clamp(max=delta)
    return -torch.minimum(capped * a, r.clamp(1 - low, 1 + high) * a)


@pytest.mark.parametrize("delta", [1.1, 1.28, 1.5, None])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_delta_and_sequence_level_match_trls_formula(delta: float | None, level: str) -> None:
    """Any delta > 1, and the sequence ratio, against TRL's formula in float64: value and
    gradient (bnpo: the local token mean)."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    logp = (
        -(old + 0.4 * torch.randn(5, 7, generator=g, dtype=torch.float64)).abs()
    ).requires_grad_()
    adv = torch.randn(5, generator=g, dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([7, 3, 0, 5, 1])[:, None]
    loss, _ = trl_adapter.trl_policy_loss(
        logp, old, adv, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.28,
        delta=delta, importance_sampling_level=level,
    )  # fmt: skip
    ref = torch.where(mask, _trl_clipped_f64(logp, old, adv, mask, 0.2, 0.28, delta, level), 0.0)
    want = ref.sum() / mask.sum()
    (g_ours,) = torch.autograd.grad(loss, logp)
    (g_want,) = torch.autograd.grad(want, logp)
    # float64 throughout: a few roundings of terms of size <= |A| r (<= ~10 here)
    assert abs(float((loss - want).detach())) <= 1e-12
    assert float((g_ours - g_want).abs().max()) <= 1e-12


def test_trl_cispo_cap_below_one_and_vespo_with_vllm_ratio() -> None:
    """cispo with TRL's default cap epsilon_high = 0.2 (< 1) and vespo with vLLM's ratio
    folded into its weight, against TRL's formulas in float64."""
    g = torch.Generator().manual_seed(4)
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    logp = (
        -(old + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)).abs()
    ).requires_grad_()
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.arange(6) < torch.tensor([6, 2, 4, 0])[:, None]
    n = int(mask.sum())
    loss, _ = trl_adapter.trl_policy_loss(
        logp, old, adv, mask, loss_type="cispo", epsilon_high=0.2, num_items_in_batch=n
    )
    w = (logp - old).detach().exp().clamp(max=0.2)
    want = torch.where(mask, -w * adv[:, None] * logp, 0.0).sum() / n
    assert abs(float((loss - want).detach())) <= 1e-12
    is_ratio = 0.5 + torch.rand(4, 6, generator=g, dtype=torch.float64)
    loss, _ = trl_adapter.trl_policy_loss(
        logp, old, adv, mask, loss_type="vespo", num_items_in_batch=n,
        importance_sampling_ratio=is_ratio,
    )  # fmt: skip
    lr = torch.where(mask, logp.detach() - old, 0.0).sum(-1) + torch.where(
        mask, is_ratio.log(), 0.0
    ).sum(-1)
    log_w = lr.clamp(math.log(1e-8), 20.0)
    k = torch.where(adv >= 0, 2.0, 3.0)
    lam = torch.where(adv >= 0, 3.0, 2.0)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    want = torch.where(mask, -(phi * adv)[:, None] * logp, 0.0).sum() / n
    assert abs(float((loss - want).detach())) <= 1e-12


def test_overlong_reward_function() -> None:
    reward = trl_adapter.OverlongReward(max_len=8, cache_len=4, factor=0.5)
    assert reward(completion_ids=[[1] * 4, [1] * 6, [1] * 9], prompts=None) == [0.0, -0.25, -0.5]
    assert reward(completion_ids=[]) == []
    assert reward.__name__ == "overlong_reward"
    with pytest.raises(InputError, match="cache_len"):
        trl_adapter.OverlongReward(max_len=8, cache_len=9)


@pytest.mark.parametrize(
    ("agg", "info", "expected"),
    [
        ("token-mean", {}, ("token_mean", "local", None)),
        ("token-mean", {"dp_size": 4, "batch_num_tokens": 100}, ("token_mean", 25.0, None)),
        ("token-sum", {"dp_size": 4}, ("token_mean", 0.25, None)),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": 8}, ("seq_mean_token_mean", 4.0, None)),
        ("seq-mean-token-sum", {}, ("seq_mean_token_sum", "local", None)),
        (
            "seq-mean-token-sum-norm",
            {"dp_size": 1, "global_batch_size": 3, "loss_scale_factor": 64},
            ("seq_mean_token_sum_norm", 3.0, 64),
        ),
    ],
)  # fmt: skip
def test_verl_aggregation(agg: str, info: dict[str, object], expected: tuple[object, ...]) -> None:
    mode, normalizer, max_len = verl_adapter.verl_aggregation(agg, info)
    got = (mode, normalizer if isinstance(normalizer, str) else float(normalizer), max_len)
    assert got == expected


def test_verl_aggregation_refuses_a_missing_global_count_under_dp() -> None:
    with pytest.raises(InputError, match="dp_size"):
        verl_adapter.verl_aggregation("token-mean", {"dp_size": 2, "batch_num_tokens": None})
    with pytest.raises(InputError, match="loss_agg_mode"):
        verl_adapter.verl_aggregation("token-max", {})


def test_verl_policy_loss_with_a_plain_dict_config() -> None:
    torch.manual_seed(2)
    logp, old, adv = -torch.randn(3, 5).abs(), -torch.randn(3, 5).abs(), torch.randn(3, 5)
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 0, 0, 0], [0.0] * 5])
    config = {"clip_ratio": 0.2, "clip_ratio_high": 0.28, "global_batch_info": {}}
    loss, metrics = verl_adapter.compute_policy_loss(old, logp, adv, mask, "token-mean", config)
    expected = token_level_loss(logp, old, adv, mask != 0, eps_high=0.28, dual_clip=3.0)
    assert torch.equal(loss, expected)  # the adapter calls the same loss: the same bits
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


_VERL_ONLY_NAMES = r"\b(logp|old_logp|mask|is_weights)\b"  # dapo_ops' names verl lacks


@pytest.mark.usefixtures("no_runtime_typecheck")  # the message a verl user sees (no jaxtyping)
@pytest.mark.parametrize("loss_mode", list(VERL_LOSS_MODES))
@pytest.mark.parametrize(
    ("bad", "named"),
    [
        ({"log_prob": (3, 4)}, "log_prob"),
        ({"old_log_prob": (3, 4)}, "old_log_prob"),
        ({"advantages": (5,)}, "advantages"),
        ({"response_mask": (3, 4)}, "response_mask"),
        ({"rollout_is_weights": (3, 4)}, "rollout_is_weights"),
    ],
)
def test_verl_twin_errors_name_verl_arguments(
    loss_mode: str, bad: dict[str, tuple[int, ...]], named: str
) -> None:
    """A bad argument of a verl loss twin is reported by the name the verl user passed
    (``log_prob``, ``response_mask``, ...), never by dapo_ops' own (``logp``, ``mask``)."""
    shapes = {"old_log_prob": (3, 5), "log_prob": (3, 5), "advantages": (3, 5),
              "response_mask": (3, 5), "rollout_is_weights": (3, 5), **bad}  # fmt: skip
    args = {k: -torch.rand(s) if k != "response_mask" else torch.ones(s) for k, s in shapes.items()}
    config = {"clip_ratio": 0.2, "global_batch_info": {}, "policy_loss": {"dro_beta": 0.1}}
    with pytest.raises(InputError) as caught:
        policy_loss_fn(loss_mode)(**args, loss_agg_mode="token-mean", config=config)
    message = str(caught.value)
    assert named in message, message
    assert not re.search(_VERL_ONLY_NAMES, message), message


# --------------------------------------------------------------------------- OpenRLHF


def _openrlhf_batch(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    logp = -(old + 0.6 * torch.randn(5, 7, generator=g, dtype=torch.float64)).abs()
    adv = torch.randn(5, 7, generator=g, dtype=torch.float64)  # per token, varying
    mask = torch.arange(7) < torch.tensor([7, 3, 0, 5, 1])[:, None]
    return logp, old, adv, mask


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_openrlhf_gspo_with_per_token_advantages(dual_clip: float | None) -> None:
    """OpenRLHF's GSPO row loss mean_t -min(s A_t, clip(s) A_t) (dual-clipped where A_t < 0),
    s = exp of the row's mean log-ratio, differentiated through the mean: float64 formula."""
    from dapo_ops.integrations.openrlhf import PolicyLossOptions, openrlhf_policy_loss

    logp, old, adv, mask = _openrlhf_batch(5)
    logp.requires_grad_()
    opts = PolicyLossOptions(policy_loss_type="gspo", clip_eps_low=0.2, clip_eps_high=0.28,
                             dual_clip=dual_clip)  # fmt: skip
    got = openrlhf_policy_loss(logp, old, adv, mask, options=opts).loss
    n = mask.sum(-1, keepdim=True)
    s = (torch.where(mask, logp - old, 0.0).sum(-1, keepdim=True) / n.clamp(min=1)).exp()
    per = -torch.minimum(s * adv, s.clamp(0.8, 1.28) * adv)
    if dual_clip is not None:
        per = torch.where(adv < 0, torch.minimum(per, -dual_clip * adv), per)
    rows = torch.where(mask, per, 0.0).sum(-1) / n.squeeze(-1).clamp(min=1)
    want = rows.sum() / (n > 0).sum()
    (g_got,) = torch.autograd.grad(got, logp)
    (g_want,) = torch.autograd.grad(want, logp)
    assert abs(float((got - want).detach())) <= 1e-12
    assert float((g_got - g_want).abs().max()) <= 1e-12


def test_openrlhf_correction_mask_keeps_the_token_ratio() -> None:
    from dapo_ops.integrations.openrlhf import PolicyLossOptions, correction_weights

    _, old, _, mask = _openrlhf_batch(6)
    rollout = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0),
                                      dtype=torch.float64)  # fmt: skip
    opts = PolicyLossOptions(is_correction_level="token", is_correction_threshold=(0.8, 1.25))
    w, filtered, counted = correction_weights(old, rollout, mask, opts)
    rho = (old - rollout).exp()
    keep = (rho >= 0.8) & (rho <= 1.25)
    assert torch.equal(filtered & mask, ~keep & mask) and torch.equal(counted, mask)
    assert torch.allclose(w, torch.where(keep & mask, rho, 0.0), rtol=0, atol=0)


@pytest.mark.usefixtures("no_runtime_typecheck")
def test_openrlhf_options_are_checked() -> None:
    from dapo_ops.integrations.openrlhf import PolicyLossOptions

    for bad, name in [
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"policy_loss_type": "grpo"}, "policy_loss_type"),
        ({"is_correction_level": "seq", "is_correction_mode": "clip"}, "is_correction_mode"),
        ({"is_correction_level": "token", "is_correction_gating": "tv"}, "is_correction_threshold"),
    ]:
        with pytest.raises(InputError, match=name):
            PolicyLossOptions(**bad)  # type: ignore[arg-type]


def test_comparison_covers_every_peer_name_of_the_parity_issue() -> None:
    """Issue 16's lists: each name is in a row, and no row claims a peer name its adapter
    does not take."""
    from dapo_ops.integrations.peers import feature_rows

    rows = feature_rows()
    verl = " ".join(r.verl for r in rows)
    trl = " ".join(r.trl for r in rows)
    openrlhf = " ".join(r.openrlhf for r in rows)
    losses = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
              "geo_mean", "dro", "cispo", "bypass_mode"]  # fmt: skip
    estimators = ["gae", "grpo", "grpo_vectorized", "gdpo", "grpo_passk", "reinforce_plus_plus",
                  "reinforce_plus_plus_baseline", "rloo", "rloo_vectorized", "opo", "remax", "gpg",
                  "optimal_token_baseline", "tir_optimal_token_baseline"]  # fmt: skip
    for name in losses + estimators:
        assert f"`{name}` → `" in verl, name
    for name in ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]:
        assert f"`loss_type={name}`" in trl, name
    for name in ["top_entropy_quantile", "off_policy_mask_threshold", "delta", "entropy_coef",
                 "use_adaptive_entropy", 'importance_sampling_level="sequence"']:  # fmt: skip
        assert f"`{name}`" in trl, name
    for name in ['policy_loss_type="ppo"', 'policy_loss_type="gspo"', "dual_clip",
                 "token_level_loss=True", "token_level_loss=False"]:  # fmt: skip
        assert f"`{name}`" in openrlhf, name
    # a row we claim never names a peer name without its adapter; a "not applicable" row
    # (no dapo_ops cell, its reason in the note) shows the peer's name marked "(no adapter)"
    assert all("(no adapter)" not in r.verl + r.trl for r in rows if r.dapo_ops)
    assert all(r.dapo_ops or r.note for r in rows), "a 'not applicable' row without its reason"


def test_verl_registration_hook_passes_namespace_packages_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-shot hook of verl_plugin sits in sys.meta_path until verl loads its module;
    meanwhile every import asks it, namespace packages included (their ``path`` is a
    ``_NamespacePath``, not a list): it must answer None for them, under the suite's
    runtime type checker too (a too-narrow annotation broke unrelated imports)."""
    from dapo_ops.integrations.verl_plugin import _AfterImport

    (tmp_path / "nspkg_for_hook" / "inner").mkdir(parents=True)  # no __init__: a namespace
    (tmp_path / "nspkg_for_hook" / "inner" / "mod.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fired: list[bool] = []
    hook = _AfterImport("nspkg_for_hook.inner.mod", lambda: fired.append(True))
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    module = importlib.import_module("nspkg_for_hook.inner.mod")
    assert module.VALUE == 3 and fired == [True] and hook not in sys.meta_path
