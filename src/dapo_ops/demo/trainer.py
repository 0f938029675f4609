"""One DAPO / GRPO training run: the wiring of ``dapo_ops`` a host trainer needs."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

from dapo_ops import (
    ObjectivePreset,
    PolicyDiagnostics,
    dynamic_sample_mask,
    global_normalizer,
    kept_group_fraction,
    overlong_filter,
    overlong_reward,
    policy_loss_with_diagnostics,
    prompts_to_generate,
)
from dapo_ops.demo.task import Rollout, Task, TinyPolicy, answer_logp, generate
from dapo_ops.objectives import ClipHigher
from dapo_ops.presets import DAPO, GRPO

#: The baseline: GRPO's clip and aggregation, without its KL term (DAPO has none either),
#: so that the two runs differ only by DAPO's four changes.
GRPO_BASELINE = GRPO.replace(kl=None)


def dapo_preset(
    *,
    clip_higher: bool = True,
    dynamic_sampling: bool = True,
    token_level: bool = True,
    overlong: bool = True,
    overlong_filtering: bool = False,
) -> ObjectivePreset:
    """The :data:`dapo_ops.presets.DAPO` preset, with any of its components switched off."""
    clip = DAPO.objective
    assert isinstance(clip, ClipHigher)
    return DAPO.replace(
        objective=clip if clip_higher else clip.replace(eps_high=clip.eps_low),
        mode=DAPO.mode if token_level else GRPO.mode,
        dynamic_sampling=dynamic_sampling,
        overlong_penalty=overlong,
        overlong_filter=overlong_filtering,
    )


@dataclass(frozen=True)
class DemoConfig:
    """Everything a run depends on; the defaults are the CLI's."""

    steps: int = 150
    seed: int = 0
    out: Path = Path("demo_out")
    group_size: int = 16  # G answers per prompt
    prompts_per_step: int = 16  # groups in one training batch
    max_gen_rounds: int = 4  # dynamic sampling: generation rounds per step, at most
    max_prompts_per_round: int = 64
    ppo_epochs: int = 2
    minibatches: int = 4  # optimiser steps per epoch
    micro_batches: int = 2  # gradient-accumulation micro-batches per mini-batch
    lr: float = 1e-3
    temperature: float = 1.0
    hidden: int = 64
    budget: Literal["steps", "samples"] = "samples"  # the "same sample budget"
    methods: tuple[str, ...] = ("dapo", "grpo")
    dapo: ObjectivePreset = dataclasses.field(default_factory=dapo_preset)
    task: Task = dataclasses.field(default_factory=Task)
    progress: bool = True
    plot: bool = True

    @property
    def sample_budget(self) -> int:
        """Generated answers per run with ``budget="samples"``: GRPO's, over ``steps``."""
        return self.steps * self.prompts_per_step * self.group_size


@dataclass
class StepLog:
    """One row of ``metrics.csv``: what a trainer would log after each step."""

    method: str
    step: int
    samples: int  # answers generated so far, this step included
    accuracy: float  # mean 0/1 accuracy of every answer generated this step
    reward: float  # mean shaped reward of the trained batch
    mean_response_length: float  # tokens, EOS included
    truncated_fraction: float
    entropy: float  # mean per-token policy entropy over the generated answers
    clip_frac_low: float
    clip_frac_high: float
    approx_kl: float
    kept_group_fraction: float  # share of drawn groups with accuracy spread
    generation_rounds: int
    prompts_drawn: int
    groups_trained: int
    seconds: float


CSV_COLUMNS = tuple(f.name for f in dataclasses.fields(StepLog))


# ------------------------------------------------------------------------------ training
@dataclass(frozen=True)
class Collected:
    """What the generation rounds of one step produced."""

    batch: Rollout  # the training batch: at most prompts_per_step groups
    accuracy: Tensor  # [batch] 0/1 accuracy of the training batch
    drawn: Rollout  # every answer generated this step (for logging)
    keep: Tensor  # [prompts drawn] bool: the group's accuracy has spread
    rounds: int
    kept_estimate: float  # kept fraction of the last round: sizes the next first round


