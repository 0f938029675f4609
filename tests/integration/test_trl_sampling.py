"""Dynamic sampling inside the real ``trl.GRPOTrainer`` (TRL 1.16): ``DapoGRPOTrainer(dynamic_sampling=True)``.

A tiny Llama built from a config (nothing downloaded), 2 optimiser steps of 16-row
generation batches (4 groups of 4). The metric ``accuracy`` is constant for the prompts
starting with "a" or "b"; a ``shaping`` reward varies in every group, so the total reward
always has spread and only the metric can drop a group. Checked on the real trainer:
the verdicts, the batch (full, or at the cap the kept groups plus masked fillers), the
advantages (TRL's formula on the kept groups), ``num_items_in_batch``, what reaches the
loss, the metrics, equality with ``GRPOTrainer`` when nothing is dropped or dynamic
sampling is off, both processes of a 2-process gloo run keeping the same groups, and the
recipe page's example.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from _trl_sampling_common import (
    MIXED,
    G,
    accuracy,
    alternating,
    make_trainer,
    recording,
    shaping,
)

from dapo_ops import InputError

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::FutureWarning")]

ROOT = Path(__file__).resolve().parents[2]
METRICS = (
    "dynamic_sampling/kept_group_fraction",
    "dynamic_sampling/generation_batches",
    "dynamic_sampling/samples_per_kept_sample",
    "dynamic_sampling/batch_fill",
    "dynamic_sampling/partial_batch",
)


def dapo_trainer() -> Any:
    from dapo_ops.integrations.trl import DapoGRPOTrainer

    return DapoGRPOTrainer


def spread(values: torch.Tensor) -> torch.Tensor:
    """Per group of G consecutive rows: does the value vary?"""
    groups = values.view(-1, G)
    return groups.amax(dim=1) != groups.amin(dim=1)


def padded_rows(ids: list[list[int]]) -> list[tuple[int, ...]]:
    return [tuple(x) for x in ids]


def completion_rows(out: dict[str, Any]) -> list[tuple[int, ...]]:
    """Each row's completion tokens, the padding removed (by the original lengths)."""
    ids, mask = out["completion_ids"].tolist(), out["completion_mask"].tolist()
    return [
        tuple(t for t, m in zip(r, mr, strict=True) if m) for r, mr in zip(ids, mask, strict=True)
    ]


def check_generation(trainer: Any, out: dict[str, Any], report: Any, rounds: list[dict]) -> None:
    """One training generation: verdicts from the metric column only, the batch made of the
    selected groups in order, TRL's advantages on the kept ones, masked fillers."""
    from dapo_ops.integrations.trl_sampling import trl_advantages

    assert len(rounds) == report.rounds
    for r, record in enumerate(rounds):
        rewards = record["rewards"]
        assert bool(spread(rewards.sum(dim=1)).all()), "the shaping reward must vary in every group"
        assert tuple(spread(rewards[:, 0]).tolist()) == report.verdicts[r]
    kept_rewards, expected_rows = [], []
    for k, (r, i) in enumerate(report.selected):
        rows = slice(i * G, (i + 1) * G)
        assert report.verdicts[r][i] == (k < report.kept_in_batch)
        if k < report.kept_in_batch:
            kept_rewards.append(rounds[r]["rewards"][rows])
        expected_rows += padded_rows(rounds[r]["ids"][rows])
        prompts = trainer.processing_class.batch_decode(
            out["prompt_ids"][k * G : (k + 1) * G], skip_special_tokens=True
        )
        assert prompts == rounds[r]["prompts"][rows]
    n_kept = report.kept_in_batch * G
    assert out["prompt_ids"].shape[0] == report.target * G  # never an empty or short batch
    rows = out["completion_ids"].tolist()
    for j, expected in enumerate(expected_rows):
        assert tuple(rows[j][: len(expected)]) == expected
        assert set(rows[j][len(expected) :]) <= {trainer.processing_class.pad_token_id}
    assert bool(out["completion_mask"][n_kept:].eq(0).all()), "fillers must be masked out"
    assert bool(out["advantages"][n_kept:].eq(0).all())
    lengths = [len(x) for x in expected_rows[:n_kept]]
    assert out["completion_mask"][:n_kept].sum(dim=1).tolist() == lengths
    assert int(out["num_items_in_batch"]) == sum(lengths)
    if kept_rewards:
        expected = trl_advantages(
            torch.cat(kept_rewards), trainer.reward_weights, G, scale_rewards=trainer.scale_rewards
        )
        assert torch.equal(out["advantages"][:n_kept], expected)
    prompt_mask = out["prompt_mask"]
    assert bool(prompt_mask[:, 0].any()), "a prompt column only the dropped rows needed is left"


