"""Benchmark suite: dapo_ops against peer-style references and against the bandwidth floor.

Usage (from the repository root, with the package installed)::

    python -m benchmarks.run                 # full run, ~10-15 min on 2 CPU cores
    python -m benchmarks.run --quick         # smoke run, ~1-2 min
    python -m benchmarks.run --device cuda   # GPU: CUDA-event timing, max_memory_allocated,
                                             # kernel launches per call (torch.profiler)

It writes ``docs/benchmarks.md`` (tables, machine, date, command, torch version),
``docs/benchmarks.json`` (the raw numbers, from which ``python -m benchmarks.summary``
renders README.md's figures) and ``docs/benchmarks.png`` (matplotlib, optional: skipped
with a note when it is missing). ``--out-md``/``--out-png``/``--json`` change the paths.

For every case: median and inter-quartile range over repeats (implementations of one
case run interleaved, round-robin, so background load hits them alike), the minimum,
the ratio to the peer-style reference (benchmarks/references.py), the ratio to the
physical floor (bytes the op must read + write divided by this machine's copy bandwidth,
measured in the same run) and the extra peak memory. On CPU the peak is measured in a
fresh subprocess per (case, implementation): inputs allocated, one warm-up call, the
peak-RSS counter reset (``/proc/self/clear_refs``), one measured call, ``VmHWM`` minus
the RSS before it; glibc's mmap threshold is pinned at 64 KiB there so that freed
buffers go back to the OS and the counter sees every large temporary. On CUDA:
``torch.cuda.max_memory_allocated`` minus the allocation before the call.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dapo_ops as d
from benchmarks import references as ref

ROOT = Path(__file__).resolve().parent.parent
Fn = Callable[[], object]


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------


@dataclass
class Impl:
    name: str
    role: str  # "ours" or "ref"
    build: Callable[[Any], Fn]  # inputs -> zero-argument callable (one iteration)
    compiled: bool = False


@dataclass
class Case:
    op: str
    size: str
    elems: int  # tokens (loss ops) or samples (reward ops), for the plot
    floor_bytes: int
    make_inputs: Callable[[], Any]
    impls: list[Impl]
    input_bytes: Callable[[Any], int] = lambda _: 0
    main_ref: str | None = None  # reference the "x ref" column divides by
    note: str = ""
    back_to_back: bool = False  # time each implementation in its own block (warm caches)


@dataclass
class Result:
    op: str
    size: str
    impl: str
    role: str
    times: list[float] = field(default_factory=list)
    first_call_s: float | None = None
    compile_s: float | None = None
    mem_extra: int | None = None
    input_bytes: int = 0
    kernels: int | None = None
    error: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    @property
    def q1q3(self) -> tuple[float, float]:
        if len(self.times) < 2:
            return (self.median, self.median)
        q = statistics.quantiles(self.times, n=4, method="inclusive")
        return q[0], q[2]


@dataclass
class LossInputs:
    logp: torch.Tensor
    old: torch.Tensor
    adv: torch.Tensor  # [B, 1]
    mask: torch.Tensor  # bool

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.logp, self.old, self.adv, self.mask))


def loss_inputs(
    batch: int, seq: int, device: str, dtype: torch.dtype = torch.float32
) -> LossInputs:
    g = torch.Generator().manual_seed(batch * 100_003 + seq)
    old = -torch.rand(batch, seq, generator=g) * 4 - 0.01
    logp = old + torch.randn(batch, seq, generator=g) * 0.2
    adv = torch.randn(batch, 1, generator=g)
    lengths = torch.randint(seq // 8, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq) < lengths[:, None]
    logp = torch.where(mask, logp, 0.0)  # padding holds zeros, as trainers' buffers do
    old = torch.where(mask, old, 0.0)
    return LossInputs(
        logp.to(device, dtype), old.to(device, dtype), adv.to(device), mask.to(device)
    )


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _fwd_bwd(loss_of: Callable[[torch.Tensor], torch.Tensor], logp: torch.Tensor) -> Fn:
    lp = _leaf(logp)

    def run() -> object:
        loss_of(lp).backward()
        lp.grad = None
        return None

    return run


def _fwd(loss_of: Callable[[torch.Tensor], torch.Tensor], logp: torch.Tensor) -> Fn:
    lp = _leaf(logp)
    return lambda: loss_of(lp)


#: implementations whose peak memory --quick does not measure (one subprocess each)
QUICK_SKIP_MEMORY = ("verl-style loss only", "TRL-style step (loss + clip metrics + .item())")

DUAL = 3.0  # verl's clip_ratio_c, on for every verl-style and dapo_ops loss below


#: one elementwise exp over the log-ratios: a compute yardstick (the loss needs at least this)
PUBLIC_EAGER = "dapo_ops token_level_loss (default, eager)"
PUBLIC_COMPILED = "dapo_ops token_level_loss(compiled=True)"
USER_COMPILED = "torch.compile(token_level_loss)"
COMPOSITION = "dapo_ops surrogate + aggregate, unfused (the autograd reference)"
EXP_YARDSTICK = "yardstick: one torch.exp pass over [B, S] (out=)"
#: the same loss case timed back-to-back: each implementation's repeats in one block, so
#: its inputs and buffers stay in cache (the interleaved cases evict them between calls)
BACK_TO_BACK = "token_level_loss fwd+bwd, back-to-back"


def exp_pass(inp: LossInputs) -> Fn:
    out = torch.empty_like(inp.logp)
    return lambda: torch.exp(inp.logp, out=out)


def loss_impls(*, backward: bool, quick: bool) -> list[Impl]:
    wrap = _fwd_bwd if backward else _fwd
    kw: dict[str, Any] = {"dual_clip": DUAL}

    def public(inp: LossInputs) -> Fn:
        return wrap(lambda lp: d.token_level_loss(lp, inp.old, inp.adv, inp.mask, **kw), inp.logp)

    def public_compiled(inp: LossInputs) -> Fn:
        return wrap(
            lambda lp: d.token_level_loss(lp, inp.old, inp.adv, inp.mask, compiled=True, **kw),
            inp.logp,
        )

    def user_compiled(inp: LossInputs) -> Fn:
        compiled = torch.compile(
            lambda lp: d.token_level_loss(lp, inp.old, inp.adv, inp.mask, **kw), fullgraph=True
        )
        return wrap(compiled, inp.logp)

    def composition(inp: LossInputs) -> Fn:
        def loss_of(lp: torch.Tensor) -> torch.Tensor:
            per_token = d.clip_higher_surrogate(lp, inp.old, inp.adv, inp.mask, **kw)
            return d.token_level_aggregate(per_token, inp.mask)

        return wrap(loss_of, inp.logp)

    def verl_step(inp: LossInputs) -> Fn:
        lp = _leaf(inp.logp)
        n_tokens = inp.mask.sum()  # the trainer's global token count, computed once a step

        def run() -> object:
            out = ref.verl_actor_step(
                lp, inp.old, inp.adv, inp.mask, backward=backward, batch_num_tokens=n_tokens
            )
            lp.grad = None
            return out

        return run

    def verl_loss_only(inp: LossInputs) -> Fn:
        def loss_of(lp: torch.Tensor) -> torch.Tensor:
            per_token = ref.verl_per_token_loss(inp.old, lp, inp.adv)
            return ref.verl_agg_loss(per_token, inp.mask, "token-mean")

        return wrap(loss_of, inp.logp)

    def trl_step(inp: LossInputs) -> Fn:
        lp = _leaf(inp.logp)
        adv = inp.adv[:, 0]
        mask = inp.mask.int()  # TRL's completion_mask is an int tensor
        n_items = mask.sum()
        metrics: dict[str, list[float]] = {}

        def run() -> object:
            loss = ref.trl_compute_loss(
                lp, inp.old, adv, mask, num_items_in_batch=n_items, metrics=metrics
            )
            if backward:
                loss.backward()
                lp.grad = None
            return loss

        return run

    impls = [
        Impl(PUBLIC_EAGER, "ours", public),
        Impl(PUBLIC_COMPILED, "ours", public_compiled, compiled=True),
    ]
    if not quick:
        impls.append(Impl(USER_COMPILED, "ours", user_compiled, compiled=True))
    impls.append(Impl(COMPOSITION, "ours", composition))
    if backward:
        impls.append(Impl(EXP_YARDSTICK, "ref", exp_pass))
    impls += installed_verl_loss(backward)
    impls += [
        Impl("verl-style step (loss + 3 metrics + .item())", "ref", verl_step),
        Impl("verl-style loss only", "ref", verl_loss_only),
        Impl("TRL-style step (loss + clip metrics + .item())", "ref", trl_step),
    ]
    return impls


def _verl_policy_loss(core_algos: Any, inp: LossInputs, lp: torch.Tensor | None) -> Any:
    """verl's ``compute_policy_loss_vanilla`` with a real ``ActorConfig`` (DAPO clip, the
    dual clip, the trainer's global token count in ``global_batch_info``)."""
    from verl.workers.config import ActorConfig  # type: ignore[import-not-found]

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=inp.logp.shape[0],
        ppo_micro_batch_size_per_gpu=inp.logp.shape[0],
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=DUAL,
    )
    config.global_batch_info.update(
        dp_size=1, batch_num_tokens=inp.mask.sum(), global_batch_size=inp.logp.shape[0]
    )

    def loss(lp: torch.Tensor) -> Any:
        return core_algos.compute_policy_loss_vanilla(
            inp.old, lp, inp.adv, inp.mask, loss_agg_mode="token-mean", config=config
        )

    return loss if lp is None else loss(lp)


