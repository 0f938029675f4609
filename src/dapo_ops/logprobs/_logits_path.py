"""The from-logits path: ``(logp, entropy)`` of a logits tensor, one block of rows at a time.

Private; the public functions are :func:`dapo_ops.token_logprobs`,
:func:`dapo_ops.token_entropy` and :func:`dapo_ops.token_logprobs_and_entropy`. Autograd
keeps only a reference to the logits (plus the per-row log-sum-exp and entropy when the
entropy is computed); backward recomputes each block's softmax inside the gradient buffer
(:func:`dapo_ops.logprobs._softmax_blocks.block_grad`), or inside the logits buffer itself with
``inplace_backward=True``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from dapo_ops._core._validate import InputError, shape_str
from dapo_ops.logprobs._logprob_checks import (
    auto_chunk,
    check_logits,
    check_options,
    check_tokens,
    compute_dtype,
    may_overlap,
)
from dapo_ops.logprobs._softmax_blocks import (
    DEFAULT_CHUNK_ELEMENTS,
    block_forward,
    block_grad,
    blocks,
    coef_rows,
    grad_with_graph,
    row_coefs,
)
from dapo_ops.logprobs._truncation import Truncation, truncation


class LogitsLogpEntropy(torch.autograd.Function):
    """(logp, entropy) from logits, one block of rows at a time; see token_logprobs."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: Tensor,
        tokens: Tensor | None,
        temperature: float,
        chunk: int,
        want_entropy: bool,
        inplace: bool,
        trunc: Truncation | None,
    ) -> tuple[Tensor, Tensor]:
        cdt = compute_dtype(logits.dtype)
        rows = logits.numel() // logits.shape[-1]
        # lse and entropy feed the entropy gradient only; log-probs alone need neither
        lse = logits.new_empty(rows if want_entropy else 0, dtype=cdt)
        logp = logits.new_empty(rows if tokens is not None else 0, dtype=cdt)
        entropy = logits.new_empty(rows if want_entropy else 0, dtype=cdt)
        tau = logits.new_empty(rows if trunc is not None else 0, dtype=cdt)
        for start, stop, block in blocks(logits, chunk):
            tok = None if tokens is None else tokens[start:stop]
            b_lse, b_logp, b_ent, b_tau = block_forward(
                block, False, tok, temperature, cdt, want_entropy, trunc
            )
            if b_tau is not None:
                tau[start:stop] = b_tau
            if b_lse is not None:
                lse[start:stop] = b_lse
            if b_logp is not None:
                logp[start:stop] = b_logp
            if b_ent is not None:
                entropy[start:stop] = b_ent
        ctx.save_for_backward(logits, tokens, lse, entropy, tau)  # type: ignore[arg-type]
        ctx.truncated = trunc is not None  # type: ignore[attr-defined]
        ctx.temperature = temperature  # type: ignore[attr-defined]
        ctx.chunk = chunk  # type: ignore[attr-defined]
        ctx.inplace = inplace  # type: ignore[attr-defined]
        ctx.want_entropy = want_entropy  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)
        if tokens is None:
            ctx.mark_non_differentiable(logp)
        if not want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, tokens, lse, entropy, tau = ctx.saved_tensors
        tau = tau if ctx.truncated else None
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        if tokens is None:
            grad_logp = None
        if not ctx.want_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 7
        if torch.is_grad_enabled():  # create_graph=True: a gradient autograd can differentiate
            vocab = logits.shape[-1]
            grad = grad_with_graph(
                logits.reshape(-1, vocab),
                tokens,
                grad_logp,
                grad_entropy,
                ctx.temperature,
                lse.dtype,
                tau,
            )
            return grad.to(logits.dtype).reshape(logits.shape), *(None,) * 6
        with torch.no_grad():
            return LogitsLogpEntropy._chunked_backward(
                ctx, logits, tokens, lse, entropy, tau, grad_logp, grad_entropy
            )

    @staticmethod
    def _chunked_backward(
        ctx: Any,
        logits: Tensor,
        tokens: Tensor | None,
        lse: Tensor,
        entropy: Tensor,
        tau: Tensor | None,
        grad_logp: Tensor | None,
        grad_entropy: Tensor | None,
    ) -> tuple[Tensor | None, ...]:
        coefs = row_coefs(grad_logp, grad_entropy, entropy, ctx.temperature, lse.dtype)
        tok_col = None if tokens is None else tokens.unsqueeze(1)
        lse_col = lse.unsqueeze(1) if coefs.neg_b is not None else None
        # In place: each piece is read (recomputed) before its gradient overwrites it, and
        # pieces do not overlap, so the buffer can hold the gradient.
        if ctx.inplace:
            grad = logits
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            flat_grad = grad.view(-1, logits.shape[-1])
        for start, stop, block in blocks(logits, ctx.chunk):
            block_grad(
                block,
                block if ctx.inplace else flat_grad[start:stop],
                None if tok_col is None else tok_col[start:stop],
                None if lse_col is None else lse_col[start:stop],
                coef_rows(coefs, start, stop),
                ctx.temperature,
                lse.dtype,
                None if tau is None else tau[start:stop],
            )
        return grad, *(None,) * 6


def from_logits(
    logits: Tensor,
    tokens: Tensor | None,
    temperature: float,
    chunk_size: int | None,
    want_entropy: bool,
    inplace_backward: bool,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[Tensor, Tensor]:
    logits = check_logits(logits)
    check_options(temperature, chunk_size)
    trunc = truncation(top_k, top_p, min_p)
    if not isinstance(inplace_backward, bool):
        raise InputError(f"inplace_backward must be a bool, got {inplace_backward!r}")
    if inplace_backward and may_overlap(logits):
        raise InputError(
            f"inplace_backward=True needs logits whose elements each have their own memory, "
            f"got a view with strides {tuple(logits.stride())} for shape {shape_str(logits)} "
            "(an expand()-ed tensor): its gradient cannot be written into it. Pass "
            "inplace_backward=False, or logits.contiguous()"
        )
    vocab = logits.shape[-1]
    rows_shape = logits.shape[:-1]
    flat_tokens = None
    if tokens is not None:
        tokens = check_tokens(tokens, rows_shape, f"logits {shape_str(logits)}", vocab)
        if tokens.device != logits.device:
            raise InputError(
                f"tokens is on {tokens.device} but logits is on {logits.device}; "
                "they must be on the same device"
            )
        flat_tokens = tokens.reshape(-1).to(torch.int64)
    chunk = auto_chunk(chunk_size, vocab, logits.device, DEFAULT_CHUNK_ELEMENTS)
    logp, entropy = LogitsLogpEntropy.apply(  # type: ignore[no-untyped-call]
        logits, flat_tokens, float(temperature), chunk, want_entropy, inplace_backward, trunc
    )
    return logp.view(rows_shape) if tokens is not None else logp, (
        entropy.view(rows_shape) if want_entropy else entropy
    )
