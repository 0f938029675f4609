"""The eager CPU kernel with IS weights and a KL penalty (``ClipHigher.cpu_terms`` with
:class:`dapo_ops.engine._kl_cpu.KLBlocks`) against the generic ``where``-based body.

The kernel runs the generic body's roundings on the same values, so its gradient is
compared *bitwise* (the sign of a zero too); its loss sums in another order, so it and the
generic body's are each held to a derived bound of the float64 value. Masked garbage in
``ref_logp``, ``is_weights`` and ``kl_weights`` changes no bit and keeps the fast path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from _bounds import F64, assert_within, func_rel, gamma
from hypothesis import given
from hypothesis import strategies as st
from test_fused import cases

import dapo_ops.engine._engine as engine
from dapo_ops import ClipHigher, KLPenalty, kl_penalty, policy_loss
from dapo_ops.engine._engine import _scale, all_terms, generic_terms
from dapo_ops.engine.policy import prepare

pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")


@st.composite
def kl_cases(draw: st.DrawFn) -> dict[str, Any]:
    c = draw(cases())
    shape = c["logp"].shape
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    dtype = draw(st.sampled_from([c["logp"].dtype, torch.float32]))
    noise = torch.randn(shape, generator=g, dtype=F64) * draw(st.sampled_from([0.05, 1.0, 30.0]))
    c["ref_logp"] = (c["logp"].double() + noise).to(dtype)
    c["kl"] = KLPenalty(
        beta=draw(st.sampled_from([0.04, 0.3])),
        estimator=draw(st.sampled_from(["k1", "k2", "k3", "abs"])),
        clamp=draw(st.sampled_from([None, 0.05, 10.0])),
        straight_through=draw(st.booleans()),
        log_ratio_clamp=draw(st.sampled_from([20.0, 0.3])),
    )
    with_kl = draw(st.booleans())
    if not with_kl:
        c["ref_logp"], c["kl"] = None, None
    c["is_weights"] = (
        (torch.rand(shape, generator=g) * 2).to(dtype)
        if draw(st.booleans()) or not with_kl
        else None
    )
    c["kl_weights"] = (
        torch.rand(shape, generator=g).to(dtype) if with_kl and draw(st.booleans()) else None
    )
    return c


def _engine_inputs(c: dict[str, Any], **changes: Any) -> tuple[Any, ...]:
    """``(spec, tensors, scale)`` of the engine for case ``c`` (tensors replaced by
    ``changes``), with the case's CPU block size."""
    kw = c["kw"]
    args = {k: c.get(k) for k in ("ref_logp", "kl", "is_weights", "kl_weights")} | changes
    objective = ClipHigher(
        dual_clip=kw["dual_clip"], eps_low=kw["eps_low"], eps_high=kw["eps_high"]
    )
    spec, tensors, den = prepare(
        objective, c["logp"], c["old_logp"], c["adv"], c["mask"], mode=kw["mode"],
        normalizer=kw["normalizer"], max_len=kw["max_len"], compiled=False, **args,
    )  # fmt: skip
    spec = dataclasses.replace(spec, chunk_elems=kw["chunk_elems"])
    wide = any(t.dtype == F64 for t in (c["logp"], c["old_logp"], c["adv"]))
    return spec, tensors, _scale(spec, tensors.valid, den, F64 if wide else torch.float32)


