"""The per-token inputs every loss-path function takes, checked once: ``logp``,
``old_logp`` (or ``ref_logp``), ``advantages`` and ``mask``.

Shared by the engine, the KL penalty, rollout correction and the diagnostics; metadata
only (shapes, dtypes, devices), no host sync.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor

from dapo_ops._core._rules import compute_dtype
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_float,
    check_ndim,
    check_same_shape,
    shape_str,
)


def policy_tensors(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor | None,
    mask: Tensor | None,
    *,
    names: tuple[str, str] = ("logp", "old_logp"),
    per_sequence: bool = False,
) -> tuple[Tensor, Tensor, torch.dtype]:
    """Check the per-token inputs; return advantages as ``[batch, 1|seq]``, the bool mask
    and the compute dtype. Metadata only: no host sync, compile-friendly."""
    name, old_name = names
    check_float(name, logp)
    check_float(old_name, old_logp)
    if logp.ndim == 3:
        raise InputError(
            f"{name} must have shape [batch, seq], got {shape_str(logp)}: this looks like "
            "logits [batch, seq, vocab]; take the sampled tokens' log-probs first with "
            "dapo_ops.token_logprobs(logits, tokens)"
        )
    check_ndim(name, logp, 2, "[batch, seq]")
    check_same_shape(old_name, old_logp, name, logp)
    batch, seq = logp.shape
    if advantages is None:  # ratio-only callers (KL, IS weights, GSPO's sequence ratio)
        adv = logp.new_zeros(0, 0)
    else:
        check_float("advantages", advantages)
        if advantages.ndim == 1 and advantages.shape[0] == batch:
            adv = rearrange(advantages, "batch -> batch 1")
        elif (
            advantages.ndim == 2
            and advantages.shape[0] == batch
            and advantages.shape[1] in ((1,) if per_sequence else (1, seq))
        ):
            adv = advantages
        else:
            allowed = "" if per_sequence else f" or [batch, seq]=[{batch}, {seq}]"
            raise InputError(
                f"advantages must have shape [batch]=[{batch}] or [batch, 1]=[{batch}, 1]"
                f"{allowed} to match {name} {shape_str(logp)}; got {shape_str(advantages)}"
                + (" (this objective's ratio is per sequence)" if per_sequence else "")
            )
    valid = (
        torch.ones_like(logp, dtype=torch.bool)
        if mask is None
        else as_bool_mask("mask", mask, name, logp)
    )
    return adv, valid, compute_dtype(logp, old_logp, adv)
