"""Every public function traces with torch.compile(fullgraph=True) and matches eager.

A graph break (an ``.item()``, a host sync, a data-dependent Python branch) fails these
tests, so they also prove the loss path never syncs with the host. The main loss is
compiled with inductor; the others with ``aot_eager``, which traces forward and backward
the same way but skips code generation, to keep the suite fast on 2 cores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _strategies import MODES, make_batch

import dapo_ops as d

pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")


def compiled(fn: Callable[..., Any], backend: str = "aot_eager") -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def test_token_level_loss_inductor_forward_backward_and_diagnostics() -> None:
    b = make_batch(8, 32, 0)
    nan_logp = torch.where(b.mask, b.logp, torch.tensor(float("nan")))

    def step(logp: torch.Tensor) -> tuple[torch.Tensor, d.PolicyDiagnostics]:
        return d.token_level_loss(
            logp,
            b.old_logp,
            b.advantages,
            b.mask,
            normalizer=torch.tensor(50.0),
            return_diagnostics=True,
        )

    eager_logp = nan_logp.clone().requires_grad_(True)
    comp_logp = nan_logp.clone().requires_grad_(True)
    loss_e, diag_e = step(eager_logp)
    loss_c, diag_c = compiled(step, backend="inductor")(comp_logp)
    loss_e.backward()
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(comp_logp.grad, eager_logp.grad)
    for name in diag_e._fields:
        # float32 sums cast to float64: compare at float32 precision
        torch.testing.assert_close(
            getattr(diag_c, name), getattr(diag_e, name), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("mode", MODES)
def test_loss_every_mode(mode: str) -> None:
    b = make_batch(4, 16, 1)
    logp = b.logp.clone().requires_grad_(True)
    f = compiled(
        lambda lp: d.token_level_loss(
            lp, b.old_logp, b.advantages, b.mask, mode=mode, dual_clip=3.0, eps_high=0.3
        )
    )
    out = f(logp)
    out.backward()
    ref_logp = b.logp.clone().requires_grad_(True)
    ref = d.token_level_loss(
        ref_logp, b.old_logp, b.advantages, b.mask, mode=mode, dual_clip=3.0, eps_high=0.3
    )  # type: ignore[call-overload]
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(logp.grad, ref_logp.grad)


def test_per_batch_functions() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (6, 8), generator=g).float()
    ids = torch.randint(0, 5, (48,), generator=g) * 3
    lengths = torch.randint(0, 40, (48,), generator=g)
    mask = torch.rand(6, 8, generator=g) > 0.2
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: d.group_advantages(rewards), "dense advantages"),
        (lambda: d.group_advantages(rewards.flatten(), ids, baseline="leave_one_out"), "flat"),
        (lambda: d.group_advantages(rewards, scale="batch"), "batch std"),
        (lambda: d.dynamic_sample_mask(rewards), "dense sampling"),
        (lambda: d.dynamic_sample_mask(rewards.flatten(), ids), "flat sampling"),
        (lambda: d.overlong_reward(lengths, max_len=32, cache_len=8), "overlong"),
        (lambda: d.overlong_filter(mask, lengths[:6] >= 32), "filter"),
        (lambda: d.global_normalizer([mask, mask[:2]], mode="seq_mean_token_mean"), "normaliser"),
        (
            lambda: d.kept_group_fraction(d.dynamic_sample_mask(rewards.flatten(), ids), ids),
            "fraction",
        ),
    ]
    for fn, name in cases:
        torch.testing.assert_close(compiled(fn)(), fn(), msg=name)


def test_variants_and_presets() -> None:
    b = make_batch(4, 16, 2)
    ref = b.old_logp + 0.05
    w = d.truncated_is_weights(b.old_logp, b.old_logp + 0.1, b.mask)
    lengths = b.mask.sum(-1)
    cases: list[tuple[Callable[[torch.Tensor], Any], str]] = [
        (lambda lp: d.gspo_surrogate(lp, b.old_logp, b.advantages, b.mask).sum(), "gspo"),
        (lambda lp: d.cispo_surrogate(lp, b.old_logp, b.advantages, b.mask).sum(), "cispo"),
        (lambda lp: d.kl_penalty(lp, ref, b.mask, estimator="k2").sum(), "kl"),
        (
            lambda lp: d.token_level_loss(
                lp, b.old_logp, b.advantages, b.mask, ref_logp=ref, kl_beta=0.1, is_weights=w
            ),
            "loss with kl and is",
        ),
        (lambda lp: d.truncated_is_weights(lp, ref, b.mask, level="sequence").sum(), "tis"),
        # fields, not properties: under this suite's runtime checker the NamedTuples'
        # methods are wrapped by jaxtyping, which dynamo cannot trace (without the
        # checker the properties compile too)
        (
            lambda lp: (
                d.policy_diagnostics(lp, b.old_logp, b.advantages, b.mask, entropy=-lp).entropy_sum
            ),
            "diag",
        ),
        (lambda lp: d.batch_diagnostics(lengths, max_len=10).overlong_samples, "batch diag"),
    ]
    cases += [
        (
            lambda lp, p=p: p.loss(
                lp, b.old_logp, b.advantages, b.mask, ref_logp=ref if p.kl else None, max_len=16
            ),
            name,
        )
        for name, p in d.presets.PRESETS.items()
    ]
    for fn, name in cases:
        lp_e = b.logp.clone().requires_grad_(True)
        lp_c = b.logp.clone().requires_grad_(True)
        out_e, out_c = fn(lp_e), compiled(fn)(lp_c)
        torch.testing.assert_close(out_c, out_e, msg=name)
        if out_e.requires_grad:
            out_e.backward()
            out_c.backward()
            torch.testing.assert_close(lp_c.grad, lp_e.grad, msg=name)
