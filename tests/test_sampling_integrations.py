"""The pure parts of dynamic sampling in the integrations (no TRL, no verl needed):
``verl_sampling.filter_groups``, the options of ``DapoGRPOTrainer(dynamic_sampling=...)``
and how it combines TRL's per-round metrics.

Against the real peers: tests/integration/test_verl_sampling.py, test_trl_sampling.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from dapo_ops import InputError
from dapo_ops.integrations._trl_metrics import combine_rounds, kept_batch_metrics
from dapo_ops.integrations.trl_sampling import (
    DEFAULT_MAX_GENERATION_BATCHES,
    DynamicSampling,
    trl_advantages,
)
from dapo_ops.integrations.verl_sampling import filter_groups, filter_metric

METRIC = [1.0, 0.0, 1.0, 1.0, 0.5]
UIDS = ["p", "p", "q", "q", "r"]  # p varies, q is constant, r has one trajectory


def test_one_sample_groups_kept_as_verl_or_dropped_as_ours() -> None:
    verl = filter_groups(METRIC, UIDS, train_batch_size=3)
    assert verl.keep.tolist() == [True, True, False, False, True]
    assert (verl.kept_prompts, verl.num_prompt_in_batch, verl.done) == (2, 2, False)
    ours = filter_groups(METRIC, UIDS, train_batch_size=3, keep_single_sample_groups=False)
    assert ours.keep.tolist() == [True, True, False, False, False]


def test_groups_need_not_be_contiguous_and_inputs_may_be_tensors() -> None:
    np = pytest.importorskip("numpy")
    metric, uids = [1, 0, 0, 0, 1, 0], np.array(["a", "b", "a", "b", "c", "c"], dtype=object)
    for m in (metric, torch.tensor(metric), np.array(metric)):
        step = filter_groups(m, uids, train_batch_size=2)
        assert step.keep.tolist() == [True, False, True, False, True, True]
        assert step.num_prompt_in_batch == 2 and step.done and not step.capped


def test_the_cap_raises_as_verl_or_trains_on_what_was_kept() -> None:
    args: dict[str, Any] = dict(train_batch_size=5, num_prompt_in_batch=1)
    step = filter_groups(METRIC, UIDS, num_gen_batches=2, max_num_gen_batches=3, **args)
    assert not step.done and step.num_prompt_in_batch == 3
    with pytest.raises(ValueError, match="num_gen_batches=3 >= max_num_gen_batches=3"):
        filter_groups(METRIC, UIDS, num_gen_batches=3, max_num_gen_batches=3, **args)
    step = filter_groups(
        METRIC, UIDS, num_gen_batches=3, max_num_gen_batches=3, on_cap="train", **args
    )
    assert step.done and step.capped and step.num_prompt_in_batch == 3
    unlimited = filter_groups(METRIC, UIDS, num_gen_batches=99, max_num_gen_batches=0, **args)
    assert not unlimited.done


def test_an_empty_batch_keeps_nothing() -> None:
    step = filter_groups([], [], train_batch_size=1, max_num_gen_batches=2)
    assert step.keep.shape == (0,) and step.kept_prompts == 0 and not step.done


def test_filter_metric_reads_the_recipes_metrics() -> None:
    from types import SimpleNamespace

    batch = SimpleNamespace(
        batch={
            "token_level_rewards": torch.tensor([[1.0, 2.0], [0.0, 0.5]]),
            "token_level_scores": torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
        },
        non_tensor_batch={"acc": [1.0, 0.0]},
    )
    assert filter_metric(batch, "seq_final_reward").tolist() == [3.0, 0.5]
    assert filter_metric(batch, "seq_reward").tolist() == [1.0, 0.0]
    assert filter_metric(batch, "acc") == [1.0, 0.0]
    with pytest.raises(InputError, match="'score' is not in the batch"):
        filter_metric(batch, "score")


@pytest.mark.usefixtures("no_runtime_typecheck")  # the library's own checks, as users get them
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"metric": [[1.0, 0.0]]}, "metric must be 1-D"),
        ({"uid": ["p"]}, "uid has 1 entries but metric has 5"),
        ({"metric": [1.0, float("nan"), 0.0, 0.0, 0.0]}, "metric"),
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"train_batch_size": 2.0}, "train_batch_size"),
        ({"num_prompt_in_batch": -1}, "num_prompt_in_batch"),
        ({"num_gen_batches": 0}, "num_gen_batches"),
        ({"max_num_gen_batches": 1.5}, "max_num_gen_batches"),
        ({"keep_single_sample_groups": 1}, "keep_single_sample_groups"),
        ({"on_cap": "skip"}, "on_cap"),
    ],
)
def test_filter_groups_bad_arguments(options: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"metric": METRIC, "uid": UIDS, "train_batch_size": 2, **options}
    with pytest.raises(InputError, match=message):
        filter_groups(args.pop("metric"), args.pop("uid"), **args)


def test_trainer_options() -> None:
    assert DynamicSampling.from_options(False, None, None) is None
    options = DynamicSampling.from_options(True, None, None)
    assert options is not None
    assert options.max_generation_batches == DEFAULT_MAX_GENERATION_BATCHES == 10
    assert options.sampling_metric == "accuracy"
    assert options.empty_batch == "skip"
    options = DynamicSampling.from_options(True, 3, "correct", "raise")
    assert options is not None
    assert (options.max_generation_batches, options.sampling_metric) == (3, "correct")
    assert options.empty_batch == "raise"


@pytest.mark.usefixtures("no_runtime_typecheck")
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ((False, 3, None), "max_generation_batches=3 is given but dynamic_sampling=False"),
        ((False, None, "acc"), "sampling_metric='acc' is given but dynamic_sampling=False"),
        (("yes", None, None), "dynamic_sampling must be True or False"),
        ((True, 0, None), "max_generation_batches must be an int in"),
        ((True, 2.0, None), "max_generation_batches must be an int"),
        ((True, None, ["accuracy"]), "sampling_metric must be a reward function's name"),
        ((False, None, None, "skip"), "empty_batch='skip' is given but dynamic_sampling=False"),
        ((True, None, None, "Skip"), "empty_batch must be 'skip' or 'raise', got 'Skip'"),
        ((True, None, None, "train"), "empty_batch must be 'skip' or 'raise', got 'train'"),
        ((True, None, None, 0), "empty_batch must be 'skip' or 'raise', got 0"),
    ],
)
def test_trainer_options_are_validated(options: tuple[Any, ...], message: str) -> None:
    with pytest.raises(InputError, match=message):
        DynamicSampling.from_options(*options)


def test_trl_advantages_zero_for_unscorable_rows_and_options_checked() -> None:
    rewards = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")], [0.0, 2.0]])
    rewards = torch.cat([rewards, torch.tensor([[3.0, 1.0]])])
    adv = trl_advantages(rewards, torch.ones(2), 2)
    assert adv[1] == 0.0 and bool(torch.isfinite(adv).all())
    with pytest.raises(InputError, match="scale_rewards"):
        trl_advantages(rewards, torch.ones(2), 2, scale_rewards="groups")
    with pytest.raises(InputError, match="multi_objective_aggregation"):
        trl_advantages(rewards, torch.ones(2), 2, multi_objective_aggregation="sum")


def test_round_metrics_are_weighted_by_samples() -> None:
    rounds = [
        (16, {"completions/mean_length": [4.0], "completions/clipped_ratio": [0.25],
              "completions/mean_terminated_length": [3.0], "completions/min_length": [2.0],
              "completions/max_terminated_length": [5.0], "sampling/x/max": [1.5],
              "user": [float("nan")]}),
        (8, {"completions/mean_length": [7.0], "completions/clipped_ratio": [1.0],
             "completions/mean_terminated_length": [0.0], "completions/min_length": [1.0],
             "completions/max_terminated_length": [0.0], "sampling/x/max": [2.5],
             "user": [2.0]}),
    ]  # fmt: skip
    out = combine_rounds(rounds)
    assert out["completions/mean_length"] == (16 * 4.0 + 8 * 7.0) / 24  # not (4 + 7) / 2
    assert out["completions/clipped_ratio"] == (16 * 0.25 + 8 * 1.0) / 24
    # round 2 has no terminated sample: TRL's 0 placeholders do not count
    assert out["completions/mean_terminated_length"] == 3.0
    assert out["completions/max_terminated_length"] == 5.0
    assert out["completions/min_length"] == 1.0 and out["sampling/x/max"] == 2.5
    assert out["user"] == 2.0  # NaN entries (a None reward) are left out, as TRL's log does
    one = combine_rounds([(24, {"a": [0.1 + 0.2]})])
    assert one["a"] == 0.1 + 0.2  # one round: TRL's entry as it wrote it
    none = combine_rounds([(8, {"completions/clipped_ratio": [1.0],
                                "completions/min_terminated_length": [0.0]})] * 2)  # fmt: skip
    assert none["completions/min_terminated_length"] == 0.0  # no terminated sample: TRL's 0
    assert math.isnan(combine_rounds([(8, {"a": [float("nan")]})])["a"])


def test_kept_batch_metrics_are_trls_formulas() -> None:
    from types import SimpleNamespace

    trainer = SimpleNamespace(
        reward_func_names=["acc", "len"],
        reward_weights=torch.tensor([1.0, 0.5]),
        num_generations=2,
        scale_rewards="group",
        multi_objective_aggregation="sum_then_normalize",
    )
    kept = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, -1.0], [1.0, 1.0]])
    out = kept_batch_metrics(trainer, kept)
    total = kept[:, 0] + 0.5 * kept[:, 1]
    assert out["reward"] == total.mean().item()
    assert out["reward_std"] == pytest.approx(total.std().item(), rel=1e-6)  # TRL's nanstd
    assert out["rewards/acc/mean"] == 0.75
    assert out["rewards/len/std"] == pytest.approx(kept[:, 1].std().item(), rel=1e-6)
    assert out["frac_reward_zero_std"] == 0.0
    out = kept_batch_metrics(
        trainer, torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, -2.0]])
    )
    assert out["frac_reward_zero_std"] == 1.0  # both groups: equal totals
    empty = kept_batch_metrics(trainer, kept[:0])
    assert len(empty) == 7 and all(math.isnan(v) for v in empty.values())
