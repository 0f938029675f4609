r"""The linear policy loss in one pass: chunk logits, log-probs, the objective, gradients.

Private; :func:`dapo_ops.linear_policy_loss` checks its inputs and calls
:func:`linear_loss`. For each chunk of tokens (:class:`dapo_ops.logprobs._fused_linear.Chunks`):
the logits, their log-softmax, the chosen tokens' log-probs (and the entropies), then the
objective's loss and its gradient ``a = d loss / d logp`` through the engine
(:func:`dapo_ops.engine._engine.generic_terms`, or autograd of ``term`` for an objective with
no ``grad``), the entropy bonus's ``b = d loss / d H``, and at once the chunk's gradient
w.r.t. the logits, ``grad_hidden`` and its share of ``grad_weight`` / ``grad_bias``: 3
matmuls in all. Backward hands the stored gradients over, scaled by the incoming
gradient.

Chunks of tokens (the objective sees them as ``[n, 1]``) for objectives whose per-token
loss reads only its own token (their class declares ``token_local = True``:
:func:`dapo_ops.objectives.base.is_token_local`); every other objective (GSPO, GMPO, VESPO,
one written by a user that does not declare it) sees whole sequences ``[k, seq]``. A sequence longer than a
chunk is walked twice: log-probs first, then, once its objective is known, the logits
again for the gradient (4 matmuls for those rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops.engine._engine import LossSpec, generic_terms, reference_terms
from dapo_ops.engine.aggregation import loss_scale, scaled_sum
from dapo_ops.logprobs._fused_linear import (
    Chunks,
    Grads,
    chunks_for,
    grads_for,
    linear,
)
from dapo_ops.logprobs._grad_handover import grads_from_forward, keep_grads
from dapo_ops.logprobs._softcap import capped
from dapo_ops.logprobs._softmax_blocks import LOGP_FLOOR
from dapo_ops.logprobs._truncation import Truncation, thresholds, truncate
from dapo_ops.objectives import Objective
from dapo_ops.objectives.base import is_token_local


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """Everything but the tensors."""

    loss: LossSpec  # objective, KL penalty, mode, max_len
    temperature: float
    chunk: int  # tokens per chunk
    entropy: bool  # entropies computed (for the bonus or the diagnostics)
    trunc: Truncation | None = None  # the sampler's truncation (top-k, top-p, min-p)
    softcap: float | None = None  # the final-logit cap c: c tanh(z / c) before / T


class LinearInputs(NamedTuple):
    """The checked ``[batch, seq]`` tensors (advantages ``[batch, 1 | seq]``)."""

    tokens: Tensor  # int64, 0 at masked positions
    old_logp: Tensor
    adv: Tensor
    valid: Tensor
    ref_logp: Tensor | None
    is_weights: Tensor | None
    normalizer: Tensor | None  # 0-dim, compute dtype, or None: the local count
    coef: Tensor | float  # entropy bonus coefficient; 0.0: none


def _objective_terms(
    spec: LossSpec, logp: Tensor, t: LinearInputs, scale: Tensor, with_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The chunk's share of the loss (0-dim) and ``d loss / d logp`` (or None); ``t``
    holds the chunk's rows in the layout of ``logp``."""
    if type(spec.objective).grad is Objective.grad:  # no analytic gradient: autograd
        leaf = logp.detach().requires_grad_(with_grad)
        with torch.enable_grad():
            per_token = reference_terms(
                spec, leaf, t.old_logp, t.adv, t.valid, t.ref_logp, t.is_weights
            )
            loss = scaled_sum(per_token.sum(dim=-1), scale)
        grad = torch.autograd.grad(loss, leaf)[0] if with_grad else None
        return loss.detach(), grad
    rows, grad = generic_terms(
        spec, logp, t.old_logp, t.adv, t.valid, scale, t.ref_logp, t.is_weights, with_grad
    )
    return scaled_sum(rows, scale), grad


def _col(x: Tensor, shape: torch.Size) -> Tensor:
    return x.expand(shape).reshape(-1, 1)


def _opt_col(x: Tensor | None, shape: torch.Size) -> Tensor | None:
    return None if x is None else _col(x, shape)


def _part(x: Tensor | None, start: int, stop: int) -> Tensor | None:
    return None if x is None else x[start:stop]


def _layout(t: LinearInputs, scale: Tensor, by_token: bool) -> tuple[LinearInputs, Tensor]:
    """The inputs (and the aggregation weights) as ``[tokens, 1]`` for token chunks.
    (Helpers at module level: a nested function would be wrapped anew at each call by an
    annotation checker, which ``torch.compile`` cannot trace.)"""
    if not by_token:
        return t, scale
    shape = t.valid.shape
    cols = [_col(x, shape) for x in (t.tokens, t.old_logp, t.adv, t.valid)]
    flat = t._replace(
        tokens=cols[0], old_logp=cols[1], adv=cols[2], valid=cols[3],
        ref_logp=_opt_col(t.ref_logp, shape), is_weights=_opt_col(t.is_weights, shape),
    )  # fmt: skip
    return flat, scale if scale.ndim == 0 else _col(scale, shape)


