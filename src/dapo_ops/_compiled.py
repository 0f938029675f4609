"""The ``compiled=True`` path of :func:`dapo_ops.token_level_loss`: one compiled graph.

Private. With ``compiled=True`` (DAPO's path: no KL term, no IS weights) the loss scale
(:func:`dapo_ops.aggregation.loss_scale`: the valid-token or non-empty-row count, or the
given normaliser), the per-token Clip-Higher loss, its weighted masked sum and the
gradient with respect to ``logp`` are one ``torch.compile`` graph (:func:`_loss_graph`),
which inductor turns into one kernel: on CPU a count loop over the mask and one loop that
reads ``logp``, ``old_logp`` and the mask once and writes the gradient and the row sums.
An autograd Function hands that gradient to backward, as :mod:`dapo_ops._fused` does.

The per-token body is :func:`dapo_ops._terms.clamp_terms`, the eager path's exact
body: the loss written as one clamp with sign-dependent bounds, the same values and
gradient as the reference composition.

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

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from dapo_ops._terms import clamp_terms
from dapo_ops.aggregation import check_normalizer, loss_scale, scaled_sum
from dapo_ops.surrogate import compute_dtype

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
    g_logp = (grad if grad.dtype == dtypes[0] else grad.to(dtypes[0])) if needs[0] else None
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
