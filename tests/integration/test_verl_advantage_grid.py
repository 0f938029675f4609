"""Every verl advantage-estimator twin against verl 0.9.1's function, over a generated grid.

The grid: each twin of ``verl_advantages.ROWS`` and ``verl_estimators.ROWS`` times every
value set of the arguments and ``AlgoConfig`` fields verl's function reads (``KNOBS``)
times every uid layout (``LAYOUTS``: ragged groups with a one-sample group, only
one-sample groups, equal-score groups, fully masked rows, single-token rows). float64;
equal within 1e-10 relative (of the largest advantage) on the response tokens, 0 at the
masked ones. verl computes ``gdpo``'s components in float32 (hence float32's tolerance
there) and ``grpo_vectorized``'s group statistics in float32: that twin is compared with
the float64 values of the same formula, verl's ``grpo`` (``test_verl_advantages.py``
compares it with verl's own within float32's rounding).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
AlgoConfig = pytest.importorskip("verl.trainer.config").AlgoConfig

from dapo_ops.integrations import verl_advantages, verl_estimators  # noqa: E402

pytestmark = pytest.mark.integration

F64_REL, F32_REL = 1e-10, 2**-23 * 64


def _layout(sizes: list[int], seq: int, seed: int, equal: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    ids = ids[torch.randperm(len(ids), generator=g)]  # groups interleaved, as verl's batches
    rows = len(ids)
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    scores = torch.randn(rows, generator=g, dtype=torch.float64)
    if equal:  # each group's scores equal, 0.1 (not a binary fraction) in one, integers else
        scores = torch.where(ids == 0, 0.1, ids.to(torch.float64) % 3)
    return {"ids": ids, "lengths": lengths, "scores": scores, "seq": seq, "g": g}


def _empty_rows(layout: dict[str, Any]) -> dict[str, Any]:
    """Every third row of the groups with three or more samples has no response token."""
    counts = torch.bincount(layout["ids"])[layout["ids"]]
    empty = (counts >= 3) & (torch.arange(len(counts)) % 3 == 0)
    return {**layout, "lengths": torch.where(empty, 0, layout["lengths"])}


LAYOUTS: dict[str, Callable[[], dict[str, Any]]] = {
    "ragged": lambda: _layout([4, 1, 3, 6, 2, 1, 5], seq=7, seed=0),
    "one_sample_groups": lambda: _layout([1] * 9, seq=5, seed=1),
    "equal_scores": lambda: _layout([3, 4, 1, 5], seq=6, seed=2, equal=True),
    "empty_rows": lambda: _empty_rows(_layout([5, 3, 4, 2, 6], seq=6, seed=3)),
    "single_token": lambda: _layout([3, 1, 4, 2], seq=1, seed=4),
}

#: name -> the knob sets: ``config`` (AlgoConfig fields), ``args`` (keyword arguments).
KNOBS: dict[str, list[dict[str, Any]]] = {
    "gae": [{"args": {"gamma": g, "lam": lam}} for g, lam in [(1.0, 1.0), (0.99, 0.95)]],
    "grpo": [
        {"config": {"norm_adv_by_std_in_grpo": n}, "args": {"epsilon": e}}
        for n, e in itertools.product([True, False], [1e-6, 1e-3])
    ],
    "gdpo": [
        {
            "config": {"gdpo_reward_keys": keys, "gdpo_reward_weights": w},
            "args": {"norm_adv_by_std_in_grpo": n},
        }
        for keys, w, n in [
            (None, None, True),
            (None, None, False),
            (["fmt", "acc"], None, True),
            (["fmt", "acc"], [0.3, 1.7], True),
            (["fmt", "acc"], [0.3, 1.7], False),
        ]
    ],
    "grpo_passk": [{"config": {"norm_adv_by_std_in_grpo": n}} for n in (True, False)],
    "reinforce_plus_plus": [{"config": {"gamma": g}} for g in (1.0, 0.9)],
    "gpg": [{"args": {"f_norm": f}} for f in (1.0, 2.5)],
    "optimal_token_baseline": [
        {"args": {"handle_zero_tail": z, "rollout_is_weights": w}}
        for z, w in itertools.product([True, False], [None, "random"])
    ],
}
KNOBS["grpo_vectorized"] = KNOBS["grpo"]
KNOBS["tir_optimal_token_baseline"] = KNOBS["optimal_token_baseline"]
TWINS = {**verl_advantages.ESTIMATORS, **verl_estimators.ESTIMATORS}
VERL_NAMES = {
    "tir_optimal_token_baseline": "compute_multi_turn_optimal_token_baseline_advantage",
    # verl's vectorised GRPO computes its group statistics in float32 even for float64
    # scores (an equal-score group then gets |s| 2^-24 / epsilon of noise): ours are the
    # exact values of its formula, which verl's loop computes in float64
    "grpo_vectorized": "compute_grpo_outcome_advantage",
}


def _inputs(name: str, layout: dict[str, Any], knobs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """verl's keyword arguments for ``name`` on ``layout`` (none for a layout it refuses)."""
    ids, lengths, seq, g = layout["ids"], layout["lengths"], layout["seq"], layout["g"]
    if name == "grpo_passk" and bool((torch.bincount(ids) < 2).any()):
        return  # verl's pass@k raises on a one-sample group (tested in test_verl_advantages)
    rows = len(ids)
    mask = (torch.arange(seq) < lengths[:, None]).to(torch.float64)
    outcome = torch.zeros(rows, seq, dtype=torch.float64)
    outcome[torch.arange(rows), (lengths - 1).clamp(min=0)] = layout["scores"]
    dense = torch.randn(rows, seq, generator=g, dtype=torch.float64) * mask
    config = AlgoConfig(**{k: v for k, v in knobs.get("config", {}).items() if v is not None})
    args: dict[str, Any] = {"response_mask": mask, "config": config, **knobs.get("args", {})}
    uids = np.array([f"uid-{int(i)}" for i in ids], dtype=object)
    if name in ("gae", "reinforce_plus_plus", "remax"):
        args["token_level_rewards"] = dense
    else:
        args |= {"token_level_rewards": outcome, "index": uids}
    if name == "gae":
        args |= {"values": torch.randn(rows, seq, generator=g, dtype=torch.float64)}
        del args["config"]
    if name == "remax":
        args["reward_baselines"] = torch.randn(rows, generator=g, dtype=torch.float64)
    if name.startswith(("grpo", "gdpo")) and "norm_adv_by_std_in_grpo" in config:
        args["norm_adv_by_std_in_grpo"] = config.norm_adv_by_std_in_grpo  # as verl's trainer
    if name == "gdpo":
        comps = torch.randint(0, 3, (rows, 2), generator=g).to(torch.float64) * 0.3
        args["non_tensor_batch"] = {"fmt": comps[:, 0].numpy(), "acc": comps[:, 1].numpy()}
        attention = torch.cat([torch.ones(rows, 3), mask], dim=1).long()
        args["batch"] = {"prompts": torch.zeros(rows, 3), "attention_mask": attention}
        if not config.get("gdpo_reward_keys"):
            args["non_tensor_batch"] = args["batch"] = None
    if name.endswith("optimal_token_baseline"):
        del args["config"]
        args["old_log_probs"] = -torch.rand(rows, seq, generator=g, dtype=torch.float64) * 3
        args["sum_pi_squared"] = torch.rand(rows, seq, generator=g, dtype=torch.float64)
        if args["rollout_is_weights"] == "random":
            args["rollout_is_weights"] = torch.rand(rows, seq, generator=g, dtype=torch.float64)
    yield args


