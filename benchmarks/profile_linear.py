"""Where a linear-loss step spends its time on a GPU: torch.profiler's kernel table for the
naive path and ``linear_policy_loss`` (the linear suite's inputs), one fwd+bwd each.

    python -m benchmarks.profile_linear                       # CUDA, the suite's GPU cases
    python -m benchmarks.profile_linear --sizes 8192x4096x151936 --dtypes bf16
    python -m benchmarks.profile_linear --backend triton --keep-logits false

Prints, per case and path, the CUDA time per kernel family (summed over calls, sorted)
and the wall time of the step between CUDA events. Nothing is written to the docs: this is
the evidence behind the linear suite's notes, not a benchmark of record.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import dapo_ops as d
from benchmarks.suites.linear import _naive, linear_inputs

Loss = Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], torch.Tensor]


def _linear(**options: Any) -> Loss:
    def loss_of(h: torch.Tensor, w: torch.Tensor, x: dict[str, Any]) -> torch.Tensor:
        return d.linear_policy_loss(h, w, x["tokens"], x["old"], x["adv"], x["mask"], **options)

    return loss_of


def _device_us(e: object) -> float:
    """Self device time of a profiler row (``self_device_time_total``, older torch:
    ``self_cuda_time_total``), in microseconds."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, attr):
            return float(getattr(e, attr))
    return 0.0


def _step(loss_of: Loss, x: dict[str, Any]) -> Callable[[], None]:
    h = x["hidden"].detach().requires_grad_(True)
    w = x["weight"].detach().requires_grad_(True)

    def run() -> None:
        loss_of(h, w, x).backward()  # type: ignore[no-untyped-call]
        h.grad = w.grad = None

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", nargs="*", default=["2048x896x32000", "8192x4096x151936"])
    p.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"])
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--backend", default="auto", choices=["auto", "chunked", "two_pass", "triton"])
    p.add_argument("--keep-logits", default="auto", choices=["auto", "true", "false"])
    args = p.parse_args()
    keep = {"auto": None, "true": True, "false": False}[args.keep_logits]
    ours = _linear(backend=args.backend, keep_logits=keep)
    dev = "cuda"
    for size in args.sizes:
        n, dim, v = (int(s) for s in size.split("x"))
        for name in args.dtypes:
            dtype = torch.float32 if name == "fp32" else torch.bfloat16
            x = linear_inputs(n, dim, v, dtype, dev)
            label_ours = f"linear_policy_loss({args.backend=}, {keep=})".replace("args.", "")
            for label, fn in (("naive", _naive), (label_ours, ours)):
                run = _step(fn, x)
                for _ in range(3):
                    run()
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                for _ in range(5):
                    run()
                end.record()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    run()
                    torch.cuda.synchronize()
                events = prof.key_averages()
                cpu = sum(e.self_cpu_time_total for e in events) / 1e3
                rows = sorted(
                    (e for e in events if _device_us(e) > 0), key=_device_us, reverse=True
                )
                gpu = sum(_device_us(e) for e in rows) / 1e3
                print(
                    f"== {size} {name} {label}: {start.elapsed_time(end) / 5:.3f} ms/step, "
                    f"kernels {gpu:.3f} ms, host {cpu:.3f} ms"
                )
                for e in rows[: args.rows]:
                    print(f"   {_device_us(e) / 1e3:8.3f} ms {e.count:5d}x  {e.key[:70]}")
            del x
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