def logged(trainer: Any, key: str) -> list[Any]:
    return [h[key] for h in trainer.state.log_history if key in h]


def test_constant_groups_are_dropped_and_the_batch_is_filled(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(
        recording(dapo_trainer()),
        tmp_path,
        MIXED,
        [accuracy, shaping],
        dynamic_sampling=True,
        max_generation_batches=16,  # room: the full batch must not depend on luck
    )
    seen: list[list[tuple[int, ...]]] = []

    original = trainer.compute_loss

    def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # what reaches the loss: the rows with loss tokens, by their completion
        seen.append(
            [
                r
                for r, m in zip(
                    completion_rows(inputs), inputs["completion_mask"].any(1).tolist(), strict=True
                )
                if m
            ]
        )
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss
    trainer.train()

    assert trainer.state.global_step == 2 and len(trainer.outputs) == 2
    start = 0
    for out, report in zip(trainer.outputs, trainer.reports, strict=True):
        check_generation(trainer, out, report, trainer.rounds[start : start + report.rounds])
        start += report.rounds
        assert report.kept_in_batch == report.target == 4  # the cap allowed a full batch
    assert start == len(trainer.rounds)
    assert sum(r.rounds for r in trainer.reports) > 2, "nothing was dropped: a vacuous test"
    # every micro-batch holds rows of its generation's kept groups only
    for step, out in enumerate(trainer.outputs):
        kept = sorted(completion_rows(out))
        assert sorted(seen[2 * step] + seen[2 * step + 1]) == kept
    # metrics, through TRL's logger
    for key in METRICS:
        assert len(logged(trainer, key)) == 2, key
    assert logged(trainer, "dynamic_sampling/batch_fill") == [1.0, 1.0]
    assert logged(trainer, "dynamic_sampling/partial_batch") == [0.0, 0.0]
    for report, fraction, batches, per_kept in zip(
        trainer.reports,
        logged(trainer, METRICS[0]),
        logged(trainer, METRICS[1]),
        logged(trainer, METRICS[2]),
        strict=True,
    ):
        flat = [v for verdicts in report.verdicts for v in verdicts]
        assert fraction == sum(flat) / len(flat) and batches == report.rounds
        assert per_kept == len(flat) * G / (report.kept_in_batch * G)
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))


def test_at_the_cap_the_step_trains_on_what_was_kept(tmp_path: Path) -> None:
    # one digit prompt among four: a generation batch (all four prompts) keeps one group
    torch.manual_seed(0)
    trainer = make_trainer(
        recording(dapo_trainer()),
        tmp_path,
        ["1 + 2 =", "a 1", "b 2", "a b"],
        [alternating, shaping],
        dynamic_sampling=True,
        max_generation_batches=1,
        sampling_metric="alternating",
        max_steps=1,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    (out,), (report,) = trainer.outputs, trainer.reports
    assert report.rounds == 1 and report.kept_in_batch == 1 and report.target == 4
    check_generation(trainer, out, report, trainer.rounds)
    assert logged(trainer, "dynamic_sampling/partial_batch") == [1.0]
    assert logged(trainer, "dynamic_sampling/batch_fill") == [0.25]
    assert logged(trainer, "dynamic_sampling/samples_per_kept_sample") == [4.0]
    (loss,) = logged(trainer, "loss")
    assert math.isfinite(loss)
    moved = [not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True)]
    assert any(moved), "the kept group must train"


