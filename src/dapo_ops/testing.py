"""Conformance checks for policy objectives: run the library's own tests on yours.

Every objective :func:`dapo_ops.policy_loss` composes gets masking, exact global
normalisation, ``torch.compile``, low-precision inputs and double backward from the
engine; these checks verify that it does, for one objective value::

    from dapo_ops.testing import check_objective

    check_objective(MyObjective())                     # every check, a few seconds
    check_objective(MyObjective(), with_compile=False)  # skip the torch.compile checks

Each ``check_*`` function tests one property and raises ``AssertionError`` naming the
objective, the property and the worst entry; :data:`CHECKS` maps their names to them.
They build a small batch themselves (:func:`make_batch`) or take yours. The library's
suite (tests/test_objectives.py) runs them over every class of
``dapo_ops.objectives.OBJECTIVES``.

Bounds. Every value that is not promised exactly is compared with the float64 reference
on the same input values (:func:`reference_loss` under autograd: ``term``, then the
aggregation), within a stated bound (:func:`reference_with_bounds`): the computation's
own rounding, :data:`F64_RTOL` or :data:`F32_RTOL` of each entry plus the largest entry
(the second term covers sums that cancel, such as DRO's ``beta log r - A``), plus a sum's
``gamma(n) sum |x|``; in float32 also the definition's own float32 error (measured) and
the jump of any decision within rounding of its bound. A wrong formula misses by far
more.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.gradcheck import GradcheckError

from dapo_ops._rules import AggregationMode
from dapo_ops._validate import InputError
from dapo_ops.aggregation import token_level_aggregate
from dapo_ops.distributed import global_normalizer
from dapo_ops.kl import KLPenalty, kl_penalty
from dapo_ops.objectives.base import Objective
from dapo_ops.policy import policy_loss
from dapo_ops.surrogate import per_token_loss

__all__ = [
    "CHECKS",
    "F32_RTOL",
    "F64_RTOL",
    "KINK_ULPS",
    "Batch",
    "Reference",
    "check_all_masked",
    "check_compile",
    "check_constants_refused",
    "check_double_backward",
    "check_fields",
    "check_fused_gradient",
    "check_gradcheck",
    "check_inputs_unchanged",
    "check_linear_loss",
    "check_low_precision",
    "check_masked_garbage",
    "check_micro_batches",
    "check_objective",
    "make_batch",
    "reference_loss",
    "reference_with_bounds",
]

#: float64 evaluation against the float64 reference: 1e-10 relative is about 10^6 ulps
#: (2^-53 each), far above another order of the same operations (a reordered row sum of
#: ``n`` log-ratios of size ``L`` moves a sequence ratio by ``n L u``); a wrong formula is off
#: by O(1).
F64_RTOL = 1e-10
#: float32 evaluation, given the same clip decisions: 256 units of roundoff (2^-24 each,
#: 1.5e-5): at most four elementary functions of 20 ulps each (ATen's loosest documented,
#: ``2 * 20 u`` relative apiece) and up to 96 correctly rounded operations in a chain.
F32_RTOL = 256 * 2.0**-24
#: Roundings of one token's log-ratio, in units of roundoff, that the float32 kink
#: allowance shifts ``logp`` by on top of the row sum's (see :func:`reference_with_bounds`):
#: the subtraction, ``exp`` (20 ulps) and the bounds' own rounding.
KINK_ULPS = 64
#: The aggregation modes every mode-dependent check runs over.
MODES: tuple[AggregationMode, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


class Batch(NamedTuple):
    """One batch of policy inputs: ``logp``, ``old_logp``, ``mask`` ``[batch, seq]``;
    ``advantages`` ``[batch]`` or ``[batch, seq]``."""

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor


def make_batch(
    objective: Objective,
    batch: int = 5,
    seq: int = 9,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    spread: float = 0.3,
    per_token_advantages: bool = False,
) -> Batch:
    """A ragged batch: old log-probs in ``(-4, 0)``, log-probs ``-|old + N(0, spread^2)|``, random
    lengths (the first row full, the last empty), per-sequence advantages (per token with
    ``per_token_advantages`` for a token-level objective)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 4 - 0.01
    # reflected at 0: log-probabilities, never > 0 (objectives such as DPPO use exp(logp))
    logp = -(old + torch.randn(batch, seq, generator=g, dtype=torch.float64) * spread).abs()
    lengths = torch.randint(0, seq + 1, (batch,), generator=g)
    if batch > 1:
        lengths[0], lengths[-1] = seq, 0
    mask = torch.arange(seq) < lengths[:, None]
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    if per_token_advantages and objective.level == "token":
        adv = adv[:, None] * (0.5 + torch.rand(batch, seq, generator=g, dtype=torch.float64))
    return Batch(logp.to(dtype), old.to(dtype), adv.to(dtype), mask)


