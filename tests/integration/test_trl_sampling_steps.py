"""``DapoGRPOTrainer(dynamic_sampling=True)`` in real TRL 1.16 runs: the metrics of the batch
trained on, ``empty_batch`` ("skip": no optimiser, scheduler or weight change; "raise") and
the warning for a shaping ``sampling_metric``. A tiny Llama built from a config, nothing
downloaded (the set-up of ``_trl_sampling_common.py``)."""

from __future__ import annotations

import copy
import functools
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from _trl_sampling_common import MIXED, G, accuracy, make_trainer, recording, shaping

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::FutureWarning")]

DIGITS = ["1 + 2 =", "3 + 4 =", "5 + 5 =", "1 + 1 ="]


def dapo_trainer() -> Any:
    from dapo_ops.integrations.trl import DapoGRPOTrainer

    return DapoGRPOTrainer


def logged(trainer: Any, key: str) -> list[Any]:
    return [h[key] for h in trainer.state.log_history if key in h and "loss" in h]


def test_reward_metrics_are_the_kept_batch_and_rounds_are_weighted(tmp_path: Path) -> None:
    """Groups dropped, extra rounds of other sizes: TRL's reward figures are those of the
    kept groups, its completion figures those of every generated sample."""
    torch.manual_seed(0)
    trainer = make_trainer(
        recording(dapo_trainer()),
        tmp_path,
        [*DIGITS[:3], "a 1"],  # a round keeps about 3 groups of 4: the next one is smaller
        [accuracy, shaping],
        dynamic_sampling=True,
        max_generation_batches=16,
    )
    trainer.train()
    start, sizes_differ, reward_moved = 0, False, False
    for step, report in enumerate(trainer.reports):
        rounds = trainer.rounds[start : start + report.rounds]
        start += report.rounds
        kept = torch.cat([rounds[r]["rewards"][i * G : (i + 1) * G] for r, i in report.selected])[
            : report.kept_in_batch * G
        ]
        total = kept.sum(dim=1)  # reward weights 1, 1
        everything = torch.cat([r["rewards"] for r in rounds])
        lengths = [len(ids) for r in rounds for ids in r["ids"]]
        sizes_differ |= len({len(r["ids"]) for r in rounds}) > 1
        reward_moved |= total.mean().item() != everything.sum(dim=1).mean().item()

        def at(key: str, step: int = step) -> Any:
            return logged(trainer, key)[step]

        assert at("reward") == pytest.approx(total.mean().item(), rel=1e-6)
        assert at("reward_std") == pytest.approx(total.std().item(), rel=1e-6)
        assert at("rewards/accuracy/mean") == pytest.approx(kept[:, 0].mean().item(), rel=1e-6)
        assert at("rewards/shaping/std") == pytest.approx(kept[:, 1].std().item(), rel=1e-6)
        groups = total.view(-1, G)
        zero = torch.isclose(groups.std(dim=1), torch.zeros(groups.shape[0])).float().mean()
        assert at("frac_reward_zero_std") == pytest.approx(zero.item())
        assert at("completions/mean_length") == pytest.approx(sum(lengths) / len(lengths))
        assert at("completions/max_length") == max(lengths)
        assert at("completions/min_length") == min(lengths)
        assert at("dynamic_sampling/generation_batches") == report.rounds
    assert sizes_differ, "every round had the same size: the weighting is not tested"
    assert reward_moved, "the kept batch's reward equals the generated one's: vacuous"


def test_nothing_dropped_logs_grpo_trainers_metrics(tmp_path: Path) -> None:
    """Every group kept in one round: TRL's generation metrics are bitwise GRPOTrainer's."""
    from _trl_sampling_common import alternating
    from trl import GRPOTrainer

    metrics = []
    for cls, options in [
        (GRPOTrainer, {}),
        (dapo_trainer(), {"dynamic_sampling": True, "sampling_metric": "alternating"}),
    ]:
        torch.manual_seed(0)
        trainer = make_trainer(cls, tmp_path, DIGITS, [alternating, accuracy], **options)
        trainer.model.train()
        inputs = [{"prompt": p} for p in DIGITS[:2] for _ in range(G)] * 2
        torch.manual_seed(1)
        trainer._generate_and_score_completions(inputs)
        metrics.append(dict(trainer._metrics["train"]))
    theirs, ours = metrics
    assert {k: v for k, v in ours.items() if not k.startswith("dynamic_sampling/")} == theirs
    assert "reward" in theirs and "completions/mean_length" in theirs


class SpreadThenConstant:
    """A metric with spread in every group (0, 1, 0, 1) in the training generations listed
    in ``spread`` (counting from 1), constant 0 in the others."""

    __name__ = "switching"

    def __init__(self, spread: set[int]) -> None:
        self.spread, self.calls = spread, 0

    def __call__(self, prompts: list[str], **kwargs: Any) -> list[float]:
        self.calls += 1
        on = self.calls in self.spread
        return [float(i % 2) if on else 0.0 for i in range(len(prompts))]