def _rows(t: LinearInputs, scale: Tensor, start: int, stop: int) -> tuple[LinearInputs, Tensor]:
    part = t._replace(
        tokens=t.tokens[start:stop], old_logp=t.old_logp[start:stop], adv=t.adv[start:stop],
        valid=t.valid[start:stop], ref_logp=_part(t.ref_logp, start, stop),
        is_weights=_part(t.is_weights, start, stop),
    )  # fmt: skip
    return part, scale if scale.ndim == 0 else scale[start:stop]


@dataclasses.dataclass
class _Pass:
    """The state of one forward pass: the chunk machinery, the sums, the outputs."""

    spec: LinearSpec
    chunks: Chunks
    grads: Grads | None
    total: Tensor  # the loss so far, 0-dim
    logp: list[Tensor]  # the chunks' log-probs
    entropy: list[Tensor]  # and entropies

    def stats(self, h: Tensor, tok: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(log-softmax buffer, chosen log-probs, entropies or None, the truncation's
        thresholds or None) of one chunk."""
        lp, tau = self.chunks.kept_log_softmax(h, tok, None)
        logp = lp.gather(1, tok).squeeze(1)
        if not self.spec.entropy:
            return lp, logp, None, tau
        lp = self.chunks.floor_(lp)
        return lp, logp, self.chunks.entropy(lp), tau

    def group(
        self, h: Tensor, t: LinearInputs, scale: Tensor, shape: tuple[int, int], offset: int
    ) -> None:
        """One group of rows (``shape`` in the objective's layout, hidden rows ``offset``
        on) whose objective is evaluated at once: one chunk, or several walked twice."""
        spec, chunks, grads = self.spec, self.chunks, self.grads
        tok = t.tokens.reshape(-1, 1)
        size = chunks.chunk
        spans = [(s, min(s + size, h.shape[0])) for s in range(0, h.shape[0], size)]
        one = len(spans) == 1
        h = torch.where(t.valid.reshape(-1, 1), h, 0.0)  # masked rows reach nothing
        if one:
            lp, logp, ent, tau = self.stats(h, tok)
        else:
            logp, ent, tau = _cat([self.stats(h[s:e], tok[s:e]) for s, e in spans])
        dtype = self.total.dtype
        loss, a = _objective_terms(
            spec.loss, logp.view(shape).to(dtype), t, scale, grads is not None
        )
        b = None
        if isinstance(t.coef, Tensor) or t.coef != 0.0:
            assert ent is not None
            coef = torch.as_tensor(t.coef, dtype=dtype, device=h.device)
            w = masked(t.valid, (-coef * scale).expand(shape))
            loss = loss + (w * masked(t.valid, ent.view(shape).to(dtype))).sum()
            b = w.reshape(-1).to(chunks.cdt)
        self.total = self.total + loss
        self.logp.append(logp)
        if ent is not None:
            self.entropy.append(ent)
        if grads is None:
            return
        a = None if a is None else a.reshape(-1).to(chunks.cdt)
        for s, e in spans:
            if not one:  # the logits again (the same kept sets), now the objective is known
                lp, _ = chunks.kept_log_softmax(h[s:e], tok[s:e], _part(tau, s, e))
                lp = lp if b is None else chunks.floor_(lp)
            g = chunks.grad_(
                lp,
                tok[s:e],
                None if a is None else a[s:e],
                None if b is None else b[s:e],
                None if b is None or ent is None else ent[s:e],
            )
            grads.add(g, h[s:e], offset + s, offset + e)


def _cat(
    parts: list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]],
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    logp = torch.cat([p[1] for p in parts])
    ents = [p[2] for p in parts if p[2] is not None]
    taus = [p[3] for p in parts if p[3] is not None]
    return logp, torch.cat(ents) if ents else None, torch.cat(taus) if taus else None


def forward_pass(
    spec: LinearSpec,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    t: LinearInputs,
    need: tuple[bool, bool, bool],
) -> tuple[Tensor, Tensor, Tensor | None, tuple[Tensor | None, ...]]:
    """(loss, logp [batch, seq], entropy or None, (grad_hidden, grad_weight, grad_bias));
    the gradients only where ``need`` says so."""
    batch, seq = t.valid.shape
    flat = hidden.reshape(batch * seq, hidden.shape[-1])
    dtype = compute_dtype(hidden, t.old_logp, t.adv)
    den = "local" if t.normalizer is None else t.normalizer
    scale = loss_scale(t.valid, mode=spec.loss.mode, normalizer=den, max_len=spec.loss.max_len, dtype=dtype)  # type: ignore[arg-type]  # fmt: skip
    by_token = is_token_local(spec.loss.objective)
    # token chunks; or whole sequences, as many as fit, one sequence in chunks if it does not
    rows = 1 if by_token else max(1, spec.chunk // max(seq, 1))
    chunk = spec.chunk if by_token or seq > spec.chunk else rows * seq
    chunks = chunks_for(flat, weight, bias, chunk, spec.temperature, spec.trunc, spec.softcap)
    grads = grads_for(chunks, flat, need) if any(need) else None
    run = _Pass(spec, chunks, grads, flat.new_zeros((), dtype=dtype), [], [])
    lay, lay_scale = _layout(t, scale, by_token)
    step, width = (chunk, 1) if by_token else (rows, seq)
    for r in range(0, lay.valid.shape[0], step):
        part, part_scale = _rows(lay, lay_scale, r, r + step)
        n = part.valid.shape[0]
        if n * width:
            run.group(flat[r * width : (r + n) * width], part, part_scale, (n, width), r * width)
    logp = torch.cat(run.logp) if run.logp else flat.new_zeros(0, dtype=chunks.cdt)
    ent = torch.cat(run.entropy) if run.entropy else None
    if ent is None and spec.entropy:  # no token at all
        ent = logp.new_zeros(0)
    chunks.release()
    gh, gw, gb = (None, None, None) if grads is None else grads.result()
    if need[0] and gh is None:
        gh = torch.zeros_like(flat)
    return (
        run.total,
        logp.view(batch, seq),
        None if ent is None else ent.view(batch, seq),
        (None if gh is None else gh.view(hidden.shape), gw, gb),
    )


def reference_loss(
    spec: LinearSpec, hidden: Tensor, weight: Tensor, bias: Tensor | None, t: LinearInputs
) -> Tensor:
    """The definition under autograd: the whole logits, ``log_softmax``, the chosen
    tokens, the reference composition of the objective (:func:`reference_terms`) and the
    entropy bonus. The naive path's memory; differentiated for ``create_graph=True``."""
    batch, seq = t.valid.shape
    dtype = compute_dtype(hidden, t.old_logp, t.adv)
    cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    flat = torch.where(t.valid.reshape(-1, 1), hidden.reshape(batch * seq, -1), 0.0)
    z = linear(flat, weight, bias).to(cdt)
    z = (z if spec.softcap is None else capped(z, spec.softcap)[0]) / spec.temperature
    tok = t.tokens.reshape(-1, 1)
    if spec.trunc is not None:  # the kept set is piecewise constant: found without a graph
        z = truncate(z, thresholds(z.detach(), spec.trunc), tok, False)
    lp_all = torch.log_softmax(z, dim=-1)
    logp = lp_all.gather(1, tok).view(batch, seq).to(dtype)
    den = "local" if t.normalizer is None else t.normalizer
    scale = loss_scale(t.valid, mode=spec.loss.mode, normalizer=den, max_len=spec.loss.max_len, dtype=dtype)  # type: ignore[arg-type]  # fmt: skip
    per_token = reference_terms(
        spec.loss, logp, t.old_logp, t.adv, t.valid, t.ref_logp, t.is_weights
    )
    loss = scaled_sum(per_token.sum(dim=-1), scale)
    if isinstance(t.coef, Tensor) or t.coef != 0.0:
        floored = lp_all.clamp(min=LOGP_FLOOR)
        ent = -(floored.exp() * floored).sum(dim=-1).view(batch, seq).to(dtype)
        coef = torch.as_tensor(t.coef, dtype=dtype, device=hidden.device)
        loss = loss - coef * scaled_sum(masked(t.valid, ent).sum(dim=-1), scale)
    return loss


class LinearPolicyLoss(torch.autograd.Function):
    """``(loss, logp, entropy)``; the gradients are formed in forward and handed over."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        spec: LinearSpec,
        t: LinearInputs,
    ) -> tuple[Tensor, Tensor, Tensor]:
        need = tuple(bool(n) for n in ctx.needs_input_grad[:3])
        loss, logp, ent, grads = forward_pass(spec, hidden, weight, bias, t, need)  # type: ignore[arg-type]
        ctx.spec, ctx.inputs, ctx.need = spec, t, need
        keep_grads(ctx, hidden, weight, bias, grads)
        ent = logp.new_zeros(0) if ent is None else ent
        ctx.mark_non_differentiable(logp, ent)
        return loss, logp, ent

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return grads_from_forward(
            ctx,
            grad_out,
            lambda h, w, b: reference_loss(ctx.spec, h, w, b, ctx.inputs),
            lambda h, w, b: forward_pass(ctx.spec, h, w, b, ctx.inputs, ctx.need)[3],
        )
