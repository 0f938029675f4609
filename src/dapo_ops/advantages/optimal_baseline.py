"""The optimal token baseline (OTB): a per-position, variance-weighted group baseline.

:func:`optimal_token_baseline_advantages` is verl 0.9.1's ``optimal_token_baseline`` and
(with ``align="response_token"``) its ``tir_optimal_token_baseline`` estimator, vectorised:
one pass over the batch with segment sums over the groups, no Python loop over samples or
groups and no host sync (the zero-tail rule is a comparison of tensors, not a read of the
lengths). The other token-level estimators are in :mod:`dapo_ops.advantages.returns`.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._groups import segment_reduce, segment_sum, segments
from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_bool,
    check_float,
    check_ndim,
    check_option,
    check_real,
    check_same_device,
    check_same_shape,
    check_tensor,
    shape_str,
)

OTBAlign = Literal["position", "response_token"]
OTB_ALIGNS: tuple[str, ...] = ("position", "response_token")


def _compact(valid: Tensor, *rows: Tensor) -> tuple[list[Tensor], Tensor, Tensor]:
    """Each row's valid entries moved to the front, in order (the k-th valid token at k),
    0 behind them; also the compacted mask and each valid token's slot ``k``."""
    seq = valid.shape[1]
    rank = valid.long().cumsum(dim=-1) - 1
    slot = torch.where(valid, rank, seq)  # masked entries go to a dropped extra column
    out = []
    for x in rows:
        wide = x.new_zeros(x.shape[0], seq + 1).scatter_(1, slot, masked(valid, x))
        out.append(wide[:, :seq])
    lengths = valid.sum(dim=-1, keepdim=True)
    front = torch.arange(seq, device=valid.device) < lengths
    return out, front, rank.clamp(min=0)


