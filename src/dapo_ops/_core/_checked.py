"""Checked mode: opt-in value checks that cost a host sync (:class:`checked`).

The default path checks metadata only (shapes, dtypes, devices, options): no host sync. A
positive "log-prob", an integer mask holding 2 or an infinite advantage is accepted
there, because seeing it means reading the values on the host. Checked mode reads them:
every public function whose arguments have a role of
:mod:`dapo_ops._core._value_checks` (masks, log-probs, advantages, group verdicts) checks
their values too, with one host read per call, and raises ``InputError`` naming the
argument and its first offending position.

The state is one :class:`contextvars.ContextVar` (per thread and per asyncio task; a new
thread starts from the process default). Its default is read once, when dapo_ops is
imported, from the environment variable ``DAPO_OPS_CHECKED`` (``1``: on; ``0``, empty or
unset: off); ``with checked():`` / ``with checked(False):`` change it for a block.

Under ``torch.compile`` the checks are skipped while tracing (as the other value checks
of dapo_ops are): reading a value there would break the graph, an error under
``fullgraph=True``. The functions that compile internally (``policy_loss(compiled=True)``,
:class:`~dapo_ops.CompiledPolicyLoss`) run the checks eagerly, outside their compiled graph.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import ParamSpec, TypeVar

from dapo_ops._core._validate import InputError, check_bool, is_compiling
from dapo_ops._core._value_checks import ROLE_NAMES, check_values

ENV_VAR = "DAPO_OPS_CHECKED"

P = ParamSpec("P")
R = TypeVar("R")


def _from_environment() -> bool:
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise InputError(f"{ENV_VAR} must be 1 (on) or 0 (off), or unset; got {raw!r}")


#: The process default, read once at import.
DEFAULT = _from_environment()
#: The only state of checked mode: on or off in this context (thread or task).
_ON: ContextVar[bool] = ContextVar("dapo_ops_checked", default=DEFAULT)


class checked(contextlib.ContextDecorator):  # lowercase, like torch.no_grad
    """Checked mode: every public function also checks the *values* of its arguments.

    Off by default, because each check reads values on the host (a device sync). On, a
    call raises ``InputError`` naming the argument, the first offending position and its
    value when

    - an integer mask (``mask``, ``masks``) holds anything but 0 and 1;
    - a log-probability (``logp``, ``old_logp``, ``ref_logp``, ``rollout_logp``,
      ``sampling_logp``, ``teacher_logp``) is not ``<= 0`` (positive, +inf or NaN; -inf is allowed) at a
      valid position (where the mask is nonzero: logits or probabilities passed as
      log-probs);
    - ``advantages`` (``task_advantages``) are not finite at a valid position (a ``[batch]`` or ``[batch, 1]``
      advantage: in a row with a valid token);
    - per-sample verdicts ``keep`` disagree within a group of ``group_ids``.

    Masked positions are never read. The values are checked when the call returns, so a
    call's own errors (shapes, dtypes, options) come first, as without the mode. All
    checks of one call cost one host read; a public function called by another is
    checked once, at the outermost call.

    Use it as a context manager or a decorator (nesting works: the innermost wins);
    ``checked(False)`` turns it off inside. ``DAPO_OPS_CHECKED=1`` in the environment
    when dapo_ops is imported turns it on for the whole process. The setting is a
    ``contextvars.ContextVar``: per thread and per asyncio task. Skipped while
    ``torch.compile`` traces (no graph break); see docs/errors.md.

    Example:
        >>> import dapo_ops
        >>> logits = torch.tensor([[0.5, -1.0]])  # not log-probs
        >>> mask = torch.tensor([[1, 1]])
        >>> with dapo_ops.checked():  # doctest: +ELLIPSIS
        ...     dapo_ops.kl_penalty(logits, logits - 0.1, mask)
        Traceback (most recent call last):
        ...
        dapo_ops.InputError: logp must be log-probabilities, <= 0 at valid positions ...
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = check_bool("enabled", enabled)
        self._tokens: list[Token[bool]] = []

    def __enter__(self) -> checked:
        self._tokens.append(_ON.set(self.enabled))
        return self

    def __exit__(self, *exc: object) -> None:
        _ON.reset(self._tokens.pop())

    def _recreate_cm(self) -> checked:  # a fresh one per decorated call (threads, recursion)
        return checked(self.enabled)

    @staticmethod
    def is_enabled() -> bool:
        """Whether checked mode is on here (in this thread or task)."""
        return _ON.get()


def check_inputs(**arguments: object) -> None:
    """In checked mode, the value checks of ``arguments`` (role name -> value), for a
    caller that then passes derived tensors to public functions under ``checked(False)``:
    an adapter of :mod:`dapo_ops.integrations` whose ``old_logp`` is a device for a
    sequence ratio (``logp - log s``), not log-probabilities."""
    if not is_compiling() and _ON.get():
        check_values(arguments)


def checks_values(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a public function: in checked mode, run it with checked mode off (what it
    calls gets arguments it made or that are checked here), then check its role
    arguments' values (:func:`dapo_ops._core._value_checks.check_values`) before returning.

    Checking after the call keeps the function's own errors (shapes, dtypes, options)
    first, as without checked mode: the mode only refuses calls that would succeed, and
    a collective (``global_normalizer``'s ``all_reduce``) runs on every rank before one
    of them raises. A raw error of the call (not a ``ValueError`` or ``TypeError``: those
    are the caller's errors, ``InputError`` included) is replaced by the value error that
    explains it, if there is one."""
    signature = inspect.signature(fn)
    roles = ROLE_NAMES & signature.parameters.keys()
    var_kw = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    if not roles and not var_kw:
        raise TypeError(f"{fn.__qualname__} has no argument that checked mode checks")

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if is_compiling() or not _ON.get():
            return fn(*args, **kwargs)
        try:
            arguments = dict(signature.bind(*args, **kwargs).arguments)
        except TypeError:  # a call that does not fit: the function's own error
            return fn(*args, **kwargs)
        for name in var_kw:
            arguments.update(arguments.pop(name, {}))
        token = _ON.set(False)
        try:
            result = fn(*args, **kwargs)
        except (ValueError, TypeError):
            raise  # the call's own error (InputError, an annotation checker's) comes first
        except Exception as raw:  # a raw error: a bad value may be its cause, name it if so
            try:
                check_values(arguments)
            except InputError as error:
                raise error from raw
            raise
        finally:
            _ON.reset(token)
        check_values(arguments)
        return result

    wrapper.__dapo_checked__ = True  # type: ignore[attr-defined]
    return wrapper