def installed_versions() -> dict[str, str]:
    """Peers that happen to be installed (timed directly, next to our re-implementations).

    Looked up in the package metadata, without importing them (TRL pulls in transformers).
    """
    found = {}
    for name in ("verl", "trl"):
        with contextlib.suppress(Exception):
            if importlib.util.find_spec(name) is not None:
                found[name] = importlib.metadata.version(name)
    return found


def installed_verl_loss(backward: bool) -> list[Impl]:
    """The real verl policy loss, when verl happens to be installed (0.9 signature)."""
    if "verl" not in installed_versions():
        return []

    def build(inp: LossInputs) -> Fn:
        from verl.trainer.ppo import core_algos

        lp = _leaf(inp.logp)
        loss_of = _verl_policy_loss(core_algos, inp, None)

        def run() -> object:
            pg_loss, metrics = loss_of(lp)  # the metrics' .item() run inside
            if backward:
                pg_loss.backward()
                lp.grad = None
            return pg_loss.item(), metrics

        return run

    version = installed_versions().get("verl", "?")
    return [Impl(f"verl {version} (installed) compute_policy_loss_vanilla + .item()", "ref", build)]


def make_cases(quick: bool, device: str) -> list[Case]:
    shapes = (
        [(16, 1024), (64, 4096)] if quick else [(16, 1024), (64, 4096), (128, 8192), (512, 8192)]
    )
    cases: list[Case] = []

    def loss_case(op: str, b: int, s: int, backward: bool) -> Case:
        per_tok = 4 + 4 + 1 + (4 if backward else 0)  # logp, old_logp, mask (+ grad)
        return Case(
            op,
            f"{b}x{s}",
            b * s,
            per_tok * b * s + 4 * b,
            lambda: loss_inputs(b, s, device),
            loss_impls(backward=backward, quick=quick),
            input_bytes=lambda x: x.nbytes(),
            main_ref="verl-style step (loss + 3 metrics + .item())",
        )

    for b, s in shapes:
        cases.append(loss_case("token_level_loss fwd+bwd", b, s, True))
    for b, s in ((64, 4096),) if quick else ((64, 4096), (512, 8192)):
        warm = loss_case(BACK_TO_BACK, b, s, True)
        keep = (PUBLIC_EAGER, PUBLIC_COMPILED, EXP_YARDSTICK, warm.main_ref)
        warm.impls = [i for i in warm.impls if i.name in keep]
        warm.back_to_back = True
        cases.append(warm)
    for b, s in shapes[1:] if quick else shapes:
        cases.append(loss_case("token_level_loss fwd", b, s, False))

    # per-op cases at one realistic size (the loss cases above cover the scaling)
    b, s = (64, 4096)
    cases.append(
        Case(
            "clip_higher_surrogate fwd",
            f"{b}x{s}",
            b * s,
            (4 + 4 + 1 + 4) * b * s + 4 * b,
            lambda: loss_inputs(b, s, device),
            [
                Impl(
                    "dapo_ops clip_higher_surrogate",
                    "ours",
                    lambda x: (
                        lambda: d.clip_higher_surrogate(
                            x.logp, x.old, x.adv, x.mask, dual_clip=DUAL
                        )
                    ),
                ),
                Impl(
                    "verl-style per-token chain",
                    "ref",
                    lambda x: lambda: ref.verl_per_token_loss(x.old, x.logp, x.adv),
                ),
            ],
            input_bytes=lambda x: x.nbytes(),
            main_ref="verl-style per-token chain",
        )
    )

    def agg_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = loss_inputs(b, s, device)
        per_token = d.clip_higher_surrogate(x.logp, x.old, x.adv, x.mask)
        return per_token, x.mask, x.mask.int()

    cases.append(
        Case(
            "token_level_aggregate fwd",
            f"{b}x{s}",
            b * s,
            (4 + 1) * b * s,
            agg_inputs,
            [
                Impl(
                    "dapo_ops token_level_aggregate",
                    "ours",
                    lambda x: lambda: d.token_level_aggregate(x[0], x[1]),
                ),
                Impl(
                    "verl-style agg_loss(token-mean)",
                    "ref",
                    lambda x: lambda: ref.verl_agg_loss(x[0], x[1], "token-mean"),
                ),
                Impl(
                    "TRL-style bnpo sum / count",
                    "ref",
                    lambda x: lambda: (x[0] * x[2]).sum() / x[2].sum().clamp(min=1.0),
                ),
            ],
            input_bytes=lambda x: x[0].numel() * 5,
            main_ref="verl-style agg_loss(token-mean)",
        )
    )

    def diag_ours(x: LossInputs) -> Fn:
        def run() -> object:
            dg = d.policy_diagnostics(x.logp, x.old, x.adv, x.mask, dual_clip=DUAL)
            # read the logged figures on the host, as verl's .item() does
            return [float(v) for v in (dg.clip_frac_low, dg.clip_frac_high, dg.approx_kl)]

        return run

    cases.append(
        Case(
            "policy_diagnostics (+ host read)",
            f"{b}x{s}",
            b * s,
            (4 + 4 + 1) * b * s + 4 * b,
            lambda: loss_inputs(b, s, device),
            [
                Impl("dapo_ops policy_diagnostics", "ours", diag_ours),
                Impl(
                    "verl-style metrics (masked_mean + .item())",
                    "ref",
                    lambda x: lambda: ref.verl_metrics_only(x.logp, x.old, x.adv, x.mask),
                ),
            ],
            input_bytes=lambda x: x.nbytes(),
            main_ref="verl-style metrics (masked_mean + .item())",
        )
    )

    def mb_masks() -> list[torch.Tensor]:
        return [loss_inputs(64, 4096, device).mask for _ in range(8)]

    cases.append(
        Case(
            "global_normalizer (8 micro-batches)",
            "8x64x4096",
            8 * 64 * 4096,
            8 * 64 * 4096,
            mb_masks,
            [
                Impl(
                    "dapo_ops global_normalizer", "ours", lambda m: lambda: d.global_normalizer(m)
                ),
                Impl(
                    "sum of per-micro-batch .item()",
                    "ref",
                    lambda m: lambda: ref.trl_num_items_in_batch(m),
                ),
            ],
            input_bytes=lambda m: sum(t.numel() for t in m),
            main_ref="sum of per-micro-batch .item()",
        )
    )

    sample_sizes = [(16_384, 1024)] if quick else [(16_384, 1024), (65_536, 4096)]
    for n, groups in sample_sizes:
        cases += reward_cases(n, groups, device)
    return cases


