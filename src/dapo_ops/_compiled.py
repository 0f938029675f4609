"""The ``compiled=True`` path of :func:`dapo_ops.token_level_loss`: one compiled graph.

Private. With ``compiled=True`` (DAPO's path: no KL term, no IS weights) the loss scale
(:func:`dapo_ops.aggregation.loss_scale`: the valid-token or non-empty-row count, or the
given normaliser), the per-token Clip-Higher loss, its weighted masked sum and the
gradient with respect to ``logp`` are one ``torch.compile`` graph (:func:`_loss_graph`),
which inductor turns into one kernel: on CPU a count loop over the mask and one loop that
reads ``logp``, ``old_logp`` and the mask once and writes the gradient and the row sums.
An autograd Function hands that gradient to backward, as :mod:`dapo_ops._fused` does.

The per-token body is :func:`clamp_terms`: the loss written as one clamp with
sign-dependent bounds, about half the vector instructions of the reference's
maximum/minimum chain, the same per-token loss values, and ``clamp``'s gradient
convention at the kinks (see its docstring).

Two inductor details shape the code: a bool tensor *input* is loaded element by element
by inductor's CPU code (measured 3x slower for the whole kernel), so the mask enters as a
uint8 view and is compared in the graph; and Python numbers become graph constants. The
clip options are constants on purpose (fixed for a run; nothing to launch or copy for
them on a GPU); a numeric ``normalizer`` is passed as a 0-dim tensor instead (it changes
every step: one graph serves every value).
Each new combination of options, dtypes or normaliser kind compiles one more graph; past
``torch._dynamo.config.recompile_limit`` the call warns and takes the eager fused path.

Compiled lazily on first use and cached per process (``_COMPILED``: compiled code, no
data). Inputs that need other gradients (``advantages``, a ``normalizer`` tensor that
requires grad) take the eager fused path instead.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from dapo_ops.aggregation import check_normalizer, loss_scale, scaled_sum
from dapo_ops.surrogate import compute_dtype


def clamp_terms(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    scale: Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
    with_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    r"""Row sums of the masked loss and ``d(sum_i w_i rowsum_i)/d logp``, one clamp a token.

    The compiled counterpart of :func:`dapo_ops._fused._chunk_terms`, same arguments.
    For :math:`A < 0` the Clip-Higher loss is :math:`-A \max(r, 1-\varepsilon_{low})`,
    capped by the dual clip at :math:`r \le c`; for :math:`A \ge 0` it is
    :math:`-A \min(r, 1+\varepsilon_{high})`. So, with sign-dependent bounds,

    .. math::

        \ell = -A\,\mathrm{clamp}(r, lo_A, hi_A), \qquad
        \frac{\partial \ell}{\partial \log\pi} = -A\,r\,[lo_A \le r \le hi_A],

    each token's loss bitwise equal to the reference's (rounding is monotone, so
    ``max(-A r, -A clip(r)) == -A max(r, clip(r))``), in about half the vector
    instructions of the maximum/minimum chain. The gradient follows ``clamp``'s
    convention at the kinks (full gradient on a bound, bounds included), where the
    reference's ``torch.maximum``/``minimum`` autograd splits an exact tie in half: the
    two differ only for a ratio exactly on the dual-clip bound or on a float-rounding tie
    of the two products (a ratio within an ulp of a clip bound), and only at that token.
    """
    dtype = scale.dtype
    if valid.dtype != torch.bool:
        valid = valid.to(dtype) != 0  # a uint8 view of the mask: see the module docstring
    lr = logp.to(dtype) - old_logp.to(dtype)
    clamped = lr.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = clamped.exp()
    neg_adv = advantages.to(dtype).neg()
    negative = neg_adv > 0  # A < 0
    # graph constants, rounded to the compute dtype like the reference's clamp bounds
    cap = math.inf if dual_clip is None else dual_clip
    lo = torch.where(negative, torch.full_like(neg_adv, 1.0 - eps_low), -math.inf)
    hi = torch.where(
        negative, torch.full_like(neg_adv, cap), torch.full_like(neg_adv, 1.0 + eps_high)
    )
    bounded = torch.minimum(torch.maximum(ratio, lo), hi)
    row_sums = torch.where(valid, bounded * neg_adv, 0.0).sum(dim=-1)
    if not with_grad:
        return row_sums, None
    keep = (clamped == lr) & (bounded == ratio) & valid
    return row_sums, torch.where(keep, (scale * neg_adv) * ratio, 0.0)


#: torch.compile'd functions, built on first use, keyed by (function, backend): compiled
#: code only, no data.
_COMPILED: dict[tuple[str, str], Callable[..., Any]] = {}


def compiled_chunk_terms(backend: str) -> Callable[..., Any]:
    """``torch.compile`` of :func:`clamp_terms` for ``backend``, built on first use."""
    return _compiled("terms", clamp_terms, backend)


def _compiled(key: str, fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    compiled = _COMPILED.get((key, backend))
    if compiled is None:
        # dynamic=None: specialised on the first shape, one dynamic-shape recompile after
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        _COMPILED[(key, backend)] = compiled
    return compiled


def _loss_graph(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask_u8: Tensor,
    normalizer: Tensor | None,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float,
    mode: str,
    max_len: int | None,
    with_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """The loss (0-dim) and ``d loss / d logp`` (or None): the graph that is compiled."""
    dtype = compute_dtype(logp, old_logp, advantages)
    valid = mask_u8.to(dtype) != 0
    # "local": the distributed check already ran outside the graph
    den = "local" if normalizer is None else normalizer
    scale = loss_scale(valid, mode=mode, normalizer=den, max_len=max_len, dtype=dtype)  # type: ignore[arg-type]
    clip = (eps_low, eps_high, dual_clip, log_ratio_clamp)
    row_sums, grad = clamp_terms(logp, old_logp, advantages, valid, scale, *clip, with_grad)
    return scaled_sum(row_sums, scale), grad


def logp_grads(
    grad: Tensor,
    grad_out: Tensor,
    needs: tuple[bool, ...],
    dtypes: tuple[torch.dtype, torch.dtype],
    *,
    owned: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """``(d/d logp, d/d old_logp)`` from the precomputed ``d loss / d logp`` buffer.

    ``owned``: the buffer was handed over by the forward pass and may be scaled in place
    (on CPU the multiplication by a ``grad_out`` of 1, a plain ``backward()``, is
    skipped); otherwise (a saved tensor, e.g. traced by ``torch.compile``) a new tensor.
    ``needs``/``dtypes``: ``ctx.needs_input_grad`` and the dtypes of logp and old_logp.
    """
    if not owned:
        grad = grad * grad_out
    elif grad_out.device.type != "cpu" or float(grad_out) != 1.0:
        grad.mul_(grad_out)
    g_old = grad.neg().to(dtypes[1]) if needs[1] else None
    g_logp = grad.to(dtypes[0]) if needs[0] else None
    return g_logp, g_old


class _CompiledLoss(torch.autograd.Function):
    """The compiled loss with its precomputed gradient handed over to backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        mask_u8: Tensor,
        normalizer: Tensor | None,
        graph: Callable[..., tuple[Tensor, Tensor | None]],
        opts: tuple[Any, ...],
    ) -> Tensor:
        total, grad = graph(logp, old_logp, advantages, mask_u8, normalizer, *opts, True)
        ctx.grad_buffer = grad
        # a second backward (retained graph) recomputes from the caller's tensors
        ctx.recompute = (graph, (logp.detach(), old_logp.detach(), advantages, mask_u8))
        ctx.rest = (normalizer, opts)
        ctx.dtypes = (logp.dtype, old_logp.dtype)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad, ctx.grad_buffer = ctx.grad_buffer, None
        if grad is None:
            graph, inputs = ctx.recompute
            normalizer, opts = ctx.rest
            grad = graph(*inputs, normalizer, *opts, True)[1]
        g_logp, g_old = logp_grads(grad, grad_out, ctx.needs_input_grad, ctx.dtypes, owned=True)
        return g_logp, g_old, None, None, None, None, None


