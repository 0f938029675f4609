"""Benchmark rows not measured yet on a device, and why (read by the page and its test).

A row is *pending* on a device when its device's record predates it (or the code it
times) and this project could not measure it since: the page lists it in its case's
table as "not measured on a GPU" with the reason, and its targets as not measured;
``tests/test_benchmarks_docs.py`` accepts it as not measured, and fails once it is (then
the entry goes). A record's rows that time code since replaced are dropped from it with
``python -m benchmarks.run --drop-stale DEVICE`` (the page says which).
"""

from __future__ import annotations

import re

GPU_RUN = "`bash tools/gpu_session.sh` on a CUDA machine measures it"
#: The two-pass design replaced what the CUDA rows of these functions timed.
TWO_PASS = (
    "issue 37's two-pass design (the CUDA default: cuBLAS products, Triton row kernels), "
    "written without a GPU; " + GPU_RUN
)

#: Rows that joined the CPU suite when the only machine at hand was loaded by other work.
LOADED = (
    "timed once on 2026-11-28 on a 2-core machine loaded by other work (load average 5 to "
    "8: not a result, not published); `python -m benchmarks.run linear` in the integration "
    "environment on an idle machine measures it"
)

#: device -> (text, why): a row is pending when the text is in its implementation's name
#: or is its case's size.
PENDING: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (
        ("dapo_ops linear_policy_loss", TWO_PASS),
        ("fused_logprobs_entropy", TWO_PASS),
        (
            "ChunkedLogProbFunction",
            "TRL 1.16's fused head joined the suite after the GPU run; " + GPU_RUN,
        ),
        (
            "linear_cross_entropy (Triton kernels)",
            "verl 0.9.1's Triton kernel joined the suite after the GPU run; " + GPU_RUN,
        ),
        ("8192x4096x151936", "the 7B-scale shape came after the GPU run; " + GPU_RUN),
        ("8192x151936, d=4096, bf16", "the 7B-scale shape came after the GPU run; " + GPU_RUN),
        ("TOPR()", "the TOPR objective came after the GPU run"),
    ),
    "cpu": (
        ("backend='two_pass'", LOADED),
        ("ChunkedLogProbFunction", LOADED),
    ),
}

#: device -> (suite, why): suites with no record on that device yet (every row pending).
PENDING_SUITES: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (
        ("rows", "the row kernels (issue 37) were written without a GPU; " + GPU_RUN),
        ("distill", "no GPU run has had this suite yet; " + GPU_RUN),
        ("padding", "issue 39's skip_padding came after the GPU run; " + GPU_RUN),
        (
            "tensor_parallel",
            "tp=2 needs two GPUs (NCCL, one rank per device); the machines lent so far have "
            "one, and `tools/gpu_session.sh` does not run it",
        ),
    ),
}


def pending(device: str, impl: str, size: str = "") -> str | None:
    """Why the row ``impl`` of the case of ``size`` has no result yet on ``device`` (see
    :data:`PENDING`), else None."""
    return next(
        (why for text, why in PENDING.get(device, ()) if text in impl or text == size), None
    )


def pending_suite(device: str, suite: str) -> str | None:
    """Why ``suite`` has no record on ``device`` yet (:data:`PENDING_SUITES`), else None."""
    return next((why for name, why in PENDING_SUITES.get(device, ()) if name == suite), None)


def stable(impl: str) -> str:
    """A row's name without the peer version installed where it ran (``"Liger ... 0.8.5
    (installed), eager"`` -> ``"Liger ..., eager"``): the same wherever it is rendered."""
    return re.sub(r" \S+ \(installed\)| \(not installed\)", "", impl)
