"""The GPU targets of issue 30 for the Triton kernels, computed from made-up results (the
real ones come from a GPU run): what each target reads, and what a row not measured
says. Nothing here times anything."""

from __future__ import annotations

import pytest

pytest.importorskip("benchmarks.run", reason="run from the repository root")

import torch

from benchmarks.harness import Result
from benchmarks.suites import linear
from benchmarks.suites._linear_gpu import CCE, TRITON, kernel_budget, triton_targets

KERNELS = f"{linear.LINEAR}, {TRITON}"
MiB = 2**20


def test_the_7b_shape_and_the_gpu_rows_are_cuda_only() -> None:
    cuda = {(c.op, c.size) for c in linear.make_cases(False, "cuda")}
    cpu = linear.make_cases(False, "cpu")
    assert ("linear loss fwd+bwd, bf16", "8192x4096x151936") in cuda
    assert ("linear loss fwd+bwd, fp32", "8192x4096x151936") not in cuda
    assert all("8192x4096" not in c.size for c in cpu)
    names = [i.name for c in cpu for i in c.impls]
    assert not [n for n in names if CCE in n or TRITON in n]
    cuda_names = {i.name for c in linear.make_cases(False, "cuda") for i in c.impls}
    assert KERNELS in cuda_names and any(n.startswith(CCE) for n in cuda_names)


def test_kernel_budget_counts_the_accumulators() -> None:
    """bf16 at the 7B shape: dh in float32 and bf16, dW in bf16, 132 programs' float32
    rows of 64 x d, 64 MiB; fp32 (fp64): dh and dW in float32 (float64), no rows."""
    n, d, v = 8192, 4096, 151936
    want = n * d * 6 + v * d * 2 + 132 * 64 * d * 4 + 64 * MiB
    assert kernel_budget(n, d, v, torch.bfloat16) == want
    assert kernel_budget(n, d, v, torch.float32) == n * d * 4 + v * d * 4 + 64 * MiB
    assert kernel_budget(n, d, v, torch.float64) == n * d * 8 + v * d * 8 + 64 * MiB


def _result(impl: str, ms: float, mem_mib: float, size: str = "2048x896x32000") -> Result:
    r = Result("linear", "linear loss fwd+bwd, bf16", size, impl, "ours", times=[ms] * 3)
    r.mem_tensors = int(mem_mib * MiB)
    return r


def test_triton_targets_read_each_row() -> None:
    case = next(c for c in linear.make_cases(False, "cuda") if c.op.endswith("bf16"))
    liger = next(i.name for i in case.impls if i.name.startswith(linear.LIGER))
    cce = next(i.name for i in case.impls if i.name.startswith(CCE))
    results = [
        _result(KERNELS, 8.0, 100.0),
        _result(linear.NAIVE, 10.0, 900.0),
        _result(cce, 7.0, 90.0),
        _result(liger, 20.0, 300.0),
    ]
    got = {
        t.name.split(": ")[-1]: t
        for t in triton_targets(results, case, linear.NAIVE, liger, KERNELS)
    }
    assert got["time / naive (goal 0.8x)"].met is True
    assert got["time / cut-cross-entropy"].met is False  # 8 ms against 7
    assert got["time / Liger (eager)"].met is True
    assert got["extra peak / the naive path's"].met is True
    budget = got["extra peak (gradients in their accumulation dtypes + 64 MiB)"]
    assert budget.met is True and budget.measured == "100 MiB"


def test_a_row_not_measured_says_why() -> None:
    case = next(c for c in linear.make_cases(False, "cuda") if c.size == "8192x4096x151936")
    targets = triton_targets([], case, linear.NAIVE, "", KERNELS)
    assert targets and all(t.met is None and "GPU" in t.reason for t in targets)
