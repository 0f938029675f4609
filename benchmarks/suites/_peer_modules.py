"""The trainers' own fused lm heads, imported without their packages' training stacks.

TRL 1.16's ``trl/kernels/chunked_logprob.py`` needs torch, triton and
``transformers.utils.is_triton_available`` (its backward also reads
``trl.trainer.utils.maybe_gather_lm_head_ctx``, which imports pandas, accelerate and
datasets); verl 0.9.1's ``verl/utils/kernel/linear_cross_entropy.py`` and
``verl/utils/experimental/torch_functional.py`` need torch, triton and
``verl.utils.device`` (whose own imports are torch and ``verl.plugin``), but ``import
verl`` runs ``verl/__init__.py`` (DataProto, tensordict, ray, the ``verl.plugins`` entry
points). A GPU machine with torch alone gets those files from wheels installed with
``--no-deps``: where the normal import fails, :func:`peer_module` loads the module file
from the installed package with the failing ``__init__.py`` files of its parent packages
skipped (empty packages whose ``__path__`` is the installed folder), so every function
timed is the peer's own code. Two names are stood in for, only where their real module
cannot be imported: ``transformers.utils.is_triton_available`` (whether triton imports,
what it tests; set while TRL's module loads, removed after) and TRL's
``maybe_gather_lm_head_ctx``, which returns ``nullcontext()`` unless DeepSpeed ZeRO-3 is
on (never, here).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: TRL 1.16's vocabulary width per tile in its GRPO trainer's fused head
#: (``trl/trainer/utils.py: _CHUNKED_LOGPROB_CHUNK_SIZE``; that module needs TRL's stack).
TRL_CHUNK_SIZE = 32768


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # an ImportError, or whatever a half-installed stack raises
        return False
    return True


def _empty_package(name: str) -> None:
    """``name`` as an empty package over its installed folder (its ``__init__`` skipped)."""
    parent, _, child = name.rpartition(".")
    if parent:
        where = [str(Path(p) / child) for p in sys.modules[parent].__path__]
    else:
        spec = importlib.util.find_spec(name)  # locates a top-level package, runs nothing
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{name} is not installed")
        where = list(spec.submodule_search_locations)
    pkg = types.ModuleType(name)
    pkg.__path__ = where
    sys.modules[name] = pkg
    if parent:
        setattr(sys.modules[parent], child, pkg)


@contextlib.contextmanager
def _stand_in(name: str, **attrs: Any) -> Iterator[None]:
    """Module ``name`` with ``attrs`` while the block runs, where the real one does not
    import (its parents too, as empty modules); nothing is left behind."""
    if _importable(name):
        yield
        return
    parts = name.split(".")
    added = [".".join(parts[: i + 1]) for i in range(len(parts))]
    added = [n for n in added if n not in sys.modules]
    for n in added:
        sys.modules[n] = types.ModuleType(n)
    for k, v in attrs.items():
        setattr(sys.modules[name], k, v)
    try:
        yield
    finally:
        for n in added:
            sys.modules.pop(n, None)


def peer_module(name: str) -> types.ModuleType:
    """Module ``name``: imported normally, else loaded past its parents' ``__init__``."""
    try:
        return importlib.import_module(name)
    except Exception:
        pass
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules and not _importable(parent):
            _empty_package(parent)
    return importlib.import_module(name)


def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def trl_chunked_logprob() -> types.ModuleType:
    """TRL's ``trl.kernels.chunked_logprob`` (``ChunkedLogProbFunction``)."""
    _importable("trl")  # its __init__ checks transformers' version: not the stand-in's
    with _stand_in("transformers.utils", is_triton_available=_has_triton):
        mod = peer_module("trl.kernels.chunked_logprob")
    if not _importable("trl.trainer.utils"):  # the backward imports it at call time
        if "trl.trainer" not in sys.modules:
            _empty_package("trl.trainer")
        utils = types.ModuleType("trl.trainer.utils")
        gather: Callable[..., Any] = lambda *params: contextlib.nullcontext()  # noqa: E731
        utils.maybe_gather_lm_head_ctx = gather  # type: ignore[attr-defined]
        sys.modules["trl.trainer.utils"] = utils
    return mod


@functools.cache
def verl_linear_cross_entropy() -> Callable[..., Any]:
    """verl's ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (Triton)."""
    mod = peer_module("verl.utils.kernel.linear_cross_entropy")
    peer_module("verl.utils.kernel.kernels")  # imported by its forward: fail here instead
    return mod.linear_cross_entropy  # type: ignore[no-any-return]


@functools.cache
def verl_fused_linear_for_ppo() -> Any:
    """verl's ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (class)."""
    return peer_module("verl.utils.experimental.torch_functional").FusedLinearForPPO