def snapshot_each_step(trainer: Any) -> list[dict[str, Any]]:
    from transformers import TrainerCallback

    states: list[dict[str, Any]] = []

    class Snapshot(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            optimizer, scheduler = kwargs["optimizer"], kwargs["lr_scheduler"]
            states.append(
                {
                    "params": [p.detach().clone() for p in kwargs["model"].parameters()],
                    "optimizer": copy.deepcopy(optimizer.state_dict()),
                    "scheduler": copy.deepcopy(scheduler.state_dict()),
                    "lr": scheduler.get_last_lr(),
                    "controller": (trainer.entropy_coef, trainer._last_world_entropy),
                }
            )

    trainer.add_callback(Snapshot())
    return states


def same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_step_with_no_kept_group_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 1 trains (Adam gains momentum), step 2 keeps no group, step 3 trains: step 2
    leaves weights, optimiser state, learning rate and TRL's adaptive entropy controller
    exactly as step 1 left them; gradient accumulation of 2 micro-batches, a linear
    learning-rate decay."""
    torch.manual_seed(0)
    metric = SpreadThenConstant(spread={1, 3})
    trainer = make_trainer(
        dapo_trainer(),
        tmp_path,
        DIGITS,
        [metric, shaping],
        dynamic_sampling=True,
        sampling_metric="switching",
        max_generation_batches=1,
        max_steps=3,
        learning_rate=0.01,
        use_adaptive_entropy=True,  # the controller: -0.01 per step (entropy above 1)
        entropy_coef=0.05,
        entropy_target=1.0,
        entropy_coef_delta=0.01,
    )
    assert trainer.args.gradient_accumulation_steps == 2
    states = snapshot_each_step(trainer)
    real_optimizer_type = None
    with caplog.at_level(logging.WARNING, logger="dapo_ops.integrations.trl_sampling"):
        trainer.train()
        real_optimizer_type = type(trainer.optimizer).__name__
    assert trainer.state.global_step == 3 and len(states) == 3 and metric.calls == 3
    first, skipped, third = states
    # not vacuous: Adam has momentum after step 1 and the schedule decays
    moments = [s["exp_avg"] for s in first["optimizer"]["state"].values()]
    assert any(bool(m.ne(0).any()) for m in moments)
    assert third["lr"] != first["lr"]
    # the skipped step changed nothing
    for a, b in zip(first["params"], skipped["params"], strict=True):
        assert torch.equal(a, b)
    assert same_state(first["optimizer"], skipped["optimizer"])
    assert same_state(first["scheduler"], skipped["scheduler"]) and first["lr"] == skipped["lr"]
    assert first["controller"] == skipped["controller"] != third["controller"]
    assert third["controller"][0] == pytest.approx(0.03)
    # step 3 trains as a second step: Adam's step count 2, the schedule advanced once more
    assert any(
        not torch.equal(a, b) for a, b in zip(skipped["params"], third["params"], strict=True)
    )
    steps = {float(s["step"]) for s in third["optimizer"]["state"].values()}
    assert steps == {2.0}
    assert third["scheduler"]["last_epoch"] == first["scheduler"]["last_epoch"] + 1
    assert real_optimizer_type == "AcceleratedOptimizer"  # the stand-ins are gone
    assert logged(trainer, "dynamic_sampling/skipped_step") == [0.0, 1.0, 0.0]
    (warning,) = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert "optimiser step 2 skipped" in warning and "kept 0 of 4 groups" in warning
    assert "kept fraction 0" in warning
    assert logged(trainer, "reward")[1] is None  # NaN (no kept sample): None in TRL's logs


def test_empty_batch_raise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = make_trainer(
        dapo_trainer(),
        tmp_path,
        ["a 1", "b 2", "a b", "b a"],
        [accuracy, shaping],
        dynamic_sampling=True,
        max_generation_batches=1,
        empty_batch="raise",
        max_steps=1,
    )
    with pytest.raises(ValueError, match=r"kept no group: 0 of 4 .*empty_batch='raise'"):
        trainer.train()


def test_a_shaping_sampling_metric_warns(tmp_path: Path) -> None:
    from trl.rewards import get_soft_overlong_punishment

    from dapo_ops.integrations.trl import OverlongReward

    overlong = OverlongReward(max_len=8, cache_len=2)
    wrapped = functools.wraps(overlong)(lambda **kw: overlong(**kw))
    wrapped.__name__ = "length_term"
    cases: list[tuple[Any, str]] = [
        (overlong, "overlong_reward"),
        (get_soft_overlong_punishment(8, 2), "soft_overlong_punishment_reward"),
        (functools.partial(overlong), "overlong_reward"),
        (wrapped, "length_term"),
    ]
    for func, name in cases:
        with pytest.warns(UserWarning, match="names the overlong reward, a shaping term"):
            make_trainer(
                dapo_trainer(),
                tmp_path,
                MIXED,
                [accuracy, func],
                dynamic_sampling=True,
                sampling_metric=name,
            )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(dapo_trainer(), tmp_path, MIXED, [accuracy, overlong], dynamic_sampling=True)
    assert not [w for w in caught if "shaping term" in str(w.message)]