def test_with_no_group_kept_the_batch_is_masked_not_empty(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(
        recording(dapo_trainer()),
        tmp_path,
        ["a 1", "b 2", "a b", "b a"],
        [alternating, shaping],
        dynamic_sampling=True,
        max_generation_batches=2,
        sampling_metric="alternating",
        max_steps=1,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    (out,), (report,) = trainer.outputs, trainer.reports
    assert report.rounds == 2 and report.kept_in_batch == 0
    check_generation(trainer, out, report, trainer.rounds)
    assert int(out["num_items_in_batch"]) == 0
    assert logged(trainer, "loss") == [0.0]
    assert logged(trainer, "dynamic_sampling/partial_batch") == [1.0]
    assert logged(trainer, "dynamic_sampling/samples_per_kept_sample") == [None]  # NaN: None
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("scale_rewards", "aggregation"),
    [
        ("group", "sum_then_normalize"),
        ("batch", "sum_then_normalize"),
        ("none", "sum_then_normalize"),
        ("group", "normalize_then_sum"),
    ],
)
def test_nothing_to_drop_gives_grpo_trainers_batch(
    tmp_path: Path, scale_rewards: str, aggregation: str
) -> None:
    """Every group has spread: the batch (advantages recomputed by ``trl_advantages``)
    is bitwise the one ``GRPOTrainer`` builds from the same generation."""
    from trl import GRPOTrainer

    outputs = []
    for cls, options in [
        (GRPOTrainer, {}),
        (dapo_trainer(), {"dynamic_sampling": True, "sampling_metric": "alternating"}),
    ]:
        torch.manual_seed(0)
        trainer = make_trainer(
            cls,
            tmp_path,
            ["1 + 2 =", "3 + 4 =", "5 + 5 =", "1 + 1 ="],
            [alternating, accuracy],
            scale_rewards=scale_rewards,
            multi_objective_aggregation=aggregation,
            reward_weights=[1.0, 0.5],
            **options,
        )
        trainer.model.train()
        inputs = [{"prompt": p} for p in ["1 + 2 =", "3 + 4 ="] for _ in range(G)] * 2
        torch.manual_seed(1)
        outputs.append(trainer._generate_and_score_completions(inputs))
    theirs, ours = outputs
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


def test_dynamic_sampling_off_is_grpo_trainer(tmp_path: Path) -> None:
    """Off (the default), the generated batches of a 2-step run are GRPOTrainer's."""
    from trl import GRPOTrainer

    runs = []
    for cls in (GRPOTrainer, dapo_trainer()):
        torch.manual_seed(0)
        trainer = make_trainer(recording(cls), tmp_path, MIXED, [accuracy, shaping])
        trainer.train()
        runs.append(trainer.outputs)
    assert len(runs[0]) == len(runs[1]) == 2
    for theirs, ours in zip(*runs, strict=True):
        assert sorted(ours) == sorted(theirs)
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), key


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, as users get them
def test_options_are_validated(tmp_path: Path) -> None:
    from datasets import IterableDataset

    cls = dapo_trainer()
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"max_generation_batches": 3},
            "max_generation_batches=3 is given but dynamic_sampling=False",
        ),
        ({"sampling_metric": "accuracy"}, "sampling_metric='accuracy' is given"),
        ({"dynamic_sampling": 1}, "dynamic_sampling must be True or False"),
        (
            {"dynamic_sampling": True, "max_generation_batches": 0},
            "max_generation_batches must be an int",
        ),
        (
            {"dynamic_sampling": True, "max_generation_batches": 2.0},
            "max_generation_batches must be an int",
        ),
        (
            {"dynamic_sampling": True, "sampling_metric": "shaped"},
            r"sampling_metric='shaped' names no reward function; the reward functions are \['accuracy', 'shaping'\]",
        ),
        ({"dynamic_sampling": True, "sampling_metric": 0}, "sampling_metric must be"),
    ]
    for options, message in bad:
        with pytest.raises(InputError, match=message):
            make_trainer(cls, tmp_path, MIXED, [accuracy, shaping], **options)

    # the default metric "accuracy" also finds TRL's accuracy_reward
    def accuracy_reward(completion_ids: Any, **kwargs: Any) -> list[float]:
        return [0.0] * len(completion_ids)

    trainer = make_trainer(cls, tmp_path, MIXED, [shaping, accuracy_reward], dynamic_sampling=True)
    assert trainer._dapo_sampling.column == 1
    assert trainer._dapo_sampling.max_generation_batches == 10
    with pytest.raises(InputError, match="map-style dataset"):
        cls(
            model=trainer.model,
            reward_funcs=[accuracy],
            args=trainer.args,
            train_dataset=IterableDataset.from_generator(lambda: iter([{"prompt": "a"}])),
            processing_class=trainer.processing_class,
            dynamic_sampling=True,
        )


