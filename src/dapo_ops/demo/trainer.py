"""One training run: the wiring of ``dapo_ops`` a host trainer needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

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
from dapo_ops.demo.model import TinyPolicy, answer_logp, base_model, generate
from dapo_ops.demo.task import Rollout, Task


@dataclass(frozen=True)
class DemoConfig:
    """Everything one run depends on besides its preset; the defaults are the CLI's."""

    seed: int = 0
    sample_budget: int = 16_384  # generated answers per run (GRPO: 64 steps of 16 x 16)
    group_size: int = 16  # G answers per prompt
    prompts_per_step: int = 16  # groups in one training batch
    max_gen_rounds: int = 4  # dynamic sampling: generation rounds per step, at most
    max_prompts_per_round: int = 64
    ppo_epochs: int = 4
    minibatches: int = 4  # optimiser steps per epoch: epochs x minibatches per batch
    micro_batches: int = 2  # gradient-accumulation micro-batches per mini-batch
    lr: float = 1e-3
    temperature: float = 1.0
    hidden: int = 64
    base_steps: int = 300  # supervised steps of the base model (same for every seed)
    base_seed: int = 0
    eval_samples: int = 16  # answers per target in the evaluation after each step
    final_eval_samples: int = 64  # answers per target in the final evaluation
    task: Task = dataclasses.field(default_factory=Task)


@dataclass(frozen=True)
class StepLog:
    """One row of the per-step CSV: what a trainer would log after each step."""

    method: str
    seed: int
    step: int
    samples: int  # answers generated so far, this step included
    accuracy: float  # evaluation: every target, eval_samples answers each, true accuracy
    response_length: float  # evaluation: mean tokens per answer, EOS included
    truncated_fraction: float  # evaluation
    entropy: float  # evaluation: mean per-token entropy of the policy (nats)
    train_accuracy: float  # true accuracy of every answer generated this step
    train_score: float  # verifier's mean reward on them (noisy on truncated answers)
    reward: float  # mean shaped reward of the trained batch
    clip_frac_low: float  # over every token of every update of this step
    clip_frac_high: float
    approx_kl: float
    kept_group_fraction: float  # share of drawn groups with spread in the verifier's reward
    generation_rounds: int
    prompts_drawn: int
    groups_trained: int


@dataclass(frozen=True)
class Evaluation:
    """The policy on every target: true accuracy, length, truncation, entropy."""

    accuracy: float
    response_length: float
    truncated_fraction: float
    entropy: float


@dataclass(frozen=True)
class RunResult:
    logs: list[StepLog]
    final: Evaluation  # at the sample budget, final_eval_samples answers per target


def evaluate(policy: TinyPolicy, cfg: DemoConfig, samples: int, seed: int) -> Evaluation:
    """Sample ``samples`` answers per target with a fixed generator (same draws each call)."""
    task = cfg.task
    gen = torch.Generator().manual_seed(seed)
    rollout = generate(policy, task.targets, samples, cfg.temperature, gen)
    entropy = torch.where(rollout.mask, rollout.entropy, 0.0).sum() / rollout.mask.sum()
    return Evaluation(
        accuracy=float(task.verify(rollout).mean()),
        response_length=float(rollout.lengths.float().mean()),
        truncated_fraction=float((~rollout.finished).float().mean()),
        entropy=float(entropy),
    )


