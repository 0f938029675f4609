"""Inputs shared by the suites: a loss micro-batch and the fwd / fwd+bwd wrappers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.harness import Fn


@dataclass
class LossInputs:
    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor  # [B, 1]
    mask: torch.Tensor  # bool
    ref: torch.Tensor  # reference-policy log-probs (KL cases)
    is_weights: torch.Tensor  # rollout IS weights (IS cases)


def loss_inputs(
    batch: int, seq: int, device: str, dtype: torch.dtype = torch.float32
) -> LossInputs:
    """Log-probs of a micro-batch: old = current + N(0, 0.2^2), lengths uniform in
    [seq/8, seq], zeros in the padding (as trainers' buffers hold), IS weights in [0, 2)."""
    g = torch.Generator().manual_seed(batch * 100_003 + seq)
    old = -torch.rand(batch, seq, generator=g) * 4 - 0.01
    logp = old + torch.randn(batch, seq, generator=g) * 0.2
    ref = old + torch.randn(batch, seq, generator=g) * 0.1
    adv = torch.randn(batch, 1, generator=g)
    is_weights = torch.rand(batch, seq, generator=g) * 2
    lengths = torch.randint(seq // 8, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq) < lengths[:, None]
    logp, old, ref = (torch.where(mask, t, 0.0) for t in (logp, old, ref))
    return LossInputs(
        logp.to(device, dtype),
        old.to(device, dtype),
        adv.to(device),
        mask.to(device),
        ref.to(device, dtype),
        is_weights.to(device, dtype),
    )


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def fwd_bwd(loss_of: Callable[[torch.Tensor], torch.Tensor], logp: torch.Tensor) -> Fn:
    lp = leaf(logp)

    def run() -> object:
        loss_of(lp).backward()  # type: ignore[no-untyped-call]
        lp.grad = None
        return None

    return run


def fwd(loss_of: Callable[[torch.Tensor], torch.Tensor], logp: torch.Tensor) -> Fn:
    lp = leaf(logp)
    return lambda: loss_of(lp)