@dataclass
class RewardInputs:
    rewards: torch.Tensor  # [N] float32, flat
    ids: torch.Tensor  # [N] int64 group ids (ragged: shuffled, uneven sizes)
    uids: np.ndarray[Any, Any]  # the same ids as verl's uid strings
    dense: torch.Tensor  # [groups, G]
    dense_uids: np.ndarray[Any, Any]
    lengths: torch.Tensor  # [N] int64
    group_size: int


def reward_inputs(n: int, groups: int, device: str, ragged: bool) -> RewardInputs:
    g = torch.Generator().manual_seed(n + groups + int(ragged))
    size = n // groups
    if ragged:  # group sizes 2 .. 2*size-2 (mean ~size), ids shuffled and non-contiguous
        sizes = torch.randint(2, 2 * size - 1, (groups * 2,), generator=g)
        sizes = sizes[: int(torch.searchsorted(sizes.cumsum(0), torch.tensor(n)))]
        rest = n - int(sizes.sum())
        if rest >= 2:  # one more group; never a one-sample group (peers differ there)
            sizes = torch.cat([sizes, torch.tensor([rest])])
        else:
            sizes[-1] += rest
        ids = torch.repeat_interleave(torch.arange(len(sizes)) * 7 + 3, sizes)
        ids = ids[torch.randperm(n, generator=g)]
    else:
        ids = torch.arange(groups).repeat_interleave(size)
    correct = (torch.rand(n, generator=g) < 0.5).float()
    lengths = torch.randint(1, 20_481, (n,), generator=g)
    rewards = correct + d.overlong_reward(lengths, max_len=20_480, cache_len=4096)
    uids = np.array([f"uid-{i}" for i in ids.tolist()], dtype=object)
    return RewardInputs(
        rewards.to(device),
        ids.to(device),
        uids,
        rewards.view(groups, size).to(device) if not ragged else rewards.to(device),
        uids,
        lengths.to(device),
        size,
    )


def installed_verl_advantages() -> list[Impl]:
    if "verl" not in installed_versions():
        return []
    version = installed_versions()["verl"]
    impls = []
    for fn_name, label in (
        ("compute_grpo_outcome_advantage", "loop"),
        ("compute_grpo_vectorized_outcome_advantage", "vectorized"),
    ):

        def build(x: RewardInputs, fn_name: str = fn_name) -> Fn:
            from verl.trainer.ppo import core_algos

            fn = getattr(core_algos, fn_name)
            rewards = x.rewards.cpu()[:, None]
            mask = torch.ones_like(rewards)
            return lambda: fn(rewards.clone(), mask, x.uids)

        impls.append(Impl(f"verl {version} (installed) GRPO advantage, {label}", "ref", build))
    return impls


