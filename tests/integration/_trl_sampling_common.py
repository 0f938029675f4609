"""Shared set-up of the dynamic-sampling tests: rewards, prompts and a recording trainer.

Also the worker of the two-process test (``python _trl_sampling_common.py OUT STORE``, one
per rank, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` in the environment): it joins a gloo group
through the ``file://`` store ``STORE`` (accelerate then uses that group), trains two steps
on CPU and writes what its process kept to ``OUT``. The teardown follows
``tests/_dist.py``: ``torch.distributed.nn`` imported before the group exists, the trainer
(its DDP model) gone and a barrier before ``destroy_process_group``, so that no gloo thread
outlives the group (else: "terminate called without an active exception" at exit).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_trl import grpo_config, tiny_model, tiny_tokenizer

G = 4  # num_generations


def accuracy(prompts: list[str], completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """The task metric: always right for prompts starting with "a", always wrong for "b"
    (constant groups), otherwise the parity of the completion's token sum (random spread)."""
    out = []
    for prompt, ids in zip(prompts, completion_ids, strict=True):
        first = prompt.split()[0]
        out.append(1.0 if first == "a" else 0.0 if first == "b" else float(sum(ids) % 2))
    return out


def alternating(prompts: list[str], **kwargs: Any) -> list[float]:
    """A metric with spread in every group for digit prompts (0, 1, 0, 1 within a group:
    TRL's groups are consecutive rows), constant for "a"/"b" prompts."""
    first = [p.split()[0] for p in prompts]
    return [1.0 if f == "a" else 0.0 if f == "b" else float(i % 2) for i, f in enumerate(first)]


def shaping(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A shaping reward with spread in every group, as the overlong penalty can have: it
    must not keep a group whose metric is constant."""
    return [0.1 * (i % G) for i in range(len(completion_ids))]


def dataset(prompts: list[str]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompts})


MIXED = ["a 1", "b 2", "1 + 2 =", "a b", "3 + 4 =", "b a", "5 + 5 =", "b 1"]


def make_trainer(
    cls: Any, tmp_path: Path, prompts: list[str], rewards: list[Any], **options: Any
) -> Any:
    config = {k: options.pop(k) for k in list(options) if k not in _TRAINER_OPTIONS}
    args = grpo_config(
        tmp_path,
        **{"per_device_train_batch_size": 8, "num_generations": G, "num_iterations": 1, **config},
    )
    return cls(
        model=tiny_model(),
        reward_funcs=rewards,
        args=args,
        train_dataset=dataset(prompts),
        processing_class=tiny_tokenizer(),
        **options,
    )


_TRAINER_OPTIONS = ("dynamic_sampling", "max_generation_batches", "sampling_metric", "empty_batch")


def recording(cls: Any) -> Any:
    """``cls`` recording each training round's rewards and each generation's output."""

    class Recording(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rounds: list[dict[str, Any]] = []
            self.outputs: list[dict[str, Any]] = []
            self.reports: list[Any] = []

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):  # type: ignore[no-untyped-def]
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            if self.model.training:
                self.rounds.append(
                    {
                        "prompts": list(prompts),
                        "ids": [list(x) for x in completion_ids_list],
                        "rewards": rewards.clone(),
                    }
                )
            return rewards

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            if self.model.training:
                self.outputs.append(
                    {k: v.clone() if hasattr(v, "clone") else v for k, v in out.items()}
                )
                self.reports.append(getattr(self, "last_dynamic_sampling", None))
            return out

    return Recording


def worker(out: str, store: str) -> None:
    import gc

    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (before any group exists: see the docstring)

    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=int(os.environ["WORLD_SIZE"])
    )
    Path(out).write_text(json.dumps(train_and_record(rank, out)))
    gc.collect()  # the trainer and its DDP model are gone with train_and_record's frame
    dist.barrier()
    dist.destroy_process_group()


def train_and_record(rank: int, out: str) -> dict[str, Any]:
    import torch

    from dapo_ops.integrations.trl import DapoGRPOTrainer

    torch.manual_seed(0)
    # 3 rows per micro-batch, 2 micro-batches, 2 processes: 12 rows = 3 groups of 4, so a
    # group spans both processes.
    trainer = make_trainer(
        recording(DapoGRPOTrainer),
        Path(out).parent / f"rank{rank}",
        MIXED,
        [accuracy, shaping],
        per_device_train_batch_size=3,
        max_steps=2,
        dynamic_sampling=True,
        max_generation_batches=16,  # room: both steps must fill their batch
    )
    trainer.train()
    tok = trainer.processing_class
    record = {
        "world": trainer.accelerator.num_processes,
        "reports": [
            {
                "verdicts": r.verdicts,
                "selected": r.selected,
                "kept": r.kept_in_batch,
                "target": r.target,
            }
            for r in trainer.reports
        ],
        "outputs": [
            {
                "prompts": tok.batch_decode(o["prompt_ids"], skip_special_tokens=True),
                "completions": [
                    [int(t) for t, m in zip(ids, mask, strict=True) if m]
                    for ids, mask in zip(
                        o["completion_ids"].tolist(), o["completion_mask"].tolist(), strict=True
                    )
                ],
                "advantages": o["advantages"].tolist(),
                "num_items_in_batch": int(o["num_items_in_batch"]),
            }
            for o in trainer.outputs
        ],
        "steps": trainer.state.global_step,
    }
    return record


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
