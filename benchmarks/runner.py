"""Run one case: time every implementation on the same inputs, then measure its memory.

The protocol is described in :mod:`benchmarks.harness`; peak memory is measured in a
fresh process (:mod:`benchmarks.memory`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from benchmarks import memory, peak
from benchmarks.harness import (
    Case,
    Fn,
    Impl,
    Protocol,
    Result,
    address_space_cap,
    count_kernels,
    time_once,
)


def measure_memory_of(case: Case, impl: Impl, proto: Protocol) -> bool:
    if not proto.memory or case.memory == "none" or case.back_to_back:
        return False
    if proto.quick and not case.memory_quick:
        return False
    if case.memory == "all":
        return not (proto.quick and impl.compiled)
    return (impl.role == "ours" and not impl.compiled) or impl.name == case.main_ref


def run_case(suite: str, case: Case, proto: Protocol, log: Callable[[str], None]) -> list[Result]:
    """Time every implementation of ``case`` (and measure its memory): the protocol above."""
    device = proto.device
    results = {i.name: Result(suite, case.op, case.size, i.name, i.role) for i in case.impls}
    fns: dict[str, Fn] = {}
    per_call: dict[str, float] = {}
    # no cap on CUDA: the driver reserves far more address space than it uses
    with address_space_cap(case.budget_gib if device == "cpu" else None):
        inputs = case.make_inputs()
        for impl in case.impls:
            res = results[impl.name]
            res.basis_bytes = case.basis_bytes
            if impl.missing is not None:
                res.error = impl.missing
                continue
            try:
                fn = impl.build(inputs)
                res.first_call_s = time_once(fn, device)  # warm-up (and compilation)
                per_call[impl.name] = time_once(fn, device)
                fns[impl.name] = fn
                if per_call[impl.name] > 1.0:  # a long case: show progress
                    log(
                        f"    {impl.name}: first call {res.first_call_s:.1f} s, then {per_call[impl.name]:.1f} s"
                    )
            except Exception as e:  # recorded in the table, exactly
                res.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                log(f"    {impl.name}: ERROR {res.error}")
            gc.collect()
        repeats = {
            name: case.repeats
            or int(min(proto.max_repeats, max(proto.min_repeats, proto.target_s / max(t, 1e-7))))
            for name, t in per_call.items()
        }
        if case.back_to_back:
            for name, fn in fns.items():
                results[name].times += [time_once(fn, device) for _ in range(repeats[name])]
        for r in range(0 if case.back_to_back else max(repeats.values(), default=0)):
            for name, fn in fns.items():  # round-robin: background load hits all alike
                if r < repeats[name]:
                    try:
                        results[name].times.append(time_once(fn, device))
                    except Exception as e:  # e.g. an allocation past the address-space cap
                        results[name].error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                        log(f"    {name}: ERROR in repeat {r}: {results[name].error}")
        if device == "cuda":
            for name, fn in fns.items():
                results[name].kernels = count_kernels(fn)
                try:
                    results[name].mem_tensors = peak.measure_cuda(fn)
                except Exception as e:  # e.g. out of memory: the row says so
                    log(f"    memory {name}: {type(e).__name__}: {str(e)[:200]}")
        del fns, inputs
        gc.collect()
    for impl in case.impls:
        res = results[impl.name]
        if impl.compiled and res.first_call_s is not None and res.times:
            res.compile_s = max(res.first_call_s - res.median, 0.0)
        if device == "cpu" and res.times and measure_memory_of(case, impl, proto):
            mem, err = memory.measure_cpu(suite, case, impl, proto)
            if mem is not None:
                res.mem_rss, res.mem_tensors = mem
            if err:
                log(f"    memory {impl.name}: {err}")
    for res in results.values():
        if res.times:
            log(
                f"    {res.impl[:56]:<56} median {res.median * 1e3:10.3f} ms  "
                f"min {res.minimum * 1e3:10.3f} ms  n={len(res.times)}"
                + (f"  compile {res.compile_s:.1f}s" if res.compile_s is not None else "")
                + (f"  mem {res.mem / 2**20:.1f} MiB" if res.mem is not None else "")
            )
    return list(results.values())