def installed_trl_overlong() -> list[Impl]:
    if "trl" not in installed_versions():
        return []
    version = installed_versions()["trl"]

    def build(x: RewardInputs) -> Fn:
        from trl.rewards import get_soft_overlong_punishment  # type: ignore[import-not-found]

        reward_fn = get_soft_overlong_punishment(max_completion_len=20_480, soft_punish_cache=4096)
        # TRL only takes len() of each completion: ranges stand in for the token-id lists
        completions = [range(n) for n in x.lengths.tolist()]
        return lambda: torch.tensor(reward_fn(completions), dtype=torch.float32)

    return [Impl(f"trl {version} (installed) soft overlong punishment", "ref", build)]


def _trl_overlong(x: RewardInputs) -> Fn:
    lengths = x.lengths.tolist()  # TRL receives completions as Python lists
    return lambda: ref.trl_soft_overlong_punishment(lengths, 20_480, 4096)


def reward_cases(n: int, groups: int, device: str) -> list[Case]:
    size_label = f"{n // 1024}k samples / {groups // 1024}k groups"
    cases: list[Case] = []
    for ragged in (False, True):
        layout = "ragged" if ragged else "dense"

        def mk(ragged: bool = ragged) -> RewardInputs:
            return reward_inputs(n, groups, device, ragged)

        def ours(x: RewardInputs, ragged: bool = ragged) -> Fn:
            if ragged:
                return lambda: d.group_advantages(x.rewards, x.ids)
            return lambda: d.group_advantages(x.dense)

        def verl(x: RewardInputs) -> Fn:
            rewards = x.rewards.cpu()[:, None]
            mask = torch.ones_like(rewards)
            return lambda: ref.verl_grpo_outcome_advantage(rewards.clone(), mask, x.uids)

        impls = [
            Impl(f"dapo_ops group_advantages ({layout})", "ours", ours),
            Impl("verl-style per-sample loop (uid defaultdict)", "ref", verl),
            *installed_verl_advantages(),
        ]
        if not ragged:
            impls.append(
                Impl(
                    "TRL-style view(-1, G) mean/std",
                    "ref",
                    lambda x: lambda: ref.trl_group_advantages(x.rewards, x.group_size),
                )
            )
        cases.append(
            Case(
                f"group_advantages {layout}",
                size_label,
                n,
                n * (4 + 4 + (8 if ragged else 0)),
                mk,
                impls,
                input_bytes=lambda x: x.rewards.numel() * 12,
                main_ref="verl-style per-sample loop (uid defaultdict)",
            )
        )

        def dyn_ours(x: RewardInputs, ragged: bool = ragged) -> Fn:
            if ragged:
                return lambda: d.dynamic_sample_mask(x.rewards, x.ids)
            return lambda: d.dynamic_sample_mask(x.dense)

        def dyn_verl(x: RewardInputs) -> Fn:
            metric = x.rewards.cpu().numpy()
            return lambda: ref.verl_filter_groups(x.uids, metric)

        cases.append(
            Case(
                f"dynamic_sample_mask {layout}",
                size_label,
                n,
                n * (4 + (8 + 1 if ragged else 0)) + groups,
                mk,
                [
                    Impl(f"dapo_ops dynamic_sample_mask ({layout})", "ours", dyn_ours),
                    Impl("verl-style filter_groups loop", "ref", dyn_verl),
                ],
                input_bytes=lambda x: x.rewards.numel() * 12,
                main_ref="verl-style filter_groups loop",
            )
        )

    def ovl_inputs() -> RewardInputs:
        return reward_inputs(n, groups, device, False)

    cases.append(
        Case(
            "overlong_reward",
            f"{n // 1024}k samples",
            n,
            n * (8 + 4),
            ovl_inputs,
            [
                Impl(
                    "dapo_ops overlong_reward",
                    "ours",
                    lambda x: lambda: d.overlong_reward(x.lengths, max_len=20_480, cache_len=4096),
                ),
                Impl(
                    "verl-style per-sample penalty loop",
                    "ref",
                    lambda x: lambda: ref.verl_overlong_penalty(x.lengths.cpu(), 20_480, 4096, 1.0),
                ),
                Impl("TRL-style list comprehension", "ref", _trl_overlong),
                *installed_trl_overlong(),
            ],
            input_bytes=lambda x: x.lengths.numel() * 8,
            main_ref="verl-style per-sample penalty loop",
        )
    )
    return cases


# --------------------------------------------------------------------------------------
# Agreement checks (references compute the same thing, up to documented epsilons)
# --------------------------------------------------------------------------------------


