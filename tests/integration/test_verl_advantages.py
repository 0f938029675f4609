"""``adv_estimator: dapo_ops_<name>`` against verl 0.9.1's ``<name>``, through verl's registry.

Each registered pair is called with the arguments verl's trainer passes
(``ray_trainer.compute_advantage``: rewards, mask, config, the uid array, and the extras
an estimator takes), float64 rewards, ragged groups with a one-sample group; advantages
and returns must agree. Tolerances: verl's whitening divides by ``count + 1e-8`` (1e-8
relative); ``grpo_vectorized`` computes its group statistics in float32 and ``gdpo`` its
components (hence theirs are compared with the float64 truth within float32's rounding).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_verl_estimators import algo, batch

from dapo_ops import InputError
from dapo_ops.integrations import verl as integration
from dapo_ops.integrations.verl_advantages import ESTIMATORS

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

pytestmark = pytest.mark.integration

F32_REL = 2**-23 * 16  # a few float32 roundings of the group statistics


def kwargs(name: str, b: dict[str, Any], seed: int, config: Any) -> dict[str, Any]:
    """What verl's trainer passes to the registered estimator ``name``."""
    if name == "gae":
        return {
            "token_level_rewards": b["dense"],
            "values": b["values"],
            "response_mask": b["mask"],
            "gamma": 0.99,
            "lam": 0.95,
        }
    out: dict[str, Any] = {"token_level_rewards": b["outcome"], "response_mask": b["mask"]}
    out["config"] = config
    if name == "remax":
        g = torch.Generator().manual_seed(seed)
        out["reward_baselines"] = torch.randn(b["mask"].shape[0], generator=g, dtype=torch.float64)
        out["token_level_rewards"] = b["dense"]
        return out
    if name == "reinforce_plus_plus":
        out["token_level_rewards"] = b["dense"]
        return out
    out["index"] = b["uids"]
    if name == "gdpo":
        rows = b["mask"].shape[0]
        g = torch.Generator().manual_seed(seed + 10)
        comps = torch.randint(0, 3, (rows, 2), generator=g).to(torch.float64) * 0.3
        out["non_tensor_batch"] = {"fmt": comps[:, 0].numpy(), "acc": comps[:, 1].numpy()}
        attention = torch.cat([torch.ones(rows, 3), b["mask"]], dim=1).long()
        out["batch"] = {"prompts": torch.zeros(rows, 3), "attention_mask": attention}
    if name == "grpo_passk":  # pass@k needs two samples per group: drop the lone one
        keep = torch.bincount(b["ids"])[b["ids"]] >= 2
        out["token_level_rewards"] = out["token_level_rewards"][keep]
        out["response_mask"] = out["response_mask"][keep]
        out["index"] = b["uids"][keep.numpy()]
    return out


CONFIGS = {
    "gdpo": [
        {"gdpo_reward_keys": ["fmt", "acc"]},
        {"gdpo_reward_keys": ["fmt", "acc"], "gdpo_reward_weights": [0.3, 1.7]},
    ],
    "grpo_passk": [{"norm_adv_by_std_in_grpo": True}, {"norm_adv_by_std_in_grpo": False}],
    "reinforce_plus_plus": [{"gamma": 1.0}, {"gamma": 0.9}],
    "grpo": [{"norm_adv_by_std_in_grpo": True}],
}
CASES = [(n, i) for n in ESTIMATORS for i in range(len(CONFIGS.get(n, [{}])))]


@pytest.mark.parametrize(("name", "config"), CASES)
def test_registered_estimator_equals_verl(name: str, config: int) -> None:
    integration.register()
    theirs = core_algos.get_adv_estimator_fn(name)
    ours = core_algos.get_adv_estimator_fn(f"dapo_ops_{name}")
    cfg = algo(**CONFIGS.get(name, [{}])[config])
    for seed in range(3):
        b = batch(seed)
        args = kwargs(name, b, seed, cfg)
        want_a, want_r = theirs(**args)
        got_a, got_r = ours(**args)
        rtol = {"grpo_vectorized": F32_REL, "gdpo": 1e-5}.get(name, 1e-7)
        atol = 1e-5 if name == "gdpo" else 1e-9
        # verl's GAE and REINFORCE++ leave masked entries of the whitened advantages as they
        # fall; compare on the response tokens (ours are exactly 0 elsewhere)
        m = args["response_mask"].bool()
        torch.testing.assert_close(got_a[m], want_a.to(got_a.dtype)[m], rtol=rtol, atol=atol)
        torch.testing.assert_close(got_r[m], want_r.to(got_r.dtype)[m], rtol=rtol, atol=atol)
        assert bool((got_a[~m] == 0).all())


def test_outcome_estimators_need_the_uid_array() -> None:
    integration.register()
    b = batch(0)
    for name in ("rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"):
        fn = core_algos.get_adv_estimator_fn(f"dapo_ops_{name}")
        with pytest.raises(InputError, match="index"):
            fn(token_level_rewards=b["outcome"], response_mask=b["mask"], config=algo())


@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
@pytest.mark.parametrize("norm", [True, False])
def test_one_sample_groups_equal_verl_to_the_bit(name: str, norm: bool) -> None:
    """verl gives a lone sample mean 0 and std ``torch.tensor(1.0)`` (float32): its advantage
    is ``score / float32(1 + epsilon)``, a float32 denominator even for float64 scores."""
    scores = torch.tensor([0.3, -1.7, 2.5, 1e3, 0.0], dtype=torch.float64)
    uids = np.array(["a", "b", "c", "d", "e"], dtype=object)
    rewards, mask = scores[:, None].clone(), torch.ones(5, 1, dtype=torch.float64)
    fn = core_algos.get_adv_estimator_fn(name)
    want, _ = fn(rewards.clone(), mask, uids, norm_adv_by_std_in_grpo=norm)
    got, _ = ESTIMATORS[name](rewards, mask, uids, norm_adv_by_std_in_grpo=norm)
    assert got.dtype == torch.float64
    assert torch.equal(got, want)
