"""dapo_ops.entropy_bonus against verl 0.9.1's entropy term (TRL's and OpenRLHF's are in
test_trl.py / test_trl_entropy.py and test_openrlhf.py).

verl's actor: ``entropy_loss = agg_loss(entropy, response_mask, loss_agg_mode,
**global_batch_info)`` and ``policy_loss = pg_loss - entropy_coeff * entropy_loss``: the
policy loss's own aggregation, which :func:`dapo_ops.integrations.verl.verl_aggregation`
maps to ``(mode, normalizer, max_len)``. float64; verl's ``seq-mean-token-mean`` divides a
row by ``n + 1e-8`` (ours by ``n``), a relative ``1e-8 / n``, hence the 1e-6 relative bound
(the other modes agree to 1e-12).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("verl")

from dapo_ops import entropy_bonus
from dapo_ops.integrations.verl import verl_aggregation

pytestmark = pytest.mark.integration

MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
         "seq-mean-token-sum-norm"]  # fmt: skip
INFOS: list[dict[str, Any]] = [
    {},
    {"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 7},
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("info", INFOS)
@pytest.mark.parametrize("scale_factor", [None, 64])
def test_entropy_bonus_matches_verl(mode: str, info: dict[str, Any], scale_factor: Any) -> None:
    from verl.trainer.ppo.core_algos import agg_loss

    coef = 0.003
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        t = 1 + 7 * seed
        h = (3.0 * torch.rand(6, t, generator=g, dtype=torch.float64)).requires_grad_()
        lengths = torch.randint(0, t + 1, (6,), generator=g)
        lengths[0], lengths[1] = t, 0
        mask = torch.arange(t) < lengths[:, None]
        kwargs = {**info, "loss_scale_factor": scale_factor}
        theirs = -coef * agg_loss(h, mask.double(), mode, **kwargs)
        agg, normalizer, max_len = verl_aggregation(mode, info, scale_factor)
        ours = entropy_bonus(h, mask, coef=coef, mode=agg, normalizer=normalizer, max_len=max_len)
        rel = 1e-6 if mode == "seq-mean-token-mean" else 1e-12
        want = float(theirs.detach())
        assert abs(float(ours.detach()) - want) <= rel * max(1e-3, abs(want)), (mode, info, seed)
        (g_t,) = torch.autograd.grad(theirs, h)
        (g_o,) = torch.autograd.grad(ours, h)
        assert float((g_o - g_t).abs().max()) <= rel * float(g_t.abs().max()), (mode, info, seed)
