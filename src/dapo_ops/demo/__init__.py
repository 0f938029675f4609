"""Train a tiny policy with DAPO, then a GRPO baseline, on CPU: ``python -m dapo_ops.demo``.

This package is also the worked example of how a host trainer wires ``dapo_ops`` together.
One training step does what a real DAPO trainer does, at toy scale:

1. **Sample** ``G`` answers per prompt from the current policy, with temperature, and keep
   their log-probs: they are the "old" policy of the PPO ratio (:func:`generate`).
2. **Score** them with a 0/1 verifier (:meth:`Task.verify`), add the **soft overlong
   penalty** (:func:`~dapo_ops.overlong_reward`) and, optionally, drop truncated answers
   from the loss (:func:`~dapo_ops.overlong_filter`).
3. **Dynamic sampling**: keep the groups whose *accuracy* has spread
   (:func:`~dapo_ops.dynamic_sample_mask`) and draw more prompts
   (:func:`~dapo_ops.prompts_to_generate`) until the batch is full or a cap on generation
   rounds is hit (:func:`collect_batch`).
4. **Group advantages** (:func:`~dapo_ops.group_advantages`, with the preset's options).
5. **PPO epochs over mini-batches**, each mini-batch one optimiser step accumulated over
   micro-batches that share one :func:`~dapo_ops.global_normalizer`, with
   :func:`~dapo_ops.token_level_loss` (Clip-Higher, token-level aggregation) and its
   diagnostics (:func:`ppo_update`).

The task: the prompt is a target number ``T``; the answer is a string of digits that must
sum to ``T``, then EOS, within a generation cap of ``max_len`` tokens (EOS included).
Answers that hit the cap are truncated, hence wrong; answers longer than
``max_len - cache_len`` tokens pay the soft overlong penalty. Larger targets need longer
answers, and a ``0`` lengthens an answer without changing its sum (padding, the toy's
version of a rambling chain of thought), so length is part of what the policy learns.

The two objectives are the library's presets (:class:`~dapo_ops.ObjectivePreset`):
:data:`~dapo_ops.presets.DAPO`, and :data:`~dapo_ops.presets.GRPO` without its KL term
(:data:`GRPO_BASELINE`: symmetric clip 0.2 / 0.2, ``mode="seq_mean_token_mean"``, no dynamic
sampling, no overlong shaping, no KL, so no reference model). Both runs start from the same
weights (same seed), train on the same batch shape (``prompts_per_step`` groups of ``G``
answers per step) and, by default, stop after the same number of generated answers
(``--budget samples``: GRPO's ``steps x prompts x G``). DAPO draws extra prompts to fill
its batches with groups that have accuracy spread, so it takes fewer steps for the same
answers; ``prompts_drawn`` and ``samples`` report that. ``--budget steps`` gives both runs
the same number of steps instead (the x-axis of the DAPO paper).

Read ``trainer.py`` for the wiring (one step: :func:`collect_batch`, then the rewards,
advantages and :func:`ppo_update` in :func:`train`); ``task.py`` holds the task, the GRU
policy and the sampler, ``report.py`` the progress bar, CSV and figure, ``cli.py`` the
command line and :func:`run`, the entry point for scripts and tests.

Outputs, in ``--out`` (default ``demo_out``): ``metrics.csv``, one row per step and
method, and ``dapo_vs_grpo.png`` (when matplotlib is installed). The progress bar uses
tqdm when installed, else a plain text line. Both are the optional extra ``demo``.
"""

from dapo_ops.demo.cli import main, parse_args, run, train_all, write_outputs
from dapo_ops.demo.report import plot, summarize, write_csv
from dapo_ops.demo.task import Rollout, Task, TinyPolicy, answer_logp, generate
from dapo_ops.demo.trainer import (
    CSV_COLUMNS,
    GRPO_BASELINE,
    DemoConfig,
    StepLog,
    collect_batch,
    dapo_preset,
    ppo_update,
    train,
)

__all__ = [
    "CSV_COLUMNS",
    "GRPO_BASELINE",
    "DemoConfig",
    "Rollout",
    "StepLog",
    "Task",
    "TinyPolicy",
    "answer_logp",
    "collect_batch",
    "dapo_preset",
    "generate",
    "main",
    "parse_args",
    "plot",
    "ppo_update",
    "run",
    "summarize",
    "train",
    "train_all",
    "write_csv",
    "write_outputs",
]