def check_agreement(device: str) -> list[str]:
    notes: list[str] = []
    x = loss_inputs(16, 1024, device)
    ours = d.token_level_loss(x.logp, x.old, x.adv, x.mask, dual_clip=DUAL)
    per_token = d.clip_higher_surrogate(x.logp, x.old, x.adv, x.mask, dual_clip=DUAL)
    composed = d.token_level_aggregate(per_token, x.mask)
    compiled = d.token_level_loss(x.logp, x.old, x.adv, x.mask, dual_clip=DUAL, compiled=True)
    verl = ref.verl_compute_policy_loss(x.old, x.logp, x.adv, x.mask)[0]
    trl = ref.trl_compute_loss(
        x.logp, x.old, x.adv[:, 0], x.mask.int(), num_items_in_batch=x.mask.sum()
    )
    ours_nodual = d.token_level_loss(x.logp, x.old, x.adv, x.mask)
    torch.testing.assert_close(composed, ours)
    torch.testing.assert_close(compiled, ours)
    torch._dynamo.reset()  # the timed cases report the compile cost from scratch
    torch.testing.assert_close(verl, ours, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(trl, ours_nodual, rtol=1e-5, atol=1e-7)
    notes.append("loss: verl-style == dapo_ops (dual_clip=3); TRL-style == dapo_ops (no dual)")

    for ragged in (False, True):
        r = reward_inputs(4096, 256, device, ragged)
        got = (
            d.group_advantages(r.rewards, r.ids, eps=1e-6)
            if ragged
            else d.group_advantages(r.dense, eps=1e-6).flatten()
        )
        want = ref.verl_grpo_outcome_advantage(
            r.rewards.cpu()[:, None].clone(), torch.ones(r.rewards.numel(), 1), r.uids
        )[:, 0]
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        keep = d.dynamic_sample_mask(r.rewards, r.ids) if ragged else None
        if keep is not None:
            kept = torch.nonzero(keep.cpu())[:, 0].tolist()
            assert kept == ref.verl_filter_groups(r.uids, r.rewards.cpu().numpy())
    notes.append("group_advantages (eps=1e-6) == verl loop; dynamic_sample_mask == filter_groups")
    lengths = reward_inputs(4096, 256, device, False).lengths
    torch.testing.assert_close(
        d.overlong_reward(lengths, max_len=20_480, cache_len=4096).cpu(),
        ref.verl_overlong_penalty(lengths.cpu(), 20_480, 4096, 1.0),
    )
    notes.append("overlong_reward == verl penalty loop (lengths <= max_len)")
    if "verl" in installed_versions():
        from verl.trainer.ppo import core_algos

        real = _verl_policy_loss(core_algos, x, x.logp)[0]
        torch.testing.assert_close(real, ours, rtol=1e-5, atol=1e-7)
        r = reward_inputs(4096, 256, device, True)
        want = core_algos.compute_grpo_outcome_advantage(
            r.rewards.cpu()[:, None].clone(), torch.ones(r.rewards.numel(), 1), r.uids
        )[0][:, 0]
        got = d.group_advantages(r.rewards, r.ids, eps=1e-6).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        notes.append("installed verl's policy loss and GRPO advantage == dapo_ops")
    return notes


# --------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(fn: Fn, device: str) -> float:
    if device == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(device: str, quick: bool) -> float:
    """Bytes/s of a large tensor copy (read + write), median of repeats."""
    n = (64 if quick else 128) * 2**20 if device == "cpu" else 256 * 2**20  # float32 elements
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [time_once(lambda: dst.copy_(src), device) for _ in range(7 if quick else 15)]
    return 2 * n * 4 / statistics.median(times)


def warm_allocator(device: str) -> None:
    """Allocate, touch and free one 30 MiB tensor, as a trainer has long before its loss.

    glibc's malloc raises its mmap threshold to the size of the largest mmapped block
    freed so far (up to 32 MiB), and its heap-trim threshold to twice that. Until a large
    block has been freed, every temporary of 128 KiB or more is a fresh mmap whose pages
    fault on first touch, which costs ~1 ms per MiB on this VM (measured): timings would
    then depend on the process's allocation history, not on the code being timed.
    """
    if device == "cpu":
        torch.empty(30 * 2**20 // 4).fill_(0.0)


def count_kernels(fn: Fn) -> int | None:
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # profiler unavailable: report n/a
        return None


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field_name)


def child_memory(spec: dict[str, Any]) -> None:
    """In a fresh process: extra peak RSS of one call of one implementation."""
    torch.set_num_threads(spec["threads"])
    cases = make_cases(spec["quick"], "cpu")
    case = next(c for c in cases if c.op == spec["op"] and c.size == spec["size"])
    impl = next(i for i in case.impls if i.name == spec["impl"])
    inputs = case.make_inputs()
    fn = impl.build(inputs)
    fn()  # warm-up: lazy initialisation, compilation
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter to the current RSS
    base = _status_kb("VmRSS")
    fn()
    peak = _status_kb("VmHWM")
    print(json.dumps({"extra": peak - base, "input_bytes": case.input_bytes(inputs)}))


def measure_memory_cpu(case: Case, impl: Impl, quick: bool, threads: int) -> tuple[int | None, str]:
    spec = {
        "op": case.op,
        "size": case.size,
        "impl": impl.name,
        "quick": quick,
        "threads": threads,
    }
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.run", "--child-memory", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=ROOT,
            check=True,
        )
        return int(json.loads(out.stdout.strip().splitlines()[-1])["extra"]), ""
    except Exception as e:  # report, do not abort the run
        return None, f"{type(e).__name__}: {getattr(e, 'stderr', '')[-300:]}"


def measure_memory_cuda(fn: Fn) -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def _measure_memory_of(case: Case, impl: Impl, quick: bool) -> bool:
    """Which (case, impl) pairs get a peak-memory subprocess (each costs a torch import)."""
    if case.back_to_back:  # the same calls as the interleaved case: measured there
        return False
    if quick:
        return not (impl.compiled or impl.name in QUICK_SKIP_MEMORY or case.size != "64x4096")
    if case.op == "token_level_loss fwd+bwd":
        return True  # every implementation, every shape
    # elsewhere: ours (not compiled) and the main reference
    return (impl.role == "ours" and not impl.compiled) or impl.name == case.main_ref


def run_case(case: Case, args: argparse.Namespace, log: Callable[[str], None]) -> list[Result]:
    device = args.device
    inputs = case.make_inputs()
    results = {i.name: Result(case.op, case.size, i.name, i.role) for i in case.impls}
    fns: dict[str, Fn] = {}
    per_call: dict[str, float] = {}
    for impl in case.impls:
        res = results[impl.name]
        res.input_bytes = case.input_bytes(inputs)
        try:
            fn = impl.build(inputs)
            res.first_call_s = time_once(fn, device)  # warm-up (and compilation)
            per_call[impl.name] = time_once(fn, device)
            fns[impl.name] = fn
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"[:200]
            log(f"    {impl.name}: ERROR {res.error}")
    target = args.target_s
    repeats = {
        name: int(min(args.max_repeats, max(args.min_repeats, target / max(t, 1e-7))))
        for name, t in per_call.items()
    }
    if case.back_to_back:  # each implementation alone, warm: the best case for each
        for name, fn in fns.items():
            results[name].times += [time_once(fn, device) for _ in range(repeats[name])]
    for r in range(0 if case.back_to_back else max(repeats.values(), default=0)):
        for name, fn in fns.items():  # round-robin: background load hits all alike
            if r < repeats[name]:
                results[name].times.append(time_once(fn, device))
    for impl in case.impls:
        res = results[impl.name]
        if impl.compiled and res.first_call_s is not None and res.times:
            res.compile_s = max(res.first_call_s - res.median, 0.0)
    if device == "cuda":
        for name, fn in fns.items():
            results[name].kernels = count_kernels(fn)
            results[name].mem_extra = measure_memory_cuda(fn)
    elif not args.no_memory and (not args.quick or case.op == "token_level_loss fwd+bwd"):
        for impl in case.impls:
            if impl.name in fns and _measure_memory_of(case, impl, args.quick):
                extra, err = measure_memory_cpu(case, impl, args.quick, torch.get_num_threads())
                results[impl.name].mem_extra = extra
                if err:
                    log(f"    memory {impl.name}: {err}")
    del fns, inputs
    gc.collect()
    for res in results.values():
        if res.times:
            log(
                f"    {res.impl:<48} median {res.median * 1e3:9.3f} ms  "
                f"min {min(res.times) * 1e3:9.3f} ms  n={len(res.times)}"
                + (f"  compile {res.compile_s:.1f}s" if res.compile_s is not None else "")
                + (f"  mem {res.mem_extra / 2**20:.1f} MiB" if res.mem_extra is not None else "")
            )
    return list(results.values())


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def machine_description(device: str) -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem = f"{mem_gib:.0f} GiB RAM"
    except (ValueError, OSError):
        mem = "RAM unknown"
    desc = f"{cpu}, {os.cpu_count()} logical CPUs, {mem}, torch threads {torch.get_num_threads()}"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        desc += f"; GPU {props.name} ({props.total_memory / 2**30:.0f} GiB)"
    return desc


