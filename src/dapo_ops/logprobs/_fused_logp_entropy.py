"""``fused_logprobs_entropy``'s autograd function: log-probs and entropies from the hidden
states and the output projection, chunk by chunk (the chunks of
:mod:`dapo_ops.logprobs._fused_linear`), with the logits formed again in the backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from dapo_ops.logprobs._fused_linear import Chunks, Grads, chunks_for, grads_for, linear
from dapo_ops.logprobs._softcap import grad_through_cap
from dapo_ops.logprobs._softmax_blocks import grad_with_graph
from dapo_ops.logprobs._truncation import Truncation


class FusedLinearLogpEntropy(torch.autograd.Function):
    """(logp, entropy) from hidden states and the output projection, chunk by chunk; the
    backward forms each chunk's logits again (4 matmuls in all)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        temperature: float,
        chunk: int,
        trunc: Truncation | None = None,
        softcap: float | None = None,
    ) -> tuple[Tensor, Tensor]:
        chunks = chunks_for(hidden, weight, bias, chunk, temperature, trunc, softcap)
        tok = tokens.unsqueeze(1)
        logp, entropy, taus = [], [], []
        for start, stop in chunks.spans():
            lp, tau = chunks.kept_log_softmax(hidden[start:stop], tok[start:stop], None)
            logp.append(lp.gather(1, tok[start:stop]).squeeze(1))
            entropy.append(chunks.entropy(chunks.floor_(lp)))
            if tau is not None:  # the kept sets' thresholds, for the backward
                taus.append(tau)
        empty = hidden.new_zeros(0, dtype=chunks.cdt)
        lp_all, ent_all = torch.cat(logp) if logp else empty, torch.cat(entropy) if logp else empty
        tau_all = torch.cat(taus) if taus else empty
        ctx.save_for_backward(hidden, weight, bias, tokens, ent_all, tau_all)  # type: ignore[arg-type]
        ctx.temperature, ctx.chunk, ctx.trunc = temperature, chunk, trunc  # type: ignore[attr-defined]
        ctx.softcap = softcap  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        return lp_all, ent_all

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, tokens, entropy, tau = ctx.saved_tensors
        tau = None if ctx.trunc is None else tau
        need = tuple(ctx.needs_input_grad[:3])
        if not any(need) or (grad_logp is None and grad_entropy is None):
            return (None,) * 8
        cdt = entropy.dtype
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate
            g = grad_through_cap(linear(hidden, weight, bias), ctx.softcap, cdt, lambda z: grad_with_graph(z, tokens, grad_logp, grad_entropy, ctx.temperature, cdt, tau))  # fmt: skip
            dtype = hidden.dtype
            return (
                (g.to(dtype) @ weight) if need[0] else None,
                (g.T @ hidden.to(cdt)).to(dtype) if need[1] else None,
                g.sum(dim=0).to(dtype) if need[2] else None,
                *(None,) * 5,
            )
        with torch.no_grad():
            chunks = chunks_for(
                hidden, weight, bias, ctx.chunk, ctx.temperature, ctx.trunc, ctx.softcap
            )
            grads = grads_for(chunks, hidden, need)
            a = None if grad_logp is None else grad_logp.to(cdt)
            b = None if grad_entropy is None else grad_entropy.to(cdt)
            tok = tokens.unsqueeze(1)
            for s, e in chunks.spans():
                _backward_chunk(chunks, grads, hidden, tok, a, b, entropy, tau, s, e)
            chunks.release()
            return (*grads.result(), *(None,) * 5)


def _backward_chunk(
    chunks: Chunks,
    grads: Grads,
    hidden: Tensor,
    tok: Tensor,
    a: Tensor | None,
    b: Tensor | None,
    entropy: Tensor,
    tau: Tensor | None,
    s: int,
    e: int,
) -> None:
    """One chunk of the backward: its logits again, ``G``, the three gradients' shares (a
    function of its own, so that no view of the chunk buffer outlives it)."""
    h = hidden[s:e]
    lp, _ = chunks.kept_log_softmax(h, tok[s:e], None if tau is None else tau[s:e])
    if b is not None:
        lp = chunks.floor_(lp)
    g = chunks.grad_(
        lp,
        tok[s:e],
        None if a is None else a[s:e],
        None if b is None else b[s:e],
        None if b is None else entropy[s:e],
    )
    grads.add(g, h, s, e)
