"""The benchmark harness: cases, the timing protocol, the bandwidth floor, the machine.

A *suite* (``benchmarks/suites/*.py``) is a list of :class:`Case`; a case is one input
size of one operation and the implementations timed on it side by side (ours, the
peers' real functions when installed, op-for-op mirrors of the peers' code paths from
``benchmarks/references.py``, and yardsticks such as one ``h @ W.T``).

Protocol of :func:`benchmarks.runner.run_case`: every implementation is built on the
same inputs and called twice (warm-up and compilation; the first call's time is kept, so compile time
is ``first call - median``); then the repeats run *interleaved*, round-robin, so that
background load hits every implementation alike (``back_to_back`` cases instead run
each implementation's repeats in one block, caches warm). Reported per implementation:
median, inter-quartile range and minimum. CPU timing is ``time.perf_counter``; CUDA
timing is CUDA events. Peak memory is measured in a fresh process (``memory.py``).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Fn = Callable[[], object]
Role = Literal["ours", "ref", "unit"]
MemoryPolicy = Literal["all", "main", "none"]


@dataclass
class Impl:
    """One implementation of a case: ``build(inputs)`` returns one iteration."""

    name: str
    role: Role  # "ours", "ref" (a peer or a mirror of one) or "unit" (a yardstick)
    build: Callable[[Any], Fn]
    compiled: bool = False
    #: why it cannot run here (e.g. a peer that is not installed): reported, not timed
    missing: str | None = None
    #: the devices whose suites have this row (a CUDA-only kernel is not listed on CPU)
    devices: tuple[str, ...] = ("cpu", "cuda")


@dataclass
class Case:
    op: str
    size: str
    make_inputs: Callable[[], Any]
    impls: list[Impl]
    floor_bytes: int = 0  # bytes the op must read + write (0: no bandwidth floor)
    basis_bytes: int = 0  # what the extra peak memory is divided by
    basis_name: str = "inputs"
    main_ref: str | None = None  # the implementation the "x ref" column divides by
    unit: str | None = None  # the implementation whose median is the time unit
    back_to_back: bool = False
    memory: MemoryPolicy = "main"
    memory_quick: bool = False  # measure the peak memory in --quick runs too
    warm_inputs: Callable[[], Any] | None = None  # small inputs for the memory child's warm-up
    repeats: int | None = None  # fixed repeat count (large cases)
    budget_gib: float | None = None  # address-space cap: a method that does not fit fails
    limit_bytes: int = 0  # a memory budget a target of the suite reads (0: none)
    elems: int = 0  # tokens or samples, for plots


@dataclass
class Result:
    suite: str
    op: str
    size: str
    impl: str
    role: str
    times: list[float] = field(default_factory=list)
    first_call_s: float | None = None
    compile_s: float | None = None
    mem_rss: int | None = None  # extra peak resident memory (CPU, fresh process)
    mem_tensors: int | None = None  # extra peak bytes of live tensors (profiler / CUDA)
    basis_bytes: int = 0
    kernels: int | None = None
    error: str | None = None
    #: the collectives one call makes, in order: ``[phase, op, what, bytes]`` each
    #: (:mod:`benchmarks.collectives`; None: not counted)
    collectives: list[list[Any]] | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    @property
    def minimum(self) -> float:
        return min(self.times) if self.times else math.nan

    @property
    def q1q3(self) -> tuple[float, float]:
        if len(self.times) < 2:
            return (self.median, self.median)
        q = statistics.quantiles(self.times, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def mem(self) -> int | None:
        """The extra peak the targets read: live tensors where measured, else RSS."""
        return self.mem_tensors if self.mem_tensors is not None else self.mem_rss


@dataclass
class Target:
    """One target, evaluated on the measured numbers of one run."""

    name: str
    measured: str
    limit: str
    met: bool | None  # None: not measured in this run
    reason: str = ""
    recorded: bool = False  # a figure the issue asks for without a limit

    @property
    def verdict(self) -> str:
        if self.recorded:
            return "recorded (no limit set)"
        if self.met is None:
            return f"not measured ({self.reason})" if self.reason else "not measured"
        if self.met:
            return f"**met** ({self.reason})" if self.reason else "**met**"
        return f"**not met** ({self.reason})" if self.reason else "**not met**"


@dataclass
class Suite:
    name: str
    title: str
    make_cases: Callable[[bool, str], list[Case]]
    #: (results, cases, copy bandwidth, device) -> the issue's targets for that device
    targets: Callable[[list[Result], list[Case], float, str], list[Target]] = lambda *_: []
    agreement: Callable[[str], list[str]] = lambda _: []
    notes: Sequence[str] = ()
    bandwidth: bool = True  # does a case of this suite use the bandwidth floor
    #: a suite that measures something else than step times runs itself
    run: Callable[[Protocol, Callable[[str], None]], list[Result]] | None = None


def for_device(impls: list[Impl], device: str) -> list[Impl]:
    """The implementations that belong to ``device``'s suite (:attr:`Impl.devices`)."""
    return [i for i in impls if device in i.devices]


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(fn: Fn, device: str) -> float:
    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(device: str, quick: bool) -> float:
    """Bytes/s of a large float32 ``copy_`` (read + write), median of repeats."""
    n = (64 if quick else 128) * 2**20 if device == "cpu" else 256 * 2**20
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [time_once(lambda: dst.copy_(src), device) for _ in range(7 if quick else 15)]
    return 2 * n * 4 / statistics.median(times)


def warm_allocator(device: str) -> None:
    """Allocate, touch and free one 30 MiB tensor, as a trainer has long before its loss.

    glibc raises its mmap threshold to the largest freed mmapped block (up to 32 MiB);
    until then every temporary of 128 KiB or more is a fresh mmap whose pages fault on
    first touch (~1 ms per MiB on a VM), and timings would depend on the process's
    allocation history rather than on the code timed.
    """
    if device == "cpu":
        torch.empty(30 * 2**20 // 4).fill_(0.0)


def count_kernels(fn: Fn) -> int | None:
    """GPU kernels (memcpy/memset included) launched by one call, from torch.profiler."""
    try:
        from torch.autograd import DeviceType  # type: ignore[attr-defined]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # profiler unavailable: n/a
        return None


def status_bytes(key: str, path: str = "/proc/self/status") -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


@contextlib.contextmanager
def address_space_cap(budget_gib: float | None) -> Any:
    """Cap the address space at the current size + ``budget_gib``: an allocation that does
    not fit raises (reported as that implementation's error) instead of waking the OOM
    killer. The previous limit is restored afterwards."""
    if budget_gib is None or not os.path.exists("/proc/self/status"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = status_bytes("VmSize") + int(budget_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard < 0 else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@dataclass
class Protocol:
    device: str
    quick: bool
    target_s: float
    min_repeats: int
    max_repeats: int
    memory: bool  # measure peak memory (fresh processes on CPU)
    threads: int


def find(results: Sequence[Result], op: str, size: str, prefix: str) -> Result | None:
    """The result of (op, size) whose implementation name starts with ``prefix``."""
    return next(
        (r for r in results if r.op == op and r.size == size and r.impl.startswith(prefix)),
        None,
    )