def reference_loss(
    objective: Objective,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mode: AggregationMode = "token_mean",
    normalizer: Tensor | float | None = None,
    ref_logp: Tensor | None = None,
    kl: KLPenalty | None = None,
    is_weights: Tensor | None = None,
) -> Tensor:
    """The definition the engine is checked against: ``token_level_aggregate`` of
    ``per_token_loss`` (the objective's ``term`` under autograd) times ``is_weights``, plus
    ``kl.beta`` times :func:`kl_penalty` against ``ref_logp``."""
    per_token = per_token_loss(objective, logp, old_logp, advantages, mask)
    if is_weights is not None:
        per_token = per_token * torch.where(mask.bool(), is_weights, 0.0)
    if kl is not None and ref_logp is not None:
        per_token = per_token + kl.beta * _kl_terms(kl, logp, ref_logp, mask)
    return token_level_aggregate(per_token, mask, mode=mode, normalizer=normalizer)  # type: ignore[arg-type]


def _kl_terms(kl: KLPenalty, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """:func:`kl_penalty` with ``kl``'s options (before ``beta``), 0 at masked positions."""
    return kl_penalty(
        logp, ref_logp, mask, estimator=kl.estimator, log_ratio_clamp=kl.log_ratio_clamp,
        clamp=kl.clamp, straight_through=kl.straight_through,
    )  # fmt: skip


# --------------------------------------------------------------------------- helpers


def _name(objective: Objective) -> str:
    return repr(objective)


def _default(objective: Objective, batch: Batch | None, dtype: torch.dtype) -> Batch:
    if batch is None:
        return make_batch(objective, dtype=dtype)
    return batch


def _bind(fn: Callable[..., Tensor], objective: Objective) -> Callable[..., Tensor]:
    """``fn`` with the objective bound as its first argument."""

    def bound(*args: Any, **kw: Any) -> Tensor:
        return fn(objective, *args, **kw)

    return bound


def _loss_and_grad(
    loss_fn: Callable[..., Tensor], logp: Tensor, *args: Any, **kw: Any
) -> tuple[Tensor, Tensor]:
    leaf = logp.detach().clone().requires_grad_(True)
    loss = loss_fn(leaf, *args, **kw)
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    return loss.detach(), torch.zeros_like(leaf) if grad is None else grad


def _assert_within(got: Tensor, want: Tensor, bound: Tensor, what: str) -> None:
    """``|got - want| <= bound`` entrywise (``want`` the float64 reference); the same
    non-finite values in the same places count as equal."""
    got64, want64 = got.detach().double(), want.detach().double()
    assert got64.shape == want64.shape, f"{what}: shape {got64.shape} != {want64.shape}"
    bound = bound.double().expand_as(want64)
    same = (got64 == want64) | (got64.isnan() & want64.isnan())
    err = torch.where(same, 0.0, (got64 - want64).abs())
    bad = ~(err <= bound)
    if bool(bad.any()):
        i = int(torch.where(bad, err / bound, 0.0).nan_to_num(math.inf).flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} entries outside the bound; worst: "
            f"got {got64.flatten()[i].item()!r}, reference {want64.flatten()[i].item()!r}, "
            f"|error| {err.flatten()[i].item():.3e} > bound {bound.flatten()[i].item():.3e}"
        )


class Reference(NamedTuple):
    """The float64 reference loss and ``logp`` gradient of one call, and bounds on
    ``|computed - reference|`` for an evaluation in the call's compute dtype."""

    loss: Tensor
    grad: Tensor
    loss_err: Tensor
    grad_err: Tensor


