"""The collectives a call makes, counted by wrapping ``torch.distributed``'s functions.

:func:`counting` replaces the public collectives of ``torch.distributed`` (the module
attributes the library calls, ``dist.all_reduce(...)``) by wrappers that log each call as
``[phase, op, what, bytes]``: ``what`` names the reduction, dtype and shape (``"MAX
float32 [1024]"``), ``bytes`` is this rank's contribution (an ``all_gather``'s input
tensor, an ``all_reduce``'s tensor, an ``all_gather_object``'s pickled object: torch
sends it as one all-gather of the sizes and one of the bytes padded to the largest).
Only the outermost call is logged (torch's own nesting, if any, is not). Nothing outside
the block is changed.

:func:`table` renders a record's logged calls on the benchmark page, one row per kind of
call with how many times it ran (``tensor_parallel`` suite, :mod:`benchmarks.report`).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: Every collective and point-to-point function of ``torch.distributed`` that a call
#: could make: what is not expected shows up too.
WRAPPED = (
    "all_gather_object",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _tensor(t: torch.Tensor) -> tuple[str, int]:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"{dtype} {list(t.shape)}", t.numel() * t.element_size()


def describe(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int]:
    """``(what, bytes)`` of one call of ``torch.distributed.<name>``."""
    if name == "all_gather_object":
        obj = args[1] if len(args) > 1 else kwargs["obj"]
        return "a pickled object", len(pickle.dumps(obj))
    if name == "all_reduce":
        op = args[1] if len(args) > 1 else kwargs.get("op", "SUM")
        what, size = _tensor(args[0] if args else kwargs["tensor"])
        return f"{getattr(op, 'name', op)} {what}", size
    if name == "all_gather":
        what, size = _tensor(args[1] if len(args) > 1 else kwargs["tensor"])
        return f"{what} per rank", size
    tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
    parts = [_tensor(t) for t in tensors]
    return ", ".join(p[0] for p in parts) or "-", sum(p[1] for p in parts)


@contextlib.contextmanager
def counting(log: list[list[Any]], phase: str) -> Iterator[None]:
    """Inside the block, every call of :data:`WRAPPED` is appended to ``log``."""
    import torch.distributed as dist

    depth = [0]
    saved = {name: getattr(dist, name) for name in WRAPPED if hasattr(dist, name)}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                log.append([phase, name, *describe(name, args, kwargs)])
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def summary(calls: list[list[Any]]) -> list[tuple[str, str, str, int, int, int]]:
    """``(phase, op, what, calls, largest bytes, bytes in all)`` per kind of call, in
    order of first appearance (object exchanges of different pickled sizes are one kind)."""
    rows: dict[tuple[str, str, str], list[int]] = {}
    for phase, op, what, size in calls:
        row = rows.setdefault((phase, op, what), [0, 0, 0])
        row[0] += 1
        row[1] = max(row[1], int(size))
        row[2] += int(size)
    return [(*key, n, size, total) for key, (n, size, total) in rows.items()]


def _bytes(n: int) -> str:
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def table(results: list[Any]) -> list[str]:
    """The page's table of the logged calls of ``results`` (:class:`Result`\\ s)."""
    counted = [r for r in results if r.collectives is not None]
    if not counted:
        return []
    lines = [
        "",
        "Collectives per call (fwd+bwd, rank 0; `torch.distributed`'s functions wrapped, "
        "`benchmarks/collectives.py`). Bytes: this rank's contribution per call (a pickled "
        "object's size; an all-gather's input); a call with none in a phase has no row "
        "for it:",
        "",
        "| case | implementation | phase | collective | what | calls | bytes per call (largest) | bytes in all |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in counted:
        if not r.collectives:
            lines.append(f"| {r.op} {r.size} | {r.impl} | — | none | | 0 | | 0 B |")
        for phase, op, what, n, size, total in summary(r.collectives):
            lines.append(
                f"| {r.op} {r.size} | {r.impl} | {phase} | `{op}` | {what} | {n} | "
                f"{_bytes(size)} | {_bytes(total)} |"
            )
    return lines
