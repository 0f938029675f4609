"""A world of processes for the benchmarks that need ranks (``tensor_parallel`` suite).

:func:`run_world` spawns ``world`` processes, joins them into one group (gloo on CPU:
a ``file://`` store in a temporary directory, no port; NCCL on CUDA, rank ``r`` on
device ``r``), calls ``fn(rank, world, *args)`` in each and returns each rank's dict.
The teardown follows ``tests/_dist.py``'s lessons: a barrier so that no rank closes its
connections while another is still in a collective, then ``destroy_process_group``; a
rank that raises destroys its group and its error reaches the parent. A world still
running after ``timeout_s`` is killed (a hung collective fails the run, not the machine).
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _entry(
    rank: int,
    fn: Callable[..., dict[str, Any]],
    world: int,
    device: str,
    threads: int,
    out_dir: str,
    args: tuple[Any, ...],
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        result = fn(rank, world, *args)
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may never get there
        raise
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_world(
    fn: Callable[..., dict[str, Any]],
    world: int,
    *args: Any,
    device: str = "cpu",
    threads: int = 1,
    timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """``fn(rank, world, *args)`` in each of ``world`` fresh processes (``threads`` torch
    threads each); one dict of plain values per rank. ``fn`` must be a module-level
    function (it is pickled by reference)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
            _entry,
            args=(fn, world, device, threads, out_dir, args),
            nprocs=world,
            join=False,
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                raise TimeoutError(
                    f"a world of {world} ranks still running after {timeout_s:.0f} s"
                )
        return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]
