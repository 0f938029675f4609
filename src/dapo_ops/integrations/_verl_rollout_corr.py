"""verl 0.9.1's rollout-correction statistics: its IS weights' and each rejection criterion's.

verl's ``bypass_mode`` logs, besides the off-policy gap (:func:`dapo_ops.offpolicy_metrics`),
``rollout_is_*`` statistics of its IS weights and ``rollout_rs_<option>_*`` statistics of
each ``rollout_rs`` criterion. They are defined here as verl defines them, one table per
family (name -> formula): token means are verl's ``masked_mean`` (the count ``+ 1e-8``),
per-sequence means too (an empty sequence's is 0, and it counts where verl averages over
every sequence), fractions of sequences are float32 means (verl's ``.float().mean()``),
the rest float64. The weights and the rejection mask themselves come from
:func:`dapo_ops.truncated_is_weights` and :func:`dapo_ops.rejection_mask`. The statistics
are host reads (verl's ``.item()``). On an all-masked batch (verl raises) they stay
finite: each formula on empty sequences (mean weight 0), a token statistic 0, ESS 1.

Example:
    >>> old = torch.log(torch.tensor([[0.5, 0.9]]))
    >>> roll = torch.log(torch.tensor([[0.25, 0.9]]))
    >>> mask = torch.ones(1, 2, dtype=torch.bool)
    >>> w, stats = rollout_is(old, roll, mask, level="token", cap=1.5, lower=None,
    ...                       normalize=False)
    >>> w, stats["rollout_is_max"], round(stats["rollout_is_ratio_fraction_high"], 6)
    (tensor([[1.5000, 1.0000]]), 1.5, 0.5)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dapo_ops._core._rules import LOG_RATIO_CLAMP
from dapo_ops.correction.importance import rejection_mask, truncated_is_weights


class _Batch(NamedTuple):
    """The valid tokens of a batch and verl's reductions over them (float64)."""

    valid: Tensor  # bool [batch, seq]

    def mean(self, x: Tensor) -> Tensor:
        """verl's ``masked_mean``: the valid tokens' sum over their count ``+ 1e-8``."""
        total = torch.where(self.valid, x.to(torch.float64), 0.0).sum()
        return total / (self.valid.sum().to(torch.float64) + 1e-8)

    @property
    def rows(self) -> Tensor:
        """The non-empty sequences, ``[batch]``."""
        return self.valid.any(dim=-1)

    def row_mean(self, x: Tensor) -> Tensor:
        """Each sequence's ``masked_mean`` (0 for an empty one), ``[batch]``."""
        total = torch.where(self.valid, x.to(torch.float64), 0.0).sum(dim=-1)
        return total / (self.valid.sum(dim=-1).to(torch.float64) + 1e-8)

    def extreme(self, x: Tensor, reduce: str) -> Tensor:
        """``amax``/``amin`` over the valid tokens (0 when there are none)."""
        fill = -math.inf if reduce == "amax" else math.inf
        top = getattr(torch.where(self.valid, x.to(torch.float64), fill), reduce)()
        return torch.where(self.valid.any(), top, 0.0)

    def spread(self, x: Tensor, low: float, high: float) -> Tensor | float:
        """verl's std of ``x`` clamped to ``[low, high]``: ``sqrt(E[c^2] - E[c]^2)``
        over the valid tokens, 0 with fewer than two."""
        if int(self.valid.sum()) < 2:
            return 0.0
        c = x.to(torch.float64).clamp(low, high)
        return (self.mean(c.square()) - self.mean(c).square()).clamp(min=0.0).sqrt()


def _share(condition: Tensor) -> Tensor:
    """verl's fraction of sequences: a float32 mean."""
    return condition.float().mean()


def _std(rows: Tensor) -> Tensor | float:
    """torch's (unbiased) std of per-sequence values, 0 for one value (verl's rule)."""
    return rows.std() if rows.numel() > 1 else 0.0


Stat = Callable[[Any], Tensor | float]


def _table(
    stats: Mapping[str, Stat], context: Any, prefix: str, skip: tuple[str, ...] = ()
) -> dict[str, float]:
    return {f"{prefix}{k}": float(f(context)) for k, f in stats.items() if k not in skip}


class _Weights(NamedTuple):
    """What verl's IS statistics read."""

    batch: _Batch
    weights: Tensor  # truncated (before batch normalisation), 0 at masked tokens
    raw: Tensor  # exp(clamped log-ratio), 0 at masked tokens
    log_ratio: Tensor  # per token [batch, seq], or per sequence [batch] (not clamped)
    cap: float
    lower: float  # the IcePop lower bound, else 1 / cap

    def seq(self) -> Tensor:
        return self.batch.row_mean(self.weights)


