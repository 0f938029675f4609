"""Extra peak memory of one call, in a fresh process (CPU) or from the CUDA allocator.

CPU: one subprocess per (case, implementation) runs ``python -m benchmarks.memory SPEC``:
it builds the case's inputs, warms the implementation up (on the case's small
``warm_inputs`` when it has them, so that a large case runs only once), frees what it
can (``malloc_trim``), resets the peak-RSS counter (``/proc/self/clear_refs``) and runs
one measured call, then one more under ``torch.profiler`` with ``profile_memory``.
Two figures:

- *tensors*: the peak bytes of live tensors allocated during the call, replayed from the
  profiler's allocator events (the CPU analogue of ``torch.cuda.max_memory_allocated``;
  allocator slack not counted). The targets read this one.
- *RSS*: ``VmHWM - VmRSS``, what the process grew by, glibc's slack included; glibc's
  mmap threshold is pinned at 64 KiB in the child so that freed buffers go back to the
  OS and the counter sees every large temporary.

CUDA: ``max_memory_allocated`` minus the allocation before the call, in-process
(:func:`benchmarks.peak.measure_cuda`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Case, Impl, Protocol, address_space_cap, status_bytes
from benchmarks.peak import TensorPeak

ROOT = Path(__file__).resolve().parent.parent


def _reset_peak() -> int:
    """Return freed memory to the OS, reset VmHWM to the current RSS; return that RSS."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def child(spec: dict[str, Any]) -> dict[str, int]:
    from benchmarks.suites import SUITES

    torch.set_num_threads(spec["threads"])
    suite = SUITES[spec["suite"]]
    case = next(
        c
        for c in suite.make_cases(spec["quick"], "cpu")
        if c.op == spec["op"] and c.size == spec["size"]
    )
    impl = next(i for i in case.impls if i.name == spec["impl"])
    with address_space_cap(case.budget_gib):
        if case.warm_inputs is not None:
            impl.build(case.warm_inputs())()  # library initialisation, compilation
            fn = impl.build(case.make_inputs())
            if impl.compiled:
                fn()  # a new shape: compiled code recompiles once
        else:
            fn = impl.build(case.make_inputs())
            fn()
        base = _reset_peak()
        fn()  # the resident-set figure, without the profiler's own buffers
        rss = status_bytes("VmHWM") - base
        with TensorPeak() as tensors:
            fn()
        return {"rss": rss, "tensors": tensors.peak}


def measure_cpu(
    suite: str, case: Case, impl: Impl, proto: Protocol
) -> tuple[tuple[int, int] | None, str]:
    """(extra peak RSS, extra peak live tensors) of one call, in a fresh process."""
    spec = {
        "suite": suite,
        "op": case.op,
        "size": case.size,
        "impl": impl.name,
        "quick": proto.quick,
        "threads": proto.threads,
    }
    path = os.pathsep.join(
        filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))
    )  # the caller's too
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=path)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=1800,
            env=env,
            cwd=ROOT,
            check=True,
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        return (int(got["rss"]), int(got["tensors"])), ""
    except Exception as e:  # reported, the run goes on
        return None, f"{type(e).__name__}: {str(getattr(e, 'stderr', ''))[-300:]}"


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
