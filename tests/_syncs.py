"""Host syncs, seen on any machine: CUDA's sync-debug mode on a GPU, and its CPU twin.

``watch(device)`` logs the host syncs of a block (:class:`Syncs`):

- ``cuda``: ``torch.cuda.set_sync_debug_mode("error")``; the first sync raises inside the
  block, is logged, and ends the block;
- ``cpu``: :func:`fake_cuda`. Every CPU tensor then says it lives on ``cuda:0``
  (:data:`FAKE`) unless it is known to be on the host, so the library takes the branches it
  takes on a GPU (no CPU kernel, none of the CPU-only value reads); the computation runs
  on the CPU as usual, and every operation that would make a CUDA host wait is logged
  with the line of dapo_ops that called it. CI has no GPU: this is how it checks the
  no-sync promises.

What the twin counts as a sync: what PyTorch's CUDA kernels do through
``c10::cuda::memcpy_and_sync`` or a stream synchronisation, the calls the sync-debug
mode reports (``_local_scalar_dense_cuda``, ``nonzero_cuda``, ``copy_kernel_cuda`` with
``non_blocking=False``, ``_bincount_cuda_template``, ...):

- a device value read on the host: ``.item()``, ``bool()``, ``float()``, ``int()``
  (``aten._local_scalar_dense``), ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``,
  printing;
- an output sized by the values: ``nonzero`` (``argwhere``, ``torch.where(cond)``),
  boolean-mask indexing and assignment, ``masked_select``, ``unique*``,
  ``repeat_interleave`` without ``output_size``, ``bincount``; ``mode``;
- a verdict read on the host: ``torch.equal``, ``allclose``, ``is_nonzero``;
- a blocking host-to-device copy: ``torch.tensor`` / ``as_tensor`` of host data onto the
  device (a Python number too: ``torch.as_tensor(0.5, device=x.device)``; PyTorch issue
  120996), ``.to(device)`` of a host tensor, ``copy_`` between host and device;
- a host tensor of one dimension or more meeting device tensors in one operation (an
  error on CUDA, or a blocking copy of an index).

Not syncs: reductions (``sum``, ``any``, ``amax``), three-argument ``torch.where``,
``torch.full`` / ``zeros`` / ``arange`` on the device, a 0-dim host tensor or a Python
number in an elementwise operation (read from host memory), sort, topk, gather,
index_select, scatter, cumsum; ``torch.multinomial`` (torch 2.13 checks its weights with
``aten._assert_async``, a device-side assert, as the profiler shows of its CPU kernel).
``tests/test_host_syncs.py`` holds both machines to one table of these
(``test_the_twin_and_the_gpu_see_the_same_syncs``).

The twin sees what goes through torch's Python API and its dispatcher (forward and
backward: the autograd entry points run with it in place); a kernel of C++ or Triton
code that syncs inside would pass unseen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.autograd
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

FAKE = torch.device("cuda", 0)
HOST = torch.device("cpu")
aten = torch.ops.aten

#: aten ops that read device memory on the host whatever their arguments.
SYNC_OPS: dict[Any, str] = {
    aten._local_scalar_dense: "a device value read on the host (.item(), bool(), float())",
    aten.item: "a device value read on the host (.item())",
    aten.is_nonzero: "bool() of a device tensor",
    aten.equal: "torch.equal (its verdict read on the host)",
    aten.allclose: "torch.allclose (its verdict read on the host)",
    aten.nonzero: "nonzero (its output size read on the host)",
    aten.masked_select: "masked_select (its output size read on the host)",
    aten._unique: "unique (its output size read on the host)",
    aten._unique2: "unique (its output size read on the host)",
    aten.unique_dim: "unique (its output size read on the host)",
    aten.unique_consecutive: "unique_consecutive (its output size read on the host)",
    aten.unique_dim_consecutive: "unique_consecutive (its output size read on the host)",
    aten.bincount: "bincount (min and max read on the host)",
    aten.mode: "mode (a blocking copy per slice)",
}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_MASK_DTYPES = (torch.bool, torch.uint8)
#: Python-level reads of a whole device tensor on the host (no aten op on the CPU).
_READS: dict[Callable[..., Any], str] = {
    Tensor.tolist: ".tolist()",
    Tensor.numpy: ".numpy()",
    Tensor.__array__: "__array__",
    Tensor.__repr__: "printing",
    Tensor.__format__: "printing",
}
#: Calls that may copy between host and device: ``x.to``, ``x.cpu()``, ``x.cuda()``, and
#: tensors made from data (``x.new_tensor``: on ``x``'s device by default).
_COPIES = {Tensor.to, Tensor.cpu, Tensor.cuda, Tensor.new_tensor, torch.tensor}
_COPIES |= {torch.as_tensor, torch.asarray}
_AUTOGRAD = {Tensor.backward, torch.autograd.backward, torch.autograd.grad}
_BACKWARD = inspect.signature(Tensor.backward)
_REAL_DEVICE = torch._C.TensorBase.device
_THIS_FILE = os.path.abspath(__file__)


@dataclasses.dataclass
class Syncs:
    """The host syncs seen in a block, each ``what (where)``."""

    seen: list[str] = dataclasses.field(default_factory=list)

    def add(self, what: str) -> None:
        self.seen.append(f"{what} ({_caller()})")

    def __bool__(self) -> bool:
        return bool(self.seen)


def _caller() -> str:
    """The innermost line of dapo_ops on the stack, else the innermost outside torch."""
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}dapo_ops{os.sep}" in path and f"{os.sep}tests{os.sep}" not in path:
            return f"dapo_ops/{path.rsplit(f'{os.sep}dapo_ops{os.sep}', 1)[1]}:{frame.f_lineno}"
        torch_file = f"{os.sep}torch{os.sep}" in path
        if fallback is None and not torch_file and os.path.abspath(path) != _THIS_FILE:
            fallback = f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return fallback or "?"


class _Host:
    """The storages known to be on the host (by a weak reference: while it lives, no
    other storage can take the address it is keyed by)."""

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}

    @staticmethod
    def _key(t: Tensor) -> int | None:
        with torch._C.DisableTorchFunction():
            if _REAL_DEVICE.__get__(t).type != "cpu":
                return None
            return int(t.untyped_storage()._cdata)

    def add(self, t: Tensor) -> None:
        key = self._key(t)
        if key is not None:
            with torch._C.DisableTorchFunction():
                self._refs[key] = StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]

    def discard(self, t: Tensor) -> None:
        key = self._key(t)
        if key is not None:
            self._refs.pop(key, None)

    def holds(self, t: Tensor) -> bool:
        key = self._key(t)
        ref = None if key is None else self._refs.get(key)
        return ref is not None and not ref.expired()  # type: ignore[no-untyped-call]

    def on_device(self, t: Tensor) -> bool:
        """A CPU tensor standing for a device tensor (every CPU tensor not on the host)."""
        return self._key(t) is not None and not self.holds(t)


_ACTIVE: list[_Host] = []
_PAUSED: list[bool] = []  # non-empty inside a kernel launch


def _device(self: Tensor) -> torch.device:
    real: torch.device = _REAL_DEVICE.__get__(self)
    if _ACTIVE and not _PAUSED and real.type == "cpu" and not _ACTIVE[-1].holds(self):
        return FAKE
    return real


def _tensors(*trees: object) -> list[Tensor]:
    return [t for t in tree_leaves(trees) if isinstance(t, Tensor)]


def _is_fake(device: object) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _is_host(device: object) -> bool:
    return (isinstance(device, str) and device.startswith("cpu")) or device == HOST


@contextlib.contextmanager
def _no_torch_function_check() -> Iterator[None]:
    """The autograd entry points run without their own ``__torch_function__`` check,
    so that the mode stays in place for what the autograd engine calls back."""
    saved = torch.autograd.has_torch_function  # type: ignore[attr-defined]
    torch.autograd.has_torch_function = lambda *a: False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.autograd.has_torch_function = saved  # type: ignore[attr-defined]


class _Functions(TorchFunctionMode):
    """Python-level calls: device arguments, host reads, host <-> device copies, and
    the tensors made on the host."""

    def __init__(self, syncs: Syncs, host: _Host) -> None:
        super().__init__()
        self.syncs, self.host = syncs, host

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _PAUSED or getattr(func, "__self__", None) is _REAL_DEVICE:
            return func(*args, **kwargs)
        if func in _AUTOGRAD:
            with self, _no_torch_function_check():
                if func is Tensor.backward:
                    bound = _BACKWARD.bind(*args, **kwargs).arguments
                    tensor, gradient = bound.pop("self"), bound.pop("gradient", None)
                    return torch.autograd.backward(tensor, gradient, **bound)
                return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        on_device = [t for t in tensors if self.host.on_device(t)]
        if func in _READS and on_device:
            self.syncs.add(f"{_READS[func]} of a device tensor")
        if func in _COPIES:
            return self._copy(func, args, kwargs)
        wanted = kwargs.get("device")
        if _is_fake(wanted):
            kwargs["device"] = HOST
        out = func(*args, **kwargs)
        if _is_fake(wanted):
            for t in _tensors(out):
                self.host.discard(t)
        elif _is_host(wanted) or (wanted is None and not tensors):
            for t in _tensors(out):  # made on the host
                self.host.add(t)
        return out

    def _copy(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of :data:`_COPIES`: a sync where it crosses between host and device
        (blocking), the result marked where it lands."""
        source = args[0] if args else kwargs.get("data")
        target: object = kwargs.get("device")
        if func is Tensor.new_tensor:
            source = args[1] if len(args) > 1 else kwargs.get("data")
            target = args[0].device if target is None else target
        if func is Tensor.cpu:
            target = HOST
        elif func is Tensor.cuda:
            target = FAKE
        else:  # a device among the positional arguments (x.to("cuda"), x.to(y))
            for i, a in enumerate(args[1:], 1):
                if isinstance(a, (str, torch.device)):
                    target, args = a, (*args[:i], HOST, *args[i + 1 :])
                elif isinstance(a, Tensor) and func is Tensor.to:
                    target = a.device  # the fake one for a device tensor
        if _is_fake(target) and "device" in kwargs:
            kwargs["device"] = HOST
        src_on_device = isinstance(source, Tensor) and self.host.on_device(source)
        if target is None:  # stays where it is (torch.tensor of Python data: the host)
            target = FAKE if src_on_device else HOST
        to_device = _is_fake(target)
        crosses = src_on_device != to_device
        if crosses and not kwargs.get("non_blocking", False):
            what = "a blocking copy to the device" if to_device else "a copy to the host"
            self.syncs.add(f"{what} ({getattr(func, '__name__', func)})")
        out: Any = source if func in (Tensor.cpu, Tensor.cuda) else func(*args, **kwargs)
        if crosses:
            out = out.clone()
        for t in _tensors(out):
            if to_device:
                self.host.discard(t)
            else:
                self.host.add(t)
        return out


