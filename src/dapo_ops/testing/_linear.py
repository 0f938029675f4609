"""Conformance checks of the entry point from hidden states: :func:`dapo_ops.linear_policy_loss`."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._rules import AggregationMode
from dapo_ops.engine._engine import LossSpec, generic_terms
from dapo_ops.engine.aggregation import loss_scale, token_level_aggregate
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.objectives.base import Objective, is_token_local, token_inputs
from dapo_ops.testing._base import (
    F64_RTOL,
    Batch,
    _assert_exact,
    _assert_within,
    _default,
    _name,
    make_batch,
    reference_loss,
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
    from dapo_ops.logprobs.linear_loss import linear_policy_loss

    b = _default(objective, batch, torch.float64)
    g = torch.Generator().manual_seed(7)
    n, seq = b.logp.shape
    hidden = torch.randn(n, seq, 5, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, 5, generator=g, dtype=torch.float64)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    noise = 0.3 * torch.randn(n, seq, generator=g, dtype=torch.float64)
    ref = -(b.logp.double() + noise).abs()  # reflected at 0: log-probs
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


def check_token_local(objective: Objective) -> None:
    """A class that declares ``token_local = True`` (so :func:`dapo_ops.linear_policy_loss`
    cuts its sequences anywhere) gives on a ``[tokens, 1]`` layout the very per-token
    values and gradients of the ``[batch, seq]`` one, bit for bit: nothing reduces over a
    row. A class that does not declare it is chunked by whole sequences: nothing to check."""
    if not is_token_local(objective):
        return
    b = make_batch(
        objective, 4, 7, seed=3, dtype=torch.float32, spread=0.5, per_token_advantages=True
    )
    valid, adv = b.mask, b.advantages
    spec = LossSpec(objective)
    scale = loss_scale(valid, mode="seq_mean_token_mean")
    rows, grad = generic_terms(spec, b.logp, b.old_logp, adv, valid, scale, None, None, True)

    def col(x: Tensor) -> Tensor:
        return x.expand(valid.shape).reshape(-1, 1)

    flat_rows, flat_grad = generic_terms(
        spec, col(b.logp), col(b.old_logp), col(adv), col(valid), col(scale), None, None, True
    )
    what = f"{_name(objective)} declares token_local"
    assert grad is not None and flat_grad is not None
    _assert_exact(
        flat_grad.view(valid.shape), grad, f"{what}: gradient per token", signed_zeros=True
    )
    _assert_exact(
        torch.where(valid, flat_rows.view(valid.shape), 0.0).sum(-1), rows, f"{what}: row sums"
    )
    x = token_inputs(objective, b.logp, b.old_logp, adv, valid, torch.float32, reference=False)
    flat_x = token_inputs(
        objective, col(b.logp), col(b.old_logp), col(adv), col(valid), torch.float32,
        reference=False,
    )  # fmt: skip
    term = torch.where(valid, objective.term(x), 0.0)
    flat_term = torch.where(valid, objective.term(flat_x).view(valid.shape), 0.0)
    _assert_exact(flat_term, term, f"{what}: term")