CASES = [
    pytest.param(name, k, layout, id=f"{name}-{k}-{layout}")
    for name in TWINS
    for k in range(len(KNOBS.get(name, [{}])))
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("name", "knob", "layout"), CASES)
def test_twin_equals_verl(name: str, knob: int, layout: str) -> None:
    knobs = KNOBS.get(name, [{}])[knob]
    verl_fn = getattr(core_algos, VERL_NAMES.get(name, ""), None)
    verl_fn = verl_fn or core_algos.get_adv_estimator_fn(name)
    for args in _inputs(name, LAYOUTS[layout](), knobs):
        want_a, want_r = verl_fn(
            **{k: v.clone() if torch.is_tensor(v) else v for k, v in args.items()}
        )
        got_a, got_r = TWINS[name](**args)
        assert got_a.dtype == got_r.dtype == torch.float64
        m = args["response_mask"].bool()
        rel = F32_REL if name == "gdpo" and args["batch"] is not None else F64_REL
        for got, want in ((got_a, want_a), (got_r, want_r)):
            want = want.to(torch.float64)
            scale = max(1.0, float(want[m].abs().max())) if bool(m.any()) else 1.0
            torch.testing.assert_close(got[m], want[m], rtol=rel, atol=rel * scale)
        assert bool((got_a[~m] == 0).all())


def test_opo_group_of_empty_responses_is_zero_where_verl_gives_nan() -> None:
    """The one input on which a twin differs from verl: 0 / 0 length-weighted baseline."""
    mask = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 3.0]], dtype=torch.float64)
    uids = np.array(["a", "a", "b"], dtype=object)
    want, _ = core_algos.compute_opo_outcome_advantage(rewards.clone(), mask, uids)
    got, _ = TWINS["opo"](rewards, mask, uids)
    assert bool(want[:2].isnan().all())
    assert bool((got[:2] == 0).all())
    torch.testing.assert_close(got[2:], want[2:])
