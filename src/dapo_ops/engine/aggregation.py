"""Token-level loss aggregation (DAPO change 3) and the peer modes it is compared with."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._rules import (
    AGGREGATION_MODES,
    AggregationMode,
    Normalizer,
    compute_dtype,
    safe_divide,
)
from dapo_ops._core._validate import (
    InputError,
    as_bool_mask,
    check_float,
    check_ndim,
    check_option,
    is_compiling,
)

__all__ = [
    "AGGREGATION_MODES",
    "AggregationMode",
    "Normalizer",
    "PartialLoss",
    "aggregate_partial",
    "loss_scale",
    "token_level_aggregate",
]


class PartialLoss(NamedTuple):
    """A loss as an exact (numerator, denominator) pair.

    ``numerator`` is a sum over this micro-batch only; ``denominator`` is this
    micro-batch's share of the normaliser (valid tokens for ``token_mean``, non-empty
    sequences for the ``seq_mean_*`` modes). Pairs from micro-batches and ranks add up
    (``+`` is element-wise), and ``numerator / denominator`` of the sum is the
    full-batch loss.
    """

    numerator: Float[Tensor, ""]
    denominator: Float[Tensor, ""]

    def __add__(self, other: object) -> PartialLoss:  # type: ignore[override]
        if not isinstance(other, PartialLoss):
            return NotImplemented
        return PartialLoss(self.numerator + other.numerator, self.denominator + other.denominator)

    def __radd__(self, other: object) -> PartialLoss:
        """Lets ``sum(parts)`` start from Python's 0."""
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def value(self) -> Float[Tensor, ""]:
        """``numerator / denominator``; 0 (not NaN) when the denominator is 0."""
        return safe_divide(self.numerator, self.denominator)


@checks_values
def aggregate_partial(
    per_token_loss: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    mode: AggregationMode = "token_mean",
    max_len: int | None = None,
) -> PartialLoss:
    r"""The micro-batch's exact share of an aggregated loss, as (numerator, denominator).

    With :math:`\ell_{i,t}` the per-token loss, :math:`m_{i,t}` the mask,
    :math:`n_i = \sum_t m_{i,t}` and :math:`S = \{i : n_i > 0\}` (sequences with at least
    one valid token):

    ============================  =================================================  ==============
    mode                          numerator                                          denominator
    ============================  =================================================  ==============
    ``token_mean`` (DAPO)         :math:`\sum_{i,t} m_{i,t}\ell_{i,t}`               :math:`\sum_i n_i`
    ``seq_mean_token_mean`` (GRPO) :math:`\sum_{i\in S} \frac{1}{n_i}\sum_t m\ell`   :math:`|S|`
    ``seq_mean_token_sum``        :math:`\sum_{i,t} m_{i,t}\ell_{i,t}`               :math:`|S|`
    ``seq_mean_token_sum_norm``   :math:`\frac{1}{L}\sum_{i,t} m_{i,t}\ell_{i,t}`    :math:`|S|`
    ============================  =================================================  ==============

    ``L = max_len`` is Dr. GRPO's constant (the generation cap); it defaults to the
    ``seq`` size of the tensor, as in verl, but pass it explicitly whenever micro-batches
    may be padded to different lengths, or the objective depends on the padding. Other
    modes ignore it, so one set of options can serve every mode.

    Shapes: per_token_loss ``[batch, seq]``; mask ``[batch, seq]`` (bool or 0/1 integers).
    Returns two 0-dim tensors (float32, or float64 for float64 input).

    Example:
        >>> part = aggregate_partial(torch.ones(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]]))
        >>> part.numerator, part.denominator
        (tensor(3.), tensor(3.))
    """
    check_float("per_token_loss", per_token_loss)
    check_ndim("per_token_loss", per_token_loss, 2, "[batch, seq]")
    valid = as_bool_mask("mask", mask, "per_token_loss", per_token_loss)
    check_option("mode", mode, AGGREGATION_MODES)
    check_max_len(max_len)
    dtype = compute_dtype(per_token_loss)
    loss = torch.where(valid, per_token_loss.to(dtype), per_token_loss.new_zeros((), dtype=dtype))
    if mode == "token_mean":
        return PartialLoss(loss.sum(), valid.sum().to(dtype))
    seq_tokens = valid.sum(dim=-1).to(dtype)
    num_seqs = (seq_tokens > 0).sum().to(dtype)
    seq_sum = loss.sum(dim=-1)
    if mode == "seq_mean_token_mean":
        return PartialLoss(safe_divide(seq_sum, seq_tokens).sum(), num_seqs)
    if mode == "seq_mean_token_sum":
        return PartialLoss(seq_sum.sum(), num_seqs)
    length = max(per_token_loss.shape[-1], 1) if max_len is None else max_len
    return PartialLoss(seq_sum.sum() / length, num_seqs)


