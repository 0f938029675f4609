"""DAPO in a plain PyTorch loop: a tiny GRU policy learns a counting task on CPU.

Task: the prompt is a number ``n`` in 1..4; an answer is correct when it holds exactly
``n`` digit tokens before EOS. Generation is capped at ``max_len`` tokens (EOS included),
and answers longer than ``max_len - cache_len`` pay DAPO's soft overlong penalty. One
optimiser step:

1. sample ``G`` answers per prompt from the current policy and keep their log-probs
   (the "old" policy of the PPO ratio);
2. reward = 0/1 correctness + :func:`dapo_ops.overlong_reward`;
3. dynamic sampling: keep the groups whose accuracy has spread
   (:func:`dapo_ops.dynamic_sample_mask`);
4. group-relative advantages (:func:`dapo_ops.group_advantages`);
5. a few PPO epochs, each cut into micro-batches (gradient accumulation) that share one
   :func:`dapo_ops.global_normalizer`, so the accumulated gradient is that of DAPO's
   token-level loss (:func:`dapo_ops.token_level_loss`) over the whole step.

Run ``python examples/plain_loop.py`` (a few seconds on one CPU core); ``--help`` for
the options. It prints one line per step and exits non-zero if the final accuracy did not
beat the initial one (with the default settings).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import Tensor, nn

from dapo_ops import (
    dynamic_sample_mask,
    global_normalizer,
    group_advantages,
    overlong_reward,
    token_level_loss,
)

DIGITS = 10
EOS = DIGITS  # token ids 0..9 are digits, 10 is EOS
VOCAB = DIGITS + 1


class Policy(nn.Module):
    """A GRU language model whose initial state encodes the prompt ``n``."""

    def __init__(self, hidden: int = 64, max_prompt: int = 4) -> None:
        super().__init__()
        self.prompt = nn.Embedding(max_prompt + 1, hidden)
        self.token = nn.Embedding(VOCAB + 1, hidden)  # + a BOS token
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def logits(self, prompts: Tensor, tokens: Tensor) -> Tensor:
        """Next-token logits ``[batch, seq, vocab]`` for every position of ``tokens``."""
        bos = torch.full_like(tokens[:, :1], VOCAB)
        inputs = self.token(torch.cat([bos, tokens[:, :-1]], dim=1))
        out, _ = self.gru(inputs, self.prompt(prompts)[None].contiguous())
        return self.head(out)

    def token_logp(self, prompts: Tensor, tokens: Tensor) -> Tensor:
        """Log-probability ``[batch, seq]`` of each sampled token."""
        logp = torch.log_softmax(self.logits(prompts, tokens).float(), dim=-1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1)

    @torch.no_grad()
    def sample(self, prompts: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
        """Sampled tokens ``[batch, max_len]`` (EOS-padded) and lengths incl. EOS."""
        batch = prompts.shape[0]
        state = self.prompt(prompts)[None].contiguous()
        token = torch.full((batch,), VOCAB)
        tokens = torch.full((batch, max_len), EOS)
        lengths = torch.full((batch,), max_len)
        done = torch.zeros(batch, dtype=torch.bool)
        for t in range(max_len):
            out, state = self.gru(self.token(token)[:, None], state)
            token = torch.distributions.Categorical(logits=self.head(out[:, 0])).sample()
            token = torch.where(done, torch.full_like(token, EOS), token)
            tokens[:, t] = token
            lengths = torch.where(~done & (token == EOS), torch.full_like(lengths, t + 1), lengths)
            done |= token == EOS
        return tokens, lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=40, help="optimiser steps")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="answers per prompt (G)")
    parser.add_argument("--micro-batches", type=int, default=4, help="gradient-accumulation splits")
    parser.add_argument("--ppo-epochs", type=int, default=2, help="passes over each batch")
    parser.add_argument("--max-len", type=int, default=8, help="generation cap, EOS included")
    parser.add_argument("--cache-len", type=int, default=3, help="soft overlong penalty zone")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny ops: threads cost more than they give
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    g, started = args.group_size, time.perf_counter()
    accuracies: list[float] = []

    for step in range(args.steps):
        # 1. Rollout: G answers per prompt, and their log-probs under the sampling policy.
        prompts = torch.randint(1, 5, (args.prompts,)).repeat_interleave(g)
        tokens, lengths = policy.sample(prompts, args.max_len)
        mask = torch.arange(args.max_len) < lengths[:, None]  # answer tokens incl. EOS
        with torch.no_grad():
            old_logp = policy.token_logp(prompts, tokens)

        # 2. Reward: correctness plus the soft overlong penalty.
        truncated = tokens[:, -1] != EOS
        correct = (lengths - 1 == prompts) & ~truncated
        accuracy = correct.view(-1, g).float()  # [prompts, G]
        penalty = overlong_reward(lengths, max_len=args.max_len, cache_len=args.cache_len)
        reward = accuracy + penalty.view(-1, g)
        accuracies.append(float(accuracy.mean()))

        # 3. Dynamic sampling on accuracy (not on the shaped reward); 4. advantages.
        keep = dynamic_sample_mask(accuracy)
        if not bool(keep.any()):
            print(f"step {step:3d}  acc {accuracies[-1]:.2f}  no group with spread: skipped")
            continue
        rows = keep.repeat_interleave(g)
        adv = group_advantages(reward[keep]).flatten()
        batch = {"p": prompts[rows], "tok": tokens[rows], "old": old_logp[rows], "m": mask[rows]}

        # 5. PPO epochs over micro-batches sharing the step's global normaliser.
        splits = torch.arange(adv.shape[0]).tensor_split(args.micro_batches)
        micro = [idx for idx in splits if idx.numel() > 0]
        norm = global_normalizer([batch["m"][idx] for idx in micro])
        for _ in range(args.ppo_epochs):
            optimizer.zero_grad()
            total = 0.0
            for idx in micro:
                logp = policy.token_logp(batch["p"][idx], batch["tok"][idx])
                loss = token_level_loss(
                    logp, batch["old"][idx], adv[idx], batch["m"][idx], normalizer=norm
                )
                loss.backward()  # no division by the number of micro-batches
                total += float(loss.detach())
            optimizer.step()
        kept = int(keep.sum())
        print(
            f"step {step:3d}  acc {accuracies[-1]:.2f}  kept {kept:2d}/{keep.numel()} groups  "
            f"mean len {lengths.float().mean():.2f}  loss {total:+.4f}"
        )

    first = sum(accuracies[:3]) / max(len(accuracies[:3]), 1)
    last = sum(accuracies[-3:]) / max(len(accuracies[-3:]), 1)
    print(
        f"accuracy {first:.2f} -> {last:.2f} in {len(accuracies)} steps, "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0 if args.steps < 20 or last > first else 1


if __name__ == "__main__":
    sys.exit(main())