def reference_with_bounds(
    objective: Objective, b: Batch, *, extra_terms: int = 0, **options: Any
) -> Reference:
    """:func:`reference_loss` in float64 on ``b``'s values (``options``: its keywords), with
    the bounds any evaluation of the same call in ``b``'s compute dtype must meet.

    - Forward error, given the same decisions: ``rtol (|x| + max|x|)`` per gradient entry
      and ``rtol (|L| + S)`` for the loss, ``S = sum_i w_i |l_i|``; plus
      ``gamma(n + 2 + extra_terms) S`` for the aggregation sum of ``n`` tokens (two divisions
      by counts, ``extra_terms`` further additions such as summing micro-batch losses).
      ``rtol`` is :data:`F64_RTOL` or :data:`F32_RTOL`.
    - In float32, the definition's own rounding, measured: twice ``|f32 - f64|``, the
      reference evaluated on the same inputs in float32 against float64 (a saturating gate
      such as SAPO's ``g (1 - g)``, a weight that underflows such as VESPO's, a decision
      the float32 values make differently: the engine inherits these from ``term``).
    - In float32, decisions the engine makes from values rounded differently than the
      reference's: the float32 log-ratio of token ``t`` is off by ``u |d_t|``, ``exp`` and
      the clip bounds by a few ulps more, and a row sum of log-ratios by
      ``(n - 1) u sum_t |d_t|``: together at most ``delta_t = (n |d_t| + KINK_ULPS) u`` per
      token (``n`` the row width), shifting every row sum by ``sum_t delta_t``. So the
      bounds add ``|f(logp +- delta) - f(logp)|``, the reference with ``logp`` shifted by
      ``+-delta``: where a decision within rounding of its bound flips, the whole jump.
    """
    floats = [t for t in b[:3] if t.dtype.is_floating_point]
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in floats) else torch.float32
    up = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in options.items()}  # fmt: skip
    b64 = Batch(b.logp.double(), b.old_logp.double(), b.advantages.double(), b.mask)
    ref = _bind(reference_loss, objective)
    loss, grad = _loss_and_grad(ref, b64.logp, *b64[1:], **up)
    scale = _abs_loss(objective, b64, **up)
    rtol = F64_RTOL if dtype == torch.float64 else F32_RTOL
    n = b.mask.numel() + 2 + extra_terms
    u = torch.finfo(dtype).eps / 2
    gamma = n * u / (1 - n * u)
    loss_err = rtol * (loss.abs() + scale) + gamma * scale
    big = grad.abs().max() if grad.numel() else grad.new_zeros(())
    grad_err = rtol * (grad.abs() + big)
    if dtype != torch.float64:
        own_loss, own_grad = _loss_and_grad(ref, b.logp, *b[1:], **options)
        loss_err = loss_err + 2 * (own_loss.double() - loss).abs().nan_to_num(math.inf)
        grad_err = grad_err + 2 * (own_grad.double() - grad).abs().nan_to_num(math.inf)
        d = torch.where(b64.mask.bool(), b64.logp - b64.old_logp, 0.0).abs().nan_to_num(0.0)
        delta = (b.mask.shape[-1] * d + KINK_ULPS) * u
        for sign in (1.0, -1.0):
            shifted_loss, shifted_grad = _loss_and_grad(
                ref, b64.logp + sign * delta, *b64[1:], **up
            )
            loss_err = loss_err + (shifted_loss - loss).abs().nan_to_num(math.inf)
            grad_err = grad_err + (shifted_grad - grad).abs().nan_to_num(math.inf)
    return Reference(loss, grad, loss_err, grad_err)


def _bits(t: Tensor) -> Tensor:
    """The raw bits of a float tensor (so the sign of a zero counts)."""
    if not t.dtype.is_floating_point:
        return t
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    return t.detach().contiguous().view(ints[t.element_size()])


