"""verl: DAPO's group filtering (``algorithm.filter_groups``) as a pure function.

:func:`filter_groups` is one step of the filter loop of verl's DAPO recipe
(``recipe/dapo/dapo_ray_trainer.py``, ``RayDAPOTrainer.fit``; verl 0.9.1 no longer ships
the recipe in its package, so its documented behaviour is reproduced here and tested
against a transcription of that loop, and the group verdict also against verl 0.9.1's own
``ReplayBuffer._dapo_filtered_keys``, in ``tests/integration/test_verl_sampling.py``):

1. Group the generation batch's trajectories by ``uid``; keep a group when its metric
   (``algorithm.filter_groups.metric``: ``acc``, ``score``, ``seq_reward``,
   ``seq_final_reward``; see :func:`filter_metric`) is not the same for all its
   trajectories, **or when it has one trajectory** (verl's choice, where the GRPO
   advantage of a one-sample group is its raw score; ``keep_single_sample_groups=False``
   drops it, as :func:`dapo_ops.dynamic_sample_mask` and ``DapoGRPOTrainer`` do: it has
   no spread to learn from).
2. Add the kept prompts to ``num_prompt_in_batch``. Below ``train_batch_size``: generate
   another batch while ``num_gen_batches < max_num_gen_batches`` (``<= 0``: no limit), and
   at the cap raise ``ValueError`` as verl does, or with ``on_cap="train"`` stop and train
   on what was kept (``DapoGRPOTrainer``'s behaviour). Otherwise the batch is complete:
   the caller keeps its first ``train_batch_size * rollout.n`` trajectories, as verl does.

Differences from verl: the spread is ``max - min > 0`` computed exactly
(:func:`dapo_ops.dynamic_sample_mask`), where verl tests ``np.std(values) > 0``, which can
underflow to 0 for values closer than about ``1e-154`` or overflow for values near the
float64 limit; a NaN or inf metric raises ``InputError`` (verl drops a NaN group unless it
has one trajectory). The caller keeps the loop state (``num_prompt_in_batch``,
``num_gen_batches``), so the function has none.

Example (the recipe's loop body, ``batch`` accumulating ``DataProto`` rows)::

    num_gen_batches += 1
    step = filter_groups(
        filter_metric(new_batch, metric_name),
        new_batch.non_tensor_batch["uid"],
        train_batch_size=config.data.train_batch_size,
        num_prompt_in_batch=num_prompt_in_batch,
        num_gen_batches=num_gen_batches,
        max_num_gen_batches=config.algorithm.filter_groups.max_num_gen_batches,
    )
    num_prompt_in_batch = step.num_prompt_in_batch
    new_batch = new_batch[step.keep.nonzero().flatten().tolist()]
    batch = new_batch if batch is None else DataProto.concat([batch, new_batch])
    if not step.done:
        continue
    batch = batch[: config.data.train_batch_size * config.actor_rollout_ref.rollout.n]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from dapo_ops._core._validate import InputError, check_bool, check_int, check_option
from dapo_ops.rewards.sampling import dynamic_sample_mask


class FilterGroupsStep(NamedTuple):
    """The result of :func:`filter_groups` on one generation batch.

    ``keep [batch]`` (bool): the trajectories to append (whole groups, in batch order);
    ``kept_prompts``: the kept groups of this batch; ``num_prompt_in_batch``: kept groups
    so far, this batch included; ``done``: train now (the batch is full, or the cap was
    reached with ``on_cap="train"``); ``capped``: done without a full batch.
    """

    keep: Tensor
    kept_prompts: int
    num_prompt_in_batch: int
    done: bool
    capped: bool


def filter_groups(
    metric: Tensor | np.ndarray | Sequence[float],
    uid: Sequence[Hashable] | np.ndarray,
    *,
    train_batch_size: int,
    num_prompt_in_batch: int = 0,
    num_gen_batches: int = 1,
    max_num_gen_batches: int = 0,
    keep_single_sample_groups: bool = True,
    on_cap: Literal["raise", "train"] = "raise",
) -> FilterGroupsStep:
    """One step of verl's DAPO group filter (``algorithm.filter_groups``); see the module.

    ``metric [batch]``: each trajectory's value of the filter metric (a tensor, a NumPy
    array such as ``non_tensor_batch["acc"]``, or a list); ``uid [batch]``: its prompt's
    uid (any hashable; groups need not be contiguous). ``train_batch_size`` (int >= 1):
    verl's ``data.train_batch_size``, in prompts; ``num_prompt_in_batch`` (int >= 0,
    default 0): kept prompts before this batch; ``num_gen_batches`` (int >= 1, default 1):
    generation batches so far, this one included; ``max_num_gen_batches`` (int, default 0;
    ``<= 0``: no limit); ``keep_single_sample_groups`` (default ``True``, verl's choice);
    ``on_cap`` (``"raise"``, verl's, or ``"train"``).

    Raises ``ValueError`` (verl's message) when the cap is reached with ``on_cap="raise"``;
    ``InputError`` naming the argument for bad arguments.

    Example:
        >>> step = filter_groups([1, 0, 1, 1, 0.5], ["p", "p", "q", "q", "r"], train_batch_size=2)
        >>> step.keep.tolist(), step.num_prompt_in_batch, step.done
        ([True, True, False, False, True], 2, True)
    """
    if isinstance(metric, Tensor):
        values = metric.detach().to("cpu", torch.float64)
    else:
        values = torch.as_tensor(np.asarray(metric, dtype=np.float64))
    if values.ndim != 1:
        raise InputError(f"metric must be 1-D [batch], got shape {tuple(values.shape)}")
    uids = list(uid)
    if len(uids) != values.numel():
        raise InputError(f"uid has {len(uids)} entries but metric has {values.numel()}")
    train_batch_size = check_int("train_batch_size", train_batch_size, low=1)
    num_prompt_in_batch = check_int("num_prompt_in_batch", num_prompt_in_batch, low=0)
    num_gen_batches = check_int("num_gen_batches", num_gen_batches, low=1)
    max_num_gen_batches = check_int("max_num_gen_batches", max_num_gen_batches, low=-(2**63))
    keep_single = check_bool("keep_single_sample_groups", keep_single_sample_groups)
    check_option("on_cap", on_cap, ("raise", "train"))
    ids: dict[Hashable, int] = {}
    group = torch.tensor([ids.setdefault(u, len(ids)) for u in uids], dtype=torch.long)
    if values.numel() == 0:
        keep = torch.zeros(0, dtype=torch.bool)
    else:
        keep = dynamic_sample_mask(values, group)
        if keep_single:
            keep = keep | (torch.bincount(group)[group] == 1)
    kept_prompts = len({int(g) for g in group[keep].tolist()})
    total = num_prompt_in_batch + kept_prompts
    if total >= train_batch_size:
        return FilterGroupsStep(keep, kept_prompts, total, done=True, capped=False)
    if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
        return FilterGroupsStep(keep, kept_prompts, total, done=False, capped=False)
    if on_cap == "raise":
        raise ValueError(
            f"num_gen_batches={num_gen_batches} >= max_num_gen_batches={max_num_gen_batches}. "
            "Generated too many. Please check if your data are too difficult. You could also "
            "try set max_num_gen_batches=0 to enable endless trials."
        )
    return FilterGroupsStep(keep, kept_prompts, total, done=True, capped=True)


def filter_metric(batch: Any, name: str) -> Any:
    """The per-trajectory metric the recipe filters on, read from a verl ``DataProto``.

    ``"seq_final_reward"``: ``token_level_rewards`` summed over the response (after any KL
    in the reward); ``"seq_reward"``: ``token_level_scores`` summed; any other name (``acc``,
    ``score``, a key the reward function returned): ``non_tensor_batch[name]``.
    """
    if name == "seq_final_reward":
        return batch.batch["token_level_rewards"].sum(dim=-1)
    if name == "seq_reward":
        return batch.batch["token_level_scores"].sum(dim=-1)
    if name not in batch.non_tensor_batch:
        raise InputError(
            f"metric {name!r} is not in the batch's non_tensor_batch "
            f"({sorted(batch.non_tensor_batch)}); the reward function must return it"
        )
    return batch.non_tensor_batch[name]


__all__ = ["FilterGroupsStep", "filter_groups", "filter_metric"]
