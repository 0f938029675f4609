"""Peak bytes of live tensors during a call: :class:`TensorPeak` (CPU), :func:`measure_cuda`.

:class:`TensorPeak` is the CPU analogue of ``torch.cuda.max_memory_allocated``: the
tensors allocated and freed inside the block, replayed in order from the profiler's
allocator events; the peak of what is live beyond what was there before (allocator
slack not counted). Used by :mod:`benchmarks.memory` (a fresh process per call) and by
the ``tensor_parallel`` suite's ranks (:mod:`benchmarks.suites._tp_worker`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch


class TensorPeak:
    """Peak bytes of live tensors allocated inside the block (profiler allocator events)."""

    peak = 0

    def __enter__(self) -> TensorPeak:
        self.prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        self.prof.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        self.prof.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        profiler = self.prof.profiler
        assert profiler is not None
        kineto: Any = profiler.kineto_results
        events = [e for e in kineto.events() if e.name() == "[memory]"]
        cur = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            cur += e.nbytes()
            self.peak = max(self.peak, cur)


def measure_cuda(fn: Callable[[], object]) -> int:
    """``max_memory_allocated`` during ``fn()`` minus the allocation before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)
