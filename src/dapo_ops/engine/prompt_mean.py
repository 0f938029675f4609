r"""SkyRL's ``prompt_mean`` aggregation: every prompt (group of samples) weighs the same.

With :math:`g(i)` the prompt of sequence :math:`i`, :math:`T_p = \sum_{i: g(i)=p}\sum_t
m_{i,t}` the valid tokens of prompt :math:`p` and :math:`P = |\{p : T_p > 0\}|`:

.. math::

    L = \frac{1}{P}\sum_{p: T_p > 0} \frac{1}{T_p}\sum_{i: g(i)=p}\sum_t m_{i,t}\,\ell_{i,t}
      = \sum_{i,t} w_i\, m_{i,t}\,\ell_{i,t}, \qquad w_i = \frac{1}{P\,T_{g(i)}}

the token mean inside each prompt, then the mean over prompts: a prompt answered by long
samples weighs as much as one answered by short ones, and inside a prompt every token
weighs the same (``token_mean`` weighs prompts by their token count, ``seq_mean_*`` by
their sample count).
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._groups import check_groups, group_each, group_sum, groups_of
from dapo_ops._core._rules import Normalizer, compute_dtype, masked
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_float,
    check_ndim,
    check_tensor,
)
from dapo_ops.engine.checks import normalizer_tensor

__all__ = ["prompt_mean_aggregate", "prompt_mean_weights"]


@checks_values
def prompt_mean_weights(
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    group_ids: Integer[Tensor, " batch"],
    *,
    num_prompts: Normalizer = None,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, "batch 1"]:
    r"""The per-sequence weights :math:`w_i = 1 / (P\,T_{g(i)})` of ``prompt_mean``.

    ``sum_{i,t} w_i m_{i,t} l_{i,t}`` is :func:`prompt_mean_aggregate` of ``l``; compute
    the weights once over the whole optimiser step (all its rows on this rank), then each
    micro-batch's share is the plain masked sum of its rows,
    ``token_level_aggregate(l_mb * w_mb, mask_mb, normalizer=1)``, and the shares add
    up to the step's loss exactly, even when a prompt's samples fall into different
    micro-batches. A sequence of a prompt with no valid token gets weight 0 (it is not a
    prompt: SkyRL's padding rows).

    ``num_prompts`` replaces :math:`P` (the prompts with at least one valid token among
    these rows) by a global count, as ``normalizer=`` does for the other modes: the
    prompts of the step across ranks, times the world size under DDP's gradient
    averaging. ``None`` is this call's own count, refused under a multi-rank
    ``torch.distributed`` unless ``num_prompts="local"`` says so (SkyRL normalises each
    rank's slice of the step by its own prompts: that is ``"local"``).

    Shapes: mask ``[batch, seq]`` (bool or 0/1 integers); group_ids ``[batch]`` integers
    (verl's / SkyRL's ``uid``: any values, in any order, groups of any size). Returns
    ``[batch, 1]`` in ``dtype`` (float32 by default; float64 for float64 losses). Not
    differentiable (a function of the mask).

    Defaults: the definition of SkyRL's ``loss_reduction="prompt_mean"`` (which applies
    ``w_i`` to the advantages before a summed loss); no SkyRL release on the package
    index has it (0.3.1 does not), so it is tested against the definition and the
    example of SkyRL's own test (4.25: :func:`prompt_mean_aggregate`'s example).

    Example:
        >>> mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
        >>> prompt_mean_weights(mask, torch.tensor([0, 0, 1, 1])).flatten()
        tensor([0.1667, 0.1667, 0.1250, 0.1250])
    """
    check_tensor("mask", mask)
    check_ndim("mask", mask, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "mask", mask)
    check_groups("mask rows", valid.any(dim=-1), group_ids)
    if dtype not in (torch.float32, torch.float64):
        raise InputError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    den = normalizer_tensor(num_prompts, dtype, valid.device, "num_prompts")
    tokens = valid.sum(dim=-1).to(dtype)
    groups = groups_of(tokens, group_ids)
    per_prompt = group_sum(groups, tokens)
    if den is None:
        den = (per_prompt > 0).sum().to(dtype)
    one = torch.ones((), dtype=dtype, device=valid.device)
    (prompt_tokens,) = group_each(groups, per_prompt)
    live = prompt_tokens > 0  # the rows of a prompt with a valid token
    share = one / (torch.where(den == 0, one, den) * torch.where(live, prompt_tokens, one))
    weights = torch.where(live, share, torch.zeros((), dtype=dtype, device=valid.device))
    return rearrange(weights, "batch -> batch 1")


@checks_values
def prompt_mean_aggregate(
    per_token_loss: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    group_ids: Integer[Tensor, " batch"],
    *,
    num_prompts: Normalizer = None,
) -> Float[Tensor, ""]:
    r"""SkyRL's ``prompt_mean``: the token mean inside each prompt, averaged over prompts.

    :math:`L = \frac{1}{P}\sum_p \frac{1}{T_p}\sum_{i\in p}\sum_t m_{i,t}\ell_{i,t}`
    (module docstring), i.e. ``sum_{i,t} w_i m l`` with the weights of
    :func:`prompt_mean_weights` (``num_prompts`` as there). Masked positions never reach
    the value or the gradient, whatever they hold; no valid token gives 0, never NaN.
    Feed it any per-token loss: :func:`dapo_ops.per_token_loss` of an objective, plus
    :func:`dapo_ops.kl_penalty`'s per-token term if there is one.

    Micro-batches: when each micro-batch holds whole prompts, pass the step's prompt
    count as ``num_prompts`` and the micro-batch losses add up to the step's loss;
    otherwise use :func:`prompt_mean_weights` over the whole step (see there).

    Shapes: per_token_loss ``[batch, seq]``, mask ``[batch, seq]``, group_ids
    ``[batch]``; returns a 0-dim float32 tensor (float64 for float64 input).

    Example:
        >>> loss = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
        >>> mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
        >>> prompt_mean_aggregate(loss, mask, torch.tensor([0, 0, 1, 1]))  # (2 + 6.5) / 2
        tensor(4.2500)
    """
    check_float("per_token_loss", per_token_loss)
    check_ndim("per_token_loss", per_token_loss, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "per_token_loss", per_token_loss)
    dtype = compute_dtype(per_token_loss)
    weights = prompt_mean_weights(valid, group_ids, num_prompts=num_prompts, dtype=dtype)
    row_sums = masked(valid, per_token_loss.to(dtype)).sum(dim=-1)
    return (row_sums * rearrange(weights, "batch 1 -> batch")).sum()
