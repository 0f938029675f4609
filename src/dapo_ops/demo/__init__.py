"""A tiny DAPO ablation on CPU: ``python -m dapo_ops.demo [--ablation --seeds 5]``.

This package is also the worked example of how a host trainer wires ``dapo_ops`` together.
One training step (:func:`train`) does what a real DAPO trainer does, at toy scale:

1. **Sample** ``G`` answers per prompt from the current policy, with temperature, and keep
   their log-probs: they are the "old" policy of the PPO ratio (:func:`generate`).
2. **Score** them with the verifier (:meth:`Task.score`: 0/1, a coin flip for truncated
   answers), add the **soft overlong punishment** (:func:`~dapo_ops.overlong_reward`)
   and drop truncated answers from the loss with **overlong filtering**
   (:func:`~dapo_ops.overlong_filter`).
3. **Dynamic sampling**: keep the groups whose verifier reward has spread
   (:func:`~dapo_ops.dynamic_sample_mask`) and draw more prompts
   (:func:`~dapo_ops.prompts_to_generate`) until the batch is full or a cap on generation
   rounds is hit (:func:`collect_batch`).
4. **Group advantages** (:meth:`~dapo_ops.ObjectivePreset.advantages`).
5. **PPO epochs over mini-batches**, each mini-batch one optimiser step accumulated over
   micro-batches that share one :func:`~dapo_ops.global_normalizer`, with the preset's
   objective (**Clip-Higher**) and aggregation (**token-level loss**) through
   :func:`~dapo_ops.policy_loss_with_diagnostics` (:func:`ppo_update`).

Each technique is one field of the preset (:func:`dapo_preset`); the rows of the
ablation (:func:`ablation_rows`) switch them one at a time, as the DAPO paper's table.
``task.py`` holds the task, ``model.py`` the GRU policy, its base model and the sampler,
``trainer.py`` one run, ``ablation.py`` the rows and the worker processes, ``report.py``
and ``docs.py`` the CSV files, table and doc blocks, ``plots.py`` the figure, ``cli.py``
the command line. ``docs/demo.md`` explains the task and reads the results.

Outputs, in ``--out`` (default ``demo_out``): ``runs.csv`` (one line per row and seed),
``curves.csv`` (mean and std over seeds on a grid of generated answers), ``steps.csv``
(one line per training step), ``table.md`` and ``curves.png`` (rendered from the CSV
files; the figure needs matplotlib). The progress bar uses tqdm when installed. Both are
the optional extra ``demo``.
"""

from dapo_ops.demo.ablation import (
    DAPO_ROW,
    GRPO_ROW,
    TECHNIQUES,
    Job,
    Row,
    ablation_rows,
    cumulative_rows,
    dapo_preset,
    leave_one_out_rows,
    run_jobs,
)
from dapo_ops.demo.cli import Command, main, parse_args, train_all, write_outputs
from dapo_ops.demo.model import TinyPolicy, answer_logp, base_model, generate
from dapo_ops.demo.task import Rollout, Task
from dapo_ops.demo.trainer import (
    DemoConfig,
    Evaluation,
    RunResult,
    StepLog,
    collect_batch,
    evaluate,
    ppo_update,
    train,
)

__all__ = [
    "DAPO_ROW",
    "GRPO_ROW",
    "TECHNIQUES",
    "Command",
    "DemoConfig",
    "Evaluation",
    "Job",
    "Rollout",
    "Row",
    "RunResult",
    "StepLog",
    "Task",
    "TinyPolicy",
    "ablation_rows",
    "answer_logp",
    "base_model",
    "collect_batch",
    "cumulative_rows",
    "dapo_preset",
    "evaluate",
    "generate",
    "leave_one_out_rows",
    "main",
    "parse_args",
    "ppo_update",
    "run_jobs",
    "train",
    "train_all",
    "write_outputs",
]
