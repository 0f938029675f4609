"""``linear_policy_loss`` on a vocabulary split across tensor-parallel ranks, on a CPU.

    python examples/tensor_parallel.py [--world 3] [--vocab 32003]

Spawns ``--world`` processes joined in a gloo group. Rank ``r`` holds the contiguous rows
``[start_r, start_r + V_r)`` of the output layer (vocab 32003 over 3 ranks: 10668 + 10668
+ 10667, uneven), and every rank passes the same hidden states, global token ids and
per-token inputs with ``vocab_group=``. Then, as Megatron's column-parallel layer does in
its backward, the ranks' hidden-state gradients are summed (``all_reduce``), and each
rank compares the loss, that sum and its slice of the weight gradient with the call of
one process on the whole layer (float64). ``docs/tensor_parallel.md`` runs it.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import dapo_ops

BATCH, SEQ, D = 2, 6, 16


def problem(vocab: int) -> dict[str, Tensor]:
    """The same batch on every rank (one seed), with the whole output layer."""
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    hidden = torch.randn(BATCH, SEQ, D, generator=g, dtype=f64)
    weight = 0.3 * torch.randn(vocab, D, generator=g, dtype=f64)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    with torch.no_grad():  # the rollout's log-probs: the policy's, a little off
        logp = dapo_ops.fused_logprobs_entropy(hidden, weight, tokens).logp
    noise = 0.1 * torch.randn(BATCH, SEQ, generator=g, dtype=f64)
    return {
        "hidden": hidden,
        "weight": weight,
        "tokens": tokens,
        "old_logp": (logp + noise).clamp(max=0.0),
        "advantages": torch.randn(BATCH, generator=g, dtype=f64),
        "mask": torch.rand(BATCH, SEQ, generator=g) > 0.25,
    }


def step(p: dict[str, Tensor], weight: Tensor, group: object = None) -> tuple[Tensor, ...]:
    """The loss and the gradients of hidden and weight (this rank's rows of it). Without
    a group, in a process of a multi-rank world: ``normalizer="local"``, the batch's own
    token count (with a group spanning every rank, ``None`` means that already)."""
    hidden = p["hidden"].clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    loss = dapo_ops.linear_policy_loss(
        hidden, weight, p["tokens"], p["old_logp"], p["advantages"], p["mask"],
        entropy_coef=0.01, vocab_group=group, normalizer=None if group else "local",
    )  # fmt: skip
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return loss.detach(), hidden.grad, weight.grad


def relative_error(got: Tensor, want: Tensor) -> Tensor:
    return ((got - want).abs().max() / want.abs().max()).reshape(1)


def rank_main(rank: int, world: int, vocab: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        sizes = [vocab // world + (r < vocab % world) for r in range(world)]
        start = sum(sizes[:rank])
        rows = slice(start, start + sizes[rank])
        p = problem(vocab)
        group = dist.group.WORLD  # Megatron: parallel_state.get_tensor_model_parallel_group()
        loss, grad_h, grad_w = step(p, p["weight"][rows], group)
        dist.all_reduce(grad_h, group=group)  # the column-parallel layer's backward does this
        want_loss, want_h, want_w = step(p, p["weight"])  # one process, the whole layer
        errors = torch.cat([
            relative_error(loss, want_loss),
            relative_error(grad_h, want_h),
            relative_error(grad_w, want_w[rows]),
        ])  # fmt: skip
        dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=group)
        if rank == 0:
            print(f"vocab {vocab} over {world} ranks: rows " + " + ".join(map(str, sizes)))
            for name, err in zip(("loss", "hidden gradient (summed)", "weight gradient (slices)"), errors.tolist(), strict=True):  # fmt: skip
                print(f"{name:26} equals the one-process call: {err <= 1e-10}")
        del loss, grad_h, grad_w, want_loss, want_h, want_w
        gc.collect()
        dist.barrier()  # every rank done with its collectives before any rank leaves
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=32003, help="vocabulary (default: %(default)s)")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        mp.spawn(rank_main, args=(args.world, args.vocab, store), nprocs=args.world)


if __name__ == "__main__":
    main()