def _exact_loss(c: dict[str, Any], dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """The loss in float64 on the same input values, and the bound of an evaluation in
    ``dtype``. Per token at most K = 40 operations and elementary functions on magnitudes
    ``|A| max(r, 1 - eps_low) rho + beta kappa (e^|x| + |x| + 1 + x^2)`` (r and x the
    clamped ratio and KL log-ratio; the clipped ratio is at most the first), times the aggregation weights ``a_t``, and sums of at most n + 2 terms:
    within ``(K f + gamma(K + n)) sum_t a_t mag_t`` in ``dtype``, plus the same in float64
    for the reference's own rounding."""
    names = ("logp", "old_logp", "adv", "ref_logp", "is_weights", "kl_weights")
    c64 = c | {k: c[k].double() for k in names if c.get(k) is not None}
    spec, tensors, scale = _engine_inputs(c64)
    den = None if c["kw"]["normalizer"] is None else torch.tensor(float(c["kw"]["normalizer"]))
    loss = engine.reference_loss(spec, tensors, None if den is None else den.double())
    valid = tensors.valid
    a_t = torch.where(valid, scale.expand(valid.shape), 0.0)
    clamp = spec.objective.log_ratio_clamp
    lr = (tensors.logp - tensors.old_logp).nan_to_num().clamp(-clamp, clamp)
    rho = 1.0 if tensors.is_weights is None else tensors.is_weights.abs()
    ratio = lr.exp().clamp(min=1.0 - spec.objective.eps_low)  # the clipped ratio's bound
    mag = tensors.adv.nan_to_num().abs() * ratio * rho
    kl = spec.kl
    if kl is not None:
        x = (
            (tensors.logp - tensors.ref_logp)
            .nan_to_num()
            .clamp(-kl.log_ratio_clamp, kl.log_ratio_clamp)
        )
        kappa = 1.0 if tensors.kl_weights is None else tensors.kl_weights.abs()
        mag = mag + kl.beta * kappa * (x.abs().exp() + x.abs() + 1 + x.square())
    total = float((a_t * torch.where(valid, mag, 0.0)).sum())
    k, n = 40, valid.numel() + 2
    bound = k * func_rel(dtype) + gamma(k + n, dtype) + k * func_rel(F64) + gamma(k + n, F64)
    return loss.detach(), bound * total


@given(kl_cases())
def test_cpu_kernel_gradient_is_the_generic_body_bitwise(c: dict[str, Any]) -> None:
    spec, tensors, scale = _engine_inputs(c)
    rows_k, grad_k = all_terms(spec, tensors, scale, True)
    rows_g, grad_g = generic_terms(spec, *tensors[:4], scale, *tensors[4:6], True, tensors[6])
    assert grad_k is not None and grad_g is not None
    assert torch.equal(grad_k, grad_g)
    assert torch.equal(grad_k.signbit(), grad_g.signbit())
    rows_nograd, none = all_terms(spec, tensors, scale, False)
    assert none is None
    if tensors.logp.numel() == 0:
        return
    exact, bound = _exact_loss(c, scale.dtype)
    for rows, what in ((rows_k, "kernel"), (rows_nograd, "kernel, no grad"), (rows_g, "generic")):
        assert_within(engine.scaled_sum(rows, scale), exact, bound, f"{what} loss")


@given(kl_cases(), st.sampled_from([math.nan, math.inf, -math.inf]), st.data())
def test_masked_garbage_in_ref_and_weights_changes_no_bit(
    c: dict[str, Any], junk: float, data: st.DataObject
) -> None:
    """NaN or inf at masked positions of ``ref_logp``, ``is_weights`` or ``kl_weights``:
    the same loss and gradient bits, and no block leaves the float-only path for it."""
    names = [k for k in ("ref_logp", "is_weights", "kl_weights") if c[k] is not None]
    where = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    mask = c["mask"].bool()
    dirty = {k: torch.where(mask, c[k], torch.tensor(junk, dtype=c[k].dtype)) for k in where}
    spec, clean_t, scale = _engine_inputs(c)
    _, dirty_t, _ = _engine_inputs(c, **dirty)
    got, want = all_terms(spec, dirty_t, scale, True), all_terms(spec, clean_t, scale, True)
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a, b) or bool(a.isnan().any() and b.isnan().any())
        assert torch.equal(a.signbit(), b.signbit())


