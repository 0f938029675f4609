"""The conformance checks' shared parts: batches, the float64 reference, bounds, asserts."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import AggregationMode
from dapo_ops.engine.aggregation import token_level_aggregate
from dapo_ops.engine.kl import KLPenalty, kl_penalty
from dapo_ops.engine.surrogate import per_token_loss
from dapo_ops.objectives.base import Objective, per_sequence_advantages

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
    if per_token_advantages and not per_sequence_advantages(objective):
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
