"""The value checks of checked mode (:class:`dapo_ops.checked`), by argument role.

Every public function names its tensor arguments by role, so one table, keyed on the
parameter names, covers them all (tests/test_checked.py keeps the names in step):

- masks (:data:`MASKS`): an integer mask holds only 0 and 1 (bool needs no check; a
  float mask is refused by the dtype check of every call);
- log-probabilities (:data:`LOG_PROBS`): ``<= 0`` at valid positions (where the mask is
  nonzero; everywhere without a mask; a stack ``[teachers, batch, seq]`` against each
  teacher's positions). -inf is the log-probability of 0; NaN and +inf
  fail, as does any positive value (logits or probabilities passed as log-probs);
- advantages (:data:`ADVANTAGES`): finite at valid positions (``[batch]`` or
  ``[batch, 1]``: in the rows with a valid token);
- ``skip_padding``'s count of valid tokens (an int): at least the mask's count;
- group verdicts (:data:`VERDICTS` with ``group_ids``): the per-sample ``keep`` of the
  flat layout is one verdict per group, so it must agree within each group (group ids
  themselves may be any integers, in any order, of uneven sizes: no other rule).

An argument whose metadata is wrong (not a tensor, on the meta device, of a wrong dtype,
shape or device) is skipped here: the function's own checks, which run next, name it.
All checks of one call cost one host read; locating the first offence (on failure only)
costs more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple, TypeGuard

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError

MASKS = ("mask", "masks")
LOG_PROBS = ("logp", "old_logp", "ref_logp", "rollout_logp", "sampling_logp", "teacher_logp")
ADVANTAGES = ("advantages", "task_advantages")
VERDICTS = ("keep",)
ROLE_NAMES = frozenset((*MASKS, *LOG_PROBS, *ADVANTAGES, *VERDICTS))


class _Check(NamedTuple):
    failed: Tensor  # 0-dim bool, on the argument's device
    message: Callable[[], str]  # the error, built only when ``failed``


def check_values(arguments: Mapping[str, object]) -> None:
    """``InputError`` for the first role argument of ``arguments`` (parameter name ->
    value) whose values break its rule; see the module docstring."""
    checks = list(_mask_checks(arguments))
    mask = arguments.get("mask")
    valid = _valid(mask)
    if mask is not None and valid is None:  # a bad mask: the function's own error
        return _raise_first(checks)
    for name in LOG_PROBS:
        checks.extend(_log_prob_check(name, arguments.get(name), valid))
    for name in ADVANTAGES:
        checks.extend(_advantage_check(name, arguments.get(name), valid))
    for name in VERDICTS:
        checks.extend(_verdict_check(name, arguments.get(name), arguments.get("group_ids")))
    checks.extend(_count_check(arguments.get("skip_padding"), valid))
    _raise_first(checks)


def _count_check(count: object, valid: Tensor | None) -> Iterator[_Check]:
    """``skip_padding``'s count (an int) is at least the valid tokens' (fewer would leave
    tokens out of the loss, which is then NaN)."""
    if valid is None or isinstance(count, bool) or not isinstance(count, int):
        return
    total = valid.sum()
    yield _Check(
        total > count,
        lambda: (
            f"skip_padding={count} is below the batch's valid tokens ({int(total)}): "
            "the loss would leave tokens out"
        ),
    )


def _raise_first(checks: list[_Check]) -> None:
    for check, failed in zip(checks, _read(checks), strict=True):
        if failed:
            raise InputError(check.message())


def _read(checks: list[_Check]) -> list[bool]:
    """Every check's verdict, with one host read per device (one in practice)."""
    flags: dict[int, bool] = {}
    for device in {c.failed.device for c in checks}:
        here = [i for i, c in enumerate(checks) if c.failed.device == device]
        values = torch.stack([checks[i].failed for i in here]).tolist()
        flags.update(zip(here, values, strict=True))
    return [flags[i] for i in range(len(checks))]


def _has_data(t: object) -> TypeGuard[Tensor]:
    return isinstance(t, Tensor) and t.device.type != "meta"


def _is_float(t: object) -> TypeGuard[Tensor]:
    return _has_data(t) and t.dtype.is_floating_point


def _is_integer_mask(t: object) -> TypeGuard[Tensor]:
    return (
        _has_data(t)
        and t.dtype != torch.bool
        and not t.dtype.is_floating_point
        and not t.dtype.is_complex
    )


def _valid(mask: object) -> Tensor | None:
    """Where ``mask`` marks valid positions (bool ``[batch, seq]``), or None (no mask
    given: every position counts; or one the function will refuse)."""
    if not (isinstance(mask, Tensor) and _has_data(mask) and mask.ndim == 2):
        return None
    if mask.dtype == torch.bool:
        return mask
    return mask != 0 if _is_integer_mask(mask) else None


