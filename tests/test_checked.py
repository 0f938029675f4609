"""Checked mode (issue 28, item 10): value errors that cost a host sync, opt-in.

Every public function of the bad-input registry with a role argument (masks, log-probs,
advantages, group verdicts; :mod:`dapo_ops._core._value_checks`) gets an offending value at a
valid position: ``InputError`` naming the argument and the position in checked mode, no
error when off; garbage at masked positions never raises; the off path never calls the
checks; the mode's switches (context manager, decorator, threads, the environment
variable in a fresh process) and ``torch.compile``.
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_bad_inputs import REGISTRY, SPECS, build, call, masked_positions, outputs

import dapo_ops as d
from dapo_ops._core import _checked, _value_checks

pytestmark = pytest.mark.usefixtures("no_runtime_typecheck")


def _role_cases(roles: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    for s in REGISTRY:
        for name in s.args:
            if name in roles:
                yield s.name, name


def _offend(fn: str, arg: str, bad: float) -> tuple[dict[str, Any], str]:
    """Valid arguments of ``fn`` but ``bad`` in ``arg`` at a valid position (row 0 is
    full: see test_bad_inputs._mask), and that position as the message shows it."""
    s = SPECS[fn]
    kwargs = build(s, batch=3, seq=5)
    t = kwargs[arg].clone()
    index = (0, 2) if t.ndim == 2 else (0,)
    t[index] = bad
    kwargs[arg] = t
    return kwargs, f"{arg}[{', '.join(map(str, index))}]"


def _raises(s: Any, kwargs: dict[str, Any], *needles: str) -> None:
    with d.checked(), pytest.raises(d.InputError) as info:
        call(s, kwargs)
    message = str(info.value)
    assert "checked mode" in message and all(n in message for n in needles), message


@pytest.mark.parametrize(("fn", "arg"), list(_role_cases(_value_checks.LOG_PROBS)))
@pytest.mark.parametrize("bad", [0.5, math.inf, math.nan])
def test_a_log_prob_above_zero_raises_in_checked_mode_only(fn: str, arg: str, bad: float) -> None:
    kwargs, where = _offend(fn, arg, bad)
    _raises(SPECS[fn], kwargs, where, str(bad))
    with d.checked(False):
        call(SPECS[fn], kwargs)  # accepted silently, as documented for the default path


@pytest.mark.parametrize(("fn", "arg"), list(_role_cases(_value_checks.ADVANTAGES)))
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_nonfinite_advantage_raises_in_checked_mode_only(fn: str, arg: str, bad: float) -> None:
    kwargs, where = _offend(fn, arg, bad)
    _raises(SPECS[fn], kwargs, where, str(bad))
    with d.checked(False):
        call(SPECS[fn], kwargs)


@pytest.mark.parametrize(("fn", "arg"), list(_role_cases(_value_checks.MASKS)))
@pytest.mark.parametrize("bad", [2, -1])
def test_an_integer_mask_beyond_0_1_raises_in_checked_mode_only(
    fn: str, arg: str, bad: int
) -> None:
    s = SPECS[fn]
    kwargs = build(s, batch=3, seq=5)
    mask = kwargs[arg].to(torch.int32)
    mask[2, 1] = bad  # row 2 may be empty: a bad entry anywhere is an error
    _raises(s, {**kwargs, arg: mask}, f"{arg}[2, 1] = {bad}")
    with d.checked(False):
        call(s, {**kwargs, arg: mask})
    with d.checked():  # a valid integer mask passes
        call(s, {**kwargs, arg: kwargs[arg].to(torch.int32)})


def test_a_list_of_masks_names_the_element() -> None:
    masks = [torch.ones(2, 3, dtype=torch.int64), torch.tensor([[1, 0, 3]])]
    with d.checked(), pytest.raises(d.InputError, match=r"masks\[1\]\[0, 2\] = 3"):
        d.global_normalizer(masks)


@pytest.mark.parametrize("fn", [n for n, _ in _role_cases(_value_checks.VERDICTS)])
def test_verdicts_that_split_a_group_raise_in_checked_mode_only(fn: str) -> None:
    s = SPECS[fn]
    kwargs = build(s, batch=4, seq=5)
    kwargs["group_ids"] = torch.tensor([7, -2, 7, 5])  # any integers, any order
    kwargs["keep"] = torch.tensor([True, False, False, True])  # group 7: kept and dropped
    _raises(s, kwargs, "keep[2] = False but keep[0] = True", "group 7")
    with d.checked(False):
        call(s, kwargs)
    with d.checked():  # one verdict per group: accepted
        call(s, {**kwargs, "keep": torch.tensor([True, False, True, True])})


def _masked_cases() -> Iterator[tuple[str, str]]:
    roles = (*_value_checks.LOG_PROBS, *_value_checks.ADVANTAGES)
    for fn, arg in _role_cases(roles):
        if SPECS[fn].args[arg].masked_by is not None:
            yield fn, arg


@pytest.mark.parametrize(("fn", "arg"), list(_masked_cases()))
def test_garbage_at_masked_positions_never_raises(fn: str, arg: str) -> None:
    """Positive log-probs and +inf at masked positions: read by nobody, the same result."""
    s = SPECS[fn]
    kwargs = build(s, batch=3, seq=5)
    with d.checked():
        want = outputs(call(s, kwargs))
        dirty = kwargs[arg].clone()
        where = masked_positions(s, arg, kwargs)
        assert bool(where.any())
        dirty[where] = torch.where(torch.rand(dirty[where].shape) < 0.5, 0.7, math.inf)
        got = outputs(call(s, {**kwargs, arg: dirty}))
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x.isnan(), y.isnan())
        assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(y))


def test_the_off_path_never_calls_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default path adds no host read: with the mode off, no check runs at all."""
    calls: list[str] = []
    monkeypatch.setattr(_checked, "check_values", lambda arguments: calls.append("called"))
    with d.checked(False):
        for s in REGISTRY:
            call(s, build(s))
    assert calls == []
    with d.checked():
        for s in REGISTRY:
            call(s, build(s))
    decorated = [s for s in REGISTRY if getattr(s.fn, "__dapo_checked__", False)]
    assert len(calls) == len(decorated) > 30  # once per call, nested calls unchecked


