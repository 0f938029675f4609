"""``verl_sampling.filter_groups`` against verl's DAPO group filter.

Two references, on the same batches:

- verl 0.9.1's own code: ``ReplayBuffer._dapo_filtered_keys`` (``verl/trainer/ppo/v1/
  replay_buffer.py``), the group verdict of its V1 trainer. The file is loaded on its own
  (its package ``__init__`` needs hydra) with its storage, TransferQueue, replaced by an
  in-memory stand-in that serves the metric of each trajectory.
- the loop of the DAPO recipe (``recipe/dapo/dapo_ray_trainer.py``, ``RayDAPOTrainer.fit``,
  which verl 0.9.1 no longer ships in its package), restated below step by step with
  NumPy as the recipe computes it: group by uid, ``np.std`` of the metric, keep a group
  with ``std > 0`` or one trajectory, accumulate generation batches until
  ``train_batch_size`` prompts, raise at ``max_num_gen_batches``, keep the first
  ``train_batch_size * n`` trajectories.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

verl = pytest.importorskip("verl")
np = pytest.importorskip("numpy")

from dapo_ops.integrations.verl_sampling import filter_groups  # noqa: E402

pytestmark = pytest.mark.integration


def replay_buffer_module(monkeypatch: pytest.MonkeyPatch, store: dict[str, Any]) -> Any:
    tq = types.ModuleType("transfer_queue")
    tq.KVBatchMeta = object  # type: ignore[attr-defined]

    def kv_batch_get(keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        (name,) = select_fields
        return {name: [store[k][name] for k in keys]}

    tq.kv_batch_get = kv_batch_get  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transfer_queue", tq)
    path = Path(verl.__file__).parent / "trainer" / "ppo" / "v1" / "replay_buffer.py"
    spec = importlib.util.spec_from_file_location("verl_v1_replay_buffer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_batch(rng: random.Random, prefix: str) -> tuple[list[float], list[str]]:
    """Ragged groups (one-sample groups included), interleaved, metrics with ties."""
    uids: list[str] = []
    for g in range(rng.randint(1, 8)):
        uids += [f"{prefix}u{g}"] * rng.choice([1, 1, 2, 3, 4, 4, 5])
    rng.shuffle(uids)
    kind = rng.choice(["acc", "score", "float"])
    pick = {
        "acc": lambda: float(rng.random() < 0.5),
        "score": lambda: float(rng.choice([-1, 0, 1])),
        "float": lambda: rng.choice([0.25, 0.5, rng.uniform(-3, 3)]),
    }[kind]
    bias = {u: rng.random() < 0.5 for u in sorted(set(uids))}  # constant groups are common
    return [1.0 if bias[u] and kind == "acc" else pick() for u in uids], uids


@pytest.mark.parametrize("metric_name", ["acc", "reward"])
def test_verdict_equals_verl_replay_buffer(
    monkeypatch: pytest.MonkeyPatch, metric_name: str
) -> None:
    rng = random.Random(0)
    checked = 0
    for trial in range(60):
        metric, uids = random_batch(rng, f"t{trial}")
        store: dict[str, Any] = {}
        keys = []
        for j, (value, uid) in enumerate(zip(metric, uids, strict=True)):
            key = f"{uid}_{j}_0"
            keys.append(key)
            if metric_name == "reward":  # the canonical reward: rm_scores summed over tokens
                store[key] = {"rm_scores": torch.tensor([0.0, value, 0.0], dtype=torch.float64)}
            else:
                store[key] = {"extra_fields": {"reward_extra_info": {"acc": value}}}
        module = replay_buffer_module(monkeypatch, store)
        buffer = module.ReplayBuffer(
            trainer_mode="sync",
            trainer_config={},
            max_off_policy_threshold=None,
            max_off_policy_strategy="drop",
            sampler_kwargs={},
            refill_fn=lambda n: None,
            filter_groups_metric=metric_name,
            train_batch_size=4,
            gen_batch_size=1,
        )
        buffer.finished_keys["train"] = set(uids)
        buffer.partitions["train"] = {key: {} for key in keys}
        verl_dropped, _ = buffer._dapo_filtered_keys("train")

        step = filter_groups(metric, uids, train_batch_size=1)
        ours_dropped = {u for u, k in zip(uids, step.keep.tolist(), strict=True) if not k}
        assert ours_dropped == verl_dropped, (metric, uids)
        checked += len(verl_dropped)
    assert checked > 20, "too few dropped groups: a vacuous comparison"


def recipe_loop(
    batches: list[tuple[list[float], list[str]]],
    train_batch_size: int,
    n: int,
    max_num_gen_batches: int,
) -> tuple[str, list[int], int]:
    """The recipe's filter loop (see the module docstring) over generation batches whose
    trajectories are numbered consecutively; returns (outcome, kept trajectory numbers
    after the final truncation, generation batches used)."""
    kept: list[int] = []
    num_prompt_in_batch = 0
    num_gen_batches = 0
    offset = 0
    for metric, uids in batches:
        num_gen_batches += 1
        values: dict[str, list[float]] = defaultdict(list)
        for uid, value in zip(uids, metric, strict=True):
            values[uid].append(value)
        stds = {uid: np.std(v) for uid, v in values.items()}
        kept_uids = [uid for uid, std in stds.items() if std > 0 or len(values[uid]) == 1]
        num_prompt_in_batch += len(kept_uids)
        kept += [offset + j for j, uid in enumerate(uids) if uid in kept_uids]
        offset += len(uids)
        if num_prompt_in_batch < train_batch_size:
            if max_num_gen_batches <= 0 or num_gen_batches < max_num_gen_batches:
                continue
            return "raise", [], num_gen_batches
        return "train", kept[: train_batch_size * n], num_gen_batches
    return "exhausted", [], num_gen_batches


def ours_loop(
    batches: list[tuple[list[float], list[str]]],
    train_batch_size: int,
    n: int,
    max_num_gen_batches: int,
    **options: Any,
) -> tuple[str, list[int], int]:
    """The same loop with filter_groups, as its module docstring shows."""
    kept: list[int] = []
    num_prompt_in_batch = 0
    offset = 0
    for num_gen_batches, (metric, uids) in enumerate(batches, start=1):
        try:
            step = filter_groups(
                metric,
                uids,
                train_batch_size=train_batch_size,
                num_prompt_in_batch=num_prompt_in_batch,
                num_gen_batches=num_gen_batches,
                max_num_gen_batches=max_num_gen_batches,
                **options,
            )
        except ValueError as err:
            assert "max_num_gen_batches" in str(err)
            return "raise", [], num_gen_batches
        num_prompt_in_batch = step.num_prompt_in_batch
        kept += [offset + j for j in step.keep.nonzero().flatten().tolist()]
        offset += len(uids)
        if step.done:
            outcome = "capped" if step.capped else "train"
            return outcome, kept[: train_batch_size * n], num_gen_batches
    return "exhausted", [], len(batches)


def test_loop_equals_the_recipe() -> None:
    rng = random.Random(1)
    outcomes: dict[str, int] = defaultdict(int)
    for trial in range(300):
        batches = [random_batch(rng, f"t{trial}b{b}") for b in range(rng.randint(1, 5))]
        train_batch_size = rng.randint(1, 6)
        n = rng.randint(1, 4)
        cap = rng.choice([0, 0, 1, 2, 3])
        recipe = recipe_loop(batches, train_batch_size, n, cap)
        assert ours_loop(batches, train_batch_size, n, cap) == recipe
        outcomes[recipe[0]] += 1
        # on_cap="train" differs only where verl raises: it trains on what was kept
        trained = ours_loop(batches, train_batch_size, n, cap, on_cap="train")
        if recipe[0] == "raise":
            assert trained[0] == "capped" and trained[2] == recipe[2]
        else:
            assert trained == recipe
    assert min(outcomes.values()) >= 10 and len(outcomes) == 3, dict(outcomes)


def test_keep_single_sample_groups_false_is_dynamic_sample_mask() -> None:
    from dapo_ops import dynamic_sample_mask

    rng = random.Random(2)
    for trial in range(100):
        metric, uids = random_batch(rng, f"t{trial}")
        step = filter_groups(metric, uids, train_batch_size=1, keep_single_sample_groups=False)
        ids = {u: i for i, u in enumerate(dict.fromkeys(uids))}
        expected = dynamic_sample_mask(
            torch.tensor(metric, dtype=torch.float64), torch.tensor([ids[u] for u in uids])
        )
        assert torch.equal(step.keep, expected)
        singles = {u for u in uids if uids.count(u) == 1}
        verl_step = filter_groups(metric, uids, train_batch_size=1)
        assert {u for u, k in zip(uids, verl_step.keep.tolist(), strict=True) if k} == (
            {u for u, k in zip(uids, expected.tolist(), strict=True) if k} | singles
        )
