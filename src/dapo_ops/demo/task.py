"""The toy task, the policy and the sampler of the demo."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Task:
    """Digit sum: prompt ``T``; answer: digits ``0..max_digit`` summing to ``T``, then EOS."""

    max_digit: int = 3
    min_target: int = 6
    max_target: int = 18
    max_len: int = 14  # generation cap, EOS included
    cache_len: int = 6  # soft overlong penalty beyond max_len - cache_len = 8 tokens

    @property
    def eos(self) -> int:
        return self.max_digit + 1

    @property
    def num_actions(self) -> int:
        """Tokens the policy emits: the digits, then EOS."""
        return self.max_digit + 2

    @property
    def vocab_size(self) -> int:
        """The action tokens, then one prompt token per target."""
        return self.num_actions + self.max_target + 1

    def prompt_tokens(self, targets: Tensor) -> Tensor:
        return targets + self.num_actions

    def sample_targets(self, n: int, generator: torch.Generator) -> Tensor:
        return torch.randint(self.min_target, self.max_target + 1, (n,), generator=generator)

    def verify(self, rollout: Rollout) -> Tensor:
        """0/1 accuracy ``[batch]``: ended with EOS, has a digit, digits sum to the target."""
        is_digit = rollout.mask & (rollout.tokens != self.eos)
        digit_sum = torch.where(is_digit, rollout.tokens, 0).sum(dim=-1)
        correct = rollout.finished & is_digit.any(dim=-1) & (digit_sum == rollout.targets)
        return correct.float()


# ---------------------------------------------------------------------------- the policy
class TinyPolicy(nn.Module):
    """A one-layer GRU language model over answer tokens, conditioned on the prompt.

    The prompt token's embedding is added to every input (a stand-in for a decoder
    attending to its prompt); the head scores the digits and EOS.
    """

    def __init__(self, task: Task, hidden: int) -> None:
        super().__init__()
        self.task = task
        self.embed = nn.Embedding(task.vocab_size, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, task.num_actions)

    def forward(
        self, targets: Tensor, inputs: Tensor, state: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``targets [batch]``, ``inputs [batch, seq]`` -> logits ``[batch, seq, actions]``."""
        prompt = self.embed(self.task.prompt_tokens(targets))
        out, state = self.rnn(self.embed(inputs) + prompt[:, None], state)
        return self.head(out), state


@dataclass(frozen=True)
class Rollout:
    """``G`` answers to each of ``groups`` prompts, flattened group-major to ``groups * G``."""

    targets: Tensor  # [n] the prompt of each answer
    tokens: Tensor  # [n, max_len] answer tokens (EOS repeated after the end)
    mask: Tensor  # [n, max_len] bool: answer tokens, EOS included
    old_logp: Tensor  # [n, max_len] log-prob of each token under the sampling policy
    finished: Tensor  # [n] bool: emitted EOS within the cap (else truncated)
    entropy: Tensor  # [n, max_len] entropy of the sampling distribution at each token

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(dim=-1)

    def __getitem__(self, rows: Tensor) -> Rollout:
        return Rollout(*(field[rows] for field in dataclasses.astuple(self)))

    @staticmethod
    def cat(parts: Sequence[Rollout]) -> Rollout:
        return Rollout(
            *(torch.cat(fields) for fields in zip(*map(dataclasses.astuple, parts), strict=True))
        )


def entropy_of(logits: Tensor) -> Tensor:
    """Entropy (nats) of ``softmax(logits)`` along the last dimension."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


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
    for t in range(cap):
        logits, state = policy(targets, inputs, state)
        logits = logits[:, -1] / temperature
        token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)[:, 0]
        token = torch.where(alive, token, task.eos)
        tokens[:, t], mask[:, t] = token, alive
        old_logp[:, t] = torch.log_softmax(logits, dim=-1).gather(-1, token[:, None])[:, 0]
        entropy[:, t] = entropy_of(logits)
        alive = alive & (token != task.eos)
        inputs = token[:, None]
    return Rollout(targets, tokens, mask, old_logp, ~alive, entropy)


def answer_logp(policy: TinyPolicy, batch: Rollout, temperature: float) -> Tensor:
    """Log-probs ``[batch, max_len]`` of the answer tokens under the current policy.

    The training forward pass divides the logits by the same temperature as the sampler,
    so that ``old_logp`` and ``logp`` are log-probs of one and the same distribution.
    """
    bos = torch.full_like(batch.tokens[:, :1], policy.task.eos)
    logits, _ = policy(batch.targets, torch.cat([bos, batch.tokens[:, :-1]], dim=1))
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, batch.tokens[..., None])[..., 0]
