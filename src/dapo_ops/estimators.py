"""Advantage estimators beyond GRPO's: the ones verl 0.9.1 registers, vectorised.

Outcome estimators take one score per sample (``[batch]`` with ``group_ids``, or dense
``[groups, samples]``) and return one advantage per sample: broadcast it over the
response (``adv[:, None]``, or pass ``[batch]`` to :func:`policy_loss`). Token-level
estimators (:func:`gae_advantages`, :func:`reinforce_pp_advantages`) take per-token
rewards ``[batch, seq]`` and a mask. No Python loop over samples; the token-level ones
loop over the ``seq`` positions (a reverse recurrence), vectorised over the batch.
:func:`group_advantages` is GRPO's (and RLOO's, with ``baseline="leave_one_out"``).
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._groups import (
    Segments,
    restore,
    segment_count,
    segment_reduce,
    segment_sum,
    segments,
)
from dapo_ops._rules import compute_dtype, masked
from dapo_ops._validate import InputError, as_bool_mask, check_float, check_ndim, check_same_shape
from dapo_ops.advantages import group_advantages


def masked_whiten(
    values: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
) -> Float[Tensor, "batch seq"]:
    r"""``(x - mean) / sqrt(var + 1e-8)`` over the valid entries (unbiased variance).

    The whitening verl applies to GAE and REINFORCE++ advantages; masked entries come out
    0. Fewer than two valid entries leave the centred values unscaled (verl raises).

    Example:
        >>> masked_whiten(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]]))
        tensor([[-0.7071,  0.7071,  0.0000]])
    """
    check_float("values", values)
    check_ndim("values", values, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "values", values)
    x = masked(valid, values.to(compute_dtype(values)))
    n = valid.sum().to(x.dtype)
    mean = x.sum() / torch.where(n == 0, 1.0, n)
    centred = masked(valid, x - mean)
    var = centred.square().sum() / torch.where(n > 1, n - 1, 1.0)
    scale = torch.where(n > 1, torch.rsqrt(var + 1e-8), 1.0)
    return centred * scale


def _token_inputs(name: str, rewards: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    check_float(name, rewards)
    check_ndim(name, rewards, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, name, rewards)
    return masked(valid, rewards.to(compute_dtype(rewards))), valid


def gae_advantages(
    rewards: Float[Tensor, "batch seq"],
    values: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Float[Tensor, "batch seq"], Float[Tensor, "batch seq"]]:
    r"""Generalised advantage estimation over the valid tokens: ``(advantages, returns)``.

    .. math::

        \delta_t = r_t + \gamma V_{t'} - V_t,\qquad A_t = \delta_t + \gamma\lambda A_{t'}

    with :math:`t'` the next *valid* position (masked positions are skipped, as verl's
    ``compute_gae_advantage_return``), :math:`V = 0` past the end; ``returns = A + V``;
    advantages whitened over the valid tokens when ``whiten`` (verl always whitens).
    Defaults ``gamma = lam = 1`` are verl's (``algorithm.gamma``, ``algorithm.lam``).

    Example:
        >>> a, ret = gae_advantages(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2),
        ...                         torch.ones(1, 2, dtype=torch.bool), whiten=False)
        >>> a
        tensor([[1., 1.]])
    """
    r, valid = _token_inputs("rewards", rewards, mask)
    check_float("values", values)
    check_same_shape("values", values, "rewards", rewards)
    v = masked(valid, values.to(r.dtype))
    next_value = torch.zeros_like(r[:, 0])
    last = torch.zeros_like(r[:, 0])
    out = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        m = valid[:, t]
        gae = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * last
        next_value = torch.where(m, v[:, t], next_value)
        last = torch.where(m, gae, last)
        out[:, t] = last
    returns = masked(valid, out + v)
    return (masked_whiten(out, valid) if whiten else masked(valid, out)), returns


def reinforce_pp_advantages(
    rewards: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    gamma: float = 1.0,
) -> tuple[Float[Tensor, "batch seq"], Float[Tensor, "batch seq"]]:
    r"""REINFORCE++: discounted returns over valid tokens, whitened over the batch.

    :math:`G_t = r_t + \gamma G_{t'}` (``t'`` the next valid position); advantages are
    ``masked_whiten(G)``. Returns ``(advantages, returns)``, 0 at masked positions. verl:
    ``adv_estimator="reinforce_plus_plus"``.

    Example:
        >>> adv, ret = reinforce_pp_advantages(torch.tensor([[0.0, 1.0]]), torch.tensor([[1, 1]]))
        >>> ret
        tensor([[1., 1.]])
    """
    r, valid = _token_inputs("rewards", rewards, mask)
    running = torch.zeros_like(r[:, 0])
    returns = torch.zeros_like(r)
    for t in range(r.shape[1] - 1, -1, -1):
        new = r[:, t] + gamma * running
        running = torch.where(valid[:, t], new, running)
        returns[:, t] = torch.where(valid[:, t], new, 0.0)
    return masked_whiten(returns, valid), returns


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
    keeps its raw score (baseline 0, as verl's ``adv_estimator="opo"``).

    Example:
        >>> opo_advantages(torch.tensor([[1.0, 0.0]]), torch.tensor([[3, 1]]))
        tensor([[ 0.2500, -0.7500]])
    """
    seg, x, count = _grouped(scores, group_ids)
    flat_len = lengths.reshape(-1).to(x.dtype)
    if flat_len.shape != x.shape:
        raise InputError(f"lengths must have the shape of scores {list(scores.shape)}")
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
    ``adv_estimator="gpg"``.

    Example:
        >>> gpg_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        tensor([[ 3., -1., -1., -1.]])
    """
    seg, x, count = _grouped(scores, group_ids)
    mean = segment_sum(seg, x) / torch.where(count == 0, 1.0, count)
    mean = torch.where(count > 1, mean, 0.0)
    nonzero = (x != 0).sum().clamp(min=1).to(x.dtype)
    alpha = x.numel() / nonzero
    return restore(seg, alpha * (x - mean[seg.segment]) / f_norm)


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
    needs at least two samples. verl: ``adv_estimator="grpo_passk"``.

    Example:
        >>> passk_advantages(torch.tensor([[0.0, 1.0, 0.5]]), scale=False)
        tensor([[0.0000, 0.5000, 0.0000]])
    """
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
    return restore(seg, torch.where(chosen, gap[seg.segment], 0.0))


def remax_advantages(
    rewards: Float[Tensor, "batch seq"],
    baselines: Float[Tensor, " batch"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
) -> tuple[Float[Tensor, "batch seq"], Float[Tensor, "batch seq"]]:
    r"""ReMax: the reward-to-go minus the reward of a greedy rollout of the same prompt.

    ``returns[t] = sum_{t' >= t} m r``, ``advantages = returns - b_i`` on valid tokens
    (``baselines`` ``[batch]``: the greedy response's reward). Returns ``(advantages,
    returns)``. verl: ``adv_estimator="remax"``.

    Example:
        >>> adv, ret = remax_advantages(torch.tensor([[0.0, 1.0]]), torch.tensor([0.25]),
        ...                             torch.tensor([[1, 1]]))
        >>> adv
        tensor([[0.7500, 0.7500]])
    """
    r, valid = _token_inputs("rewards", rewards, mask)
    check_float("baselines", baselines)
    check_ndim("baselines", baselines, 1, "[batch]")
    if baselines.shape[0] != r.shape[0]:
        raise InputError(
            f"baselines must have shape [batch]=[{r.shape[0]}], got {list(baselines.shape)}"
        )
    returns = r.flip(-1).cumsum(dim=-1).flip(-1)
    advantages = masked(valid, returns - baselines.to(r.dtype)[:, None])
    return advantages, returns


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
    one score per sample per reward component. verl: ``adv_estimator="gdpo"`` with
    ``gdpo_reward_keys``/``gdpo_reward_weights``.

    Example:
        >>> comp = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
        >>> a = gdpo_advantages(comp, torch.tensor([0, 0, 0, 0]), torch.ones(4, 2, dtype=torch.bool))
        >>> a.shape
        torch.Size([4, 2])
    """
    check_float("components", components)
    check_ndim("components", components, 2, "[batch, components]")
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
