"""Errors in the peer's words: an adapter reports a bad argument by the name its caller used.

A twin takes the peer's arguments (verl's ``log_prob``, ``response_mask``, ...) and hands
them to dapo_ops functions, whose :class:`~dapo_ops.InputError` names dapo_ops' parameters
(``logp``, ``mask``, ...). :func:`peer_names` re-raises such an error with each dapo_ops
name replaced by the peer's, whole words only (``logp`` and ``old_logp`` are distinct
words), so the message points at the argument the user passed. The original error is
kept as the new one's ``__cause__``.

Example:
    >>> from dapo_ops import InputError
    >>> try:
    ...     with peer_names(VERL_POLICY_LOSS):
    ...         raise InputError("logp must have shape [batch, seq] like old_logp")
    ... except InputError as error:
    ...     print(error)
    log_prob must have shape [batch, seq] like old_log_prob
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType

from dapo_ops._core._validate import InputError

#: dapo_ops' argument names -> verl's ``PolicyLossFn`` arguments (``compute_policy_loss``).
VERL_POLICY_LOSS: Mapping[str, str] = MappingProxyType({
    "logp": "log_prob",
    "old_logp": "old_log_prob",
    "advantages": "advantages",
    "mask": "response_mask",
    "is_weights": "rollout_is_weights",
})  # fmt: skip


def rename(message: str, names: Mapping[str, str]) -> str:
    """``message`` with every whole-word dapo_ops name of ``names`` replaced by the peer's."""
    pattern = r"\b(" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda m: names[m.group(1)], message)


@contextmanager
def peer_names(names: Mapping[str, str]) -> Iterator[None]:
    """Re-raise an :class:`~dapo_ops.InputError` of the block with the peer's names."""
    try:
        yield
    except InputError as error:
        message = rename(str(error), names)
        if message == str(error):
            raise
        raise InputError(message) from error


__all__ = ["VERL_POLICY_LOSS", "peer_names", "rename"]