def _where(t: Tensor, bad: Tensor) -> tuple[tuple[int, ...], object, int]:
    """The first offending index (row-major), its value and how many offend."""
    hits = bad.nonzero()
    index = tuple(int(i) for i in hits[0].tolist())
    return index, t[index].item(), hits.shape[0]


def _at(name: str, index: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, index))}]"


def _entries_check(
    name: str,
    t: Tensor,
    bad: Tensor,
    rule: str,
    *,
    place: str = "",
    offend: str = "offend",
    hint: str = "",
) -> _Check:
    """No entry of ``t`` may be ``bad``; the message names the rule, the first offender
    (``place`` says where it lies), how many offend, then the ``hint``."""

    def message() -> str:
        index, value, count = _where(t, bad)
        return (
            f"{name} must {rule} (checked mode): {_at(name, index)} = {value}{place} "
            f"({count} of {t.numel()} entries {offend}){hint}"
        )

    return _Check(bad.any(), message)


def _mask_checks(arguments: Mapping[str, object]) -> Iterator[_Check]:
    for role in MASKS:
        value = arguments.get(role)
        items = (
            [(role, value)]
            if not isinstance(value, (list, tuple))
            else [(f"{role}[{k}]", v) for k, v in enumerate(value)]
        )
        for name, t in items:
            if _is_integer_mask(t):
                assert isinstance(t, Tensor)
                yield _entries_check(
                    name,
                    t,
                    (t != 0) & (t != 1),
                    "hold only 0 and 1",
                    offend="are neither",
                    hint=f"; an integer mask is otherwise read as {name} != 0: pass a bool mask "
                    "or 0/1 values",
                )


def _fits(t: Tensor, valid: Tensor | None) -> bool:
    """``t`` is ``[batch, seq]`` like ``valid``, or a stack of such (``[teachers, batch, seq]``)."""
    if valid is None:
        return True
    return t.device == valid.device and t.shape[-valid.ndim :] == valid.shape


def _log_prob_check(name: str, t: object, valid: Tensor | None) -> Iterator[_Check]:
    if not _is_float(t):
        return
    assert isinstance(t, Tensor)
    if not _fits(t, valid):
        return
    bad = ~(t <= 0)  # positive, +inf or NaN
    if valid is not None:
        bad = bad & valid
    yield _entries_check(
        name,
        t,
        bad,
        "be log-probabilities, <= 0 at valid positions",
        place=" where the mask is nonzero",
        hint="; logits or probabilities instead of log-probs? Gather log_softmax at the sampled "
        "tokens (dapo_ops.token_logprobs)",
    )


def _advantage_check(name: str, t: object, valid: Tensor | None) -> Iterator[_Check]:
    if not _is_float(t):
        return
    assert isinstance(t, Tensor)
    where: Tensor | None = None
    if valid is not None:
        if t.device != valid.device:
            return
        if t.shape == valid.shape:
            where = valid
        elif t.shape == valid.shape[:1]:
            where = valid.any(dim=-1)
        elif t.shape == (valid.shape[0], 1):
            where = valid.any(dim=-1, keepdim=True)
        else:
            return
    bad = ~torch.isfinite(t)
    if where is not None:
        bad = bad & where
    yield _entries_check(
        name, t, bad, "be finite at valid positions", place=" in a row with valid tokens"
    )


def _verdict_check(name: str, keep: object, group_ids: object) -> Iterator[_Check]:
    """Flat verdicts: sorted by group id, neighbours of one group agree."""
    if not (_has_data(keep) and _is_integer_mask(group_ids)):
        return
    assert isinstance(keep, Tensor) and isinstance(group_ids, Tensor)
    if keep.dtype != torch.bool or keep.ndim != 1 or keep.shape != group_ids.shape:
        return
    if keep.device != group_ids.device or keep.numel() < 2:
        return
    order = torch.sort(group_ids, stable=True).indices
    ids, verdicts = group_ids[order], keep[order]
    split = (ids[1:] == ids[:-1]) & (verdicts[1:] != verdicts[:-1])

    def message() -> str:
        first: dict[int, tuple[int, bool]] = {}
        for i, (g, k) in enumerate(zip(group_ids.tolist(), keep.tolist(), strict=True)):
            j, verdict = first.setdefault(g, (i, k))
            if k != verdict:
                return (
                    f"{name} must give every sample of a group one verdict (checked mode): "
                    f"{name}[{i}] = {k} but {name}[{j}] = {verdict}, both in group_ids "
                    f"group {g}; pass keep and group_ids of the same batch, in the same order "
                    f"(the flat output of dynamic_sample_mask)"
                )
        raise AssertionError("no split group found")  # pragma: no cover

    yield _Check(split.any(), message)
