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
match it to float32 tolerance on every rank, while ``naive`` is clearly off.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _strategies import MODES
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dapo_ops import global_normalizer, token_level_loss

VARIANTS = ("no_sync", "sync_each", "manual_sum", "naive")
EXACT_VARIANTS = ("no_sync", "sync_each", "manual_sum")

FEATURES = 6
HIDDEN = 8
VOCAB = 5
MAX_LEN = 12  # Dr. GRPO's constant L: >= every padded length below
MICRO_BATCHES = 3  # per rank per optimiser step

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
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, VOCAB))


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
                "features": torch.randn(rows, seq, FEATURES, generator=gen),
                "tokens": torch.randint(0, VOCAB, (rows, seq), generator=gen),
                "advantages": torch.randn(rows, generator=gen),
                "mask": mask,
            }
            with torch.no_grad():
                noise = 0.3 * torch.randn(rows, seq, generator=gen)
                batch["old_logp"] = token_logp(model, batch) + noise
            rank_batches.append(batch)
        data.append(rank_batches)
    return data


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, data: list[list[Batch]], out_dir: str) -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        micro = data[rank]
        masks = [b["mask"] for b in micro]
        ddp = DistributedDataParallel(make_model())  # broadcasts rank 0's weights
        plain = make_model()
        results: dict[str, dict[str, object]] = {}
        for mode in MODES:
            res: dict[str, object] = {}

            # The realistic loop: accumulate locally, all-reduce on the last micro-batch.
            ddp.zero_grad(set_to_none=True)
            norm = global_normalizer(masks, mode=mode)
            loss_sum = torch.zeros(())
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
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


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


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_grad_accumulation_matches_full_batch(world_size: int, tmp_path: Path) -> None:
    data = make_data(world_size)
    # The set-up really is uneven: token and sequence counts differ across micro-batches.
    counts = [int(b["mask"].sum()) for rank_batches in data for b in rank_batches]
    assert 0 in counts and len(set(counts)) >= 4
    assert len({b["mask"].shape[1] for rank_batches in data for b in rank_batches}) >= 4

    mp.spawn(
        _worker,
        args=(world_size, free_port(), data, str(tmp_path)),
        nprocs=world_size,
        join=True,
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    assert all(res.get("refused_none") == {"ok": True} for res in results)

    all_masks = [b["mask"] for rank_batches in data for b in rank_batches]
    tol = {"rtol": 1e-5, "atol": 1e-6}
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