@dataclass(frozen=True)
class Collected:
    """What the generation rounds of one step produced."""

    batch: Rollout  # the training batch: at most prompts_per_step groups
    score: Tensor  # [batch] the verifier's 0/1 reward of the training batch
    drawn: Rollout  # every answer generated this step (for logging)
    drawn_score: Tensor  # [drawn] the verifier's reward of every answer generated
    keep: Tensor  # [prompts drawn] bool: the group's verifier reward has spread
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
    g, need = cfg.group_size, cfg.prompts_per_step
    kept: list[Rollout] = []
    kept_scores: list[Tensor] = []
    drawn: list[Rollout] = []
    scores: list[Tensor] = []
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
        score = cfg.task.score(rollout, gen)
        # Filter on the verifier's reward (the task metric the trainer sees), never on the
        # shaped reward: the overlong penalty would give an all-wrong group of uneven
        # lengths a spurious spread.
        keep = dynamic_sample_mask(score.view(n, g))
        kept_estimate = float(kept_group_fraction(keep))  # one host sync per round
        train = keep if preset.dynamic_sampling else torch.ones_like(keep)
        train = train & (train.cumsum(0) <= need)  # fill the batch, no more
        rows = train.repeat_interleave(g)
        kept.append(rollout[rows])
        kept_scores.append(score[rows])
        drawn.append(rollout)
        scores.append(score)
        verdicts.append(keep)
        need -= int(train.sum())
        budget_left -= n * g
    return Collected(
        batch=Rollout.cat(kept),
        score=torch.cat(kept_scores),
        drawn=Rollout.cat(drawn),
        drawn_score=torch.cat(scores),
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
                # = preset.loss(...) (no KL here), plus the clip / ratio diagnostics
                loss, diag = policy_loss_with_diagnostics(
                    preset.objective,
                    logp,
                    batch.old_logp[idx],
                    advantages[idx],
                    loss_mask[idx],
                    mode=preset.mode,
                    normalizer=normalizer,
                )
                loss.backward()  # type: ignore[no-untyped-call]
                total = diag if total is None else total + diag
            nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert total is not None
    return total


#: Offset of the evaluation generator's seed from the run's seed.
EVAL_SEED = 1_000_003


def train(
    cfg: DemoConfig,
    preset: ObjectivePreset,
    name: str,
    on_step: Callable[[StepLog], None] | None = None,
) -> RunResult:
    """One run of ``preset`` from the base model until ``cfg.sample_budget`` answers.

    Deterministic for a given config: the base model has its own seed, everything random
    in the run draws from one generator seeded with ``cfg.seed`` (the evaluation from
    another, re-seeded at each call). Run it single-threaded for bitwise-equal results.
    """
    task, g = cfg.task, cfg.group_size
    policy = TinyPolicy(task, cfg.hidden)
    policy.load_state_dict(base_model(task, cfg.hidden, cfg.base_steps, cfg.base_seed))
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    logs: list[StepLog] = []
    samples, kept_estimate = 0, 1.0
    while samples + g <= cfg.sample_budget:
        step = collect_batch(policy, cfg, preset, gen, kept_estimate, cfg.sample_budget - samples)
        kept_estimate = step.kept_estimate
        batch, drawn = step.batch, step.drawn
        samples += drawn.targets.shape[0]
        groups = batch.targets.shape[0] // g

        rewards = step.score  # 2. the verifier's reward, then DAPO's reward shaping
        if preset.overlong_penalty:
            rewards = rewards + overlong_reward(
                batch.lengths, max_len=task.max_len, cache_len=task.cache_len
            )
        loss_mask = batch.mask
        if preset.overlong_filter:  # truncated answers leave the loss (not the group stats)
            loss_mask = overlong_filter(loss_mask, ~batch.finished)

        diag = None
        if groups > 0:  # dynamic sampling may come back empty-handed after its last round
            advantages = preset.advantages(rewards.view(groups, g)).view(-1)
            diag = ppo_update(policy, optimizer, cfg, preset, batch, advantages, loss_mask, gen)

        ev = evaluate(policy, cfg, cfg.eval_samples, cfg.seed + EVAL_SEED)
        log = StepLog(
            method=name,
            seed=cfg.seed,
            step=len(logs) + 1,
            samples=samples,
            accuracy=ev.accuracy,
            response_length=ev.response_length,
            truncated_fraction=ev.truncated_fraction,
            entropy=ev.entropy,
            train_accuracy=float(task.verify(drawn).mean()),
            train_score=float(step.drawn_score.mean()),
            reward=float(rewards.mean()) if groups > 0 else 0.0,
            clip_frac_low=float(diag.clip_frac_low) if diag is not None else 0.0,
            clip_frac_high=float(diag.clip_frac_high) if diag is not None else 0.0,
            approx_kl=float(diag.approx_kl) if diag is not None else 0.0,
            kept_group_fraction=float(kept_group_fraction(step.keep)),
            generation_rounds=step.rounds,
            prompts_drawn=step.keep.numel(),
            groups_trained=groups,
        )
        logs.append(log)
        if on_step is not None:
            on_step(log)
    final = evaluate(policy, cfg, cfg.final_eval_samples, cfg.seed + 2 * EVAL_SEED)
    return RunResult(logs, final)
