"""M2PO's second-moment token mask: drop the most off-policy tokens until the rest agree.

M2PO ("Fixing Off-Policy Problems in RL for LLMs: Second-Moment Trust Policy
Optimization", Zheng et al. 2025, arXiv 2510.01161) bounds the second moment of the token
log-ratio, :math:`M_2 = \\mathbb{E}[(\\log r)^2]`, by masking the tokens whose
:math:`(\\log r)^2` is largest, instead of clipping every token's ratio. Peer: AReaL's
``m2_threshold`` (``areal/engine/ppo/actor.py``: ``_apply_m2po_masking`` and
``_get_m2po_loss_mask``), whose selection rule this module reproduces, vectorised and with
no host sync.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._validate import InputError
from dapo_ops.correction.cov_masks import _rank


@checks_values
def m2po_mask(
    old_logp: Float[Tensor, "batch seq"],
    rollout_logp: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    threshold: float = 0.04,
) -> Bool[Tensor, "batch seq"]:
    r"""The valid tokens M2PO keeps: all but the largest :math:`(\log r)^2`, until
    the mean of the rest is below ``threshold``.

    With :math:`m_t = (\log\pi_{old} - \log\pi_{rollout})^2` over the :math:`n` valid
    tokens of the whole batch, sorted so that :math:`m_{(1)} \ge \dots \ge m_{(n)}`:

    .. math::

        k = \min\Big\{ i \ge 0 : \tfrac{1}{n - i} \textstyle\sum_{j > i} m_{(j)}
            < \tau_M \Big\}, \qquad \text{(} k = n - 1 \text{ if there is none)}

    and the :math:`k` tokens :math:`m_{(1)}, \dots, m_{(k)}` are masked: the second moment
    of the kept tokens is then below :math:`\tau_M` = ``threshold``, with the fewest tokens
    dropped. When even the smallest :math:`m` alone is not below it, every token but the
    smallest is dropped (at least one is always kept), as AReaL does. Ties in :math:`m`
    are broken by position (row-major: the earlier token is dropped first; AReaL's sort
    leaves that order unspecified). A NaN or infinite log-ratio ranks as the largest and
    is dropped.

    ``old_logp`` is the policy the loss's ratio is taken against (AReaL: its proximal
    policy), ``rollout_logp`` the policy that sampled the tokens (AReaL: the behaviour
    policy); the mask is symmetric in the two. Use the result as the loss mask: AReaL
    replaces its loss mask by it, so the dropped tokens leave the denominator too.

    The selection depends on every valid token the call sees (one threshold over the
    batch), so, like Clip-Cov, a loss built on it is not invariant to how a mini-batch is
    split into micro-batches: AReaL applies it per micro-batch, inside its loss function.

    Shapes: ``[batch, seq]``; returns bool ``[batch, seq]``, False at masked positions.
    Computed in float32 (float64 stays float64), with no host sync (one sort).

    Defaults: ``threshold=0.04``, the second-moment budget :math:`\tau_M` of the M2PO
    authors' own training scripts (Zheng et al. 2025, Infini-AI-Lab/M2PO,
    ``M2_budget=0.04`` at every staleness they report); AReaL has no default (its
    ``m2_threshold=None`` switches M2PO off). It must be finite and > 0.

    Example:
        >>> old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
        >>> roll = torch.tensor([[-0.95, -1.1, 0.0, -1.0]])
        >>> m2po_mask(old, roll, torch.ones(1, 4, dtype=torch.bool), threshold=0.04)
        tensor([[ True,  True, False,  True]])
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise InputError(f"threshold must be a number, got {threshold!r}")
    if not 0.0 < threshold < math.inf:
        raise InputError(f"threshold must be finite and > 0, got {threshold}")
    _, valid, dtype = policy_tensors(
        old_logp, rollout_logp, None, mask, names=("old_logp", "rollout_logp")
    )
    if valid.numel() == 0:
        return valid
    delta = old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    m2 = torch.where(torch.isnan(delta), torch.inf, delta.square())  # NaN ranks largest
    # Valid tokens first, in descending m2 (ties by position); masked ones last (key -1).
    rank = _rank(torch.where(valid, m2, -1.0), descending=True).reshape(-1)
    flat_valid = valid.reshape(-1)
    ordered = torch.zeros_like(m2.reshape(-1)).scatter(
        0, rank, torch.where(flat_valid, m2.reshape(-1), 0.0)
    )
    n = flat_valid.sum()
    # mean of the sorted tail from i (the zeros past n add nothing); flip-cumsum-flip, as AReaL
    tail_sum = ordered.flip(0).cumsum(0).flip(0)
    places = torch.arange(ordered.numel(), device=ordered.device)
    tail_count = (n - places).clamp(min=1).to(dtype)
    below = (tail_sum / tail_count < threshold) & (places < n)
    first_below = torch.where(below, places, ordered.numel()).amin()
    dropped = torch.where(below.any(), first_below, (n - 1).clamp(min=0))
    return (flat_valid & (rank >= dropped)).view(valid.shape)
