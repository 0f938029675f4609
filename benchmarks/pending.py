"""Benchmark rows not measured yet on a device, and why (read by the page and its test)."""

from __future__ import annotations

#: Rows a suite has that its device's record predates and this project could not measure
#: since (device -> (text, why)): a row is pending when the text is in its implementation's
#: name or is its case's size. The page lists them, and tests/test_benchmarks_docs.py
#: accepts them as not measured, and fails once they are.
PENDING: dict[str, tuple[tuple[str, str], ...]] = {
    "cuda": (
        (
            "backend='triton'",
            "the Triton kernels (issue 30) were written in a session without a GPU: "
            "`bash tools/gpu_session.sh` measures them",
        ),
        ("TOPR()", "the TOPR objective came after the GPU run"),
        (
            "8192x4096x151936",
            "issue 30's 7B-scale shape came after the GPU run: `bash tools/gpu_session.sh` "
            "measures it",
        ),
    ),
}


def pending(device: str, impl: str, size: str = "") -> str | None:
    """Why the row ``impl`` of the case of ``size`` has no result yet on ``device`` (see
    :data:`PENDING`), else None."""
    return next(
        (why for text, why in PENDING.get(device, ()) if text in impl or text == size), None
    )