@checks_values
def token_level_aggregate(
    per_token_loss: Float[Tensor, "batch seq"],
    mask: Bool[Tensor, "batch seq"] | Integer[Tensor, "batch seq"],
    *,
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
) -> Float[Tensor, ""]:
    r"""Aggregate a per-token loss into the scalar that is backpropagated.

    ``loss = numerator / denominator`` with the table of :func:`aggregate_partial`.
    DAPO's ``token_mean`` weighs every valid token of the batch equally (1 / total
    tokens); GRPO's ``seq_mean_token_mean`` weighs every *sequence* equally, so a token
    of a 10-token answer weighs 20x one of a 200-token answer.

    ``normalizer`` replaces the local denominator by a global one (a Python number or a
    0-dim tensor): the valid-token count of the whole optimiser step for ``token_mean``,
    the non-empty sequence count for the ``seq_mean_*`` modes, across micro-batches and
    ranks. Then the micro-batch losses *add up* to the full-batch loss. Use
    :func:`dapo_ops.global_normalizer` to compute it (it also applies the world-size
    factor of DDP's gradient averaging). With ``normalizer=None`` the local count is
    used, which is exact only when this call sees the whole batch; under an initialised
    multi-rank ``torch.distributed`` that is refused unless ``normalizer="local"`` says
    so explicitly.

    A zero denominator (everything masked) gives loss 0 and a zero gradient, never NaN.

    Shapes: per_token_loss ``[batch, seq]``, mask ``[batch, seq]`` (bool or 0/1
    integers); returns a 0-dim float32 tensor (float64 for float64 input).

    Defaults: ``mode="token_mean"`` is DAPO's (sec. 3.3); verl calls it ``token-mean``,
    TRL ``loss_type="dapo"`` (global) / ``"bnpo"`` (local count).

    Example:
        >>> loss = torch.tensor([[1.0, 1.0, 9.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[True, True, False], [True, False, False]])
        >>> token_level_aggregate(loss, mask)  # (1 + 1 + 4) / 3
        tensor(2.)
        >>> token_level_aggregate(loss, mask, normalizer=6)  # half of a 6-token step
        tensor(1.)
    """
    part = aggregate_partial(per_token_loss, mask, mode=mode, max_len=max_len)
    given = check_normalizer(normalizer)
    return safe_divide(part.numerator, part.denominator if given is None else given)


def check_max_len(max_len: int | None) -> None:
    if max_len is not None and (
        isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0
    ):
        raise InputError(f"max_len must be a positive int, got {max_len!r}")


def check_normalizer(normalizer: object, name: str = "normalizer") -> Tensor | float | None:
    """Validate ``normalizer`` (``name`` in errors); return it, or None for the local count.

    The local count (``None``) is refused under a multi-rank ``torch.distributed``;
    ``"local"`` opts in to it explicitly. Tensor values are not inspected (that would
    sync with the device).
    """
    if normalizer is None or isinstance(normalizer, str):
        if isinstance(normalizer, str) and normalizer != "local":
            raise InputError(
                f"{name} must be a number, a 0-dim tensor, None or 'local'; got {normalizer!r}"
            )
        if normalizer is None:
            _refuse_local_count_under_distributed(name)
        return None
    if isinstance(normalizer, Tensor):
        if normalizer.ndim != 0:
            raise InputError(f"{name} must be a 0-dim tensor, got shape {list(normalizer.shape)}")
        if normalizer.is_complex() or normalizer.dtype == torch.bool:
            raise InputError(f"{name} must be a real number, got dtype {normalizer.dtype}")
    elif isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise InputError(f"{name} must be a number or a 0-dim tensor, got {normalizer!r}")
    elif not (0 < normalizer < math.inf):
        raise InputError(
            f"{name} must be finite and > 0 (a count of tokens or sequences), got {normalizer}"
        )
    return normalizer  # type: ignore[return-value]