def _ms(t: float) -> str:
    if math.isnan(t):
        return "n/a"
    if t >= 1.0:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.0f} µs"


def _ratio(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return "n/a"
    return f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def _mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def render_markdown(
    results: list[Result],
    cases: list[Case],
    bandwidth: float,
    args: argparse.Namespace,
    notes: list[str],
    loads: tuple[str, str],
    wall_s: float,
) -> str:
    by_case: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        by_case.setdefault((r.op, r.size), []).append(r)
    case_of = {(c.op, c.size): c for c in cases}
    cuda = args.device == "cuda"
    cmd = "python -m benchmarks.run" + (" --quick" if args.quick else "")
    cmd += " --device cuda" if cuda else ""
    cmd += f" --threads {args.threads}" if args.threads else ""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/run.py`; do not edit by hand. Re-run with:",
        "",
        "```bash",
        cmd,
        "```",
        "",
        f"- Date: {args.date}",
        f"- Machine: {args.machine}",
        f"- Python {args.python}, torch {args.torch}, "
        f"dapo_ops {args.dapo_ops}; device `{args.device}`"
        + (" (CUDA-event timing)" if cuda else " (wall-clock timing, `time.perf_counter`)"),
        f"- Copy bandwidth measured in this run: **{bandwidth / 1e9:.1f} GB/s** "
        "(large float32 `copy_`, read + write bytes / time). The floor of an op is the bytes "
        "it must read and write divided by this figure.",
        f"- Load average (1/5/15 min) at start: {loads[0]}; at end: {loads[1]}. "
        "Implementations of one case run interleaved, so shared background load hits all "
        "of them alike; the minimum is the least disturbed sample.",
        f"- Total wall time of this run: {wall_s / 60:.1f} min"
        + (" (quick mode: fewer shapes and repeats)" if args.quick else ""),
        "",
        "Columns: median and inter-quartile range (IQR) over `n` repeats, and the minimum; "
        "`x ref` = time of the case's main peer-style reference / this row's time (above 1: "
        "faster than the reference), from the medians / from the minima; `x floor` = time / "
        "floor, likewise; on a machine shared with other jobs the minima are the better "
        "estimate of each implementation's own cost. Extra peak = memory above the "
        "inputs during one call (CPU: peak RSS in a fresh process; CUDA: "
        "`max_memory_allocated`), also as a multiple of the input size."
        + (
            " `kernels` = GPU kernels (incl. memcpy/memset) per call, from torch.profiler."
            if cuda
            else ""
        ),
        "",
    ]
    header = (
        "| case | implementation | median | IQR | min | n | x ref (med / min) "
        "| x floor (med / min) | extra peak MiB | x inputs |"
    )
    sep = "|---|---|---|---|---|---|---|---|---|---|"
    if cuda:
        header += " kernels |"
        sep += "---|"
    section = None
    for key, rs in by_case.items():
        case = case_of[key]
        op_section = case.op.split(" ")[0]
        if op_section != section:
            section = op_section
            lines += ["", f"## {section}", "", header, sep]
        floor = case.floor_bytes / bandwidth
        main = next((r for r in rs if r.impl == case.main_ref), None)
        for r in rs:
            if not r.times:
                lines.append(f"| {case.op} {case.size} | {r.impl} | error: {r.error} |||||||||")
                continue
            q1, q3 = r.q1q3
            x_ref = main.median / r.median if main is not None and main.times else math.nan
            x_ref_min = (
                min(main.times) / min(r.times) if main is not None and main.times else math.nan
            )
            xin = (
                f"{r.mem_extra / r.input_bytes:.2f}"
                if r.mem_extra is not None and r.input_bytes
                else "n/a"
            )
            name = f"**{r.impl}**" if r.role == "ours" else r.impl
            row = (
                f"| {case.op} {case.size} | {name} | {_ms(r.median)} | {_ms(q1)}-{_ms(q3)} | "
                f"{_ms(min(r.times))} | {len(r.times)} | "
                f"{'—' if r is main else _ratio(x_ref) + ' / ' + _ratio(x_ref_min)} | "
                f"{_ratio(r.median / floor)} / {_ratio(min(r.times) / floor)} | "
                f"{_mib(r.mem_extra)} | {xin} |"
            )
            if cuda:
                row += f" {r.kernels if r.kernels is not None else 'n/a'} |"
            lines.append(row)
    compiled = [r for r in results if r.compile_s is not None]
    if compiled:
        lines += [
            "",
            "## Compile time (first call minus steady-state median)",
            "",
            "| case | implementation | compile time |",
            "|---|---|---|",
        ]
        lines += [f"| {r.op} {r.size} | {r.impl} | {r.compile_s:.1f} s |" for r in compiled]
    lines += ["", "## Targets", "", *targets(results, cases, bandwidth)]
    if getattr(args, "note", None):
        lines += ["", "## Notes", "", *[f"- {n}" for n in args.note]]
    lines += ["", "## Reference implementations", ""]
    lines += [
        "`benchmarks/references.py` holds our own re-implementations of the peers' code "
        "paths, op for op (written from the peers' algorithms, nothing imported or copied; "
        "where the peers themselves are installed they are timed too, see below):",
        "",
        "- **verl 0.9.1** (`verl/trainer/ppo/core_algos.py`): `compute_policy_loss_vanilla` "
        "(dual clip `clip_ratio_c=3` always applied) + `agg_loss` (token-mean divided by the "
        "global token count the trainer passes in `global_batch_info`) + `verl_F.masked_sum`"
        " (`where(mask, x, 0) * mask`, summed; verl 0.4-0.5 had no `where`) and "
        "`masked_mean`; the `.detach().item()` of the three policy metrics (pg_clipfrac, "
        "ppo_kl, pg_clipfrac_lower) and of pg_loss; "
        "`compute_grpo_outcome_advantage` (defaultdict-of-lists loop over the uid array); "
        "the DAPO recipe's `filter_groups` loop (with its list-membership test); the DAPO "
        "reward manager's overlong-buffer penalty, per sample.",
        "- **TRL 0.19-0.21** (`trl/trainer/grpo_trainer.py`): `GRPOTrainer._compute_loss` "
        "with `beta=0`, `loss_type='dapo'`, the low/high/region clip-ratio metrics and their "
        "`.item()` calls (no dual clip in TRL: the dapo_ops rows use `dual_clip=3`, a little "
        "more work); the dense `view(-1, G)` group advantage; "
        "`get_soft_overlong_punishment` (list comprehension).",
        "- Compile times are first call minus the steady-state median. Inductor keeps an "
        "on-disk cache (`/tmp/torchinductor_$USER`): with it warm from an earlier run a "
        "compile costs tenths of a second; with it cold, the first `compiled=True` call took "
        "about 2.5 s on this machine and `torch.compile(token_level_loss)` about 4 s. After "
        "the second shape the graphs are dynamic and new shapes compile nothing.",
        "- Back-to-back cases: the same calls, each implementation's repeats in one block, so "
        "its inputs and buffers stay in cache (between two calls of the interleaved cases, "
        "the other implementations evict them: the realistic case for a loss that runs "
        "after a model's forward, and the one the targets are read on first).",
        "- Allocator state: before timing, the process allocates and frees one 30 MiB "
        "tensor, so that glibc's dynamic mmap threshold sits at its steady-state value (as "
        "in any training process); otherwise every temporary of 128 KiB or more would be "
        "a fresh mmap, and page faults (~1 ms per MiB on this VM) would dominate every "
        "row. The peak-memory subprocesses pin the threshold low instead, to see every "
        "temporary.",
        "- Inputs are the same tensors for every implementation: float32 log-probs, a bool "
        "mask (TRL-style gets it as int32, as TRL builds it), per-sequence advantages "
        "`[B, 1]` (verl passes them expanded to `[B, S]`, which would only slow it down). "
        "Advantage inputs for verl are `[N, 1]` token-level rewards (response length 1), "
        "so its timing is the Python loop, not a reduction over a long response.",
        "- Installed peers found in this environment and timed directly (rows marked "
        "`(installed)`): "
        + (", ".join(f"{k} {v}" for k, v in args.installed.items()) or "none")
        + ". Installed verl's `compute_policy_loss_vanilla` runs with a real `ActorConfig` "
        "(clip 0.2/0.28, `clip_ratio_c=3`, the global token count in `global_batch_info`); "
        "its GRPO advantage is timed both as the uid loop and as the vectorized estimator "
        "(`grpo_vectorized`) that newer verl offers.",
        "- Agreement checked before timing: " + "; ".join(notes) + ".",
        "- `token_level_loss` (and `policy_loss` for every objective with an analytic "
        "gradient) runs the fused path (one pass, analytic backward), with a KL term and IS "
        "weights too; the unfused composition row (surrogate, then aggregation, through "
        "autograd) is the reference it is checked against. `compiled=True` puts the loss "
        "scale, the loss "
        "and its gradient in one `torch.compile` graph (compiled once per process; its "
        "compile time is in the table below, not in the timings). The eager CPU path works "
        "in blocks of rows of about 512 Ki elements, inside the gradient and two scratch "
        "buffers allocated per call (at most 4 MiB in float32; six with per-token "
        "advantages); they are part of the `extra peak` column.",
    ]
    return "\n".join(lines) + "\n"