def _assert_exact(got: Tensor, want: Tensor, what: str, *, signed_zeros: bool = False) -> None:
    """Equal, as values (NaN in the same places counts as equal, ``-0.0 == 0.0``); with
    ``signed_zeros``, bit for bit (the sign of a zero too)."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    g, w = got.detach(), want.detach()
    if signed_zeros:
        differ = _bits(g) != _bits(w)
    elif g.dtype.is_floating_point:
        differ = (g != w) & ~(g.isnan() & w.isnan())
    else:
        differ = g != w
    if bool(differ.any()):
        first = tuple(int(k) for k in differ.nonzero()[0])
        raise AssertionError(
            f"{what}: not {'bitwise ' if signed_zeros else ''}equal at {int(differ.sum())} of "
            f"{differ.numel()} entries; first at {first}: got {g[first].item()!r}, want "
            f"{w[first].item()!r}"
        )


# --------------------------------------------------------------------------- checks


def check_gradcheck(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    stop_gradient: bool = False,
) -> None:
    """float64 ``torch.autograd.gradcheck`` of :func:`policy_loss` with respect to ``logp``:
    the gradient (fused, when the objective has ``grad``) is the derivative of the loss.

    ``stop_gradient=True`` for objectives that detach part of their value on purpose
    (CISPO, DPPO, VESPO: ``-sg[w] A log pi``): their value is *not* the integral of their
    gradient, so a finite difference of the value cannot check it. Their gradient is then
    compared with autograd's gradient of the reference definition (:func:`reference_loss`)
    in float64 within :data:`F64_RTOL`, which checks ``grad`` against ``term``. (GSPO and
    GMPO detach too, yet every token carries its sequence's value, so the derivative of
    the aggregated value is their gradient: gradcheck applies to them.)
    """
    b = _default(objective, batch, torch.float64)
    assert b.logp.dtype == torch.float64, "gradcheck needs a float64 batch"
    if stop_gradient:
        check_fused_gradient(objective, b, mode=mode)
        return

    def loss(lp: Tensor) -> Tensor:
        return policy_loss(objective, lp, b.old_logp, b.advantages, b.mask, mode=mode)  # type: ignore[arg-type]

    try:
        torch.autograd.gradcheck(loss, (b.logp.detach().clone().requires_grad_(True),))
    except GradcheckError as err:
        raise AssertionError(
            f"{_name(objective)}, mode={mode}: the gradient is not the derivative of the loss "
            "value (if term() detaches part of its value on purpose, as CISPO, pass "
            f"stop_gradient=True):\n{err}"
        ) from None


def check_fused_gradient(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    bitwise: bool = False,
    signed_zeros: bool = False,
    kl_and_is_weights: bool = False,
) -> None:
    """The loss and ``logp`` gradient of :func:`policy_loss` (the fused path, for an
    objective with ``grad``) equal autograd's through :func:`reference_loss` in float64,
    within :func:`reference_with_bounds`; with ``bitwise``, the gradient also equals, exactly,
    autograd's through the reference evaluated in the batch's own dtype (``signed_zeros``:
    the sign of a zero too). ``kl_and_is_weights``: with a k3 ``KLPenalty`` (``beta=0.1``)
    and IS weights in ``[0.5, 1.5)``."""
    b = _default(objective, batch, torch.float64)
    extra: dict[str, Any] = {"mode": mode}
    if kl_and_is_weights:
        g = torch.Generator().manual_seed(2)
        noise = torch.randn(b.logp.shape, generator=g, dtype=torch.float64)
        extra["ref_logp"] = (b.logp.double() + 0.3 * noise).to(b.logp.dtype)
        extra["kl"] = KLPenalty(beta=0.1)
        extra["is_weights"] = (torch.rand(b.logp.shape, generator=g) + 0.5).to(b.logp.dtype)
    args = (b.old_logp, b.advantages, b.mask)
    got = _loss_and_grad(_bind(policy_loss, objective), b.logp, *args, **extra)
    what = f"{_name(objective)}, mode={mode}, {b.logp.dtype}" + (
        ", KL and IS weights" if kl_and_is_weights else ""
    )
    assert got[1].dtype == b.logp.dtype, f"{what}: gradient dtype {got[1].dtype}"
    if bitwise:  # against the reference evaluated in the same dtype
        want = _loss_and_grad(_bind(reference_loss, objective), b.logp, *args, **extra)
        _assert_exact(
            got[1], want[1], f"{what}: fused gradient vs autograd of the reference",
            signed_zeros=signed_zeros,
        )  # fmt: skip
    ref = reference_with_bounds(objective, b, **extra)
    _assert_within(got[0], ref.loss, ref.loss_err, f"{what}: loss vs the float64 reference")
    _assert_within(got[1], ref.grad, ref.grad_err, f"{what}: gradient vs the float64 reference")


def _abs_loss(objective: Objective, b: Batch, **options: Any) -> Tensor:
    """``sum_i w_i |l_i|`` (each part of ``l_i`` in absolute value): the scale of a loss's
    rounding error. ``options``: :func:`reference_loss`'s keywords."""
    kl, ref_logp = options.pop("kl", None), options.pop("ref_logp", None)
    is_weights = options.pop("is_weights", None)
    with torch.no_grad():
        per_token = per_token_loss(objective, b.logp, b.old_logp, b.advantages, b.mask).abs()
        if is_weights is not None:
            per_token = per_token * torch.where(b.mask.bool(), is_weights, 0.0).abs()
        if kl is not None and ref_logp is not None:
            per_token = per_token + kl.beta * _kl_terms(kl, b.logp, ref_logp, b.mask).abs()
        return token_level_aggregate(per_token, b.mask, **options)