_GLOBAL_COUNT = {
    "normalizer": "normalizer=dapo_ops.global_normalizer(masks, mode=...)",
    "num_prompts": "num_prompts=<the step's prompts, summed over ranks, times the world size>",
}


def _refuse_local_count_under_distributed(name: str) -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise InputError(
            f"{name}=None under torch.distributed with world size "
            f"{dist.get_world_size()} would divide by this rank's own count and change the "
            f"objective; pass {_GLOBAL_COUNT.get(name, 'the global count')} or, to opt in to "
            f"the per-rank count (TRL's 'bnpo'), {name}='local'"
        )


def _count_true(valid: Tensor, *, row_wise: bool, dtype: torch.dtype | None = None) -> Tensor:
    """Number of True entries of a bool tensor, in all (0-dim) or per row (``[b, 1]``).

    Exact; in ``dtype`` when given. On CPU in eager mode it sums a uint8 view with an
    int32 accumulator (below 2**31 entries), about twice as fast as ``bool.sum``, which
    goes through int64; straight into a float dtype when every partial sum is an
    integer that float represents exactly (fewer than 2**24 entries).
    """
    if valid.device.type == "cpu" and not is_compiling() and valid.numel() < 2**31:
        u8 = valid.view(torch.uint8)
        acc = dtype if dtype is not None and valid.numel() < 2**24 else torch.int32
        count = u8.sum(dim=-1, keepdim=True, dtype=acc) if row_wise else u8.sum(dtype=acc)
    else:
        count = valid.sum(dim=-1, keepdim=True) if row_wise else valid.sum()
    return count if dtype is None or count.dtype == dtype else count.to(dtype)


def loss_scale(
    valid: Bool[Tensor, "batch seq"],
    *,
    mode: AggregationMode = "token_mean",
    normalizer: Normalizer = None,
    max_len: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Float[Tensor, ""] | Float[Tensor, "batch 1"]:
    r"""The weights ``w`` with ``token_level_aggregate(l, valid, ...) == sum_{i,t} w_i m l``.

    ``token_mean``: ``1 / N`` (0-dim); ``seq_mean_token_mean``: ``(1 / |S|) / n_i``
    (``[batch, 1]``); ``seq_mean_token_sum``: ``1 / |S|``; ``seq_mean_token_sum_norm``:
    ``(1 / |S|) / L``; ``N``/``|S|`` replaced by ``normalizer`` when given, a zero count
    replaced by 1 (the loss is then 0). Same checks, same errors and the same rounding
    order as :func:`dapo_ops.token_level_aggregate`'s backward, so the fused gradient is
    bitwise equal to the reference's in float32.

    Example:
        >>> valid = torch.tensor([[True, True, False], [True, False, False]])
        >>> loss_scale(valid)
        tensor(0.3333)
        >>> loss_scale(valid, mode="seq_mean_token_mean")
        tensor([[0.2500],
                [0.5000]])
    """
    check_option("mode", mode, AGGREGATION_MODES)
    check_max_len(max_len)
    given = check_normalizer(normalizer)
    if mode == "token_mean" and given is None:
        # 1 / max(N, 1): a count is an integer, so this is one / where(N == 0, one, N)
        return torch.reciprocal(_count_true(valid, row_wise=False, dtype=dtype).clamp_(min=1))
    one = torch.ones((), dtype=dtype, device=valid.device)
    den = None if given is None else torch.as_tensor(given, dtype=dtype, device=valid.device)
    if mode == "token_mean" and den is not None:
        return one / torch.where(den == 0, one, den)
    seq_tokens = _count_true(valid, row_wise=True, dtype=dtype)
    if den is None:
        den = (seq_tokens > 0).sum().to(dtype)
    inv = one / torch.where(den == 0, one, den)
    if mode == "seq_mean_token_mean":
        return inv / torch.where(seq_tokens == 0, one, seq_tokens)
    if mode == "seq_mean_token_sum":
        return inv
    return inv / (max(valid.shape[-1], 1) if max_len is None else max_len)


def scaled_sum(row_sums: Tensor, scale: Tensor) -> Tensor:
    """``sum_i w_i * row_sums_i`` for the weights of :func:`loss_scale` (0-dim or ``[b, 1]``)."""
    if scale.ndim == 0:
        return row_sums.sum() * scale
    return (row_sums * rearrange(scale, "batch 1 -> batch")).sum()
