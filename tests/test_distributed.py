"""Exact token-level normalisation under real DDP (gloo) with gradient accumulation.

Each world size is one ``torch.multiprocessing.spawn`` of CPU workers that wrap a tiny
policy (an MLP giving ``log_softmax``-gathered token log-probs) in
``DistributedDataParallel`` and accumulate gradients over several micro-batches per rank.
The micro-batches have uneven row counts, uneven valid-token counts, different padded
lengths and one of them is entirely masked (it is the *last*, synchronising micro-batch of
its rank, so DDP's all-reduce runs on an all-zero local gradient).

For every aggregation mode the workers produce the accumulated gradient of

- ``no_sync``: ``ddp.no_sync()`` for all but the last micro-batch (the realistic loop),
  normaliser ``global_normalizer(micro_masks, mode=mode)``;
- ``sync_each``: the same loss, but DDP all-reduces after every micro-batch;
- ``manual_sum``: no DDP, a hand-written ``all_reduce(SUM)`` of the gradients, with
  ``global_normalizer(..., grads_averaged_over_ranks=False)``;
- ``naive``: what a trainer gets by normalising each micro-batch by its own count
  (``normalizer="local"``) and averaging over micro-batches (and, through DDP, ranks).

The parent process computes the reference gradient from the concatenated global batch in
one call with ``normalizer=None`` (no process group there) and asserts that the first three
match it to float64 rounding (``_dist.TOLERANCE``) on every rank, while ``naive`` is clearly off.

The worlds are spawned by ``tests/_dist.py``, whose teardown frees the gloo group inside
``destroy_process_group``; ``test_teardown_leaves_no_gloo_threads`` guards it (a group that
survived to interpreter shutdown made a rank abort now and then with "terminate called
without an active exception").
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import (
    DTYPE,
    TOLERANCE,
    Batch,
    can_list_threads,
    check_uneven,
    gloo_threads,
    gloo_threads_after_join,
    grads_of,
    make_data,
    make_model,
    micro_loss,
    reference,
    rel_diff,
    run_world,
)
from _strategies import MODES
from torch.nn.parallel import DistributedDataParallel

from dapo_ops import global_normalizer

VARIANTS = ("no_sync", "sync_each", "manual_sum", "naive")
EXACT_VARIANTS = ("no_sync", "sync_each", "manual_sum")


def _ddp_worker(rank: int, world_size: int, data: list[list[Batch]]) -> dict[str, Any]:
    """One rank: every mode and variant. Returns tensors only (no model outlives it)."""
    micro = data[rank]
    masks = [b["mask"] for b in micro]
    ddp = DistributedDataParallel(make_model())  # broadcasts rank 0's weights
    plain = make_model()
    results: dict[str, Any] = {}
    for mode in MODES:
        res: dict[str, object] = {}

        # The realistic loop: accumulate locally, all-reduce on the last micro-batch.
        ddp.zero_grad(set_to_none=True)
        norm = global_normalizer(masks, mode=mode)
        loss_sum = torch.zeros((), dtype=DTYPE)
        for k, batch in enumerate(micro):
            with ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                loss = micro_loss(ddp, batch, mode, norm)
                loss.backward()
            loss_sum += loss.detach()
        res["no_sync"] = grads_of(ddp)
        # Sum of all ranks' accumulated losses = W * full-batch loss (DDP averages).
        dist.all_reduce(loss_sum)
        res["loss_sum_no_sync"] = loss_sum / world_size

        # All-reduce after every micro-batch: the same gradient, more communication.
        ddp.zero_grad(set_to_none=True)
        for batch in micro:
            micro_loss(ddp, batch, mode, norm).backward()
        res["sync_each"] = grads_of(ddp)

        # No DDP: ranks *sum* gradients by hand, so the plain global count is right.
        plain.zero_grad(set_to_none=True)
        norm_sum = global_normalizer(masks, mode=mode, grads_averaged_over_ranks=False)
        for batch in micro:
            micro_loss(plain, batch, mode, norm_sum).backward()
        manual = grads_of(plain)
        flat = torch.cat([g.flatten() for g in manual])
        dist.all_reduce(flat)  # one SUM over ranks for all parameters
        res["manual_sum"] = [
            chunk.view_as(g)
            for chunk, g in zip(flat.split([g.numel() for g in manual]), manual, strict=True)
        ]
        res["normalizer"] = (norm, norm_sum)

        # The pitfall: each micro-batch divided by its own count, then averaged.
        ddp.zero_grad(set_to_none=True)
        for k, batch in enumerate(micro):
            with ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                (micro_loss(ddp, batch, mode, "local") / len(micro)).backward()
        res["naive"] = grads_of(ddp)
        results[mode] = res
    # normalizer=None is refused while a multi-rank group is initialised.
    try:
        micro_loss(plain, micro[0], "token_mean", None)
    except ValueError:
        results["refused_none"] = {"ok": True}
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_grad_accumulation_matches_full_batch(world_size: int, tmp_path: Path) -> None:
    data = make_data(world_size)
    check_uneven(data)

    results = run_world(_ddp_worker, world_size, tmp_path, data)
    assert all(res.get("refused_none") == {"ok": True} for res in results)
    if can_list_threads():  # the teardown guard, on the real workload
        assert [res["leaked_threads"] for res in results] == [[]] * world_size

    all_masks = [b["mask"] for rank_batches in data for b in rank_batches]
    tol = TOLERANCE  # float64 problem: see tests/_dist.py
    for mode in MODES:
        ref_grads, ref_loss = reference(data, mode)
        assert any(g.abs().max() > 1e-3 for g in ref_grads)

        # The all-reduced normaliser is the global count (over W when grads are averaged).
        count = global_normalizer(all_masks, mode=mode)
        for res in results:
            norm, norm_sum = res[mode]["normalizer"]
            torch.testing.assert_close(norm, count / world_size)
            torch.testing.assert_close(norm_sum, count)
            torch.testing.assert_close(res[mode]["loss_sum_no_sync"], ref_loss, **tol)

        for rank, res in enumerate(results):
            for variant in EXACT_VARIANTS:
                for got, want in zip(res[mode][variant], ref_grads, strict=True):
                    torch.testing.assert_close(
                        got, want, **tol, msg=lambda m, v=variant, r=rank: f"{v} {r}: {m}"
                    )
            # The naive per-micro-batch normalisation optimises another objective.
            naive_err = rel_diff(res[mode]["naive"], ref_grads)
            assert naive_err > 0.05, (mode, naive_err)


def _teardown_worker(rank: int, world_size: int) -> dict[str, Any]:
    """What the teardown guard needs to know, measured inside one rank."""
    import torch.distributed.nn.functional as dist_nn_functional

    out: dict[str, Any] = {}
    # The pin: collectives of torch.distributed.nn.functional take ``group=group.WORLD``
    # as a default evaluated at import; DDP's constructor imports that module. It must
    # have been imported before the group existed, so no default holds the group.
    ddp = DistributedDataParallel(make_model())
    ddp(torch.randn(3, 6, dtype=torch.float64)).sum().backward()  # one synchronising backward
    pinned = [
        name
        for name, fn in vars(dist_nn_functional).items()
        if callable(fn)
        and any(isinstance(d, dist.ProcessGroup) for d in getattr(fn, "__defaults__", None) or ())
    ]
    out["pinned_defaults"] = pinned
    del ddp

    # The detector sees a group that outlives destroy_process_group while referenced, and
    # sees its threads stop once the last reference goes.
    base = len(gloo_threads())
    extra = dist.new_group(backend="gloo")
    dist.barrier(group=extra)
    dist.destroy_process_group(extra)
    destroyed_but_referenced = len(gloo_threads())
    del extra
    out["threads"] = {
        "base": base,
        "destroyed_but_referenced": destroyed_but_referenced,
        "released": len(gloo_threads_after_join(at_most=base)),
    }
    return out


@pytest.mark.distributed
@pytest.mark.skipif(not can_list_threads(), reason="needs /proc/self/task to list native threads")
def test_teardown_leaves_no_gloo_threads(tmp_path: Path) -> None:
    """Guard for the rare SIGABRT "terminate called without an active exception".

    A gloo group still alive at interpreter shutdown lets a gloo run-loop thread ask for
    the GIL after finalisation began; CPython ends it with pthread_exit, whose unwind
    through a noexcept C++ destructor aborts the rank (see tests/_dist.py). The abort is
    rare; a group that survives destroy_process_group is not: every rank must end with
    no gloo or TCP-store thread left.
    """
    results = run_world(_teardown_worker, 2, tmp_path)
    for res in results:
        assert res["pinned_defaults"] == []
        assert res["threads_while_up"], "the detector must see the group's threads"
        assert res["leaked_threads"] == []
        # (A new group's threads name themselves as they start, so counts taken right
        # after its creation may lag by one; only the comparisons with base are firm.)
        threads = res["threads"]
        assert threads["base"] > 0
        assert threads["destroyed_but_referenced"] > threads["base"]
        assert threads["released"] == threads["base"]
