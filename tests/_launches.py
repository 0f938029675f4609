"""Recording the library's Triton kernel launches in tests (interpreted, on CPU).

:func:`record_launches` swaps the named kernels of a kernel module (as
``dapo_ops._core._triton.load_kernels`` loaded it) for wrappers that note each launch's
name and keyword options, then run it; ``Launches.busy`` is true while a kernel runs, so
a caller tracing ATen ops can tell the kernel's own (interpreter) work from the host's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from dapo_ops._core._triton import load_kernels


@dataclasses.dataclass
class Launches:
    """What ran: ``(kernel name, keyword arguments)`` per launch, in order."""

    calls: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)
    busy: bool = False

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


class _Recorded:
    def __init__(self, name: str, kernel: Any, launches: Launches) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kw: Any) -> Any:
            self.launches.calls.append((self.name, kw))
            self.launches.busy = True
            try:
                return self.kernel[grid](*args, **kw)
            finally:
                self.launches.busy = False

        return launch


def record_launches(
    monkeypatch: pytest.MonkeyPatch, module: str, names: tuple[str, ...]
) -> Launches:
    """Record the interpreted kernels ``names`` of kernel module ``module`` until the test
    ends."""
    launches = Launches()
    ks = load_kernels(module, True)
    for name in names:
        monkeypatch.setattr(ks, name, _Recorded(name, getattr(ks, name), launches))
    return launches
