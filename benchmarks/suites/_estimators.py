"""Every advantage estimator of ours beside its verl 0.9.1 twin (``core_algos``).

One case per estimator on one batch (rows x response length, shuffled uneven groups).
Ours returns what verl's returns, token-level ``[rows, seq]`` advantages (an outcome
estimator's ``[rows]`` result broadcast over the response with ``where``), and takes
integer group ids where verl takes its ``uid`` string array (the id mapping is the
caller's, outside the timing, as in ``integrations/verl_estimators.py``). Agreement of
each pair is tested in ``tests/integration/test_verl_estimators.py`` and
``test_verl_optimal_baseline.py``; here they are timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import dapo_ops as d
from benchmarks.harness import Case, Fn, Impl
from benchmarks.suites._peers import verl_version


@dataclass
class EstInputs:
    mask: torch.Tensor  # bool [rows, seq]
    maskf: torch.Tensor  # float32, as verl's response_mask
    ids: torch.Tensor  # int64 [rows]
    uids: np.ndarray[Any, Any]
    scores: torch.Tensor  # [rows]
    outcome: torch.Tensor  # [rows, seq]: the score on the last response token
    dense: torch.Tensor  # [rows, seq] dense token rewards
    values: torch.Tensor
    lengths: torch.Tensor
    base: torch.Tensor  # ReMax's greedy-baseline rewards [rows]
    comps: torch.Tensor  # GDPO's reward components [rows, 2]
    old: torch.Tensor  # log-probs of the sampled tokens
    s2: torch.Tensor  # sum of squared probabilities per position


def est_inputs(rows: int, seq: int, group: int, device: str) -> EstInputs:
    g = torch.Generator().manual_seed(rows + seq)
    sizes = torch.randint(2, 2 * group - 1, (rows,), generator=g)
    sizes = sizes[: int(torch.searchsorted(sizes.cumsum(0), torch.tensor(rows)))]
    sizes = torch.cat([sizes, torch.tensor([rows - int(sizes.sum())])])
    sizes = sizes[sizes > 0]
    ids = torch.repeat_interleave(torch.arange(len(sizes)) * 7 + 3, sizes)
    ids = ids[torch.randperm(rows, generator=g)]
    lengths = torch.randint(1, seq + 1, (rows,), generator=g)
    mask = torch.arange(seq) < lengths[:, None]
    scores = torch.randint(0, 2, (rows,), generator=g).float()
    outcome = torch.zeros(rows, seq)
    outcome[torch.arange(rows), lengths - 1] = scores
    p = torch.rand(rows, seq, generator=g) * 0.9 + 0.05
    t = EstInputs(
        mask=mask,
        maskf=mask.float(),
        ids=ids,
        uids=np.array([f"u{i}" for i in ids.tolist()], dtype=object),
        scores=scores,
        outcome=outcome,
        dense=torch.randn(rows, seq, generator=g) * mask,
        values=torch.randn(rows, seq, generator=g),
        lengths=lengths,
        base=torch.rand(rows, generator=g),
        comps=torch.randint(0, 2, (rows, 2), generator=g).float(),
        old=p.log(),
        s2=p.square() + (1 - p).square() / 4,
    )
    for name, value in vars(t).items():
        if isinstance(value, torch.Tensor):
            setattr(t, name, value.to(device))
    return t


def _tok(adv: torch.Tensor, x: EstInputs) -> torch.Tensor:
    return torch.where(x.mask, adv[:, None], 0.0)


def _algo(**kw: Any) -> Any:
    from verl.trainer.config import AlgoConfig  # type: ignore[import-not-found]

    return AlgoConfig(**kw)


def _gdpo_verl(fn: Callable[..., Any], x: EstInputs) -> Fn:
    rows = x.mask.shape[0]
    cfg = _algo(gdpo_reward_keys=["fmt", "acc"])
    extra = {
        "non_tensor_batch": {
            "fmt": x.comps[:, 0].cpu().numpy(),
            "acc": x.comps[:, 1].cpu().numpy(),
        },
        "batch": {
            "prompts": torch.zeros(rows, 3, device=x.mask.device),
            "attention_mask": torch.cat(
                [torch.ones(rows, 3, device=x.mask.device), x.maskf], 1
            ).long(),
        },
    }
    return lambda: fn(x.outcome, x.maskf, x.uids, config=cfg, **extra)


#: (verl name, ours, verl call given verl's registered function)
PAIRS: list[
    tuple[str, Callable[[EstInputs], Fn], Callable[[Callable[..., Any], EstInputs], Fn]]
] = [
    (
        "gae",
        lambda x: lambda: d.gae_advantages(x.dense, x.values, x.mask, gamma=0.99, lam=0.95),
        lambda f, x: lambda: f(x.dense, x.values, x.maskf, torch.tensor(0.99), torch.tensor(0.95)),
    ),
    (
        "reinforce_plus_plus",
        lambda x: lambda: d.reinforce_pp_advantages(x.dense, x.mask, gamma=1.0),
        lambda f, x: lambda: f(x.dense, x.maskf, config=_algo(gamma=1.0)),
    ),
    (
        "reinforce_plus_plus_baseline",
        lambda x: (
            lambda: d.masked_whiten(
                _tok(d.group_advantages(x.scores, x.ids, scale="none", singleton="score"), x),
                x.mask,
            )
        ),
        lambda f, x: lambda: f(x.outcome, x.maskf, x.uids),
    ),
    (
        "rloo",
        lambda x: (
            lambda: _tok(
                d.group_advantages(
                    x.scores, x.ids, scale="none", baseline="leave_one_out", singleton="score"
                ),
                x,
            )
        ),
        lambda f, x: lambda: f(x.outcome, x.maskf, x.uids, config=_algo()),
    ),
    (
        "rloo_vectorized",
        lambda x: (
            lambda: _tok(
                d.group_advantages(
                    x.scores, x.ids, scale="none", baseline="leave_one_out", singleton="zero"
                ),
                x,
            )
        ),
        lambda f, x: lambda: f(x.outcome, x.maskf, x.uids, config=_algo()),
    ),
    (
        "opo",
        lambda x: lambda: _tok(d.opo_advantages(x.scores, x.lengths, x.ids), x),
        lambda f, x: lambda: f(x.outcome, x.maskf, x.uids),
    ),
    (
        "remax",
        lambda x: lambda: d.remax_advantages(x.dense, x.base, x.mask),
        lambda f, x: lambda: f(x.dense, x.base, x.maskf),
    ),
    (
        "gpg",
        lambda x: lambda: _tok(d.gpg_advantages(x.scores, x.ids), x),
        lambda f, x: lambda: f(x.outcome, x.maskf, x.uids),
    ),
    (
        "grpo_passk",
        lambda x: lambda: _tok(d.passk_advantages(x.scores, x.ids, scale=True), x),
        lambda f, x: (
            lambda: f(x.outcome, x.maskf, x.uids, config=_algo(norm_adv_by_std_in_grpo=True))
        ),
    ),
    ("gdpo", lambda x: lambda: d.gdpo_advantages(x.comps, x.ids, x.mask), _gdpo_verl),
    (
        "optimal_token_baseline",
        lambda x: lambda: d.optimal_token_baseline_advantages(x.dense, x.old, x.s2, x.mask, x.ids),
        lambda f, x: (
            lambda: f(
                token_level_rewards=x.dense,
                response_mask=x.maskf,
                index=x.uids,
                old_log_probs=x.old,
                sum_pi_squared=x.s2,
                config=None,
            )
        ),
    ),
]


def estimator_cases(rows: int, seq: int, group: int, device: str) -> list[Case]:
    version = verl_version()
    cases = []
    for name, ours, theirs in PAIRS:

        def verl(x: EstInputs, name: str = name, theirs: Any = theirs) -> Fn:
            from verl.trainer.ppo import core_algos  # type: ignore[import-not-found]

            fn: Fn = theirs(core_algos.get_adv_estimator_fn(name), x)
            return fn

        twin = f"verl {version} (installed) {name}" if version else f"verl (not installed) {name}"
        missing = None if version else "verl is not installed (pip install --no-deps verl==0.9.1)"
        cases.append(
            Case(
                f"estimator {name}",
                f"{rows}x{seq}, groups ~{group}",
                lambda: est_inputs(rows, seq, group, device),
                [
                    Impl(f"dapo_ops ({name})", "ours", ours),
                    Impl(twin, "ref", verl, missing=missing),
                ],
                basis_bytes=rows * seq * 9,
                main_ref=twin if version else None,
                memory="none",
                elems=rows,
            )
        )
    return cases