@pytest.mark.distributed
def test_two_processes_keep_the_same_groups(tmp_path: Path) -> None:
    """2 CPU processes (a gloo group that accelerate adopts), a group spanning both: every
    process makes the same decisions, and their slices put together are the kept groups.
    A process that does not exit cleanly fails the test."""
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",  # one host (accelerate wants MASTER_ADDR otherwise)
            "OMP_NUM_THREADS": "1",
        }
        script = Path(__file__).with_name("_trl_sampling_common.py")
        out, store = tmp_path / f"rank{rank}.json", tmp_path / "store"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out), str(store)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["world"] == r1["world"] == 2 and r0["steps"] == r1["steps"] == 2
    assert r0["reports"] == r1["reports"], "the processes decided differently"
    assert any(len(r["verdicts"]) > 1 for r in r0["reports"]), "no extra round: vacuous"
    for step, report in enumerate(r0["reports"]):
        assert report["kept"] == report["target"] == 3
        a, b = r0["outputs"][step], r1["outputs"][step]
        assert len(a["prompts"]) == len(b["prompts"]) == 6  # the same batch size
        assert a["num_items_in_batch"] == b["num_items_in_batch"]
        assert a["num_items_in_batch"] == sum(len(c) for c in a["completions"] + b["completions"])
        prompts = a["prompts"] + b["prompts"]
        completions = a["completions"] + b["completions"]
        for k in range(3):  # each kept group: one prompt, a metric with spread
            group = slice(k * G, (k + 1) * G)
            assert len(set(prompts[group])) == 1
            metric = accuracy(prompts[group], completions[group])
            assert max(metric) != min(metric)
        assert a["advantages"] + b["advantages"] != [0.0] * 12


def test_recipe_page_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/trl_dapo.md: the recipe block runs as written (the model, tokenizer and
    dataset of the set-up block replaced by tiny local ones, and ``GRPOConfig`` told to
    run on CPU in float32, one step of 16-token completions), with all four DAPO
    techniques on. The solutions are empty: a completion that stops at once is
    right, so some groups have spread and some do not."""
    from test_trl import tiny_model, tiny_tokenizer

    from dapo_ops.integrations.trl import OverlongReward

    text = (ROOT / "docs" / "trl_dapo.md").read_text()
    recipe = re.search(r"## The recipe\n.*?```python\n(.*?)```", text, re.S)
    assert recipe, "docs/trl_dapo.md lost its recipe block"
    from datasets import Dataset

    monkeypatch.chdir(tmp_path)
    import trl

    real_config = trl.GRPOConfig

    def cpu_config(**options: Any) -> Any:
        # this machine: CPU, float32; 16 tokens (the random model rarely stops early)
        cpu = {"use_cpu": True, "bf16": False, "save_strategy": "no", "disable_tqdm": True}
        short = {"max_completion_length": 16, "gradient_checkpointing": False, "max_steps": 1}
        return real_config(**{**options, **cpu, **short})

    monkeypatch.setattr(trl, "GRPOConfig", cpu_config)
    namespace: dict[str, Any] = {
        "model": tiny_model(),
        "tokenizer": tiny_tokenizer(),
        "train_dataset": Dataset.from_dict(
            {"prompt": ["1 + 2 =", "3 + 4 =", "a b", "5 + 5 ="], "solution": ["", "", "", ""]}
        ),
    }
    torch.manual_seed(0)
    exec(compile(recipe.group(1), "docs/trl_dapo.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.epsilon_low == 0.2 and trainer.epsilon_high == 0.28  # Clip-Higher
    assert trainer.loss_type == "dapo" and trainer.beta == 0.0  # token-level loss
    assert any(isinstance(f, OverlongReward) for f in trainer.reward_funcs)  # overlong shaping
    assert trainer._dapo_sampling is not None  # dynamic sampling
    assert trainer._dapo_sampling.sampling_metric == "accuracy"
    assert trainer.state.global_step == 1  # the block's trainer.train()
    assert logged(trainer, "dynamic_sampling/generation_batches")