def _find(results: list[Result], op: str, size: str, impl_prefix: str) -> Result | None:
    return next(
        (r for r in results if r.op == op and r.size == size and r.impl.startswith(impl_prefix)),
        None,
    )


def _verdict(ok_median: bool, ok_min: bool) -> str:
    if ok_median and ok_min:
        return "**met**"
    if ok_min:
        return "**met on the minima, not on the medians** (background load)"
    return "**not met**"


#: the sizes the issue's loss targets name
SIZES = ("64x4096", "512x8192")


def targets(results: list[Result], cases: list[Case], bandwidth: float) -> list[str]:
    out: list[str] = []
    case_of = {(c.op, c.size): c for c in cases}
    for op, size in [(o, z) for o in ("token_level_loss fwd+bwd", BACK_TO_BACK) for z in SIZES]:
        if (op, size) not in case_of:
            continue
        verl = _find(results, op, size, "verl-style step")
        if verl is None or not verl.times:
            out.append(f"- {op} {size}: not measured in this run.")
            continue
        floor = case_of[(op, size)].floor_bytes / bandwidth
        r = _find(results, op, size, PUBLIC_EAGER)
        if r and r.times:
            x, xm = verl.median / r.median, min(verl.times) / min(r.times)
            out.append(
                f"- {op} {size}, token_level_loss (default, eager) vs verl-style: {x:.1f}x "
                f"faster on medians, {xm:.1f}x on minima (target ≥ 5x): "
                f"{_verdict(x >= 5, xm >= 5)}."
            )
        for prefix in (PUBLIC_COMPILED, USER_COMPILED):
            r = _find(results, op, size, prefix)
            if r and r.times:
                x, xm = r.median / floor, min(r.times) / floor
                out.append(
                    f"- {op} {size}, {prefix}: {x:.1f}x the bandwidth floor on the median, "
                    f"{xm:.1f}x on the minimum ({_ms(r.median)} / {_ms(min(r.times))} vs "
                    f"{_ms(floor)}; target ≤ 3x): {_verdict(x <= 3, xm <= 3)}."
                )
        for prefix in (PUBLIC_EAGER, PUBLIC_COMPILED):
            r = _find(results, op, size, prefix)
            if r and r.mem_extra is not None and r.input_bytes and op != BACK_TO_BACK:
                x = r.mem_extra / r.input_bytes
                out.append(
                    f"- {op} {size}, {r.impl}: extra peak {_mib(r.mem_extra)} MiB = {x:.2f}x "
                    f"the inputs (target ≤ 4x): **{'met' if x <= 4 else 'not met'}**."
                )
    for r in results:
        if r.op == "group_advantages ragged" and r.size.startswith("16k") and r.role == "ours":
            loop = _find(results, r.op, r.size, "verl-style")
            if loop and loop.times and r.times:
                x, xm = loop.median / r.median, min(loop.times) / min(r.times)
                out.append(
                    f"- group_advantages ragged, 16k samples: {x:.0f}x faster than the "
                    f"per-group Python loop on medians, {xm:.0f}x on minima (target ≥ 50x): "
                    f"{_verdict(x >= 50, xm >= 50)}."
                )
    return out