class _Dispatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """aten ops: the syncs of :data:`SYNC_OPS`, boolean-mask indexing,
    ``repeat_interleave`` without ``output_size``, host tensors meeting device tensors;
    and the outputs of ops on host tensors only marked as on the host."""

    def __init__(self, syncs: Syncs, host: _Host) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.syncs, self.host = syncs, host

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _PAUSED:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        on_device = [t for t in tensors if self.host.on_device(t)]
        if on_device:
            self._check(func, args, kwargs, tensors)
        out = func(*args, **kwargs)
        if tensors and not on_device and all(self.host.holds(t) for t in tensors):
            for t in _tensors(out):
                self.host.add(t)
        return out

    def _check(self, func: Any, args: Any, kwargs: Any, tensors: list[Tensor]) -> None:
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            self.syncs.add(SYNC_OPS[packet])
        elif packet in _INDEX_OPS and any(
            isinstance(i, Tensor) and i.dtype in _MASK_DTYPES for i in args[1]
        ):
            self.syncs.add(f"boolean-mask {packet.__name__} (a nonzero: its size on the host)")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.syncs.add("repeat_interleave without output_size (its sum on the host)")
        copy = packet is aten.copy_
        host = [t for t in tensors if self.host.holds(t) and (t.ndim or copy)]
        if host:
            shapes = ", ".join(str(list(t.shape)) for t in host)
            self.syncs.add(f"{packet.__name__}: host tensor {shapes} meets device tensors")


