"""dapo_ops.truncation_penalty against OpenRLHF 0.11.2's own ``apply_stop_properly_penalty``
(``openrlhf/trainer/ppo_utils/length_penalty.py``, the ProRL "stop properly" penalty).

The peer module is loaded from its file: ``openrlhf.trainer``'s and ``openrlhf.utils``'
package ``__init__`` import the trainers and their dependencies, which the integration venv
installs without; its one import, ``openrlhf.utils.logging_utils.init_logger``, is stood in
by :func:`logging.getLogger` while it loads (the stand-in is removed afterwards). The peer edits a list of
experiences in place (``rewards`` and ``truncated`` per experience); each case feeds it the
same float64 rewards and flags, split into two experiences of uneven size.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("openrlhf")

from dapo_ops import truncation_penalty

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def peer() -> Any:
    spec = importlib.util.find_spec("openrlhf")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "trainer/ppo_utils/length_penalty.py"
    mod_spec = importlib.util.spec_from_file_location("_openrlhf_length_penalty", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    stand_in = types.ModuleType("openrlhf.utils.logging_utils")
    stand_in.init_logger = logging.getLogger  # type: ignore[attr-defined]
    saved = sys.modules.get(stand_in.__name__)
    sys.modules[stand_in.__name__] = stand_in
    try:
        mod_spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[stand_in.__name__]
        else:
            sys.modules[stand_in.__name__] = saved
    return module


@pytest.mark.parametrize("coef", [0.0, 0.25, 1.0, -0.5, -2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncation_penalty_matches_openrlhf(peer: Any, coef: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(11, generator=g, dtype=torch.float64)
    truncated = torch.rand(11, generator=g) < 0.5
    truncated[0] = True
    experiences = [
        SimpleNamespace(rewards=rewards[:4].clone(), truncated=truncated[:4].clone()),
        SimpleNamespace(rewards=rewards[4:].clone(), truncated=truncated[4:].clone()),
    ]
    count = peer.apply_stop_properly_penalty(experiences, coef)
    want = torch.cat([e.rewards for e in experiences])
    got = truncation_penalty(rewards, truncated, coef=coef)
    assert count == int(truncated.sum())
    assert torch.equal(got, want)


def test_both_refuse_a_coef_above_one(peer: Any) -> None:
    from dapo_ops import InputError

    experiences = [SimpleNamespace(rewards=torch.ones(2), truncated=torch.tensor([True, False]))]
    with pytest.raises(AssertionError):
        peer.apply_stop_properly_penalty(experiences, 1.5)
    with pytest.raises(InputError, match="coef"):
        truncation_penalty(torch.ones(2), torch.tensor([True, False]), coef=1.5)