def test_one_host_read_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """All checks of one call share a host read; nested public calls are not re-checked."""
    reads: list[int] = []
    real = _value_checks._read
    monkeypatch.setattr(_value_checks, "_read", lambda checks: reads.append(1) or real(checks))
    s = SPECS["policy_loss_with_diagnostics"]  # calls policy_loss and objective_diagnostics
    with d.checked():
        call(s, {**build(s), "mask": build(s)["mask"].to(torch.uint8)})
    assert reads == [1]


def test_every_role_argument_is_checked() -> None:
    """Each public function (and CompiledPolicyLoss) with a role argument is decorated,
    and every log-prob or mask parameter has a role: a new name cannot slip through."""
    fns = {n: getattr(d, n) for n in d.__all__ if inspect.isfunction(getattr(d, n))}
    fns["CompiledPolicyLoss.__call__"] = d.CompiledPolicyLoss.__call__
    for name, fn in fns.items():
        params = set(inspect.signature(fn).parameters)
        for p in params:
            if "logp" in p or p.endswith(("mask", "masks")) or "advantage" in p:
                assert p in _value_checks.ROLE_NAMES, f"{name}({p}) has no role"
        has_role = bool(params & _value_checks.ROLE_NAMES)
        assert getattr(fn, "__dapo_checked__", False) == has_role, name
    with pytest.raises(TypeError, match="no argument"):
        _checked.checks_values(lambda x: x)


def test_compiled_policy_loss_checks_outside_its_graph() -> None:
    loss_fn = d.CompiledPolicyLoss(d.ClipHigher(), backend="eager")
    logp, mask = torch.tensor([[0.25, -1.0]]), torch.tensor([[True, True]])
    with d.checked(), pytest.raises(d.InputError, match=r"logp\[0, 0\] = 0.25"):
        loss_fn(logp, logp - 0.1, torch.ones(1), mask)
    with d.checked(False):
        assert torch.isfinite(loss_fn(logp, logp - 0.1, torch.ones(1), mask))


def test_the_switches_nest_and_restore() -> None:
    default = d.checked.is_enabled()
    with d.checked(False):
        assert not d.checked.is_enabled()
        with d.checked():
            assert d.checked.is_enabled()
            with d.checked(False):
                assert not d.checked.is_enabled()
            assert d.checked.is_enabled()
        with pytest.raises(RuntimeError), d.checked():
            raise RuntimeError("restored on the way out")
        assert not d.checked.is_enabled()

    @d.checked()
    def inner() -> bool:
        return d.checked.is_enabled()

    with d.checked(False):
        assert inner() and inner() and not d.checked.is_enabled()
    assert d.checked.is_enabled() == default
    with pytest.raises(d.InputError, match="enabled"):
        d.checked(1)  # type: ignore[arg-type]


