"""What the report states about where it was measured: peers, machine, load."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import platform

import torch


def installed(name: str) -> str | None:
    """The installed version of a peer package, from its metadata (no import)."""
    with contextlib.suppress(Exception):
        if importlib.util.find_spec(name) is not None:
            return importlib.metadata.version(name.replace("_", "-"))
    return None


def peers() -> dict[str, str]:
    found = {
        n: installed(n) for n in ("verl", "trl", "liger_kernel", "cut_cross_entropy", "triton")
    }
    return {k: v for k, v in found.items() if v is not None}


def machine_description(device: str) -> str:
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        mem = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        mem = "RAM unknown"
    desc = f"{cpu}, {os.cpu_count()} logical CPUs, {mem}, torch threads {torch.get_num_threads()}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        desc += f"; GPU {props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return desc


def loadavg() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
