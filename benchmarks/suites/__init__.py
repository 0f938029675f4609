"""One module per benchmark suite; ``SUITES`` maps each name to its :class:`Suite`."""

from __future__ import annotations

from benchmarks.harness import Suite
from benchmarks.suites import (
    advantages,
    compile_time,
    distill,
    linear,
    logprobs,
    loss,
    padding,
    rows,
    tensor_parallel,
)

SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        loss.SUITE,
        advantages.SUITE,
        logprobs.SUITE,
        linear.SUITE,
        rows.SUITE,
        distill.SUITE,
        padding.SUITE,
        tensor_parallel.SUITE,
        compile_time.SUITE,
    )
}