def collect_batch(
    policy: TinyPolicy,
    cfg: DemoConfig,
    preset: ObjectivePreset,
    gen: torch.Generator,
    kept_estimate: float,
    budget_left: int,
) -> Collected:
    """The generation rounds of one step, with dynamic sampling when ``preset`` uses it."""
    g = cfg.group_size
    need = cfg.prompts_per_step
    kept: list[Rollout] = []
    drawn: list[Rollout] = []
    verdicts: list[Tensor] = []
    for _ in range(cfg.max_gen_rounds if preset.dynamic_sampling else 1):
        max_prompts = min(cfg.max_prompts_per_round, budget_left // g)
        if need == 0 or max_prompts < 1:
            break
        if preset.dynamic_sampling:  # over-sample by the expected share of kept groups
            n = prompts_to_generate(need, kept_estimate, max_prompts=max_prompts)
        else:
            n = min(need, max_prompts)
        rollout = generate(policy, cfg.task.sample_targets(n, gen), g, cfg.temperature, gen)
        # Filter on the task metric (accuracy), never on the shaped reward: the overlong
        # penalty would give an all-wrong group of uneven lengths a spurious spread.
        keep = dynamic_sample_mask(cfg.task.verify(rollout).view(n, g))
        kept_estimate = float(kept_group_fraction(keep))  # one host sync per round
        train = keep if preset.dynamic_sampling else torch.ones_like(keep)
        train = train & (train.cumsum(0) <= need)  # fill the batch, no more
        kept.append(rollout[train.repeat_interleave(g)])
        drawn.append(rollout)
        verdicts.append(keep)
        need -= int(train.sum())
        budget_left -= n * g
    batch = Rollout.cat(kept)
    return Collected(
        batch=batch,
        accuracy=cfg.task.verify(batch),
        drawn=Rollout.cat(drawn),
        keep=torch.cat(verdicts),
        rounds=len(drawn),
        kept_estimate=kept_estimate,
    )


def ppo_update(
    policy: TinyPolicy,
    optimizer: torch.optim.Optimizer,
    cfg: DemoConfig,
    preset: ObjectivePreset,
    batch: Rollout,
    advantages: Tensor,
    loss_mask: Tensor,
    gen: torch.Generator,
) -> PolicyDiagnostics:
    """PPO epochs over shuffled mini-batches; returns the diagnostics summed over them."""
    total: PolicyDiagnostics | None = None
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(batch.targets.shape[0], generator=gen)
        for minibatch in order.chunk(cfg.minibatches):
            micro = minibatch.chunk(cfg.micro_batches)
            # One optimiser step = every micro-batch of this mini-batch: divide each
            # micro-batch's loss by the mini-batch's count (tokens, or sequences for
            # GRPO's mode), not its own, so the accumulated gradient is the full one.
            normalizer = global_normalizer([loss_mask[idx] for idx in micro], mode=preset.mode)
            for idx in micro:
                logp = answer_logp(policy, batch[idx], cfg.temperature)
                loss, diag = policy_loss_with_diagnostics(
                    preset.objective,
                    logp,
                    batch.old_logp[idx],
                    advantages[idx],
                    loss_mask[idx],
                    mode=preset.mode,
                    normalizer=normalizer,
                )
                # = preset.loss(...) (no KL here), plus the clip/ratio diagnostics
                loss.backward()  # type: ignore[no-untyped-call]
                total = diag if total is None else total + diag
            nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert total is not None
    return total


def train(
    cfg: DemoConfig, preset: ObjectivePreset, on_step: Callable[[StepLog], None] | None = None
) -> list[StepLog]:
    """One run of ``preset`` from the seed's initial weights; one log row per step."""
    torch.manual_seed(cfg.seed)
    policy = TinyPolicy(cfg.task, cfg.hidden)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    g = cfg.group_size
    logs: list[StepLog] = []
    samples, kept_estimate, start = 0, 1.0, time.perf_counter()
    while len(logs) < cfg.steps if cfg.budget == "steps" else samples < cfg.sample_budget:
        budget_left = cfg.sample_budget - samples if cfg.budget == "samples" else sys.maxsize
        step = collect_batch(policy, cfg, preset, gen, kept_estimate, budget_left)
        kept_estimate = step.kept_estimate
        batch, drawn = step.batch, step.drawn
        samples += drawn.targets.shape[0]
        groups = batch.targets.shape[0] // g

        rewards = step.accuracy
        if preset.overlong_penalty:
            task = cfg.task
            penalty = overlong_reward(batch.lengths, max_len=task.max_len, cache_len=task.cache_len)
            rewards = rewards + penalty
        loss_mask = batch.mask
        if preset.overlong_filter:
            loss_mask = overlong_filter(loss_mask, ~batch.finished)

        diag = None
        if groups > 0:  # dynamic sampling may come back empty-handed after its last round
            advantages = preset.advantages(rewards.view(groups, g)).view(-1)
            diag = ppo_update(policy, optimizer, cfg, preset, batch, advantages, loss_mask, gen)

        # Entropy of the sampling policy: a masked mean over the valid answer tokens.
        entropy = torch.where(drawn.mask, drawn.entropy, 0.0).sum() / drawn.mask.sum()
        log = StepLog(
            method=preset.name,
            step=len(logs) + 1,
            samples=samples,
            accuracy=float(cfg.task.verify(drawn).mean()),
            reward=float(rewards.mean()) if groups > 0 else 0.0,
            mean_response_length=float(drawn.lengths.float().mean()),
            truncated_fraction=float((~drawn.finished).float().mean()),
            entropy=float(entropy),
            clip_frac_low=float(diag.clip_frac_low) if diag is not None else 0.0,
            clip_frac_high=float(diag.clip_frac_high) if diag is not None else 0.0,
            approx_kl=float(diag.approx_kl) if diag is not None else 0.0,
            kept_group_fraction=float(kept_group_fraction(step.keep)),
            generation_rounds=step.rounds,
            prompts_drawn=step.keep.numel(),
            groups_trained=groups,
            seconds=time.perf_counter() - start,
        )
        logs.append(log)
        if on_step is not None:
            on_step(log)
    return logs