def compiled_token_level_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    valid: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    mode: str,
    normalizer: object,
    dual_clip: float | None,
    max_len: int | None,
    log_ratio_clamp: float,
    backend: str,
) -> Tensor | None:
    """The compiled loss for checked inputs (``advantages`` ``[b, 1|s]``, bool ``valid``).

    Returns None when this path does not apply (a gradient is needed for the advantages
    or the normaliser): the caller then takes the eager fused path.
    """
    given = check_normalizer(normalizer)  # eager: validation and the distributed check
    dtype = compute_dtype(logp, old_logp, advantages)
    if isinstance(given, Tensor):
        if given.requires_grad and torch.is_grad_enabled():
            return None
        den: Tensor | None = given
    else:
        # a tensor, not a graph constant (one graph for every value); a fill, no copy
        den = (
            None if given is None else torch.full((), float(given), dtype=dtype, device=logp.device)
        )
    if advantages.requires_grad and torch.is_grad_enabled():
        return None
    # imported here: torch._dynamo costs ~1 s to import, only compiled=True needs it
    from torch._dynamo.exc import FailOnRecompileLimitHit, Unsupported

    graph = _compiled("loss", _loss_graph, backend)
    mask_u8 = valid.view(torch.uint8)
    opts = (eps_low, eps_high, dual_clip, log_ratio_clamp, mode, max_len)
    try:
        if not (torch.is_grad_enabled() and (logp.requires_grad or old_logp.requires_grad)):
            return graph(logp, old_logp, advantages, mask_u8, den, *opts, False)[0]  # type: ignore[no-any-return]
        return _CompiledLoss.apply(logp, old_logp, advantages, mask_u8, den, graph, opts)  # type: ignore[no-any-return,no-untyped-call]
    except (FailOnRecompileLimitHit, Unsupported) as err:
        # one graph per (mode, max_len, dtypes, normaliser kind, grad or not, shape kind):
        # past torch._dynamo's recompile limit, eager is the honest fallback
        warnings.warn(
            f"dapo_ops: compiled=True fell back to the eager fused path ({type(err).__name__}: "
            "too many distinct loss configurations for torch._dynamo.config.recompile_limit)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
