"""Truncated importance sampling between the rollout engine and the trainer."""

from __future__ import annotations

import math
from typing import Literal

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._engine import policy_tensors
from dapo_ops._rules import LOG_RATIO_CLAMP, masked
from dapo_ops._validate import InputError, check_option


def truncated_is_weights(
    old_logp: Float[Tensor, "batch seq"],
    rollout_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    level: Literal["token", "sequence"] = "token",
    cap: float = 2.0,
) -> Float[Tensor, "batch seq"]:
    r"""Detached per-token weights correcting the rollout engine / trainer mismatch.

    The rollout engine (vLLM, SGLang) samples with log-probs ``rollout_logp`` that differ
    from the trainer's ``old_logp`` for the same policy (kernels, precision). Truncated IS
    (TIS) reweights each token's loss by the capped ratio:

    - ``level="token"``: :math:`w_{i,t} = \min(\pi_{old}/\pi_{rollout}, C)` per token;
    - ``level="sequence"``: :math:`w_i = \min(\prod_t \pi_{old}/\pi_{rollout}, C)`, the same
      for every token of the sequence (computed in log space, never overflowing).

    Multiply any per-token surrogate by it before aggregating, or pass it as
    ``token_level_loss(..., is_weights=w)``. The weights are detached (constants) and 0
    at masked positions.

    Shapes: ``[batch, seq]``; returns ``[batch, seq]`` float32 (float64 for float64).

    Defaults: ``cap=2.0`` as in Yao et al. 2025 ("Your efficient RL framework secretly
    brings you off-policy RL training"); verl: ``rollout_is_threshold``.

    Example:
        >>> old = torch.log(torch.tensor([[0.5, 0.9]]))
        >>> roll = torch.log(torch.tensor([[0.25, 0.9]]))
        >>> truncated_is_weights(old, roll, torch.ones(1, 2, dtype=torch.bool))
        tensor([[2., 1.]])
    """
    check_option("level", level, ("token", "sequence"))
    if not (cap > 0 and math.isfinite(cap)):
        raise InputError(f"cap must be finite and > 0, got {cap}")
    _, valid, dtype = policy_tensors(
        old_logp, rollout_logp, None, mask, names=("old_logp", "rollout_logp")
    )
    log_ratio = masked(valid, old_logp.to(dtype) - rollout_logp.to(dtype))
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    if level == "token":
        weight = ratio.clamp(max=cap)
    else:
        seq_log = rearrange(log_ratio.sum(dim=-1), "batch -> batch 1")
        weight = torch.exp(seq_log.clamp(max=math.log(cap))).expand_as(ratio)
    return masked(valid, weight).detach()
