"""Exact token-level normalisation under FSDP2 (``fully_shard``, gloo, CPU) with accumulation.

Two ranks shard the toy policy of ``tests/_dist.py`` with ``fully_shard`` (each layer and
the root, on a 1-D CPU ``DeviceMesh``) and accumulate three micro-batches per rank with
gradient sync off (``set_requires_gradient_sync(False)``) for all but the last one. The
micro-batches have uneven rows, padded lengths and token counts; rank 1's last (the
synchronising) micro-batch is entirely masked. The parent computes the reference from
the concatenated global batch in one call with ``normalizer=None`` and compares the
gathered gradients (``p.grad.full_tensor()``) of every rank, for every aggregation mode,
in these configurations:

- ``averaged``: FSDP2's default reduction (the mean over ranks) with
  ``global_normalizer(masks, mode=mode)`` (count / W): exact;
- ``summed_convention``: the same reduction with ``grads_averaged_over_ranks=False``: the
  mistake, off by exactly the world size, which the test must see;
- ``force_sum_comms``: ``set_force_sum_reduction_for_comms(True)``, which only changes
  the collective (SUM, then FSDP2 divides by W itself): the gradient is still the mean,
  so the default normaliser stays exact;
- ``sum_reduction``: ``set_gradient_divide_factor(1.0)`` (with force-sum comms, as gloo
  has no PREMUL_SUM): ranks now sum, so ``grads_averaged_over_ranks=False`` is exact.

One spawn covers everything.
"""

from __future__ import annotations

import warnings
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
    make_data,
    make_model,
    max_abs_diff,
    micro_loss,
    reference,
    rel_diff,
    run_world,
)
from _strategies import MODES
from torch import nn

from dapo_ops import global_normalizer

try:  # public since torch 2.6
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # pragma: no cover - old torch
    fully_shard = None

WORLD_SIZE = 2
# name: (force-sum comms, gradient divide factor, grads_averaged_over_ranks)
CONFIGS: dict[str, tuple[bool, float | None, bool]] = {
    "averaged": (False, None, True),
    "summed_convention": (False, None, False),
    "force_sum_comms": (True, None, True),
    "sum_reduction": (True, 1.0, False),
}
EXACT = ("averaged", "force_sum_comms", "sum_reduction")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        fully_shard is None or not (dist.is_available() and dist.is_gloo_available()),
        reason="needs torch.distributed.fsdp.fully_shard (FSDP2) and the gloo backend",
    ),
]


def _sharded_model(mesh: Any, force_sum: bool, divide_factor: float | None) -> nn.Module:
    model = make_model()  # same seed on every rank: fully_shard does not broadcast
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if force_sum:
                module.set_force_sum_reduction_for_comms(True)
            if divide_factor is not None:
                module.set_gradient_divide_factor(divide_factor)
    return model


def _fsdp2_worker(rank: int, world_size: int, data: list[list[Batch]]) -> dict[str, Any]:
    # Linear on [batch, seq, features] returns a view; nothing here modifies it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    mesh = init_device_mesh("cpu", (world_size,))
    micro = data[rank]
    masks = [b["mask"] for b in micro]
    results: dict[str, Any] = {}
    for name, (force_sum, divide_factor, averaged) in CONFIGS.items():
        for mode in MODES:
            model = _sharded_model(mesh, force_sum, divide_factor)
            norm = global_normalizer(masks, mode=mode, grads_averaged_over_ranks=averaged)
            loss_sum = torch.zeros((), dtype=DTYPE)
            unsynced_grads_unset = []
            for k, batch in enumerate(micro):
                last = k == len(micro) - 1
                model.set_requires_gradient_sync(last)
                loss = micro_loss(model, batch, mode, norm)
                loss.backward()
                loss_sum += loss.detach()
                if not last:  # no reduce-scatter yet: the sharded .grad is still unset
                    unsynced_grads_unset.append(all(p.grad is None for p in model.parameters()))
            dist.all_reduce(loss_sum)
            results[f"{name}/{mode}"] = {
                "grads": [p.grad.full_tensor().detach().clone() for p in model.parameters()],
                "loss_sum": loss_sum,
                "norm": norm,
                "unsynced_grads_unset": unsynced_grads_unset,
            }
            del model
    return results


def test_fsdp2_grad_accumulation_matches_full_batch(tmp_path: Path) -> None:
    data = make_data(WORLD_SIZE)
    check_uneven(data)
    results = run_world(_fsdp2_worker, WORLD_SIZE, tmp_path, data)
    if can_list_threads():  # the teardown guard (see tests/_dist.py)
        assert [res["leaked_threads"] for res in results] == [[]] * WORLD_SIZE

    all_masks = [b["mask"] for rank_batches in data for b in rank_batches]
    tol = TOLERANCE  # float64 problem: see tests/_dist.py
    max_err: dict[str, float] = {}
    for mode in MODES:
        ref_grads, ref_loss = reference(data, mode)
        assert any(g.abs().max() > 1e-3 for g in ref_grads)
        count = global_normalizer(all_masks, mode=mode)  # single process: the plain count
        for name, (_, _, averaged) in CONFIGS.items():
            for rank, res in enumerate(results):
                got = res[f"{name}/{mode}"]
                where = f"{name} {mode} rank {rank}"
                assert got["unsynced_grads_unset"] == [True, True], where
                torch.testing.assert_close(got["norm"], count / WORLD_SIZE if averaged else count)
                grads = got["grads"]
                if name in EXACT:
                    for g, want in zip(grads, ref_grads, strict=True):
                        torch.testing.assert_close(
                            g, want, **tol, msg=lambda m, w=where: f"{w}: {m}"
                        )
                    # Each rank's loss is its share: their sum is W x (the step's loss) when
                    # gradients are averaged, the step's loss when they are summed.
                    scale = WORLD_SIZE if averaged else 1
                    torch.testing.assert_close(got["loss_sum"] / scale, ref_loss, **tol)
                    key = f"{name}/{mode}"
                    max_err[key] = max(max_err.get(key, 0.0), max_abs_diff(grads, ref_grads))
                else:
                    # The summed normaliser under averaging FSDP2: exactly 1/W of the gradient.
                    assert rel_diff(grads, ref_grads) > 0.4, where
                    scaled = [g * WORLD_SIZE for g in grads]
                    for g, want in zip(scaled, ref_grads, strict=True):
                        torch.testing.assert_close(
                            g, want, **tol, msg=lambda m, w=where: f"{w}: {m}"
                        )
    assert max(max_err.values()) < TOLERANCE["atol"] * 1e3, max_err  # float64: ~1e-16 here