def _ess(c: _Weights) -> Tensor:
    """``1 / E[(w / (E[w] + 1e-8))^2]`` (verl clamps ``w`` to ``[0, cap]`` first, which the
    truncated weights already are); 1 when that mean is 0 (no valid token; verl raises)."""
    second = c.batch.mean((c.weights / (c.batch.mean(c.weights) + 1e-8)).square())
    return torch.where(second == 0, 1.0, 1.0 / second)


_IS: Mapping[str, Stat] = {
    "mean": lambda c: c.batch.mean(c.weights),
    "std": lambda c: c.batch.spread(c.weights, 0.0, c.cap),
    "eff_sample_size": _ess,
    "seq_mean": lambda c: c.seq().mean(),
    "seq_std": lambda c: _std(c.seq()),
    "seq_max": lambda c: c.seq().max(),
    "seq_min": lambda c: c.seq().min(),
    "seq_max_deviation": lambda c: (c.seq() - 1.0).abs().max(),
    "seq_fraction_high": lambda c: _share(c.batch.row_mean(c.raw) > c.cap),
    "seq_fraction_low": lambda c: _share(c.batch.row_mean(c.raw) < c.lower),
}
_IS_TOKEN: Mapping[str, Stat] = {
    "max": lambda c: c.batch.extreme(c.weights, "amax"),
    "min": lambda c: c.batch.extreme(c.weights, "amin"),
    "ratio_fraction_high": lambda c: c.batch.mean(c.raw > c.cap),
    "ratio_fraction_low": lambda c: c.batch.mean(c.raw < c.lower),
}
#: Sequence level: over every sequence's log-ratio sum (an empty one's is 0), the bounds'
#: logs in torch's default dtype (float32), as verl compares them.
_IS_SEQUENCE: Mapping[str, Stat] = {
    "max": lambda c: c.log_ratio.max().clamp(max=LOG_RATIO_CLAMP).exp(),
    "min": lambda c: c.log_ratio.min().exp(),
    "ratio_fraction_high": lambda c: _share(c.log_ratio > torch.tensor(c.cap).log()),
    "ratio_fraction_low": lambda c: _share(c.log_ratio < torch.tensor(c.lower).log()),
}


def _normaliser(weights: Tensor, batch: _Batch, level: str) -> Tensor:
    """verl's ``rollout_is_batch_normalize`` divisor: the mean weight (token level, count
    ``+ 1e-8``) or the mean of the non-empty sequences' means (count at least 1e-8),
    over every rank when a process group is initialised (no ``+ 1e-8`` there); 1 when
    not above 1e-8."""
    token = level == "token"
    values, counted = (weights, batch.valid) if token else (batch.row_mean(weights), batch.rows)
    total = torch.where(counted, values.to(torch.float64), 0.0).sum()
    count = counted.sum().to(torch.float64)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        both = torch.stack([total, count])
        dist.all_reduce(both)
        mean = both[0] / both[1]
    else:
        mean = total / (count + 1e-8 if token else count.clamp(min=1e-8))
    return torch.where(mean > 1e-8, mean, 1.0).to(weights.dtype)