def check_masked_garbage(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    junk: float = math.nan,
    where: tuple[str, ...] = ("logp", "old_logp", "advantages"),
    signed_zeros: bool = False,
) -> None:
    """``junk`` (NaN, +-inf, any value) at the masked positions of the tensors named in
    ``where`` (advantages: at masked positions if per token, on the empty rows if per
    sequence) changes the loss and the gradient by nothing: the same values (with
    ``signed_zeros``, the same bits: the sign of a zero too)."""
    b = _default(objective, batch, torch.float32)
    mask = b.mask.bool()
    dirty = dict(zip(("logp", "old_logp", "advantages"), b[:3], strict=True))
    for name in where:
        t = dirty[name]
        bad = torch.tensor(junk, dtype=t.dtype)
        if name == "advantages" and t.shape != mask.shape:
            empty = ~mask.any(dim=-1)
            dirty[name] = torch.where(empty.view(t.shape), bad, t)
        else:
            dirty[name] = torch.where(mask, t, bad)
    loss = _bind(policy_loss, objective)
    clean = _loss_and_grad(loss, b.logp, b.old_logp, b.advantages, b.mask, mode=mode)
    got = _loss_and_grad(
        loss, dirty["logp"], dirty["old_logp"], dirty["advantages"], b.mask, mode=mode
    )
    what = f"{_name(objective)}, mode={mode}, {junk} in masked {'/'.join(where)}"
    _assert_exact(got[0], clean[0], f"{what}: loss", signed_zeros=signed_zeros)
    _assert_exact(got[1], clean[1], f"{what}: gradient", signed_zeros=signed_zeros)


def check_micro_batches(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    sizes: tuple[int, ...] = (1, 2),
) -> None:
    """Micro-batches of ``sizes`` rows (the rest in a last one), each normalised by
    ``global_normalizer`` of all their masks, add up to the full-batch loss, and their
    gradients are the full batch's: both within :func:`reference_with_bounds` of the
    full-batch float64 reference."""
    b = _default(objective, batch, torch.float64)
    n = b.logp.shape[0]
    cuts = [c for c in torch.tensor(sizes).cumsum(0).tolist() if 0 < c < n]
    parts = [Batch(*(torch.tensor_split(t, cuts)[k] for t in b)) for k in range(len(cuts) + 1)]
    den = global_normalizer([p.mask for p in parts], mode=mode)  # type: ignore[arg-type]
    loss = _bind(policy_loss, objective)
    pieces = [_loss_and_grad(loss, p.logp, *p[1:], mode=mode, normalizer=den) for p in parts]
    total = torch.stack([p[0] for p in pieces]).sum()
    grad = torch.cat([p[1] for p in pieces])
    ref = reference_with_bounds(objective, b, mode=mode, extra_terms=len(parts))
    what = f"{_name(objective)}, mode={mode}, micro-batches {[p.mask.shape[0] for p in parts]}"
    _assert_within(total, ref.loss, ref.loss_err, f"{what}: summed loss vs the full batch's")
    _assert_within(grad, ref.grad, ref.grad_err, f"{what}: gradient vs the full batch's")