@contextlib.contextmanager
def _kernels_opaque() -> Iterator[None]:
    """Triton kernels run by Triton's interpreter, with the twin paused while one runs:
    a launch is asynchronous (its arguments, made before it, are checked; what its
    program does is no host sync)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # no Triton: the library takes its ATen paths
        yield
        return
    import numpy as np

    run = InterpretedFunction.run

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        _PAUSED.append(True)
        try:  # NumPy warns of 0 * -inf in a branch tl.where discards
            with np.errstate(invalid="ignore"):
                return run(self, *args, **kwargs)
        finally:
            _PAUSED.pop()

    from _interpreter import index_fix

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    InterpretedFunction.run = launch  # type: ignore[method-assign]
    try:
        with index_fix():  # Triton 3.6's interpreter under NumPy 2.4
            yield
    finally:
        InterpretedFunction.run = run  # type: ignore[method-assign]
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


@contextlib.contextmanager
def fake_cuda() -> Iterator[Syncs]:
    """The CPU twin of ``set_sync_debug_mode``: CPU tensors stand for CUDA ones (see the
    module docstring); yields the log of the block's syncs. Not reentrant."""
    syncs, host = Syncs(), _Host()
    saved = {k: torch.Tensor.__dict__.get(k) for k in ("device", "is_cuda", "is_cpu")}
    torch.Tensor.device = property(_device)  # type: ignore[assignment, method-assign]
    torch.Tensor.is_cuda = property(lambda t: _device(t).type == "cuda")  # type: ignore[assignment, method-assign]
    torch.Tensor.is_cpu = property(lambda t: _device(t).type == "cpu")  # type: ignore[assignment, method-assign]
    _ACTIVE.append(host)
    try:
        with _kernels_opaque(), _Functions(syncs, host), _Dispatch(syncs, host):
            yield syncs
    finally:
        _ACTIVE.pop()
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


@contextlib.contextmanager
def watch(device: str) -> Iterator[Syncs]:
    """The host syncs of the block on ``device``: CUDA's sync-debug mode, or the twin."""
    if torch.device(device).type != "cuda":
        with fake_cuda() as syncs:
            yield syncs
        return
    syncs = Syncs()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield syncs
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        syncs.seen.append(str(e).splitlines()[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)


class _FakeCudaGenerator(torch.Generator):
    """A CPU generator that says it is on :data:`FAKE` (for the functions that check
    that a generator is on their tensors' device)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return FAKE


def generator(device: str, seed: int = 0) -> torch.Generator:
    """A seeded generator of ``device`` (under the twin: a CPU one that says cuda:0)."""
    if torch.device(device).type == "cuda":
        return torch.Generator(device=device).manual_seed(seed)
    return _FakeCudaGenerator().manual_seed(seed)