@checks_values
def optimal_token_baseline_advantages(
    rewards: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    sum_pi_squared: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    group_ids: Integer[Tensor, " batch"],
    *,
    is_weights: Float[Tensor, "batch seq"] | None = None,
    align: OTBAlign = "position",
    zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[Float[Tensor, "batch seq"], Float[Tensor, "batch seq"]]:
    r"""The optimal token baseline: reward-to-go minus a variance-weighted group mean per step.

    .. math::

        G_{i,t} = \sum_{t' \ge t} m_{i,t'} r_{i,t'},\qquad
        W_{i,t} = \sum_{t' \le t} m_{i,t'}\,\rho_{i,t'}^2\,
            \big(1 - 2\pi_{i,t'} + \textstyle\sum_a \pi_{i,t'}(a)^2\big),

        B_{g,t} = \frac{\sum_{i \in g} m_{i,t} G_{i,t} W_{i,t}}
            {\sum_{i \in g} m_{i,t} W_{i,t} + \epsilon},\qquad
        A_{i,t} = m_{i,t}\,(G_{i,t} - B_{g(i),t})

    :math:`1 - 2\pi_t + \sum_a\pi_t(a)^2 = \lVert e_{y_t} - \pi_t\rVert^2` is the squared
    norm of the score of the sampled token's logits, and :math:`W` its running sum: the
    baseline that minimises the gradient's variance weights each sample's return by it
    (verl's "Optimal Token Baseline"). :math:`\pi_t = e^{\text{old\_logp}}` is the
    sampled token's probability under the rollout policy, ``sum_pi_squared`` its
    :math:`\sum_a \pi_t(a)^2` (``torch.softmax(logits, -1).square().sum(-1)``),
    :math:`\rho` the rollout IS weights ``is_weights`` (1 when not given). A group of one
    sample has baseline 0 (its advantage is its return).

    ``align``: ``"position"`` compares the samples of a group at the same position ``t``
    (verl's ``optimal_token_baseline``); ``"response_token"`` at the same index among each
    response's valid tokens, so masked tokens inside a response (tool outputs of a
    multi-turn rollout) are skipped, and responses with no valid token are left out of
    their group (verl's ``tir_optimal_token_baseline``). ``zero_tail``: where a group has
    one longest response, its baseline is 0 from the length of the second longest on (no
    other sample to compare with there); verl's ``handle_zero_tail``. Lengths count valid
    tokens; the tail starts at that count, a position (``"position"``) or a slot
    (``"response_token"``).

    Returns ``(advantages, returns)``: ``advantages`` 0 at masked positions, ``returns``
    :math:`G` (at a masked position the return of the next valid token, as verl's).
    Masked entries of every input are ignored, whatever they hold. A non-finite value at a
    valid position propagates: a reward to its row's advantages up to it, a variance
    weight (``old_logp``, ``sum_pi_squared``, ``is_weights``) to its group's baselines from
    its slot on, except where the baseline is 0 (a one-sample group, the zero tail), which
    it does not enter. Computed in float32 (float64 if any input is float64); no host sync.

    Shapes: ``rewards``, ``old_logp``, ``sum_pi_squared``, ``mask``, ``is_weights``
    ``[batch, seq]``; ``group_ids`` ``[batch]`` integer (verl's ``uid``, any order).

    Defaults: ``zero_tail=True`` and ``eps=1e-8`` are verl's (``handle_zero_tail``,
    ``epsilon``).

    Paper: Li et al. 2026, "The Optimal Token Baseline: Variance Reduction for Long-Horizon
    LLM-RL" (arXiv:2602.07078).

    Example:
        >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
        >>> old = torch.log(torch.full((2, 2), 0.5))
        >>> adv, ret = optimal_token_baseline_advantages(
        ...     r, old, torch.full((2, 2), 0.5), torch.ones(2, 2, dtype=torch.bool),
        ...     torch.tensor([0, 0]))
        >>> adv
        tensor([[ 0.5000,  0.5000],
                [-0.5000, -0.5000]])
    """
    check_option("align", align, OTB_ALIGNS)
    check_bool("zero_tail", zero_tail)
    eps = check_real("eps", eps)
    if eps < 0:
        raise InputError(f"eps must be >= 0, got {eps}")
    check_float("rewards", rewards)
    check_ndim("rewards", rewards, 2, "[batch, seq]")
    extra = [("old_logp", old_logp), ("sum_pi_squared", sum_pi_squared)]
    if is_weights is not None:
        extra.append(("is_weights", is_weights))
    for name, t in extra:
        check_float(name, t)
        check_same_shape(name, t, "rewards", rewards)
        check_same_device(name, t, "rewards", rewards)
    valid = as_bool_mask("mask", mask, "rewards", rewards)
    check_tensor("group_ids", group_ids)
    if group_ids.shape != rewards.shape[:1]:
        raise InputError(
            f"group_ids must have shape [batch]=[{rewards.shape[0]}] (one id per row of "
            f"rewards {shape_str(rewards)}), got {shape_str(group_ids)}"
        )
    seg = segments("rewards", rewards.new_zeros(rewards.shape[0]), group_ids)
    dtype = compute_dtype(rewards, *(t for _, t in extra))

    r = masked(valid, rewards.to(dtype))
    returns = r.flip(-1).cumsum(dim=-1).flip(-1)
    w = 1 - 2 * old_logp.to(dtype).exp() + sum_pi_squared.to(dtype)
    if is_weights is not None:
        w = w * is_weights.to(dtype) ** 2
    w_cum = masked(valid, w).cumsum(dim=-1)
    lengths = valid.sum(dim=-1)
    if align == "position":
        g, big_w, slots, rank = returns, w_cum, valid, None
        member = torch.ones_like(lengths, dtype=torch.bool)
    else:
        (g, big_w), slots, rank = _compact(valid, returns, w_cum)
        member = lengths > 0

    num = g.new_zeros(seg.num_slots, g.shape[1]).index_add_(
        0, seg.segment, masked(slots, g * big_w)
    )
    den = torch.zeros_like(num).index_add_(0, seg.segment, masked(slots, big_w))
    base = (num / (den + eps))[seg.segment]
    count = segment_sum(seg, member.to(dtype))[seg.segment]
    base = torch.where((count >= 2)[:, None], base, 0.0)
    if zero_tail:
        own = torch.where(member, lengths, -1)
        longest = segment_reduce(seg, own, "amax")[seg.segment]
        at_max = member & (own == longest)
        n_longest = segment_sum(seg, at_max.to(dtype))[seg.segment]
        second = segment_reduce(seg, torch.where(member & ~at_max, own, -1), "amax")
        start = second[seg.segment]
        tail_row = at_max & (n_longest == 1) & (count >= 2)
        position = torch.arange(g.shape[1], device=g.device)
        base = torch.where(tail_row[:, None] & (position >= start[:, None]), 0.0, base)
    adv = masked(slots, g - base)
    if rank is not None:  # back from each response's slots to its positions
        adv = adv.gather(1, rank)
    return masked(valid, adv), returns
