"""Loading Triton kernel modules: once per mode, compiled or interpreted.

Private. ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *defined*, and the
interpreter looks a kernel's globals up in its module, so a kernel module is loaded under
a name of its own per mode (:func:`load_kernels`) with the variable set while it runs.
Triton is imported then, never at ``import dapo_ops``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any


def launch_options(warps: int) -> dict[str, Any]:
    """The options every kernel of the library is launched (and compiled) with: ``warps``
    warps per program and floating-point fusion on (``a * b + c`` as one FMA, as cuBLAS
    does). Fusion is stated rather than left to Triton's default: Triton 3.9 warns at each
    first compile when it is left unset, and its default turns to off in Triton 3.10."""
    return {"num_warps": warps, "enable_fp_fusion": True}


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``, read per call)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=8)
def load_kernels(module: str, interpret: bool) -> Any:
    """The kernel module ``module``, loaded once per mode under its own name, with
    ``TRITON_INTERPRET`` set to ``interpret`` while ``triton.jit`` defines the kernels."""
    name = module + ("_interpreted" if interpret else "")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    spec = importlib.util.spec_from_file_location(name, spec.origin)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        sys.modules[name] = loaded  # the interpreter looks kernels' globals up there
        spec.loader.exec_module(loaded)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return loaded
