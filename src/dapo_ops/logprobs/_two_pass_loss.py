r"""The two-pass design under autograd: the policy loss and the fused log-probs.

Private. Pass 1 (:func:`dapo_ops.logprobs._two_pass.pass1`) runs in forward; between the
passes the engine works on ``[batch, seq]`` vectors, as :func:`dapo_ops.policy_loss`
does: the objective's ``grad`` (or autograd of its ``term``) with KL, IS weights,
aggregation and the normaliser gives ``a = d loss / d logp``, the entropy bonus ``b =
d loss / d H``; every objective works, sequence-level ones included, since every
log-prob exists after pass 1. Backward runs pass 2 with ``a`` and ``b`` scaled by the
incoming gradient. With kept logits pass 2 writes ``G`` over them: a second backward
through a retained graph finds them used and forms them again. ``create_graph=True``
differentiates the definition (the naive composition).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops._core._validate import InputError
from dapo_ops.engine.aggregation import loss_scale
from dapo_ops.logprobs._linear_loss import (
    LinearInputs,
    LinearSpec,
    _objective_terms,
    reference_loss,
)
from dapo_ops.logprobs._packing import RowMap
from dapo_ops.logprobs._two_pass import Pass1, TwoPassSpec, logits_into, pass1, pass2


def _engine(
    spec: LinearSpec, logp: Tensor, ent: Tensor, t: LinearInputs, with_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The loss (0-dim), ``a`` and ``b`` (``[batch, seq]``, or None) from pass 1's vectors."""
    dtype = compute_dtype(logp, t.old_logp, t.adv)
    den = "local" if t.normalizer is None else t.normalizer
    scale = loss_scale(t.valid, mode=spec.loss.mode, normalizer=den, max_len=spec.loss.max_len, dtype=dtype)  # type: ignore[arg-type]  # fmt: skip
    loss, a = _objective_terms(spec.loss, logp.to(dtype), t, scale, with_grad)
    b = None
    if isinstance(t.coef, Tensor) or t.coef != 0.0:
        coef = t.coef if isinstance(t.coef, Tensor) else torch.full((), t.coef, dtype=dtype, device=logp.device)  # fmt: skip
        w = masked(t.valid, (-coef * scale).expand(t.valid.shape))
        loss = loss + (w * masked(t.valid, ent.to(dtype))).sum()
        b = w
    return loss, a, b


def no_split_twice(tp: TwoPassSpec) -> None:
    """Double backward differentiates the whole-vocabulary definition: not on a split one."""
    if tp.split is not None:
        raise InputError(
            "create_graph=True (double backward) is not available with vocab_group: the "
            "definition it differentiates needs the whole vocabulary on one rank"
        )


