"""Outcome advantage estimators beyond GRPO's: the ones verl 0.9.1 registers, and MaxRL (SkyRL), vectorised.

They take one score per sample (``[batch]`` with ``group_ids``, or dense ``[groups,
samples]``) and return one advantage per sample: broadcast it over the response
(``adv[:, None]``, or pass ``[batch]`` to :func:`policy_loss`). No Python loop over
samples. :func:`group_advantages` is GRPO's (and RLOO's, with
``baseline="leave_one_out"``); the token-level estimators (GAE, REINFORCE++, ReMax) are in
:mod:`dapo_ops.advantages.returns`.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._groups import (
    Segments,
    restore,
    segment_count,
    segment_reduce,
    segment_sum,
    segments,
)
from dapo_ops._core._rules import compute_dtype, masked
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_bool,
    check_count_dtype,
    check_finite,
    check_float,
    check_ndim,
    check_non_negative,
    check_real,
    check_same_device,
    check_tensor,
    shape_str,
)
from dapo_ops.advantages.group import group_advantages
from dapo_ops.advantages.returns import masked_whiten


def _grouped(scores: Tensor, group_ids: Tensor | None) -> tuple[Segments, Tensor, Tensor]:
    """The segments, the scores as flat floats in the compute dtype, and the group sizes."""
    check_float("scores", scores)
    seg = segments("scores", scores, group_ids)
    x = seg.values.to(compute_dtype(scores))
    count = segment_count(seg, x.dtype)
    return seg, x, count


def opo_advantages(
    scores: Float[Tensor, " batch"] | Float[Tensor, "groups samples"],
    lengths: Integer[Tensor, " batch"] | Integer[Tensor, "groups samples"],
    group_ids: Integer[Tensor, " batch"] | None = None,
) -> Float[Tensor, " batch"] | Float[Tensor, "groups samples"]:
    r"""OPO: the score minus the length-weighted mean score of its group.

    :math:`A_i = s_i - \sum_{j\in g} |y_j| s_j / \sum_{j\in g}|y_j|`; a one-sample group
    keeps its raw score (baseline 0, as verl's ``adv_estimator="opo"``). ``lengths`` are
    the responses' token counts (integer or float, finite and >= 0, else ``InputError``:
    checked with one host sync, skipped under ``torch.compile``), shaped as ``scores``.

    Paper: Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline" (arXiv:2505.23585).

    Example:
        >>> opo_advantages(torch.tensor([[1.0, 0.0]]), torch.tensor([[3, 1]]))
        tensor([[ 0.2500, -0.7500]])
    """
    seg, x, count = _grouped(scores, group_ids)
    check_tensor("lengths", lengths)
    check_count_dtype("lengths", lengths)
    check_same_device("lengths", lengths, "scores", scores)
    if lengths.shape != scores.shape:
        raise InputError(
            f"lengths has shape {shape_str(lengths)} but scores has shape {shape_str(scores)}; "
            "they must match"
        )
    check_non_negative("lengths", lengths)
    flat_len = lengths.reshape(-1).to(x.dtype)
    weighted = segment_sum(seg, x * flat_len)
    total_len = segment_sum(seg, flat_len)
    base = weighted / torch.where(total_len == 0, 1.0, total_len)
    base = torch.where(count > 1, base, 0.0)
    return restore(seg, x - base[seg.segment])


def gpg_advantages(
    scores: Float[Tensor, " batch"] | Float[Tensor, "groups samples"],
    group_ids: Integer[Tensor, " batch"] | None = None,
    *,
    f_norm: float = 1.0,
) -> Float[Tensor, " batch"] | Float[Tensor, "groups samples"]:
    r"""GPG's advantage: the group-centred score rescaled by ``batch / #nonzero scores``.

    :math:`A_i = \alpha\,(s_i - \bar s_g) / f_{norm}` with :math:`\alpha = B / \max(1,
    |\{i: s_i \ne 0\}|)` over the whole batch; a one-sample group has mean 0. verl:
    ``adv_estimator="gpg"``; ``f_norm`` (> 0, default 1) is its ``f_norm``.

    Paper: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning" (arXiv:2504.02546).

    Example:
        >>> gpg_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 3., -1., -1., -1.]])
    """
    f_norm = check_real("f_norm", f_norm)
    if f_norm <= 0:
        raise InputError(f"f_norm must be > 0, got {f_norm}")
    seg, x, count = _grouped(scores, group_ids)
    mean = segment_sum(seg, x) / torch.where(count == 0, 1.0, count)
    mean = torch.where(count > 1, mean, 0.0)
    nonzero = (x != 0).sum().clamp(min=1).to(x.dtype)
    alpha = x.numel() / nonzero
    return restore(seg, alpha * (x - mean[seg.segment]) / f_norm)


def maxrl_advantages(
    scores: Float[Tensor, " batch"] | Float[Tensor, "groups samples"],
    group_ids: Integer[Tensor, " batch"] | None = None,
    *,
    eps: float = 1e-6,
) -> Float[Tensor, " batch"] | Float[Tensor, "groups samples"]:
    r"""MaxRL: the group-centred score divided by the group mean, not the std.

    :math:`A_i = (s_i - \bar s_g) / (\bar s_g + \epsilon)`. For 0/1 rewards with
    :math:`K` of :math:`G` samples right, a right sample gets :math:`(G-K)/K` and a wrong
    one :math:`-1`: the :math:`1/p` weighting of maximum likelihood, so a hard prompt
    (small pass rate :math:`p`) weighs more. An all-zero group gives 0. A one-sample group
    keeps its raw score (baseline 0, as SkyRL). Meant for non-negative rewards (a pass
    rate): a negative group mean is not refused, but its sign flips the advantages.

    Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning" (arXiv:2602.02710).
    Peers: SkyRL (``ppo_utils.compute_maxrl_advantage``, ``adv_estimator="maxrl"``,
    ``epsilon=1e-6``: the default here), prime-rl. Same layouts as
    :func:`group_advantages`.

    Example:
        >>> maxrl_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
        tensor([[ 3.0000, -1.0000, -1.0000, -1.0000],
                [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    eps = check_real("eps", eps)
    if eps < 0:
        raise InputError(f"eps must be >= 0, got {eps}")
    seg, x, count = _grouped(scores, group_ids)
    mean = segment_sum(seg, x) / torch.where(count == 0, 1.0, count)
    many = (count > 1)[seg.segment]
    base = mean[seg.segment]
    den = torch.where(many, base + eps, 1.0)
    adv = torch.where(many, (x - base) / torch.where(den == 0, 1.0, den), x)
    return restore(seg, adv)


def passk_advantages(
    scores: Float[Tensor, " batch"] | Float[Tensor, "groups samples"],
    group_ids: Integer[Tensor, " batch"] | None = None,
    *,
    scale: bool = True,
    eps: float = 1e-6,
) -> Float[Tensor, " batch"] | Float[Tensor, "groups samples"]:
    r"""GRPO pass@k: only each group's best sample gets an advantage, best minus second best.

    :math:`A_{i^*} = (s_{(1)} - s_{(2)}) / (\mathrm{std}_g + \epsilon)` for the sample
    :math:`i^*` with the group's highest score (the first one on ties), 0 for the others;
    ``scale=False`` skips the division (verl's ``norm_adv_by_std_in_grpo``). Every group
    needs at least two samples (else ``InputError``: checked with one host sync, skipped
    under ``torch.compile``). A NaN score makes its whole group's advantages NaN.
    verl: ``adv_estimator="grpo_passk"``.

    Paper: Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives
    using Reinforcement Learning" (arXiv:2503.19595).

    Example:
        >>> passk_advantages(torch.tensor([[0.0, 1.0, 0.5]]), scale=False)
        tensor([[0.0000, 0.5000, 0.0000]])
    """
    check_bool("scale", scale)
    eps = check_real("eps", eps)
    if eps < 0:
        raise InputError(f"eps must be >= 0, got {eps}")
    seg, x, count = _grouped(scores, group_ids)
    if not torch.compiler.is_compiling() and bool((count[count > 0] < 2).any()):
        raise InputError("passk_advantages needs at least 2 samples in every group")
    best = segment_reduce(seg, x, "amax")
    is_best = x == best[seg.segment]
    position = torch.arange(x.numel(), device=x.device)
    first = segment_reduce(seg, torch.where(is_best, position, x.numel()), "amin")
    chosen = position == first[seg.segment]
    second = segment_reduce(seg, torch.where(chosen, -torch.inf, x), "amax")
    gap = best - second
    if scale:
        mean = segment_sum(seg, x) / torch.where(count == 0, 1.0, count)
        dev = segment_sum(seg, (x - mean[seg.segment]).square())
        std = torch.sqrt(dev / torch.where(count > 1, count - 1, 1.0))
        gap = gap / (std + eps)
    adv = torch.where(chosen, gap[seg.segment], 0.0)
    # amax propagates a NaN score, which then matches no sample: say so instead of 0.
    return restore(seg, torch.where(torch.isnan(best)[seg.segment], torch.nan, adv))


@checks_values
def gdpo_advantages(
    components: Float[Tensor, "batch components"],
    group_ids: Integer[Tensor, " batch"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    weights: Float[Tensor, " components"] | None = None,
    scale: bool = True,
    eps: float = 1e-6,
) -> Float[Tensor, "batch seq"]:
    r"""GDPO: each reward component normalised within its group, summed, then whitened.

    :math:`A = \mathrm{whiten}\big(\sum_k w_k\,\mathrm{GRPO}(s^{(k)})\big)` over the valid
    tokens, with GRPO's group advantage per component (a one-sample group keeps its raw
    score, as verl) and ``weights`` (default 1 each). ``components`` ``[batch, K]`` holds
    one score per sample per reward component, finite (else ``InputError``: checked with
    one host sync, skipped under ``torch.compile``). verl: ``adv_estimator="gdpo"`` with
    ``gdpo_reward_keys``/``gdpo_reward_weights``.

    Paper: Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy
    Optimization for Multi-reward RL Optimization" (arXiv:2601.05242).

    Example:
        >>> comp = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
        >>> a = gdpo_advantages(comp, torch.tensor([0, 0, 0, 0]), torch.ones(4, 2, dtype=torch.bool))
        >>> a.shape
        torch.Size([4, 2])
    """
    check_bool("scale", scale)
    check_float("components", components)
    check_ndim("components", components, 2, "[batch, components]")
    check_finite("components", components)  # as group_advantages would, naming ours
    valid = as_bool_mask("mask", mask, "mask", mask)
    if valid.shape[0] != components.shape[0]:
        raise InputError(f"mask has {valid.shape[0]} rows but components has {components.shape[0]}")
    dtype = compute_dtype(components)
    k = components.shape[1]
    w = torch.ones(k, dtype=dtype, device=components.device) if weights is None else weights
    check_float("weights", w)
    if w.shape != (k,):
        raise InputError(f"weights must have shape [components]=[{k}], got {list(w.shape)}")
    total = torch.zeros(components.shape[0], dtype=dtype, device=components.device)
    for j in range(k):  # a few reward components, each vectorised over the batch
        adv = group_advantages(
            components[:, j], group_ids, scale="group" if scale else "none", eps=eps,
            singleton="score",
        )  # fmt: skip
        total = total + w[j].to(dtype) * adv.to(dtype)
    return masked_whiten(masked(valid, total[:, None].expand_as(valid).to(dtype)), valid)