def check_compile(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    backend: str = "aot_eager",
    compiled_option: bool = False,
) -> None:
    """``torch.compile(fullgraph=True, backend=backend)`` around a function calling
    :func:`policy_loss` traces with no graph break, and its loss and gradient, like eager's,
    lie within :func:`reference_with_bounds` of the float64 reference; with
    ``compiled_option=True``, the eager call ``policy_loss(..., compiled=True)`` (inductor)
    instead, which must not fall back to eager. Resets ``torch._dynamo``'s caches first
    (each objective value is a new graph)."""
    import torch._dynamo

    b = _default(objective, batch, torch.float32)
    args = (b.old_logp, b.advantages, b.mask)

    def step(lp: Tensor) -> Tensor:
        return policy_loss(objective, lp, *args, mode=mode, compiled=compiled_option)

    torch._dynamo.reset()
    if compiled_option:
        run, how = step, "compiled=True"
    else:
        run, how = torch.compile(step, fullgraph=True, backend=backend), f"torch.compile({backend})"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="dapo_ops: compiled=True ran eagerly")
        got = _loss_and_grad(run, b.logp)
    eager = _loss_and_grad(_bind(policy_loss, objective), b.logp, *args, mode=mode)
    ref = reference_with_bounds(objective, b, mode=mode)
    for name, (loss, grad) in ((how, got), ("eager", eager)):
        what = f"{_name(objective)}, mode={mode}, {name}"
        _assert_within(loss, ref.loss, ref.loss_err, f"{what}: loss vs the float64 reference")
        _assert_within(grad, ref.grad, ref.grad_err, f"{what}: gradient vs the reference")


def check_low_precision(
    objective: Objective,
    batch: Batch | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    mode: AggregationMode = "token_mean",
) -> None:
    """``dtype`` (bfloat16, float16) inputs: a float32 loss equal, bit for bit, to the
    float32 call on the same (rounded) values, and a gradient in ``dtype`` equal to that
    call's float32 gradient rounded once to ``dtype``."""
    b = _default(objective, batch, torch.float32)
    low = [t.to(dtype) for t in b[:3]]
    loss = _bind(policy_loss, objective)
    got = _loss_and_grad(loss, *low, b.mask, mode=mode)
    want = _loss_and_grad(loss, *(t.float() for t in low), b.mask, mode=mode)
    what = f"{_name(objective)}, mode={mode}, {dtype} inputs"
    assert got[0].dtype == torch.float32, f"{what}: loss dtype {got[0].dtype}, want float32"
    assert got[1].dtype == dtype, f"{what}: gradient dtype {got[1].dtype}, want {dtype}"
    _assert_exact(got[0], want[0], f"{what}: loss vs float32 on the rounded inputs")
    _assert_exact(got[1], want[1].to(dtype), f"{what}: gradient vs float32's, rounded")


def check_all_masked(objective: Objective, *, mode: AggregationMode = "token_mean") -> None:
    """An all-masked batch (NaN everywhere) and an empty one give loss 0 and gradient 0."""
    nan = torch.full((3, 4), math.nan)
    empty = torch.zeros(0, 4)
    for logp, mask in ((nan, torch.zeros(3, 4, dtype=torch.bool)), (empty, empty.bool())):
        adv = torch.ones(logp.shape[0])
        loss, grad = _loss_and_grad(_bind(policy_loss, objective), logp, logp, adv, mask, mode=mode)
        what = f"{_name(objective)}, mode={mode}, all masked {list(logp.shape)}"
        assert loss.shape == () and float(loss) == 0.0, f"{what}: loss {loss}, want 0"
        assert grad.shape == logp.shape and not bool(grad.any()), f"{what}: gradient {grad}"


def check_inputs_unchanged(objective: Objective, batch: Batch | None = None) -> None:
    """Forward and backward (with a KL penalty, IS weights, a normaliser tensor and NaN in
    masked positions) leave every input as it was, bit for bit."""
    b = _default(objective, batch, torch.float32)
    mask = b.mask.bool()
    logp = torch.where(mask, b.logp, math.nan).requires_grad_(True)
    inputs = {
        "old_logp": b.old_logp,
        "advantages": b.advantages,
        "mask": b.mask,
        "ref_logp": b.old_logp - 0.1,
        "is_weights": torch.rand_like(b.logp) + 0.5,
        "normalizer": torch.tensor(7.0),
    }
    before = {k: v.clone() for k, v in inputs.items()} | {"logp": logp.detach().clone()}
    loss = policy_loss(
        objective, logp, inputs["old_logp"], inputs["advantages"], inputs["mask"],
        ref_logp=inputs["ref_logp"], kl=KLPenalty(), is_weights=inputs["is_weights"],
        normalizer=inputs["normalizer"],
    )  # fmt: skip
    loss.backward()  # type: ignore[no-untyped-call]
    for name, value in (inputs | {"logp": logp.detach()}).items():
        what = f"{_name(objective)}: {name} after forward and backward"
        _assert_exact(value, before[name], what, signed_zeros=True)


