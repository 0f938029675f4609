"""The toy task of the demo: a digit-sum prompt, a verifier, the base model's style and
the rollouts it scores."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Task:
    """Digit sum: prompt ``T``; answer: digits ``0..max_digit`` summing to ``T``, then EOS.

    Built so that each DAPO technique has something to act on (``docs/demo.md``):

    - **lengths vary, long answers go wrong and degenerate**: a ``0`` lengthens an answer
      without changing its sum (the toy's rambling), and the base model repeats it once
      started (``base_filler_repeat``: a loop of zeros runs into the cap);
    - **a cap with a noisy reward**: generation stops at ``max_len`` tokens (EOS
      included). A truncated answer has no final answer; the verifier passes it with
      probability ``truncated_pass_rate`` whatever it holds (the reward noise of truncated
      samples that overlong filtering and the soft penalty address). The true accuracy
      (:meth:`verify`, what the evaluation reports) counts it wrong;
    - **correct but unlikely tokens**: the base model writes mostly ``1`` and ``2``;
      the large targets fit under the cap only with many ``3``, which the base model
      emits with probability ``base_digit_probs[3]``;
    - **groups without spread**: the base model solves small targets nearly always and
      large ones nearly never.

    Every target fits in ``max_len - cache_len`` tokens when written with ``3`` s, so a
    correct answer never has to pay the soft overlong penalty.
    """

    max_digit: int = 3
    min_target: int = 4
    max_target: int = 18
    max_len: int = 9  # generation cap, EOS included
    cache_len: int = 2  # soft overlong penalty beyond max_len - cache_len tokens
    truncated_pass_rate: float = 0.25
    #: Base model's digit distribution (filler 0, then 1, 2, 3) in its training answers.
    base_digit_probs: tuple[float, ...] = (0.05, 0.78, 0.16, 0.01)
    #: After a 0, the base style writes another 0 with this probability (a loop).
    base_filler_repeat: float = 0.6
    #: A digit larger than what is left is written anyway (overshoot) with this probability.
    base_overshoot: float = 0.3

    def __post_init__(self) -> None:
        if len(self.base_digit_probs) != self.max_digit + 1:
            raise ValueError("base_digit_probs needs one probability per digit 0..max_digit")
        shortest = -(-self.max_target // self.max_digit) + 1  # ceil(T / max_digit) + EOS
        if shortest > self.max_len - self.cache_len:
            raise ValueError("the largest target must fit before the overlong penalty starts")

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

    @property
    def targets(self) -> Tensor:
        """Every prompt, in order (the evaluation set)."""
        return torch.arange(self.min_target, self.max_target + 1)

    def prompt_tokens(self, targets: Tensor) -> Tensor:
        return targets + self.num_actions

    def sample_targets(self, n: int, generator: torch.Generator) -> Tensor:
        return torch.randint(self.min_target, self.max_target + 1, (n,), generator=generator)

    def verify(self, rollout: Rollout) -> Tensor:
        """True 0/1 accuracy ``[batch]``: ended with EOS, has a digit, digits sum to ``T``."""
        is_digit = rollout.mask & (rollout.tokens != self.eos)
        digit_sum = torch.where(is_digit, rollout.tokens, 0).sum(dim=-1)
        correct = rollout.finished & is_digit.any(dim=-1) & (digit_sum == rollout.targets)
        return correct.float()

    def score(self, rollout: Rollout, generator: torch.Generator) -> Tensor:
        """The verifier's 0/1 reward ``[batch]``: what the trainer sees.

        :meth:`verify` for finished answers; a coin flip (``truncated_pass_rate``) for a
        truncated one, which has no final answer to check.
        """
        coin = torch.rand(rollout.targets.shape, generator=generator) < self.truncated_pass_rate
        return torch.where(rollout.finished, self.verify(rollout), coin.float())

    def base_answers(self, targets: Tensor, generator: torch.Generator) -> Tensor:
        """Answers in the base model's style ``[n, max_len]``, EOS-padded, cut at the cap.

        Digits are drawn from ``base_digit_probs`` (after a ``0``, another ``0`` with
        probability ``base_filler_repeat``); a digit larger than what is left to reach the
        target is lowered to land on it exactly, then EOS. Long answers (large targets,
        loops of zeros) run past the cap and are cut: the base model learns to ramble into
        truncation on them.
        """
        n = targets.shape[0]
        probs = torch.tensor(self.base_digit_probs).expand(n, -1)
        out = torch.full((n, self.max_len), self.eos)
        remaining = targets.clone()
        previous = torch.full((n,), self.eos)
        for t in range(self.max_len):
            done = remaining == 0
            draw = torch.multinomial(probs, 1, generator=generator)[:, 0]
            repeat = torch.rand(n, generator=generator) < self.base_filler_repeat
            draw = torch.where((previous == 0) & repeat, 0, draw)
            over = torch.rand(n, generator=generator) < self.base_overshoot
            digit = torch.where(over, draw, torch.minimum(draw, remaining))
            out[:, t] = torch.where(done, self.eos, digit)
            remaining = torch.where(done, remaining, (remaining - digit).clamp(min=0))
            previous = out[:, t]
        return out


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

    def fields(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def __getitem__(self, rows: Tensor) -> Rollout:
        return Rollout(*(field[rows] for field in self.fields()))

    @staticmethod
    def cat(parts: Sequence[Rollout]) -> Rollout:
        return Rollout(*(torch.cat(f) for f in zip(*(p.fields() for p in parts), strict=True)))