def rollout_is(
    current: Tensor, rollout: Tensor, mask: Tensor, *, level: str, cap: float,
    lower: float | None, normalize: bool,
) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """verl's ``rollout_is``: the truncated (``lower``: IcePop) IS weights of ``current``
    against ``rollout``, batch-normalised if asked, and their ``rollout_is_*`` statistics
    (of the weights before normalisation, as verl's)."""
    weights = truncated_is_weights(current, rollout, mask, level=level, cap=cap, lower=lower)  # type: ignore[arg-type]
    batch = _Batch(mask)
    log_ratio = torch.where(mask, current.double() - rollout.double(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1)
        safe = log_ratio[:, None].expand_as(mask)
    else:
        safe = log_ratio
    raw = torch.where(mask, safe.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp(), 0.0)
    context = _Weights(batch, weights.double(), raw, log_ratio, cap, 1.0 / cap if lower is None else lower)  # fmt: skip
    levelled = _IS_TOKEN if level == "token" else _IS_SEQUENCE
    stats = _table({**_IS, **levelled}, context, "rollout_is_")
    if lower is not None:
        stats["rollout_is_oob_ratio"] = float(batch.mean((raw < lower) | (raw > cap)))
    if normalize:
        factor = _normaliser(weights, batch, level)
        weights = weights / factor
        stats["rollout_is_batch_norm_factor"] = float(factor)
    return weights, stats


#: verl's per-token divergences of the clamped log-ratio ``d`` (``rollout_rs`` statistics).
_DIVERGENCE: Mapping[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d.square(),
    "k3": lambda d: torch.exp(d) - 1.0 - d,
}


class _Criterion(NamedTuple):
    """What verl's statistics of one ``rollout_rs`` option read."""

    batch: _Batch
    tokens: Tensor  # the statistic per token (a sequence level's, per sequence, broadcast)
    seqs: Tensor  # per non-empty sequence (a single 0 when none)
    by_token: bool
    two_sided: bool  # k1: a lower bound too
    upper: float  # for k1, the log of the ratio bounds
    lower: float  # 0 unless k1
    keep: Tensor  # the tokens this option keeps

    def beyond(self, high: bool) -> Tensor:
        bound = self.upper if high else self.lower
        if self.by_token:
            return self.batch.mean(self.tokens > bound if high else self.tokens < bound)
        return _share(self.seqs > bound if high else self.seqs < bound)


_RS: Mapping[str, Stat] = {
    "mean": lambda c: c.batch.mean(c.tokens),
    "max": lambda c: c.batch.extreme(c.tokens, "amax"),
    "min": lambda c: c.batch.extreme(c.tokens, "amin"),
    "fraction_high": lambda c: c.beyond(True),
    "fraction_low": lambda c: c.beyond(False) if c.two_sided else 0.0,
    "std": lambda c: c.batch.spread(c.tokens, c.lower, c.upper),
    "seq_mean": lambda c: c.seqs.mean(),
    "seq_std": lambda c: _std(c.seqs),
    "seq_max": lambda c: c.seqs.max(),
    "seq_min": lambda c: c.seqs.min(),
    "seq_max_deviation": lambda c: c.seqs.abs().max(),
    "seq_fraction_high": lambda c: _share(c.seqs > c.upper),
    "seq_fraction_low": lambda c: _share(c.seqs < c.lower),
    "masked_fraction": lambda c: c.batch.mean(~c.keep),
    "seq_masked_fraction": lambda c: _rejected_rows(c.batch.valid, c.keep),
}


def _rejected_rows(valid: Tensor, keep: Tensor) -> Tensor:
    """The fraction of non-empty sequences with a rejected token (0 when none)."""
    rows = valid.any(dim=-1).sum().to(torch.float64)
    hit = (valid & ~keep).any(dim=-1).sum().to(torch.float64)
    return torch.where(rows > 0, hit / rows.clamp(min=1.0), 0.0)


def _per_sequence(stat: Tensor, batch: _Batch, level: str) -> Tensor:
    """A sequence level's statistic (``token``: the sequence's mean, as verl reports)."""
    if level == "seq_sum":
        return torch.where(batch.valid, stat, 0.0).sum(dim=-1)
    if level == "seq_max":
        top = torch.where(batch.valid, stat, -math.inf).amax(dim=-1)
        return torch.where(top == -math.inf, 0.0, top)
    return batch.row_mean(stat)


def rollout_rs(
    current: Tensor, rollout: Tensor, mask: Tensor, criteria: list[dict[str, Any]]
) -> tuple[Tensor, dict[str, float]]:
    """verl's ``rollout_rs``: the tokens every criterion (:func:`dapo_ops.rejection_mask`
    keywords) keeps, and each option's ``rollout_rs_<option>_*`` statistics."""
    batch, kept, stats = _Batch(mask), mask, dict[str, float]()
    delta = torch.where(mask, current.double() - rollout.double(), 0.0)
    delta = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rows = batch.rows
    for criterion in criteria:
        keep = rejection_mask(current, rollout, mask, **criterion)
        kept = kept & keep
        level, statistic, upper = criterion["level"], criterion["statistic"], criterion["upper"]
        stat = _DIVERGENCE[statistic](delta)
        seq = _per_sequence(stat, batch, "seq_mean" if level == "token" else level)
        tokens = stat if level == "token" else seq[:, None].expand_as(stat)
        two_sided = statistic == "k1"
        lower = criterion["lower"] or 1.0 / upper
        high, low = (math.log(upper), math.log(lower)) if two_sided else (upper, 0.0)
        seqs = seq[rows] if bool(rows.any()) else seq.new_zeros(1)
        context = _Criterion(batch, tokens, seqs, level == "token", two_sided, high, low, keep)
        skip = () if two_sided else ("seq_fraction_low",)
        stats |= _table(_RS, context, f"rollout_rs_{level}_{statistic}_", skip)
    stats["rollout_rs_masked_fraction"] = float(batch.mean(~kept))
    stats["rollout_rs_seq_masked_fraction"] = float(_share((mask & ~kept).any(dim=-1)))
    return kept, stats
