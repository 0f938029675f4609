"""What each rank of the ``tensor_parallel`` suite runs (:func:`worker`, in a spawned world).

Every rank builds the same whole problem from one seed and takes its contiguous rows of
the output layer (``V // world`` each, the first ``V % world`` ranks one more), as
Megatron's column-parallel layer holds them, and of the teacher's logits. Per case, two
steps (fwd+bwd, the gradients of ``hidden`` and ``weight``): the one-process call on the
whole layer (``vocab_group=None``) and the split call on the rank's rows
(``vocab_group=`` the world's group). Both run on every rank at the same time, so the
ranks share the machine alike in both rows; a barrier starts every timed call on every
rank together. Then, per step, one call under :class:`benchmarks.peak.TensorPeak`
(CUDA: :func:`benchmarks.peak.measure_cuda`) and one split call with its collectives
logged (:func:`benchmarks.collectives.counting`), forward and backward apart.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

import dapo_ops as d
from benchmarks.collectives import counting
from benchmarks.harness import time_once
from benchmarks.peak import TensorPeak, measure_cuda
from benchmarks.suites import distill
from benchmarks.suites.linear import linear_inputs

ONE = "one process: the whole layer (vocab_group=None)"
SPLIT = "vocab_group, tp=2: this rank's rows of the layer"
#: The calls of the suite, by key: what each case's two rows run.
POLICY, FUSED, DISTILL_FULL, DISTILL_TOPK = "policy", "fused", "distill_full", "distill_topk"
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def rows_of(vocab: int, world: int) -> list[int]:
    """Each rank's rows of the output layer: contiguous, in rank order."""
    return [vocab // world + (r < vocab % world) for r in range(world)]


def inputs(
    key: str, n: int, dim: int, vocab: int, dtype: torch.dtype, device: str
) -> dict[str, Any]:
    """The whole problem: the ``linear`` suite's inputs for the policy calls, the
    ``distill`` suite's (teacher logits, or its top-64 log-probs and ids) for the others."""
    if key in (POLICY, FUSED):
        return linear_inputs(n, dim, vocab, dtype, device)
    x = distill.inputs(n, dim, vocab, key == DISTILL_TOPK, device)
    x["hidden"], x["weight"] = x["hidden"].to(dtype), x["weight"].to(dtype)
    return x


def loss_of(key: str, x: dict[str, Any], keep: bool, backend: str, group: Any, cols: slice) -> Loss:
    """The loss of case ``key`` as a function of ``(hidden, weight)``; ``group`` None: the
    one-process call (``cols`` then every column of the teacher's logits)."""
    # "local": the batch's own count, as normalizer=None means with a group of every
    # rank; the one-process call in a world of two must say so
    opts: dict[str, Any] = {"backend": backend, "keep_logits": keep, "vocab_group": group}
    opts["normalizer"] = "local"
    if key == POLICY:
        return lambda h, w: d.linear_policy_loss(
            h, w, x["tokens"], x["old"], x["adv"], x["mask"], **opts
        )
    if key == FUSED:

        def fused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            fused_opts = {k: v for k, v in opts.items() if k != "normalizer"}
            logp = d.fused_logprobs_entropy(h, w, x["tokens"], **fused_opts).logp
            return d.policy_loss(
                d.ClipHigher(), logp, x["old"], x["adv"], x["mask"], normalizer="local"
            )

        return fused
    if key == DISTILL_TOPK:
        return lambda h, w: d.linear_distill_loss(
            h, w, x["logp"], x["mask"], teacher_ids=x["ids"], log_prob_min_clamp=-10.0, **opts
        )
    teacher = x["teacher"][..., cols].contiguous()  # this rank's columns of the teacher
    return lambda h, w: d.linear_distill_loss(h, w, teacher, x["mask"], **opts)


class Step:
    """One fwd+bwd of a loss on leaves of ``hidden`` and ``weight`` (the grads dropped)."""

    def __init__(self, loss: Loss, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        self.loss = loss
        self.h = hidden.detach().requires_grad_(True)
        self.w = weight.detach().clone().requires_grad_(True)  # the rank's own rows

    def __call__(self) -> None:
        self.loss(self.h, self.w).backward()  # type: ignore[no-untyped-call]
        self.h.grad = self.w.grad = None

    def counted(self) -> list[list[Any]]:
        """The collectives of one call, forward and backward apart."""
        log: list[list[Any]] = []
        with counting(log, "forward"):
            loss = self.loss(self.h, self.w)
        with counting(log, "backward"):
            loss.backward()  # type: ignore[no-untyped-call]
        self.h.grad = self.w.grad = None
        return log


def peak_of(step: Step, device: str) -> int:
    if device == "cuda":
        return measure_cuda(step)
    with TensorPeak() as p:
        step()
    return p.peak


def worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Per case of ``spec["cases"]``: each row's times, extra peak and (the split row)
    collectives on this rank."""
    import torch.distributed as dist

    device = spec["device"]
    backend = "triton" if device == "cuda" else "two_pass"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    group = dist.group.WORLD
    out: dict[str, Any] = {}
    for case in spec["cases"]:
        n, dim, vocab = case["shape"]
        rows = rows_of(vocab, world)
        start = sum(rows[:rank])
        cols = slice(start, start + rows[rank])
        x = inputs(case["key"], n, dim, vocab, dtype, "cuda" if device == "cuda" else "cpu")
        key, keep = case["key"], case["keep"]
        steps = {
            ONE: Step(loss_of(key, x, keep, backend, None, slice(None)), x["hidden"], x["weight"]),
            SPLIT: Step(
                loss_of(key, x, keep, backend, group, cols), x["hidden"], x["weight"][cols]
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():  # warm-up
            dist.barrier()
            step()
        for _ in range(case["repeats"]):  # interleaved: both rows see the same load
            for name, step in steps.items():
                dist.barrier()
                times[name].append(time_once(step, device))
        mem = {}
        for name, step in steps.items():
            dist.barrier()
            mem[name] = peak_of(step, device)
        dist.barrier()
        out[case["name"]] = {"times": times, "mem": mem, "collectives": steps[SPLIT].counted()}
        if rank == 0:
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            print(f"    {case['name']}: medians (rank 0) {med}, extra peak {mem}", flush=True)
        del steps, x
        gc.collect()
    return out