def test_fast_path_kept_with_masked_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clean valid tokens stay on the float-only path whatever the masked positions hold;
    a NaN on a valid token (ref_logp, or an IS weight) sends its block to the generic body,
    whose loss is then NaN (inf weights: inf)."""
    calls: list[int] = []
    generic = engine.generic_terms

    def counting(*args: Any) -> Any:
        calls.append(1)
        return generic(*args)

    monkeypatch.setattr(engine, "generic_terms", counting)
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 10, generator=g) * 3
    old = logp + torch.randn(6, 10, generator=g) * 0.2
    mask = torch.rand(6, 10, generator=g) > 0.3
    ref, w, kappa = logp - 0.3, torch.rand(6, 10, generator=g) * 2, torch.rand(6, 10, generator=g)
    adv = torch.randn(6, generator=g)
    for junk in (math.nan, math.inf, -math.inf):
        bad = torch.tensor(junk)
        for kl in (KLPenalty(), KLPenalty(estimator="k2", straight_through=True, clamp=0.1)):
            for rows in (None, 20):
                spec, tensors, scale = _engine_inputs(
                    _case(logp, old, adv, mask, kl, rows),
                    ref_logp=torch.where(mask, ref, bad),
                    is_weights=torch.where(mask, w, bad),
                    kl_weights=torch.where(mask, kappa, bad),
                )
                rows_k, grad_k = all_terms(spec, tensors, scale, True)
                assert bool(torch.isfinite(rows_k).all()) and grad_k is not None
                assert bool(torch.isfinite(grad_k).all())
    assert not calls
    for name in ("ref_logp", "is_weights"):
        spec, tensors, scale = _engine_inputs(
            _case(logp, old, adv, mask, KLPenalty(), 20), ref_logp=ref, is_weights=w
        )
        bad_t = getattr(tensors, name).clone()
        first = tuple(int(i) for i in mask.nonzero()[0])
        bad_t[first] = math.nan
        rows_k, _ = all_terms(spec, tensors._replace(**{name: bad_t}), scale, True)
        assert bool(rows_k.isnan().any())
    assert calls


def _case(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    kl: KLPenalty,
    chunk: int | None,
) -> dict[str, Any]:
    kw = {"mode": "seq_mean_token_mean", "dual_clip": 3.0, "eps_low": 0.2, "eps_high": 0.28}
    kw |= {"normalizer": None, "max_len": None, "chunk_elems": chunk}
    return {"logp": logp, "old_logp": old, "adv": adv, "mask": mask, "kw": kw, "kl": kl}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_gradcheck_float64_with_kl_and_weights(estimator: str) -> None:
    """float64 gradcheck through the kernel's blocks (5 elements each), KL with kappa
    (not straight-through: its gradient is by design not the value's)."""
    straight_through = False
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(3, 5, generator=g, dtype=F64) * 3
    old = logp + torch.randn(3, 5, generator=g, dtype=F64) * 0.3
    ref = logp + torch.randn(3, 5, generator=g, dtype=F64) * 0.3
    w, kappa = (
        torch.rand(3, 5, generator=g, dtype=F64) * 2,
        torch.rand(3, 5, generator=g, dtype=F64),
    )
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    adv = torch.randn(3, generator=g, dtype=F64)
    kl = KLPenalty(beta=0.3, estimator=estimator, straight_through=straight_through)  # type: ignore[arg-type]

    def f(lp: torch.Tensor) -> torch.Tensor:
        spec, tensors, den = prepare(
            ClipHigher(), lp, old, adv, mask, mode="seq_mean_token_mean", normalizer=None,
            max_len=None, ref_logp=ref, kl=kl, is_weights=w, compiled=False, kl_weights=kappa,
        )  # fmt: skip
        return engine.fused_loss(dataclasses.replace(spec, chunk_elems=5), tensors, den)

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(True),))


def test_grpo_preset_is_the_composition() -> None:
    """The GRPO preset's loss (k3 KL, IS weights) on the fused CPU path against the unfused
    composition, in float64, within the bound of two evaluations of one formula."""
    g = torch.Generator().manual_seed(5)
    logp = -torch.rand(4, 9, generator=g, dtype=F64) * 3
    old = -(logp + torch.randn(4, 9, generator=g, dtype=F64) * 0.2).abs()  # log-probs: <= 0
    ref = -(logp + torch.randn(4, 9, generator=g, dtype=F64) * 0.2).abs()
    w = torch.rand(4, 9, generator=g, dtype=F64) * 2
    mask = torch.rand(4, 9, generator=g) > 0.3
    adv = torch.randn(4, generator=g, dtype=F64)
    lp_f, lp_r = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    objective = ClipHigher(eps_high=0.2)
    fused = policy_loss(
        objective, lp_f, old, adv, mask, mode="seq_mean_token_mean", ref_logp=ref,
        kl=KLPenalty(), is_weights=w,
    )  # fmt: skip
    from dapo_ops import clip_higher_surrogate, token_level_aggregate

    per_token = clip_higher_surrogate(lp_r, old, adv, mask, eps_high=0.2) * w
    per_token = per_token + 0.04 * kl_penalty(lp_r, ref, mask)
    want = token_level_aggregate(per_token, mask, mode="seq_mean_token_mean")
    fused.backward()
    want.backward()
    # per token at most K = 30 float64 operations on magnitudes |A| r w + beta (e^|x| + |x|
    # + 1), aggregated with weights a_t = 1 / (|S| n_i): each evaluation within
    # (K f + gamma(K + n)) sum a_t mag_t, each gradient entry within 2 (K f + gamma(K)) a mag
    n_i = mask.sum(-1, keepdim=True).clamp(min=1).double()
    a_t = torch.where(mask, 1.0 / (n_i * float((n_i > 0).sum())), 0.0)
    x = (ref - logp).abs()
    mag = adv.abs()[:, None] * (logp - old).exp() * w + 0.04 * (x.exp() + x + 1)
    k, n = 30, logp.numel()
    bound = 2 * (k * func_rel(F64) + gamma(k + n, F64)) * float((a_t * mag).sum())
    assert_within(fused, want, bound, "loss")
    assert lp_f.grad is not None and lp_r.grad is not None
    assert_within(lp_f.grad, lp_r.grad, 2 * (k * func_rel(F64) + gamma(k, F64)) * a_t * mag, "grad")
