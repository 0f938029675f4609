"""Every public function traces with torch.compile(fullgraph=True) and matches eager.

A graph break (an ``.item()``, a host sync, a data-dependent Python branch) fails these
tests, so they also prove the loss path never syncs with the host. The main loss is
compiled with inductor; the others with ``aot_eager``, which traces forward and backward
the same way but skips code generation, to keep the suite fast on 2 cores.

"Matches eager" is checked against the exact values, never compiled against eager
directly: a compiled graph may sum in another order (inductor does) or decompose an op,
so each of the two is held to the rounding-error bound of tests/_bounds.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _bounds import (
    advantage_bound,
    assert_within,
    func_rel,
    gamma,
    loss_reference,
    scale_of,
    unit_roundoff,
)
from _strategies import MODES, make_batch

import dapo_ops as d

# slow: compiles (README's fast subset, -m "not slow and not distributed", leaves it out)
pytestmark = [pytest.mark.usefixtures("no_runtime_typecheck"), pytest.mark.slow]

F32, F64 = torch.float32, torch.float64


def compiled(fn: Callable[..., Any], backend: str = "aot_eager") -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def diagnostics_bounds(b: Any, exact: d.PolicyDiagnostics) -> dict[str, float]:
    """Bounds on each float32-computed field of :func:`policy_diagnostics` (Clip-Higher
    0.2 / 0.28): counts are exact, except that a token whose ratio lies within its error
    bound of a clip boundary may be counted either way; ``ratio_sum`` and
    ``approx_kl_sum`` are float32 sums of ``n`` terms, each with ``r = exp(d)`` off by
    ``f + u (D + 1)`` relative and ``(r - 1) - d`` by that times ``r`` plus
    ``u (|r - 1| + |d|)`` (two more roundings); min/max are ``r`` itself."""
    valid = b.mask
    dlt = torch.where(valid, b.logp.double() - b.old_logp.double(), 0.0)
    r = dlt.exp()
    big_d = float(dlt.abs().max())
    n = int(valid.sum())
    r_rel = sum(func_rel(dt) + unit_roundoff(dt) * (big_d + 1) for dt in (F32, F64))
    u = unit_roundoff(F32) + unit_roundoff(F64)
    near = torch.zeros_like(valid)
    for edge in (0.8, 1.28):
        near |= valid & ((r - edge).abs() <= 2 * r_rel * r)
    k_terms = torch.where(valid, r_rel * r + 2 * u * ((r - 1).abs() + dlt.abs()), 0.0)
    k_exact = torch.where(valid, (r - 1) - dlt, 0.0)
    ambiguous = float(near.sum())
    sum_rel = r_rel + gamma(n, F32) + gamma(n, F64)
    return {
        "valid_tokens": 0.0,
        "clipped_low": ambiguous,
        "clipped_high": ambiguous,
        "clipped_dual": 0.0,
        "ratio_sum": sum_rel * float(exact.ratio_sum),
        "ratio_min": r_rel * float(exact.ratio_min),
        "ratio_max": r_rel * float(exact.ratio_max),
        "approx_kl_sum": float(k_terms.sum())
        + (gamma(n, F32) + gamma(n, F64)) * float(k_exact.abs().sum()),
        "entropy_sum": 0.0,
        "entropy_tokens": 0.0,
    }


def test_token_level_loss_inductor_forward_backward_and_diagnostics() -> None:
    b = make_batch(8, 32, 0)
    nan_logp = torch.where(b.mask, b.logp, torch.tensor(float("nan")))
    options: dict[str, Any] = {"normalizer": torch.tensor(50.0)}

    def step(logp: torch.Tensor) -> tuple[torch.Tensor, d.PolicyDiagnostics]:
        return d.token_level_loss(
            logp, b.old_logp, b.advantages, b.mask, return_diagnostics=True, **options
        )

    exact = loss_reference(nan_logp, b.old_logp, b.advantages, b.mask, dtype=F32, **options)
    diag_exact = d.policy_diagnostics(b.logp.double(), b.old_logp.double(), b.advantages, b.mask)
    diag_bound = diagnostics_bounds(b, diag_exact)
    for name, fn in (("eager", step), ("inductor", compiled(step, backend="inductor"))):
        logp = nan_logp.clone().requires_grad_(True)
        loss, diag = fn(logp)
        loss.backward()
        assert_within(loss, exact.loss, exact.loss_err, f"{name}: loss")
        assert_within(logp.grad, exact.grad, exact.grad_err, f"{name}: gradient")
        for field in diag._fields:
            assert_within(
                getattr(diag, field),
                getattr(diag_exact, field),
                diag_bound[field],
                f"{name}: diagnostics.{field}",
            )


@pytest.mark.parametrize("mode", MODES)
def test_loss_every_mode(mode: str) -> None:
    b = make_batch(4, 16, 1)
    options: dict[str, Any] = {"mode": mode, "dual_clip": 3.0, "eps_high": 0.3}

    def loss(lp: torch.Tensor) -> torch.Tensor:
        return d.token_level_loss(lp, b.old_logp, b.advantages, b.mask, **options)

    exact = loss_reference(b.logp, b.old_logp, b.advantages, b.mask, dtype=F32, **options)
    for name, fn in (("eager", loss), ("compiled", compiled(loss))):
        logp = b.logp.clone().requires_grad_(True)
        out = fn(logp)
        out.backward()
        assert_within(out, exact.loss, exact.loss_err, f"{name}: loss")
        assert_within(logp.grad, exact.grad, exact.grad_err, f"{name}: gradient")


def test_per_batch_functions() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (6, 8), generator=g).float()
    ids = torch.randint(0, 5, (48,), generator=g) * 3
    lengths = torch.randint(0, 40, (48,), generator=g)
    mask = torch.rand(6, 8, generator=g) > 0.2
    # Exact results (booleans, counts, a float64 normaliser): equal, bitwise.
    exact_cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: d.dynamic_sample_mask(rewards), "dense sampling"),
        (lambda: d.dynamic_sample_mask(rewards.flatten(), ids), "flat sampling"),
        (lambda: d.overlong_filter(mask, lengths[:6] >= 32), "filter"),
        (lambda: d.global_normalizer([mask, mask[:2]], mode="seq_mean_token_mean"), "normaliser"),
        (lambda: d.difficulty_band_mask(rewards), "dense difficulty band"),
        (lambda: d.difficulty_band_mask(rewards.flatten(), ids), "flat difficulty band"),
        (lambda: d.truncation_penalty(rewards[0], mask[0], coef=0.5), "truncation penalty"),
        (lambda: d.m2po_mask(rewards - 1.0, -rewards / 3, mask, threshold=0.04), "m2po"),
    ]
    for fn, name in exact_cases:
        assert torch.equal(compiled(fn)(), fn()), name

    # Advantages: float64 statistics rounded to float32, against the float64 evaluation.
    dense_ids = [i for i in range(6) for _ in range(8)]
    flat_ids = ids.tolist()
    adv_cases: list[tuple[Callable[[torch.Tensor], Any], list[int], str, str]] = [
        (lambda r: d.group_advantages(r), dense_ids, "group", "dense advantages"),
        (
            lambda r: d.group_advantages(r.flatten(), ids, baseline="leave_one_out"),
            flat_ids,
            "group",
            "flat",
        ),
        (lambda r: d.group_advantages(r, scale="batch"), dense_ids, "batch", "batch std"),
    ]
    for fn, group_of, scale, name in adv_cases:
        want = fn(rewards.double()).flatten()
        bound = advantage_bound(rewards, want, scale_of(rewards, group_of, scale))
        assert_within(fn(rewards).flatten(), want, bound, f"eager {name}")
        assert_within(compiled(lambda fn=fn: fn(rewards))().flatten(), want, bound, name)

    # overlong: (expected - length) / cache_len * factor from exact integers, <= 3
    # roundings in any arrangement (a reciprocal-multiply included)
    def overlong() -> torch.Tensor:
        return d.overlong_reward(lengths, max_len=32, cache_len=8)

    want = d.overlong_reward(lengths.double(), max_len=32, cache_len=8)
    bound = 3 * unit_roundoff(F32) * want.abs()
    assert_within(overlong(), want, bound, "eager overlong")
    assert_within(compiled(overlong)(), want, bound, "overlong")

    # kept fraction: a quotient of exact counts, rounded once
    def fraction() -> torch.Tensor:
        return d.kept_group_fraction(d.dynamic_sample_mask(rewards.flatten(), ids), ids)

    keep = d.dynamic_sample_mask(rewards.flatten(), ids)
    kept_groups = len({int(i) for i, k in zip(ids, keep, strict=True) if k})
    exact_fraction = torch.tensor(kept_groups / len(set(flat_ids)), dtype=F64)
    bound_f = unit_roundoff(F32) * float(exact_fraction)
    assert_within(fraction(), exact_fraction, bound_f, "eager fraction")
    assert_within(compiled(fraction)(), exact_fraction, bound_f, "fraction")


def test_variants_and_presets() -> None:
    """Every objective, KL and IS-weight function and preset, in float64: compiled and
    eager each within a stated bound of the eager float64 value (their float32 accuracy is
    tested with each function; here the point is the traced graph).

    Bound: each case is a sum (or token-level aggregation) over ``n <= 64`` tokens of
    per-token formulas of at most ``K = 30`` operations and elementary functions whose
    intermediates are at most ``C = |A|max e^D (1 + max|logp|) + e^D + D + 1`` in
    magnitude (``D`` the largest |log-ratio|, ``A`` the advantages), so two float64
    evaluations differ by at most ``2 (K f + gamma(n)) n C`` (value and each gradient
    entry alike; ``f`` of float64).
    """
    b = make_batch(4, 16, 2, dtype=F64)
    ref = b.old_logp + 0.05
    w = d.truncated_is_weights(b.old_logp, b.old_logp + 0.1, b.mask)
    lengths = b.mask.sum(-1)
    big_d = float(
        torch.stack([(b.logp - b.old_logp).abs().max(), (b.logp - ref).abs().max()]).max()
    )
    a_max, lp_max, n = float(b.advantages.abs().max()), float(b.logp.abs().max()), 64
    big_c = a_max * math.exp(big_d) * (1 + lp_max) + math.exp(big_d) + big_d + 1
    bound = 2 * (30 * func_rel(F64) + gamma(n, F64)) * n * big_c

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
        # detached weights: a constant of the objective (lp requiring grad is refused)
        (
            lambda lp: d.truncated_is_weights(lp.detach(), ref, b.mask, level="sequence").sum(),
            "tis",
        ),
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
        (lambda lp: d.value_loss(lp, b.old_logp, ref, b.mask, clip=0.02).loss, "value loss"),
        (
            lambda lp: d.kl_reward(b.old_logp, lp.detach(), ref, b.mask, coef=0.1).rewards.sum(),
            "kl reward",
        ),
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
        want = out_e.detach()
        assert_within(out_c, want, bound, f"{name}: compiled")
        if out_e.requires_grad:
            out_e.backward()
            out_c.backward()
            assert_within(lp_c.grad, lp_e.grad, bound, f"{name}: compiled gradient")
