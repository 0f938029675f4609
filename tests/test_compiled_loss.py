"""``CompiledPolicyLoss``: the fused body exported once per input signature and called
without dynamo.

With ``backend="eager"`` the exported graph runs the very operations of the fused body
(:func:`dapo_ops.engine._engine.generic_terms` after :func:`dapo_ops.loss_scale`), so its loss
and gradient are compared *bitwise* with that body evaluated eagerly; with inductor (as
users run it) each is held to the derived bound of the float64 value (tests/_bounds.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from _strategies import make_batch
from test_fused import assert_grad_close, assert_loss_close, exact
from test_fused_kl_is import _exact_loss

import dapo_ops
from dapo_ops import ClipHigher, InputError, KLPenalty, policy_loss
from dapo_ops._core._inputs import policy_tensors
from dapo_ops.engine._engine import generic_terms
from dapo_ops.engine.aggregation import loss_scale, scaled_sum
from dapo_ops.engine.compiled_loss import CompiledPolicyLoss
from dapo_ops.objectives import OBJECTIVES, Objective

pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")


def _eager_body(
    loss_fn: CompiledPolicyLoss, logp: torch.Tensor, *args: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused body, evaluated eagerly: what the exported graph runs."""
    old, adv, mask = args
    adv2, valid, dtype = policy_tensors(logp, old, adv, mask)
    normalizer = kw.get("normalizer")
    den = "local" if normalizer is None else torch.as_tensor(normalizer, dtype=dtype)
    scale = loss_scale(
        valid, mode=loss_fn.mode, normalizer=den, max_len=loss_fn.max_len, dtype=dtype
    )  # type: ignore[arg-type]
    spec = dapo_ops.engine._engine.LossSpec(
        loss_fn.objective, loss_fn.kl, loss_fn.mode, loss_fn.max_len
    )
    rows, grad = generic_terms(
        spec, logp, old, adv2, valid, scale, kw.get("ref_logp"), kw.get("is_weights"), True,
        kw.get("kl_weights"),
    )  # fmt: skip
    assert grad is not None
    return scaled_sum(rows, scale), grad.to(logp.dtype)