def check_double_backward(
    objective: Objective, batch: Batch | None = None, *, mode: AggregationMode = "token_mean"
) -> None:
    """``torch.autograd.grad(loss, logp, create_graph=True)`` gives a gradient whose own
    derivative (of a weighted ``sum g^2``) equals the reference definition's (both in
    float64, within :data:`F64_RTOL` of each entry plus the largest)."""
    b = _default(objective, batch, torch.float64)
    assert b.logp.dtype == torch.float64, "the double-backward check needs a float64 batch"
    weights = torch.rand(b.logp.shape, generator=torch.Generator().manual_seed(1)).to(b.logp)
    results = []
    for fn in (policy_loss, reference_loss):
        lp = b.logp.detach().clone().requires_grad_(True)
        loss = fn(objective, lp, b.old_logp, b.advantages, b.mask, mode=mode)  # type: ignore[operator]
        (g,) = torch.autograd.grad(loss, lp, create_graph=True)
        if g.requires_grad:
            (h,) = torch.autograd.grad((weights * g * g).sum(), lp, allow_unused=True)
        else:  # constant gradient (no graph): its derivative is 0
            h = None
        results.append((g.detach(), torch.zeros_like(lp) if h is None else h))
    (g_f, h_f), (g_r, h_r) = results
    what = f"{_name(objective)}, mode={mode}"
    _assert_within(g_f, g_r, F64_RTOL * (g_r.abs() + g_r.abs().max()), f"{what}: gradient")
    h_err = F64_RTOL * (h_r.abs() + h_r.abs().max())
    _assert_within(h_f, h_r, h_err, f"{what}: double backward vs the reference's")


def check_constants_refused(objective: Objective) -> None:
    """``old_logp`` or ``advantages`` that require grad raise ``InputError`` naming them."""
    b = make_batch(objective, 2, 3, dtype=torch.float32)
    for name in ("old_logp", "advantages"):
        args = {"old_logp": b.old_logp, "advantages": b.advantages}
        args[name] = args[name].clone().requires_grad_(True)
        lp = b.logp.clone().requires_grad_(True)
        try:
            policy_loss(objective, lp, args["old_logp"], args["advantages"], b.mask)
        except InputError as err:
            assert name in str(err), f"{_name(objective)}: the error does not name {name}: {err}"
        else:
            raise AssertionError(f"{_name(objective)}: {name} requiring grad was accepted")


#: What no numeric option accepts: not a number at all, and NaN.
BAD_NUMBERS: tuple[object, ...] = ("x", math.nan)


def check_fields(objective: Objective) -> None:
    """Every option is validated at construction: a bad value of each field (not a number,
    NaN; a non-bool for a bool field; an unknown option for a string field) raises
    ``InputError`` naming ``Type.field``. Fields are discovered with ``dataclasses.fields``
    and classified by their current value."""
    cls = type(objective)
    for field in dataclasses.fields(objective):
        value = getattr(objective, field.name)
        if isinstance(value, bool):
            bad: tuple[object, ...] = ("yes", 1.5)
        elif isinstance(value, str):
            bad = ("no such option",)
        elif value is None or isinstance(value, (int, float)):
            bad = BAD_NUMBERS
        else:
            continue
        for wrong in bad:
            try:
                dataclasses.replace(objective, **{field.name: wrong})  # type: ignore[arg-type]
            except InputError as err:
                assert field.name in str(err), (
                    f"{cls.__name__}({field.name}={wrong!r}): the error does not name the "
                    f"field: {err}"
                )
            else:
                raise AssertionError(
                    f"{cls.__name__}({field.name}={wrong!r}) was accepted: validate the field "
                    "in __post_init__ (dapo_ops.objectives.base.check_number / check_field)"
                )


