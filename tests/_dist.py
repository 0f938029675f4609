"""Gloo worlds for the distributed tests, and the toy policy problem they share.

``run_world(fn, world_size, tmp_path, *args)`` spawns ``world_size`` CPU processes, joins
them into a gloo group through a ``file://`` store under ``tmp_path`` and calls
``fn(rank, world_size, *args)`` in each; the dict it returns comes back to the parent,
with ``"leaked_threads"`` added: the gloo / TCP-store native threads still running in
that rank after the group was destroyed (the teardown guard: it must be empty).

Why the teardown is spelled out (torch 2.13, CPython 3.11; the abort reproduced and read
from a core dump, the deadlock from a live backtrace):

- A gloo group owns native threads (``pt_gloo_runloop``, ``gloo_tcp_loop``, and on the
  rank that hosts a TCP store ``pt_tcpstore_uv``). When a run-loop thread drops its
  reference to a finished collective, it may hold the last reference to an input tensor
  whose Python object is already gone; freeing it needs the GIL.
- If the group is still alive when the interpreter shuts down, such a thread can ask for
  the GIL after finalisation began. CPython then ends the thread with ``pthread_exit``,
  whose forced unwind crosses the work's noexcept C++ destructor: ``std::terminate``,
  "terminate called without an active exception", SIGABRT (6 runs in 40 of a 3-rank
  DDP script on 2 busy cores).
- ``dist.destroy_process_group()`` alone does not free the group once a
  ``DistributedDataParallel`` was built: DDP's constructor imports ``torch._dynamo``,
  which imports ``torch.distributed.nn.functional``, whose collectives take
  ``group=group.WORLD`` as a default argument evaluated at import time, so after the
  group exists that import pins it until interpreter shutdown. Importing
  ``torch.distributed.nn`` here, before any group exists, binds those defaults to None.
- FSDP2 pins it another way: its ``DeviceMesh`` holds the group, and DTensor's global
  caches hold the mesh (``release_dtensor_caches``).
- A model that still holds the group must be gone before the destroy. If the last
  reference is DDP's C++ reducer, the group's destructor joins its run-loop threads with
  the GIL held and can deadlock against a thread waiting for it (seen: a rank hung at
  exit). ``fn`` therefore returns plain tensors only, so the model dies with its frame;
  ``gc.collect()`` clears any cycle; a barrier lets every rank finish its collectives
  before any rank closes its connections. ``destroy_process_group`` then drops the last
  reference through torch's GIL-releasing holder, and the threads are joined there.
- A ``file://`` store has no server thread and no port: the former "bind a free port,
  release it, hope nobody takes it" race is gone too.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group exists: see the docstring
import torch.multiprocessing as mp
from torch import nn

from dapo_ops import token_level_loss

# Native thread names (/proc/<pid>/task/<tid>/comm, 15 characters at most) of a gloo group
# and of c10d's TCP store server.
GLOO_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_tcpstore")
WORLD_TIMEOUT_S = 180.0  # a hang (deadlocked teardown) fails the test instead of the CI job


def native_threads() -> list[str]:
    """Names of this process's native threads (gloo's are not Python threads)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread ended while we listed
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return sorted(names)


def gloo_threads() -> list[str]:
    return [n for n in native_threads() if n.startswith(GLOO_THREAD_PREFIXES)]


def gloo_threads_after_join(at_most: int = 0, timeout: float = 2.0) -> list[str]:
    """``gloo_threads()`` once at most ``at_most`` remain, or after ``timeout`` seconds.

    A joined thread can stay listed in /proc for a moment while the kernel finishes its
    exit; a leaked thread stays for good.
    """
    deadline = time.monotonic() + timeout
    while len(threads := gloo_threads()) > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


