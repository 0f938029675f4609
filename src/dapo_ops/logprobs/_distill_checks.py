"""Argument checks of :func:`dapo_ops.linear_distill_loss` (private): numbers, the
teacher's top-k ids, the tail of the top-k loss and the per-token weights."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dapo_ops._core._validate import (
    InputError,
    check_option,
    check_same_device,
    check_tensor,
    is_compiling,
    shape_str,
)
from dapo_ops.engine.checks import check_constants
from dapo_ops.logprobs._distill_support import TOPK_SUPPORTS
from dapo_ops.logprobs._distill_topk import TOPK_TAILS


def _number(name: str, value: object, ok: bool, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok:
        raise InputError(f"{name} must be {expected}; got {value!r}")


def check_ids(ids: object, teacher: Tensor, valid: Tensor, vocab: int, distinct: bool) -> Tensor:
    """``teacher_ids`` as int64 (0 at masked positions), in ``[0, vocab)`` at unmasked
    positions and, when ``distinct`` (a tail term), distinct among the slots the teacher
    gives mass to (padding, a ``-inf`` log-prob, may repeat any id): one host sync, eager."""
    check_tensor("teacher_ids", ids)
    assert isinstance(ids, Tensor)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InputError(f"teacher_ids must be an integer tensor of token ids, got {ids.dtype}")
    if ids.shape != teacher.shape:
        raise InputError(
            f"teacher_ids must have the shape of teacher (its top-k log-probs) "
            f"{list(teacher.shape)}, got {shape_str(ids)}"
        )
    check_same_device("teacher_ids", ids, "mask", valid)
    ids = torch.where(valid.unsqueeze(-1), ids, 0).to(torch.int64)
    if is_compiling() or not ids.numel():
        return ids
    lo, hi = torch.aminmax(ids)
    dup = torch.zeros((), dtype=torch.bool, device=ids.device)
    if distinct:
        real = valid.unsqueeze(-1) & (teacher > -math.inf)
        pad = -1 - torch.arange(ids.shape[-1], device=ids.device)  # distinct, below any id
        key = torch.where(real, ids, pad).sort(dim=-1).values
        dup = (key[..., 1:] == key[..., :-1]).any()
    lo_, hi_, dup_ = torch.stack([lo, hi, dup.to(lo.dtype)]).tolist()  # the one host sync
    if lo_ < 0 or hi_ >= vocab:
        raise InputError(
            f"teacher_ids must hold ids in [0, vocab) = [0, {vocab}) at unmasked "
            f"positions; got values in [{lo_}, {hi_}]"
        )
    if dup_:
        raise InputError(
            "teacher_ids must be distinct within a position (over the slots whose teacher "
            "log-prob is finite) with topk_tail='bucket' or 'renormalize': a repeated id "
            "would count the student's mass there twice"
        )
    return ids


def check_tail(tail: object, on_topk: bool, kind: str, clamp: object) -> str:
    """``topk_tail``: one of :data:`TOPK_TAILS`; a tail term only on the top-k path and
    without verl's ``log_prob_min_clamp``; the reverse KL and JSD there need one."""
    check_option("topk_tail", tail, TOPK_TAILS)  # type: ignore[arg-type]
    assert isinstance(tail, str)
    if tail != "none" and not on_topk:
        raise InputError(
            f"topk_tail={tail!r} completes a divergence over top-k ids: with teacher_ids "
            f"or topk; got neither (kind={kind!r})"
        )
    if on_topk and tail == "none" and kind != "forward_kl":
        raise InputError(
            f"kind={kind!r} on the top-k path is a divergence between two distributions "
            f"over the ids: topk_tail='bucket' or 'renormalize'; topk_tail='none' (verl's "
            f"forward_kl_topk) is kind='forward_kl' only"
        )
    if tail != "none" and clamp is not None:
        raise InputError(
            f"log_prob_min_clamp is verl's floor of the top-k loss (topk_tail='none'); "
            f"TRL's tail terms use no floor: got log_prob_min_clamp={clamp!r} with "
            f"topk_tail={tail!r}"
        )
    return tail


def check_support(support: object, tail: str, has_ids: bool, topk: object) -> str:
    """``topk_support``: one of :data:`TOPK_SUPPORTS`; other than ``"teacher"`` only with
    ``topk`` over the teacher's logits and a tail term."""
    check_option("topk_support", support, TOPK_SUPPORTS)  # type: ignore[arg-type]
    assert isinstance(support, str)
    if support != "teacher" and (has_ids or topk is None or tail == "none"):
        raise InputError(
            f"topk_support={support!r} picks the ids from the student's logits in each "
            f"chunk: with topk=k, the teacher's logits (not teacher_ids) and topk_tail="
            f"'bucket' or 'renormalize'; got topk={topk!r}, "
            f"teacher_ids {'given' if has_ids else 'None'}, topk_tail={tail!r}"
        )
    return support


def check_is_weights(is_weights: object, mask: Tensor, hidden: Tensor) -> Tensor | None:
    """``is_weights``: None, or a float ``[batch, seq]`` constant on hidden's device."""
    if is_weights is None:
        return None
    check_tensor("is_weights", is_weights)
    assert isinstance(is_weights, Tensor)
    check_constants((("is_weights", is_weights),), shape_of=("mask", mask), device_of=("hidden", hidden))  # fmt: skip
    return is_weights.detach()