def test_the_setting_is_per_thread() -> None:
    """A ContextVar: a new thread starts from the process default, not the caller's block."""
    seen: list[bool] = []
    with d.checked(not _checked.DEFAULT):
        worker = threading.Thread(target=lambda: seen.append(d.checked.is_enabled()))
        worker.start()
        worker.join()
    assert seen == [_checked.DEFAULT]


def test_the_suite_runs_in_checked_mode() -> None:
    """conftest.py sets DAPO_OPS_CHECKED=1 before dapo_ops is imported (unless the run
    overrides it)."""
    assert d.checked.is_enabled() == (os.environ.get("DAPO_OPS_CHECKED") == "1")


def test_the_environment_variable_is_read_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, want in (("1", True), ("0", False), ("", False), (" 1 ", True)):
        monkeypatch.setenv("DAPO_OPS_CHECKED", raw)
        assert _checked._from_environment() is want
    monkeypatch.setenv("DAPO_OPS_CHECKED", "yes")
    with pytest.raises(d.InputError, match="DAPO_OPS_CHECKED must be 1"):
        _checked._from_environment()
    code = (
        "import torch, dapo_ops as d\n"
        "print(d.checked.is_enabled())\n"
        "try:\n"
        "    d.kl_penalty(torch.tensor([[0.5]]), torch.tensor([[-1.0]]), torch.tensor([[1]]))\n"
        "    print('accepted')\n"
        "except d.InputError:\n"
        "    print('refused')\n"
    )
    for raw, want in (("1", "True\nrefused"), (None, "False\naccepted")):
        env = {k: v for k, v in os.environ.items() if k != "DAPO_OPS_CHECKED"}
        if raw is not None:
            env["DAPO_OPS_CHECKED"] = raw
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == want, (raw, done.stdout, done.stderr)


def test_torch_compile_traces_with_the_mode_on_or_off() -> None:
    """fullgraph=True compiles either way: while dynamo traces, the checks are skipped
    (documented); the eager call right after checks again."""
    logp, mask = torch.tensor([[0.5, -1.0]]), torch.tensor([[1, 1]])
    with d.checked(False):
        want = d.kl_penalty(logp, logp - 0.2, mask)
    for on in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(d.kl_penalty, fullgraph=True, backend="eager")
        with d.checked(on):
            assert torch.equal(fn(logp, logp - 0.2, mask), want)
    with d.checked(), pytest.raises(d.InputError, match=r"logp\[0, 0\] = 0.5"):
        d.kl_penalty(logp, logp - 0.2, mask)


def test_the_own_errors_of_a_call_come_first() -> None:
    """Values are checked when the call returns: a call that fails without the mode fails
    the same way with it (here a shape error, with a positive log-prob too)."""
    logp, ref = torch.full((2, 3), 0.5), torch.full((2, 4), -1.0)
    with d.checked(False), pytest.raises(d.InputError) as off:
        d.kl_penalty(logp, ref, torch.ones(2, 3, dtype=torch.bool))
    with d.checked(), pytest.raises(d.InputError) as on:
        d.kl_penalty(logp, ref, torch.ones(2, 3, dtype=torch.bool))
    assert str(on.value) == str(off.value) and "checked mode" not in str(on.value)


def test_a_raw_error_is_explained_by_the_value_that_caused_it() -> None:
    def crashes(logp: torch.Tensor, mask: torch.Tensor) -> None:
        raise RuntimeError("an index out of range, deep inside")

    wrapped = _checked.checks_values(crashes)
    with d.checked(), pytest.raises(d.InputError, match=r"logp\[0, 0\] = 3.0") as info:
        wrapped(torch.tensor([[3.0]]), torch.tensor([[True]]))
    assert isinstance(info.value.__cause__, RuntimeError)
    with d.checked(), pytest.raises(RuntimeError, match="deep inside"):  # no value to blame
        wrapped(torch.tensor([[-3.0]]), torch.tensor([[True]]))


def test_a_stack_of_teachers_is_checked_at_each_teachers_valid_positions() -> None:
    logp = -torch.rand(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    teachers = -torch.rand(2, 2, 3)
    teachers[0, 0, 2] = 5.0  # masked: read by nobody
    with d.checked():
        d.distill_loss(logp, teachers, mask)
    teachers[1, 1, 0] = 0.25
    with d.checked(), pytest.raises(d.InputError, match=r"teacher_logp\[1, 1, 0\] = 0.25"):
        d.distill_loss(logp, teachers, mask)