def render_plot(results: list[Result], cases: list[Case], bandwidth: float, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install matplotlib): no plot written"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    op = "token_level_loss fwd+bwd"
    loss_cases = [c for c in cases if c.op == op]
    names = [i.name for i in loss_cases[0].impls] if loss_cases else []
    for name in names:
        pts = [
            (c.elems, r.median * 1e3)
            for c in loss_cases
            for r in results
            if r.op == op and r.size == c.size and r.impl == name and r.times
        ]
        if pts:
            xs, ys = zip(*pts, strict=True)
            style = "-o" if "dapo_ops" in name or "compile" in name else "--s"
            ax1.plot(xs, ys, style, label=name)
    if loss_cases:
        xs = [c.elems for c in loss_cases]
        ax1.plot(
            xs, [c.floor_bytes / bandwidth * 1e3 for c in loss_cases], "k:", label="bandwidth floor"
        )
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="tokens (batch x seq)",
        ylabel="median ms per call",
        title="token_level_loss forward + backward",
    )
    if loss_cases:
        ax1.legend(fontsize=7)
    ax1.grid(True, which="both", alpha=0.3)
    labels, ratios = [], []
    for c in cases:
        if c.op.startswith("token_level_loss"):
            continue
        main = _find(results, c.op, c.size, c.main_ref or "\0")
        ours = next(
            (r for r in results if r.op == c.op and r.size == c.size and r.role == "ours"), None
        )
        if main and ours and main.times and ours.times:
            labels.append(f"{c.op}\n{c.size}")
            ratios.append(main.median / ours.median)
    ax2.barh(
        range(len(ratios)), ratios, color=["tab:green" if x >= 1 else "tab:red" for x in ratios]
    )
    ax2.set_yticks(range(len(ratios)), labels, fontsize=7)
    ax2.set_xscale("log")
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set(xlabel="speed-up of dapo_ops over the peer-style reference (x, log)", title="other ops")
    ax2.invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def _loadavg() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run (~1-2 min)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out-md", default=str(ROOT / "docs" / "benchmarks.md"))
    p.add_argument("--out-png", default=str(ROOT / "docs" / "benchmarks.png"))
    p.add_argument(
        "--json",
        default="docs/benchmarks.json",
        help="the raw results (README's figures are rendered from them: benchmarks.summary)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--only", default=None, help="run only cases whose name contains this")
    p.add_argument("--target-s", type=float, default=None, help="timing budget per impl/case")
    p.add_argument("--min-repeats", type=int, default=None)
    p.add_argument("--max-repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--from-json", default=None, help="re-render the report from a --json dump")
    p.add_argument("--note", action="append", default=[], help="free text for the report")
    p.add_argument("--child-memory", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_memory is not None:
        child_memory(json.loads(args.child_memory))
        return 0
    if args.from_json is not None:
        return rerender(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    warm_allocator(args.device)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    args.target_s = args.target_s or (0.15 if args.quick else 1.0)
    args.min_repeats = args.min_repeats or (3 if args.quick else 5)
    args.max_repeats = args.max_repeats or (15 if args.quick else 50)

    t_start = time.perf_counter()
    load_start = _loadavg()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    log(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    notes = check_agreement(args.device)
    log("agreement checks passed: " + "; ".join(notes))
    bandwidth = copy_bandwidth(args.device, args.quick)
    log(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    cases = make_cases(args.quick, args.device)
    if args.only:
        cases = [c for c in cases if args.only in f"{c.op} {c.size}"]
    results: list[Result] = []
    for case in cases:
        log(f"{case.op} {case.size}")
        results += run_case(case, args, log)
    wall = time.perf_counter() - t_start
    args.date = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    args.machine = machine_description(args.device)
    record_environment(args)
    loads = (load_start, _loadavg())
    md = render_markdown(results, cases, bandwidth, args, notes, loads, wall)
    Path(args.out_md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_md).write_text(md)
    log(f"report written to {args.out_md}")
    log(render_plot(results, cases, bandwidth, Path(args.out_png)))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "bandwidth": bandwidth,
                    "args": {k: v for k, v in vars(args).items()},
                    "notes": notes,
                    "loads": loads,
                    "wall": wall,
                    "results": [{**r.__dict__, "median": r.median} for r in results],
                },
                indent=1,
            )
        )
    return 0


def record_environment(args: argparse.Namespace) -> None:
    """What the report states about the measuring environment, kept with the results so
    that re-rendering them elsewhere (``--from-json``, the docs test) states the same."""
    args.python = platform.python_version()
    args.torch = torch.__version__
    args.dapo_ops = d.__version__
    args.installed = installed_versions()


def rerender(args: argparse.Namespace) -> int:
    """Rebuild the markdown and the plot from a ``--json`` dump (no measurement)."""
    data = json.loads(Path(args.from_json).read_text())
    if args.note:  # kept with the results, so that the report re-renders with them
        data["args"]["note"] = args.note
        Path(args.from_json).write_text(json.dumps(data, indent=1))
    md, results, cases = render_json(data)
    Path(args.out_md).write_text(md)
    print(render_plot(results, cases, data["bandwidth"], Path(args.out_png)))
    return 0


def render_json(data: dict[str, Any]) -> tuple[str, list[Result], list[Case]]:
    """The markdown report of a ``--json`` dump, with its results and cases."""
    saved = argparse.Namespace(**data["args"])
    results = [Result(**{k: v for k, v in r.items() if k != "median"}) for r in data["results"]]
    cases = make_cases(saved.quick, saved.device)
    keys = {(r.op, r.size) for r in results}
    cases = [c for c in cases if (c.op, c.size) in keys]
    md = render_markdown(
        results, cases, data["bandwidth"], saved, data["notes"], tuple(data["loads"]), data["wall"]
    )
    return md, results, cases


if __name__ == "__main__":
    sys.exit(main())