def gloo_threads_when_up(timeout: float = 2.0) -> list[str]:
    """``gloo_threads()`` once there is one, or after ``timeout`` seconds (a new thread
    names itself, in /proc, a moment after it starts)."""
    deadline = time.monotonic() + timeout
    while not (threads := gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads


def can_list_threads() -> bool:
    return Path("/proc/self/task").is_dir()


def release_dtensor_caches() -> None:
    """Drop DTensor's global caches, which pin every DeviceMesh they saw.

    A ``DeviceMesh`` holds its process groups (``_pg_registry``). DTensor caches keep
    meshes alive: the sharding-propagation caches (Python and C++ fast path) hold the
    specs of every op dispatched, the redistribute planner cache holds one planner per
    mesh, ``_gen_transform_infos`` (``full_tensor()``) holds specs, and (torch 2.14: the
    leak its FSDP2 test showed) ``MeshTopoInfo.build_from_mesh``'s cache holds the mesh of
    every redistribute cost estimate. After
    ``fully_shard`` the group would therefore outlive ``destroy_process_group`` (measured:
    its gloo threads survive until interpreter shutdown). torch exposes the clearing only
    through private helpers, so each is optional; if one moves, the ``leaked_threads``
    check names the surviving threads.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return
    for module_name, attr in (
        ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
        ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
        ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
        ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
    ):
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            continue
        obj()


def release_meshes() -> None:
    """Make every live ``DeviceMesh`` let go of its process groups (``_pg_registry``).

    For a mesh that a cache torch gives no way to empty still holds: torch 2.11's C++
    sharding-propagation cache keeps its entries (``DTensorSpec``s, hence their mesh)
    after ``_clear_DTensor_sharding_propagator_cache`` (measured: 4 entries after one
    FSDP2 step, the mesh alive and the group's gloo threads running after
    ``destroy_process_group``). The mesh is dead after the destroy anyway; dropping its
    group references lets the destroy join the threads on every torch.
    """
    if "torch.distributed.device_mesh" not in sys.modules:
        return
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


def _entry(
    rank: int,
    fn: Callable[..., dict[str, Any]],
    world_size: int,
    init_method: str,
    out_dir: str,
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    # torch 2.11 creates the gloo backend, and its threads, at the group's first
    # collective (2.13 at init): look once one has run and the threads have named themselves
    dist.barrier()
    threads_while_up = gloo_threads_when_up()
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may never get there
        raise
    release_dtensor_caches()
    release_meshes()
    gc.collect()  # a model caught in a reference cycle must not outlive the group
    dist.barrier()
    dist.destroy_process_group()
    result["threads_while_up"] = threads_while_up
    result["leaked_threads"] = gloo_threads_after_join()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def run_world(
    fn: Callable[..., dict[str, Any]], world_size: int, tmp_path: Path, *args: Any
) -> list[dict[str, Any]]:
    """Run ``fn(rank, world_size, *args)`` on a fresh gloo world; one result dict per rank.

    ``fn`` must be a module-level function (it is pickled by reference) and must return
    a dict of tensors / plain values, holding no model, DDP/FSDP wrapper or group.
    """
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    store = tmp_path / "gloo_store"  # must not exist yet: one store file per world
    ctx = mp.spawn(
        _entry,
        args=(fn, world_size, f"file://{store}", str(out_dir), args),
        nprocs=world_size,
        join=False,
    )
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
            raise TimeoutError(
                f"gloo world of {world_size} ranks still running after "
                f"{WORLD_TIMEOUT_S:.0f} s (hung collective or teardown)"
            )
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


# ---------------------------------------------------------------------------------------
# The toy policy problem: an MLP giving log_softmax-gathered token log-probs, and
# micro-batches with uneven rows, padded lengths and valid-token counts.

FEATURES = 6
HIDDEN = 8
VOCAB = 5
MAX_LEN = 12  # Dr. GRPO's constant L: >= every padded length below
MICRO_BATCHES = 3  # per rank per optimiser step
#: The toy problem runs in float64, so that comparing the distributed gradient with the
#: single-process one tests the normalisation, not float32 summation order: see TOLERANCE.
DTYPE = torch.float64
#: Every gradient entry is a float64 sum of at most a few hundred token contributions
#: (each a few dozen flops through the MLP), i.e. within about gamma(1000) = 1.1e-13 of
#: the exact value relative to the sum of their magnitudes; the gradients are O(1e-2-1), so
#: 1e-10 relative (plus 1e-12 absolute, for entries that cancel) is that bound with a wide
#: margin for cancellation, and 1e4 times below any normalisation error (>= 1e-2 relative:
#: the smallest micro-batch weight change in this layout).
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}

# (rows, padded seq length) of each micro-batch, per rank. Uneven on purpose.
LAYOUT: dict[int, list[list[tuple[int, int]]]] = {
    2: [
        [(3, 5), (1, 9), (4, 7)],
        [(2, 12), (5, 4), (2, 6)],  # rank 1's last micro-batch is fully masked
    ],
    3: [
        [(3, 5), (1, 9), (4, 7)],
        [(2, 12), (5, 4), (2, 6)],  # fully masked last micro-batch
        [(1, 3), (2, 10), (6, 8)],
    ],
}
FULLY_MASKED = (1, MICRO_BATCHES - 1)  # (rank, micro-batch index)

Batch = dict[str, torch.Tensor]


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, VOCAB))
    return model.to(DTYPE)


def token_logp(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Log-probability of each sampled token: ``log_softmax`` over VOCAB, then gather."""
    logits = model(batch["features"])  # [batch, seq, vocab]
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)


