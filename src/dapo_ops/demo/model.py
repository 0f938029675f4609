"""The demo's policy (a GRU language model), its base model, the sampler and the rollout."""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from dapo_ops.demo.task import Rollout, Task


class TinyPolicy(nn.Module):
    """A one-layer GRU language model over answer tokens, conditioned on the prompt.

    Each input is the previous token's embedding plus the prompt's (a stand-in for a
    decoder attending to its prompt) plus an embedding of what is left to reach the
    target (the running total a transformer reads off its context; a GRU this small
    counts badly); the head scores the digits and EOS.
    """

    def __init__(self, task: Task, hidden: int) -> None:
        super().__init__()
        self.task = task
        self.embed = nn.Embedding(task.vocab_size, hidden)
        self.left = nn.Embedding(task.max_target + 2, hidden)  # left to go: -1 (over) .. T
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, task.num_actions)

    def forward(
        self, targets: Tensor, inputs: Tensor, left: Tensor, state: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``targets [batch]``, ``inputs, left [batch, seq]`` -> logits ``[batch, seq, actions]``."""
        prompt = self.embed(self.task.prompt_tokens(targets))
        x = self.embed(inputs) + prompt[:, None] + self.left(left.clamp(min=-1) + 1)
        out, state = self.rnn(x, state)
        return self.head(out), state


def left_to_go(task: Task, targets: Tensor, inputs: Tensor) -> Tensor:
    """``[batch, seq]``: the target minus the digits among ``inputs`` up to each position."""
    digits = torch.where(inputs < task.eos, inputs, 0)
    left: Tensor = targets[:, None] - digits.cumsum(dim=1)
    return left


def teacher_forced_logits(policy: TinyPolicy, targets: Tensor, tokens: Tensor) -> Tensor:
    """Logits ``[batch, seq, actions]`` predicting ``tokens`` (EOS doubles as BOS)."""
    bos = torch.full_like(tokens[:, :1], policy.task.eos)
    inputs = torch.cat([bos, tokens[:, :-1]], dim=1)
    logits: Tensor = policy(targets, inputs, left_to_go(policy.task, targets, inputs))[0]
    return logits


@functools.cache
def base_model(task: Task, hidden: int, steps: int, seed: int) -> dict[str, Tensor]:
    """The base model's weights, which every run of every seed starts from (cached).

    Supervised training on :meth:`Task.base_answers`: it stands in for the pretrained,
    instruction-tuned LLM that RL starts from. It writes plausible answers in one peaked
    style, solves the small targets and not the large ones, and rambles into the cap.
    Its own seed; the global RNG is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = TinyPolicy(task, hidden)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    for _ in range(steps):
        targets = task.sample_targets(128, generator)
        tokens = task.base_answers(targets, generator)
        logits = teacher_forced_logits(policy, targets, tokens)
        # the whole answer, EOS padding included: the base model learns to stop
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


@torch.no_grad()
def generate(
    policy: TinyPolicy, targets: Tensor, group_size: int, temperature: float, gen: torch.Generator
) -> Rollout:
    """Sample ``group_size`` answers per target token by token; keep the sampler's log-probs."""
    task = policy.task
    targets = targets.repeat_interleave(group_size)
    n, cap = targets.shape[0], task.max_len
    tokens = torch.full((n, cap), task.eos)
    old_logp = torch.zeros(n, cap)
    entropy = torch.zeros(n, cap)
    mask = torch.zeros(n, cap, dtype=torch.bool)
    alive = torch.ones(n, dtype=torch.bool)
    inputs, state = torch.full((n, 1), task.eos), None  # EOS doubles as BOS
    left = targets[:, None].clone()
    for t in range(cap):
        logits, state = policy(targets, inputs, left, state)
        logp = torch.log_softmax(logits[:, -1] / temperature, dim=-1)
        token = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
        token = torch.where(alive, token, task.eos)
        tokens[:, t], mask[:, t] = token, alive
        old_logp[:, t] = logp.gather(-1, token[:, None])[:, 0]
        entropy[:, t] = -(logp.exp() * logp).sum(dim=-1)
        alive = alive & (token != task.eos)
        if not bool(alive.any()):
            break
        inputs = token[:, None]
        left = left - torch.where(token < task.eos, token, 0)[:, None]
    return Rollout(targets, tokens, mask, old_logp, ~alive, entropy)


def answer_logp(policy: TinyPolicy, batch: Rollout, temperature: float) -> Tensor:
    """Log-probs ``[batch, max_len]`` of the answer tokens under the current policy.

    The training forward pass divides the logits by the same temperature as the sampler,
    so that ``old_logp`` and ``logp`` are log-probs of one and the same distribution.
    """
    logits = teacher_forced_logits(policy, batch.targets, batch.tokens)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, batch.tokens[..., None])[..., 0]
