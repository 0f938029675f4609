"""Hypothesis strategies: shapes and seeds are drawn, tensors are made from the seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass
class PolicyBatch:
    logp: torch.Tensor  # [batch, seq]
    old_logp: torch.Tensor
    advantages: torch.Tensor  # [batch]
    mask: torch.Tensor  # bool [batch, seq]


def make_batch(
    batch: int, seq: int, seed: int, *, dtype: torch.dtype = torch.float32, spread: float = 0.5
) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq, generator=g, dtype=torch.float64) * 4 - 0.01
    logp = old + torch.randn(batch, seq, generator=g, dtype=torch.float64) * spread
    # log-probs are <= 0 (checked mode checks it): where logp > -0.01, move both down to
    # logp = -0.01 (a margin for gradcheck's steps), which keeps the log-ratio (large
    # positive ones included)
    shift = (logp + 0.01).clamp(min=0.0)
    logp, old = logp - shift, old - shift
    adv = torch.randn(batch, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq) < lengths[:, None]
    return PolicyBatch(logp.to(dtype), old.to(dtype), adv.to(dtype), mask)


def projection_leaves(
    g: torch.Generator, rows: tuple[int, ...], dim: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 hidden states ``[*rows, dim]``, weight ``[vocab, dim]`` and bias ``[vocab]``
    that require grad, and token ids ``[*rows]``, drawn from ``g`` in that order."""
    hidden = torch.randn(*rows, dim, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True)
    return hidden, weight, bias, torch.randint(0, vocab, rows, generator=g)


@st.composite
def policy_batches(draw: st.DrawFn, max_batch: int = 6, max_seq: int = 24) -> PolicyBatch:
    batch = draw(st.integers(1, max_batch))
    seq = draw(st.integers(1, max_seq))
    seed = draw(st.integers(0, 2**31 - 1))
    spread = draw(st.sampled_from([0.01, 0.2, 0.5, 2.0]))
    return make_batch(batch, seq, seed, spread=spread)


MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