def make_data(world_size: int) -> list[list[Batch]]:
    """All micro-batches of every rank; ``old_logp`` is near the initial policy's log-probs."""
    gen = torch.Generator().manual_seed(world_size)
    model = make_model()
    data: list[list[Batch]] = []
    for rank, micro in enumerate(LAYOUT[world_size]):
        rank_batches = []
        for k, (rows, seq) in enumerate(micro):
            # Right-padded masks with lengths in [0, seq] (some rows empty), plus a few holes.
            lengths = torch.randint(0, seq + 1, (rows,), generator=gen)
            lengths[0] = max(int(lengths[0]), 1)
            mask = torch.arange(seq) < lengths[:, None]
            mask &= torch.rand(rows, seq, generator=gen) > 0.15
            if (rank, k) == FULLY_MASKED:
                mask[:] = False
            batch: Batch = {
                "features": torch.randn(rows, seq, FEATURES, generator=gen, dtype=DTYPE),
                "tokens": torch.randint(0, VOCAB, (rows, seq), generator=gen),
                "advantages": torch.randn(rows, generator=gen, dtype=DTYPE),
                "mask": mask,
            }
            with torch.no_grad():
                noise = 0.3 * torch.randn(rows, seq, generator=gen, dtype=DTYPE)
                batch["old_logp"] = token_logp(model, batch) + noise
            rank_batches.append(batch)
        data.append(rank_batches)
    return data


def check_uneven(data: list[list[Batch]]) -> None:
    """The set-up really is uneven: token counts and padded lengths differ, one is empty."""
    counts = [int(b["mask"].sum()) for rank_batches in data for b in rank_batches]
    assert 0 in counts and len(set(counts)) >= 4
    assert len({b["mask"].shape[1] for rank_batches in data for b in rank_batches}) >= 4


def concat_batches(batches: list[Batch]) -> Batch:
    """Stack micro-batches of different padded lengths into one right-padded batch."""
    seq = max(b["mask"].shape[1] for b in batches)

    def pad(t: torch.Tensor) -> torch.Tensor:
        widths = [0, 0] * (t.ndim - 2) + [0, seq - t.shape[1]]
        return nn.functional.pad(t, widths)

    out: Batch = {}
    for key in ("features", "tokens", "old_logp", "mask"):
        out[key] = torch.cat([pad(b[key]) for b in batches])
    out["advantages"] = torch.cat([b["advantages"] for b in batches])
    return out


def micro_loss(model: nn.Module, batch: Batch, mode: str, normalizer: object) -> torch.Tensor:
    return token_level_loss(
        token_logp(model, batch),
        batch["old_logp"],
        batch["advantages"],
        batch["mask"],
        mode=mode,  # type: ignore[arg-type]
        normalizer=normalizer,  # type: ignore[arg-type]
        max_len=MAX_LEN,
    )


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def reference(data: list[list[Batch]], mode: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradient and loss of the whole global batch in one call, single process."""
    model = make_model()
    full = concat_batches([b for rank_batches in data for b in rank_batches])
    loss = micro_loss(model, full, mode, None)
    loss.backward()
    return grads_of(model), loss.detach()


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = torch.cat([(x - y).flatten() for x, y in zip(a, b, strict=True)]).norm()
    den = torch.cat([y.flatten() for y in b]).norm()
    return float(num / den)


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