def definition_grads(
    ctx: Any, leaves: tuple[Tensor, Tensor, Tensor | None], need: tuple[bool, bool, bool],
    reference: Callable[[], Tensor], grad_out: Tensor | None, nones: int,
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """``create_graph=True``: the gradients of the definition (``reference()``, the naive
    composition with differentiable ops), then ``nones`` Nones for the other inputs."""
    no_split_twice(ctx.tp)
    if getattr(ctx, "rm", None) is not None:
        raise InputError(
            "create_graph=True (double backward) is not available with skip_padding or "
            "cu_seqlens: the definition it differentiates is the padded grid's"
        )
    wanted = [x for x, n in zip(leaves, need, strict=True) if n and x is not None]
    with torch.enable_grad():
        got = iter(torch.autograd.grad(reference(), wanted, grad_out, create_graph=True))
    return (*(next(got) if n else None for n in need), *(None,) * nones)


def _rows(hidden: Tensor, valid: Tensor | None) -> Tensor:
    """``hidden`` as contiguous ``[N, d]`` rows, the masked ones zero (they reach nothing)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if valid is None:
        return flat.contiguous()
    return torch.where(valid.reshape(-1, 1), flat, 0.0)


def _pass2(
    ctx: Any, h: Tensor, w: Tensor, b: Tensor | None, a: Tensor, bvec: Tensor | None,
    need: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
    """Pass 2 of a saved pass 1. The kept logits are used once (pass 2 writes ``G`` over
    them): a second backward through a retained graph forms them whole again (one more
    product), so it runs the same arithmetic and gives the same bits."""
    p1: Pass1 = ctx.p1
    if ctx.tp.keep and p1.logits is None:
        p1 = p1._replace(logits=logits_into(h.new_empty(h.shape[0], w.shape[0]), h, w, b))
    ctx.p1 = p1._replace(logits=None)
    return pass2(ctx.tp, h, w, b, ctx.tok, p1, a, bvec, need)


def _scatter(x: Tensor, rm: RowMap | None, size: int) -> Tensor:
    """Per-row values at their grid positions (0 elsewhere), or ``x`` without a map."""
    return x if rm is None else x.new_zeros(size).index_copy(0, rm.dst, x)


def _pick(x: Tensor, rm: RowMap | None) -> Tensor:
    """Grid values at the rows that run (all of them without a map), flat."""
    return x.reshape(-1) if rm is None else x.reshape(-1)[rm.dst]


class TwoPassPolicyLoss(torch.autograd.Function):
    """``(loss, logp, entropy)``: pass 1 and the engine in forward, pass 2 in backward.
    With a :class:`RowMap` the passes run on its rows only; the engine sees the grid."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, spec: LinearSpec,
        t: LinearInputs, tp: TwoPassSpec, rm: RowMap | None,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        shape, size = t.valid.shape, t.valid.numel()
        if rm is None:
            h, tok = _rows(hidden, t.valid), t.tokens.reshape(-1)
        else:
            flat = hidden.reshape(-1, hidden.shape[-1])
            v = t.valid.reshape(-1)[rm.dst].unsqueeze(1)
            h, tok = torch.where(v, flat[rm.src], 0.0), t.tokens.reshape(-1)[rm.dst]
        p1 = pass1(tp, h, weight, bias, tok)
        logp, ent = (_scatter(x, rm, size).view(shape) for x in (p1.logp, p1.ent))
        with_grad = any(ctx.needs_input_grad[:3])
        loss, a, g_ent = _engine(spec, logp, ent, t, with_grad)
        if rm is not None and rm.short is not None:  # the caller's count left tokens out
            loss = torch.where(rm.short, torch.nan, loss)
        ctx.spec, ctx.inputs, ctx.tp, ctx.p1, ctx.tok, ctx.rm = spec, t, tp, p1, tok, rm
        a = logp.new_zeros(shape) if a is None else a
        saved = (a,) if g_ent is None else (a, g_ent)
        ctx.save_for_backward(hidden, weight, bias, h, *saved)
        # copies: an output held by ctx would close a cycle through the graph, which
        # Python's collector cannot see (the kept logits and the group would leak)
        logp = logp.clone() if rm is None else logp
        entropy = (ent.clone() if rm is None else ent) if spec.entropy else logp.new_zeros(0)
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, h, a, *rest = ctx.saved_tensors
        need: tuple[bool, bool, bool] = tuple(bool(n) for n in ctx.needs_input_grad[:3])  # type: ignore[assignment]
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition

            def reference() -> Tensor:
                return reference_loss(ctx.spec, hidden, weight, bias, ctx.inputs)

            return definition_grads(ctx, (hidden, weight, bias), need, reference, grad_out, 4)
        g = grad_out.to(a.dtype)
        rm: RowMap | None = ctx.rm
        bvec = _pick(rest[0] * g, rm) if rest else None
        gh, gw, gb = _pass2(ctx, h, weight, bias, _pick(a * g, rm), bvec, need)
        if gh is not None and rm is not None:
            flat = hidden.reshape(-1, hidden.shape[-1])
            gh = flat.new_zeros(flat.shape).index_copy(0, rm.src, gh)
        return (None if gh is None else gh.view(hidden.shape), gw, gb, None, None, None, None)


def reference_logp_entropy(
    h: Tensor, w: Tensor, b: Tensor | None, tok: Tensor, tp: TwoPassSpec, tau: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(log p_y, H)`` of the whole logits with differentiable ops (the same kept sets)."""
    z = h @ w.T if b is None else torch.addmm(b, h, w.T)
    cdt = torch.float64 if h.dtype == torch.float64 else torch.float32
    raw = z.to(cdt)
    x = raw if tp.rows.softcap is None else tp.rows.softcap * torch.tanh(raw / tp.rows.softcap)
    x = x / tp.rows.temperature
    if tau is not None:
        cols = torch.arange(x.shape[1], device=x.device)
        keep = (raw.detach() >= tau.unsqueeze(1)) | (cols == tok.unsqueeze(1))
        x = torch.where(keep, x, -torch.inf)
    lp = torch.log_softmax(x, dim=1)
    p = lp.exp()
    ent = -torch.where(p > 0, p * lp, 0.0).sum(dim=1)
    return lp.gather(1, tok.unsqueeze(1)).squeeze(1), ent


class TwoPassLogpEntropy(torch.autograd.Function):
    """``(logp, entropy)`` of ``hidden [N, d]``: pass 1 forward, pass 2 backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor,
        tp: TwoPassSpec,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        h = hidden.contiguous()
        p1 = pass1(tp, h, weight, bias, tokens)
        ctx.tp, ctx.p1, ctx.tok = tp, p1, tokens
        ctx.save_for_backward(hidden, weight, bias, h)
        ctx.set_materialize_grads(False)
        return p1.logp.clone(), p1.ent.clone()  # copies: ctx holds p1 (see above)

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]  # fmt: skip
        hidden, weight, bias, h = ctx.saved_tensors
        need: tuple[bool, bool, bool] = tuple(bool(n) for n in ctx.needs_input_grad[:3])  # type: ignore[assignment]
        if not any(need) or (grad_logp is None and grad_ent is None):
            return (None,) * 5
        p1: Pass1 = ctx.p1
        if torch.is_grad_enabled():  # create_graph=True: differentiate the definition

            def reference() -> Tensor:
                logp, ent = reference_logp_entropy(hidden, weight, bias, ctx.tok, ctx.tp, p1.tau)
                total = logp.new_zeros(())
                for g, v in ((grad_logp, logp), (grad_ent, ent)):
                    total = total if g is None else total + (g * v).sum()
                return total

            return definition_grads(ctx, (hidden, weight, bias), need, reference, None, 2)
        cdt = p1.lse.dtype
        a = p1.lse.new_zeros(p1.lse.shape) if grad_logp is None else grad_logp.to(cdt)
        bvec = None if grad_ent is None else grad_ent.to(cdt)
        gh, gw, gb = _pass2(ctx, h, weight, bias, a, bvec, need)
        return (None if gh is None else gh.view(hidden.shape), gw, gb, None, None)