def _loss_and_grad(
    loss_fn: CompiledPolicyLoss, logp: torch.Tensor, *args: torch.Tensor, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    lp = logp.detach().clone().requires_grad_(True)
    loss = loss_fn(lp, *args, **kw)
    loss.backward()
    assert lp.grad is not None
    return loss.detach(), lp.grad


CONFIGS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"objective": ClipHigher(dual_clip=3.0)}, {}),
    ({"objective": ClipHigher(), "mode": "seq_mean_token_sum_norm", "max_len": 11}, {}),
    (
        {"objective": ClipHigher(eps_high=0.2), "mode": "seq_mean_token_mean", "kl": KLPenalty()},
        {"ref": True, "is_weights": True},
    ),
    (
        {"objective": ClipHigher(), "kl": KLPenalty(estimator="k2", clamp=0.05)},
        {"ref": True, "kl_weights": True, "normalizer": 37.0},
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("adv_layout", ["batch", "batch seq"])
@pytest.mark.parametrize(("options", "extra"), CONFIGS)
def test_eager_backend_is_the_fused_body_bitwise(
    options: dict[str, Any], extra: dict[str, Any], adv_layout: str, dtype: torch.dtype
) -> None:
    b = make_batch(5, 11, 3)
    g = torch.Generator().manual_seed(1)
    adv = b.advantages if adv_layout == "batch" else b.advantages[:, None] * torch.rand(5, 11)
    kw: dict[str, Any] = {}
    if extra.get("ref"):
        kw["ref_logp"] = (-(b.logp + torch.randn(5, 11, generator=g) * 0.3).abs()).to(dtype)
    if extra.get("is_weights"):
        kw["is_weights"] = torch.rand(5, 11, generator=g).to(dtype)
    if extra.get("kl_weights"):
        kw["kl_weights"] = torch.rand(5, 11, generator=g).to(dtype)
    if "normalizer" in extra:
        kw["normalizer"] = extra["normalizer"]
    loss_fn = CompiledPolicyLoss(**options, backend="eager")
    args = (b.old_logp.to(dtype), adv.to(dtype), b.mask)
    got = _loss_and_grad(loss_fn, b.logp.to(dtype), *args, **kw)
    want = _eager_body(loss_fn, b.logp.to(dtype), *args, **kw)
    for a, w in zip(got, want, strict=True):
        assert torch.equal(a, w) and torch.equal(a.signbit(), w.signbit())
    with torch.no_grad():
        assert torch.equal(loss_fn(b.logp.to(dtype), *args, **kw), want[0])
    assert len(loss_fn.cache) == 1  # the no-grad call shares the signature


def test_inductor_within_the_derived_bounds() -> None:
    """As users run it: ClipHigher (token_mean) and the GRPO preset with KL and IS
    weights, each within the float64 value's derived bound."""
    b = make_batch(6, 40, 4)
    loss_fn = CompiledPolicyLoss(ClipHigher(dual_clip=3.0))
    for seed in (0, 1):  # the second call reuses the compiled code
        logp = b.logp - seed * 0.01  # log-probs stay <= 0
        loss, grad = _loss_and_grad(loss_fn, logp, b.old_logp, b.advantages, b.mask)
        want = exact(logp, b.old_logp, b.advantages, b.mask, torch.float32, dual_clip=3.0)
        assert_loss_close(loss, want, "inductor loss")
        assert_grad_close(grad, want, 1.0, "inductor gradient")
    assert len(loss_fn.cache) == 1
    grpo = dapo_ops.presets.GRPO
    g = torch.Generator().manual_seed(2)
    ref = -(b.logp + torch.randn(6, 40, generator=g) * 0.2).abs()  # log-probs: <= 0
    w = torch.rand(6, 40, generator=g) * 2
    loss_fn = CompiledPolicyLoss(grpo.objective, mode=grpo.mode, kl=grpo.kl)
    loss, _ = _loss_and_grad(
        loss_fn, b.logp, b.old_logp, b.advantages, b.mask, ref_logp=ref, is_weights=w
    )
    kw = {"mode": grpo.mode, "dual_clip": None, "eps_low": 0.2, "eps_high": 0.2}
    kw |= {"normalizer": None, "max_len": None, "chunk_elems": None}
    case = {"logp": b.logp, "old_logp": b.old_logp, "adv": b.advantages, "mask": b.mask}
    case |= {"kw": kw, "kl": grpo.kl, "ref_logp": ref, "is_weights": w, "kl_weights": None}
    want64, bound = _exact_loss(case, torch.float32)
    from _bounds import assert_within

    assert_within(loss, want64, bound, "GRPO loss")


def test_guards_and_cache() -> None:
    b = make_batch(4, 9, 5)
    loss_fn = CompiledPolicyLoss(ClipHigher(), backend="eager")
    args = (b.old_logp, b.advantages, b.mask)
    loss_fn(b.logp, *args)
    loss_fn(b.logp + 0.1, *args)  # new values: the same code
    assert len(loss_fn.cache) == 1
    for n in (3.0, 50.0, torch.tensor(7.0)):  # a normaliser's value is an input
        got = loss_fn(b.logp, *args, normalizer=n)
        assert torch.equal(got, policy_loss(ClipHigher(), b.logp, *args, normalizer=n))
    assert len(loss_fn.cache) == 2
    c = make_batch(4, 10, 5)  # a new shape, a new dtype: compiled once more each
    loss_fn(c.logp, c.old_logp, c.advantages, c.mask)
    loss_fn(b.logp.double(), b.old_logp, b.advantages, b.mask)
    assert len(loss_fn.cache) == 4
    with pytest.raises(InputError, match="old_logp requires grad"):
        loss_fn(b.logp, b.old_logp.clone().requires_grad_(True), b.advantages, b.mask)
    with pytest.raises(InputError, match="normalizer"):
        loss_fn(b.logp, *args, normalizer=-1.0)
    with pytest.raises(InputError, match="advantages"):
        loss_fn(b.logp, b.old_logp, torch.ones(3), b.mask)


def test_bad_options() -> None:
    no_grad = [t() for t in OBJECTIVES if t.grad is Objective.grad]
    for objective in no_grad:
        with pytest.raises(InputError, match="analytic grad"):
            CompiledPolicyLoss(objective)
    with pytest.raises(InputError, match="mode"):
        CompiledPolicyLoss(ClipHigher(), mode="sum")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="backend"):
        CompiledPolicyLoss(ClipHigher(), backend="tvm")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="objective"):
        CompiledPolicyLoss("clip_higher")  # type: ignore[arg-type]
    b = make_batch(2, 3, 0)
    with pytest.raises(InputError, match="ref_logp"):
        CompiledPolicyLoss(ClipHigher(), kl=KLPenalty(), backend="eager")(
            b.logp, b.old_logp, b.advantages, b.mask
        )
    with pytest.raises(InputError, match="ref_logp"):
        CompiledPolicyLoss(ClipHigher(), backend="eager")(
            b.logp, b.old_logp, b.advantages, b.mask, ref_logp=b.logp
        )


def test_masked_garbage_and_double_backward() -> None:
    b = make_batch(5, 9, 6)
    loss_fn = CompiledPolicyLoss(ClipHigher(dual_clip=3.0), backend="eager")
    clean = _loss_and_grad(loss_fn, b.logp, b.old_logp, b.advantages, b.mask)
    nan, inf = torch.tensor(math.nan), torch.tensor(math.inf)
    dirty = _loss_and_grad(
        loss_fn, torch.where(b.mask, b.logp, nan), torch.where(b.mask, b.old_logp, -inf),
        b.advantages, b.mask,
    )  # fmt: skip
    for a, w in zip(dirty, clean, strict=True):
        assert torch.equal(a, w) and torch.equal(a.signbit(), w.signbit())
    b64 = make_batch(3, 5, 7, dtype=torch.float64)
    lp = b64.logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(
        loss_fn(lp, b64.old_logp, b64.advantages, b64.mask), lp, create_graph=True
    )
    lp_r = b64.logp.clone().requires_grad_(True)
    (g_r,) = torch.autograd.grad(
        policy_loss(ClipHigher(dual_clip=3.0), lp_r, b64.old_logp, b64.advantages, b64.mask),
        lp_r,
        create_graph=True,
    )
    assert g.requires_grad
    (h,) = torch.autograd.grad(g.square().sum(), lp)
    (h_r,) = torch.autograd.grad(g_r.square().sum(), lp_r)
    assert torch.equal(h, h_r)  # both differentiate the reference definition


def test_frozen_options() -> None:
    loss_fn = CompiledPolicyLoss(ClipHigher())
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss_fn.mode = "seq_mean_token_mean"  # type: ignore[misc]