def check_linear_loss(
    objective: Objective,
    batch: Batch | None = None,
    *,
    mode: AggregationMode = "token_mean",
    chunk_sizes: tuple[int | None, ...] = (None, 3),
    vocab: int = 11,
) -> None:
    """:func:`dapo_ops.linear_policy_loss`, the entry point from hidden states, equals the
    composition it replaces: ``log_softmax(hidden @ W.T + bias)`` at the tokens, then
    :func:`reference_loss` (with a KL penalty and IS weights) minus an entropy bonus, loss
    and gradients w.r.t. hidden, weight and bias by autograd, in float64 within
    :data:`F64_RTOL` of each entry plus the largest. The log-probs are made from random
    hidden states; ``old_logp`` keeps the batch's log-ratios (so the same clip decisions
    arise). ``chunk_sizes``: tokens per chunk (3 cuts every sequence: token chunks, or a
    sequence walked twice)."""
    from dapo_ops.linear_loss import linear_policy_loss

    b = _default(objective, batch, torch.float64)
    g = torch.Generator().manual_seed(7)
    n, seq = b.logp.shape
    hidden = torch.randn(n, seq, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, 5, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    ref = (b.logp.double() + 0.3 * torch.randn(n, seq, generator=g, dtype=torch.float64)).detach()
    rho = torch.rand(n, seq, generator=g, dtype=torch.float64) + 0.5
    kl, coef = KLPenalty(beta=0.1), 0.03

    def naive(h: Tensor, w: Tensor, bb: Tensor) -> tuple[Tensor, Tensor]:
        all_lp = torch.log_softmax(h @ w.T + bb, dim=-1)
        logp = all_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return logp, -(all_lp.exp() * all_lp).sum(dim=-1)

    with torch.no_grad():
        old = naive(hidden, weight, bias)[0] - (b.logp.double() - b.old_logp.double())
    extra: dict[str, Any] = {"mode": mode, "ref_logp": ref, "kl": kl, "is_weights": rho}
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logp, entropy = naive(*leaves)
    want_loss = reference_loss(objective, logp, old, b.advantages, b.mask, **extra)
    want_loss = want_loss - coef * token_level_aggregate(entropy, b.mask, mode=mode)
    want = torch.autograd.grad(want_loss, leaves)
    for chunk in chunk_sizes:
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        loss = linear_policy_loss(
            leaves[0], leaves[1], tokens, old, b.advantages, b.mask, objective=objective,
            bias=leaves[2], entropy_coef=coef, chunk_size=chunk, **extra,
        )  # fmt: skip
        got = torch.autograd.grad(loss, leaves)
        what = f"{_name(objective)}, mode={mode}, linear_policy_loss(chunk_size={chunk})"
        err = F64_RTOL * (want_loss.abs() + 1)
        _assert_within(loss, want_loss, err, f"{what}: loss vs the composition")
        for name, x, y in zip(("hidden", "weight", "bias"), got, want, strict=True):
            bound = F64_RTOL * (y.abs() + y.abs().max())
            _assert_within(x, y, bound, f"{what}: gradient w.r.t. {name} vs the composition")


# --------------------------------------------------------------------------- all of them


def _every_mode(check: Callable[..., None]) -> Callable[..., None]:
    def run(objective: Objective, **kw: Any) -> None:
        for mode in MODES:
            check(objective, mode=mode, **kw)

    return run


#: Every check by name, each taking the objective (and, for ``gradcheck``,
#: ``stop_gradient=``): what :func:`check_objective` runs.
CHECKS: Mapping[str, Callable[..., None]] = {
    "fields": check_fields,
    "gradcheck": _every_mode(check_gradcheck),
    "fused_gradient": _every_mode(check_fused_gradient),
    "kl_and_is_weights": _every_mode(
        functools.partial(check_fused_gradient, kl_and_is_weights=True)
    ),
    "masked_garbage": _every_mode(check_masked_garbage),
    "micro_batches": _every_mode(check_micro_batches),
    "low_precision": check_low_precision,
    "all_masked": _every_mode(check_all_masked),
    "inputs_unchanged": check_inputs_unchanged,
    "double_backward": check_double_backward,
    "constants_refused": check_constants_refused,
    "compile": check_compile,
    "linear_loss": _every_mode(check_linear_loss),
}


def check_objective(
    objective: Objective, *, stop_gradient: bool = False, with_compile: bool = True
) -> None:
    """Run every check of :data:`CHECKS` on ``objective`` (every aggregation mode where
    it matters); ``AssertionError`` at the first failure.

    ``stop_gradient``: see :func:`check_gradcheck`. ``with_compile=False`` skips the
    ``torch.compile`` check (the slowest one).

    Example:
        >>> from dapo_ops import ClipHigher
        >>> check_objective(ClipHigher(dual_clip=3.0), with_compile=False)
    """
    if not isinstance(objective, Objective):
        raise InputError(f"objective must be an Objective value, got {objective!r}")
    for name, check in CHECKS.items():
        if name == "compile" and not with_compile:
            continue
        if name == "gradcheck":
            check(objective, stop_gradient=stop_gradient)
        else:
            check(objective)
