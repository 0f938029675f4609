"""The global normaliser of one optimiser step, over micro-batches and data-parallel ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Integer
from torch import Tensor

from dapo_ops._core._checked import checks_values
from dapo_ops._core._validate import InputError, as_bool_mask, check_bool, check_ndim, check_option
from dapo_ops.engine.aggregation import AGGREGATION_MODES, AggregationMode

MaskLike = Bool[Tensor, "_batch _seq"] | Integer[Tensor, "_batch _seq"]


@checks_values
def global_normalizer(
    masks: MaskLike | Sequence[MaskLike],
    *,
    mode: AggregationMode = "token_mean",
    group: Any | None = None,
    grads_averaged_over_ranks: bool = True,
) -> Float[Tensor, ""]:
    r"""The denominator that makes micro-batch losses add up to the full-batch loss.

    ``masks`` are the loss masks of *all* micro-batches this rank runs in one optimiser
    step (one tensor, or a list of ``[batch, seq]`` tensors of any sizes), after any
    overlong filtering. The count is

    - ``mode="token_mean"``: valid tokens, :math:`\sum_{mb}\sum_{i,t} m_{i,t}`;
    - ``seq_mean_*`` modes: sequences with at least one valid token;

    summed over the ranks of ``group`` with ``all_reduce`` when ``torch.distributed`` is
    initialised (on the masks' device, so use a backend that serves it), and over nothing
    otherwise. Pass the result as ``normalizer=`` to every micro-batch's
    :func:`token_level_loss` / :func:`token_level_aggregate` and call ``backward()`` on
    each: the accumulated gradient is the one of the full-batch loss.

    World-size factor: DDP and FSDP *average* gradients over ranks, i.e. divide their sum
    by the world size ``W``. To get the gradient of (sum of all ranks' token losses) /
    (global count), each rank must then divide by ``global count / W``; that is what this
    returns when ``grads_averaged_over_ranks=True`` (the default, right for DDP/FSDP
    defaults). If your ranks *sum* gradients (a hand-written ``all_reduce(SUM)``, or DDP
    with a comm hook that sums), pass ``False`` to get the plain global count.

    Counts are reduced as int64 (exact at any scale) and returned as a 0-dim float64
    tensor; the loss functions cast it to their compute dtype.

    Example:
        >>> micro = [torch.tensor([[1, 1, 0]]), torch.tensor([[1, 0, 0], [0, 0, 0]])]
        >>> global_normalizer(micro)  # 3 valid tokens, single process
        tensor(3., dtype=torch.float64)
        >>> global_normalizer(micro, mode="seq_mean_token_mean")  # 2 non-empty sequences
        tensor(2., dtype=torch.float64)
    """
    check_option("mode", mode, AGGREGATION_MODES)
    check_bool("grads_averaged_over_ranks", grads_averaged_over_ranks)
    mask_list = [masks] if isinstance(masks, Tensor) else list(masks)
    if not mask_list:
        raise InputError("masks must hold at least one [batch, seq] mask")
    counts = []
    for k, mask in enumerate(mask_list):
        name = f"masks[{k}]" if not isinstance(masks, Tensor) else "masks"
        if not isinstance(mask, Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
        check_ndim(name, mask, 2, "[batch, seq]")
        valid = as_bool_mask(name, mask, name, mask)
        if mode == "token_mean":
            counts.append(valid.sum())
        else:
            counts.append(valid.any(dim=-1).sum())
    count = torch.stack(counts).sum().to(torch.int64)
    world = 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count, group=group)
        world = dist.get_world_size(group)
    total = count.to(torch.float64)
    return total / world if grads_averaged_over_ranks else total
