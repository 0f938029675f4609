"""What a trainer logs about a policy update, as 0-dim tensors: no host sync."""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._inputs import policy_tensors
from dapo_ops._core._rules import safe_divide
from dapo_ops._core._validate import (
    InputError,
    check_count_dtype,
    check_float,
    check_int,
    check_ndim,
    check_non_negative,
    check_same_device,
    check_same_shape,
    check_tensor,
)
from dapo_ops.objectives import ClipHigher, Objective
from dapo_ops.objectives.base import check_objective_value, per_sequence_advantages, token_inputs
from dapo_ops.rewards.sampling import kept_group_counts

#: The default objective of :func:`policy_diagnostics`: DAPO's Clip-Higher.
DAPO_CLIP = ClipHigher()


class PolicyDiagnostics(NamedTuple):
    """Masked token statistics, kept as sums and counts so they combine exactly.

    Every field is a 0-dim float64 tensor (detached): counts stay exact past 2**24 tokens. ``a + b`` combines two micro-batches
    (sums add, min/max combine), :meth:`all_reduce` combines ranks, and the properties
    turn the totals into the figures a trainer logs. Converting to Python numbers (e.g.
    ``float(d.clip_frac_high)``) is the caller's choice, once per step.
    """

    valid_tokens: Float[Tensor, ""]
    clipped_low: Float[Tensor, ""]  # A < 0 and r < 1 - eps_low: gradient 0
    clipped_high: Float[Tensor, ""]  # A > 0 and r > 1 + eps_high: gradient 0
    clipped_dual: Float[Tensor, ""]  # A < 0 and r > c (dual clip): gradient 0
    ratio_sum: Float[Tensor, ""]
    ratio_min: Float[Tensor, ""]  # +inf when no valid token
    ratio_max: Float[Tensor, ""]  # -inf when no valid token
    approx_kl_sum: Float[Tensor, ""]  # k3 estimate of KL(old || new), summed
    entropy_sum: Float[Tensor, ""]  # per-token policy entropy, summed (0 if not given)
    entropy_tokens: Float[Tensor, ""]  # tokens whose entropy was given (0 if not given)

    def __add__(self, other: object) -> PolicyDiagnostics:  # type: ignore[override]
        if not isinstance(other, PolicyDiagnostics):
            return NotImplemented
        sums = {f: getattr(self, f) + getattr(other, f) for f in _SUMS}
        return PolicyDiagnostics(
            **sums,
            ratio_min=torch.minimum(self.ratio_min, other.ratio_min),
            ratio_max=torch.maximum(self.ratio_max, other.ratio_max),
        )

    def all_reduce(self, group: object | None = None) -> PolicyDiagnostics:
        """Totals over the ranks of ``group`` (a no-op without torch.distributed)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return self
        sums = torch.stack([getattr(self, f) for f in _SUMS])
        lo_neg_hi = torch.stack([self.ratio_min, -self.ratio_max])
        dist.all_reduce(sums, group=group)  # type: ignore[arg-type]
        dist.all_reduce(lo_neg_hi, op=dist.ReduceOp.MIN, group=group)  # type: ignore[arg-type]
        return PolicyDiagnostics(
            **dict(zip(_SUMS, sums.unbind(), strict=True)),
            ratio_min=lo_neg_hi[0],
            ratio_max=-lo_neg_hi[1],
        )

    @property
    def clip_frac_low(self) -> Tensor:
        return safe_divide(self.clipped_low, self.valid_tokens)

    @property
    def clip_frac_high(self) -> Tensor:
        return safe_divide(self.clipped_high, self.valid_tokens)

    @property
    def clip_frac_dual(self) -> Tensor:
        return safe_divide(self.clipped_dual, self.valid_tokens)

    @property
    def ratio_mean(self) -> Tensor:
        return safe_divide(self.ratio_sum, self.valid_tokens)

    @property
    def approx_kl(self) -> Tensor:
        return safe_divide(self.approx_kl_sum, self.valid_tokens)

    @property
    def entropy(self) -> Tensor:
        """Mean entropy over the tokens it was measured on (0 if it never was)."""
        return safe_divide(self.entropy_sum, self.entropy_tokens)


#: The fields of :class:`PolicyDiagnostics` that are sums (the others: the ratio's min and max).
_SUMS = tuple(f for f in PolicyDiagnostics._fields if f not in ("ratio_min", "ratio_max"))


def policy_diagnostics(
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    objective: Objective = DAPO_CLIP,
    entropy: Float[Tensor, "batch seq"] | None = None,
) -> PolicyDiagnostics:
    r"""Clip fractions, ratio statistics and approximate KL of the loss ``objective``.

    :func:`objective_diagnostics` of ``objective``, by default DAPO's Clip-Higher
    (``ClipHigher()``: ``eps_low=0.2``, ``eps_high=0.28``, the default of
    :func:`token_level_loss`). For ``ClipHigher`` the low / high clip counts are the tokens
    whose clip is *active* (gradient exactly 0), ``A < 0, r < 1 - eps_low`` and
    ``A > 0, r > 1 + eps_high``; the dual count is ``A < 0, r > dual_clip``.

    Same shapes as :func:`clip_higher_surrogate`; returns a :class:`PolicyDiagnostics` of
    detached 0-dim float64 tensors.

    Example:
        >>> d = policy_diagnostics(torch.zeros(1, 2), torch.tensor([[0.0, -1.0]]),
        ...                        torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
        >>> float(d.clip_frac_high)
        0.5
    """
    check_objective_value(objective)
    return objective_diagnostics(objective, logp, old_logp, advantages, mask, entropy=entropy)


@torch.no_grad()
def objective_diagnostics(
    objective: Objective,
    logp: Float[Tensor, "batch seq"],
    old_logp: Float[Tensor, "batch seq"],
    advantages: Float[Tensor, " batch"] | Float[Tensor, "batch 1"] | Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    entropy: Float[Tensor, "batch seq"] | None = None,
) -> PolicyDiagnostics:
    r"""What a trainer logs about an update with ``objective``, over the valid tokens.

    With :math:`r = \exp(\log\pi_\theta - \log\pi_{old})` (log-ratio clamped to the
    objective's ``log_ratio_clamp``): the clip counts are the objective's
    :meth:`~dapo_ops.objectives.Objective.clipped` tokens; ``approx_kl`` is the k3
    estimator :math:`\mathbb{E}_{old}[(r - 1) - \log r]` of
    :math:`KL(\pi_{old}\,\|\,\pi_\theta)`, >= 0 per token. ``entropy`` (per-token
    policy entropy, e.g. from :func:`token_entropy`) adds its masked sum, so ``.entropy``
    is its masked mean; the DAPO paper monitors it (too low is collapsed exploration).
    A NaN advantage at a valid token has no sign, so the clip counts are NaN (as the loss
    is); +-inf advantages count by their sign.

    Shapes as :func:`dapo_ops.policy_loss`; returns detached 0-dim float64 tensors.

    Example:
        >>> from dapo_ops import CISPO
        >>> d = objective_diagnostics(CISPO(), torch.zeros(1, 2), torch.tensor([[0.0, -1.0]]),
        ...                           torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
        >>> float(d.clip_frac_high)  # r = e > 1.28: the weight is capped
        0.5
    """

    adv, valid, dtype = policy_tensors(
        logp, old_logp, advantages, mask, per_sequence=per_sequence_advantages(objective)
    )
    x = token_inputs(objective, logp, old_logp, adv, valid, dtype, reference=True)
    acc = torch.float64  # counts stay exact past 2**24 tokens
    # A NaN advantage has no sign, so whether its token is clipped is undefined: NaN.
    undefined = valid & torch.isnan(x.adv)
    low, high, dual = (
        torch.where(undefined, float("nan"), (valid & c).to(acc)).sum()
        for c in objective.clipped(x)
    )
    ratio, log_ratio = x.ratio, x.clamped
    inf = torch.full_like(ratio, float("inf"))
    zero = ratio.new_zeros((), dtype=acc)
    return PolicyDiagnostics(
        valid_tokens=valid.sum().to(acc),
        clipped_low=low,
        clipped_high=high,
        clipped_dual=dual,
        ratio_sum=torch.where(valid, ratio, 0.0).sum().to(acc),
        ratio_min=extreme(torch.where(valid, ratio, inf), "amin").to(acc),
        ratio_max=extreme(torch.where(valid, ratio, -inf), "amax").to(acc),
        approx_kl_sum=torch.where(valid, (ratio - 1.0) - log_ratio, 0.0).sum().to(acc),
        entropy_sum=zero if entropy is None else masked_sum("entropy", entropy, valid, logp),
        entropy_tokens=zero if entropy is None else valid.sum().to(acc),
    )


def extreme(x: Tensor, reduce: str) -> Tensor:
    """amin/amax of all entries; +-inf for an empty tensor (shape-static branch)."""
    if x.numel() == 0:
        return x.new_full((), float("inf") if reduce == "amin" else float("-inf"))
    return x.amin() if reduce == "amin" else x.amax()


def masked_sum(name: str, values: Tensor, valid: Tensor, ref: Tensor) -> Tensor:
    check_float(name, values)
    check_same_shape(name, values, "logp", ref)
    return torch.where(valid, values.to(torch.float64), 0.0).sum()


class BatchDiagnostics(NamedTuple):
    """Per-batch figures (dynamic sampling, overlong answers, lengths) as counts.

    0-dim float64 tensors that add across micro-batches (``+``) and ranks
    (:meth:`all_reduce`); the properties give the logged fractions.
    """

    groups: Float[Tensor, ""]
    groups_kept: Float[Tensor, ""]
    samples: Float[Tensor, ""]
    overlong_samples: Float[Tensor, ""]  # length >= max_len: hit the generation cap
    response_tokens: Float[Tensor, ""]

    def __add__(self, other: object) -> BatchDiagnostics:  # type: ignore[override]
        if not isinstance(other, BatchDiagnostics):
            return NotImplemented
        return BatchDiagnostics(*(a + b for a, b in zip(self, other, strict=True)))

    def all_reduce(self, group: object | None = None) -> BatchDiagnostics:
        """Totals over the ranks of ``group`` (a no-op without torch.distributed)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return self
        sums = torch.stack(list(self))
        dist.all_reduce(sums, group=group)  # type: ignore[arg-type]
        return BatchDiagnostics(*sums.unbind())

    @property
    def kept_group_fraction(self) -> Tensor:
        return safe_divide(self.groups_kept, self.groups)

    @property
    def overlong_fraction(self) -> Tensor:
        return safe_divide(self.overlong_samples, self.samples)

    @property
    def mean_response_length(self) -> Tensor:
        return safe_divide(self.response_tokens, self.samples)


def batch_diagnostics(
    lengths: Integer[Tensor, " batch"] | Float[Tensor, " batch"],
    *,
    max_len: int,
    keep: Bool[Tensor, " groups"] | Bool[Tensor, " batch"] | None = None,
    group_ids: Integer[Tensor, " batch"] | None = None,
) -> BatchDiagnostics:
    """Counts for the per-batch curves DAPO monitors: kept groups, overlong samples, length.

    ``lengths`` are response token counts (EOS included) of every generated sample;
    a sample with ``length >= max_len`` hit the generation cap. ``keep`` is the output of
    :func:`dynamic_sample_mask` (with the same ``group_ids`` for the flat layout); without
    it the group counts are 0.

    Exact: integer lengths are compared and summed in int64, float lengths in float64
    (never in the input dtype: a float16 sum would overflow, a float32 one round past
    ``2**24``). ``max_len`` is an int >= 1; lengths must be finite and >= 0 (one host
    sync, skipped under ``torch.compile``); anything else raises ``InputError``.

    Example:
        >>> d = batch_diagnostics(torch.tensor([5, 20, 7, 20]), max_len=20,
        ...                       keep=torch.tensor([True, False]))
        >>> float(d.kept_group_fraction), float(d.overlong_fraction), float(d.mean_response_length)
        (0.5, 0.5, 13.0)
    """
    max_len = check_int("max_len", max_len, low=1)
    check_tensor("lengths", lengths)
    check_ndim("lengths", lengths, 1, "[batch] of response token counts")
    check_count_dtype("lengths", lengths)
    check_non_negative("lengths", lengths)
    if group_ids is not None and keep is None:
        raise InputError("group_ids was given without keep; pass keep too, or neither")
    if keep is not None:
        check_tensor("keep", keep)
        check_same_device("keep", keep, "lengths", lengths)
        if group_ids is not None:
            check_tensor("group_ids", group_ids)
            check_same_shape("group_ids", group_ids, "lengths", lengths)
    acc = torch.float64  # counts stay exact past 2**24 tokens
    zero = lengths.new_zeros((), dtype=acc)
    kept, groups = (zero, zero) if keep is None else kept_group_counts(keep, group_ids)
    kept, groups = kept.to(acc), groups.to(acc)
    # floats summed and compared in float64 (no float16 overflow), integers in int64
    exact = lengths.to(acc if lengths.dtype.is_floating_point else torch.int64)
    return BatchDiagnostics(
        groups=groups,
        groups_kept=kept,
        samples=lengths.new_full((), lengths.numel(), dtype=acc),  # filled on the device
        overlong_samples=(exact >= max_len).sum().to(acc),
        response_tokens=exact.sum().to(acc),
    )
