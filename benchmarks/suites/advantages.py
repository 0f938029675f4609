"""Suite ``advantages``: aggregation, the step's normaliser, advantages, sampling, rewards.

``group_advantages`` dense (beside a plain ``view(-1, G)`` mean/std, TRL's formula) and
ragged (shuffled, uneven group ids, beside verl 0.9.1's loop and vectorised GRPO
estimators); every other estimator beside its verl twin (``_estimators.py``);
``dynamic_sample_mask``, ``overlong_reward``, ``token_level_aggregate``,
``global_normalizer`` beside the peers' code paths.
"""

from __future__ import annotations

import torch

import dapo_ops as d
from benchmarks import references as ref
from benchmarks import references_rewards as ref_rewards
from benchmarks.harness import Case, Impl, Result, Suite, Target, find
from benchmarks.suites._estimators import estimator_cases
from benchmarks.suites._inputs import loss_inputs
from benchmarks.suites._rewards import PLAIN_VIEW, reward_cases, reward_inputs
from benchmarks.targets import compare


def make_cases(quick: bool, device: str) -> list[Case]:
    b, s = 64, 4096

    def agg_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = loss_inputs(b, s, device)
        return d.clip_higher_surrogate(x.logp, x.old, x.adv, x.mask), x.mask, x.mask.int()

    agg_ref = "verl-style agg_loss(token-mean)"
    cases = [
        Case(
            "token_level_aggregate fwd",
            f"{b}x{s}",
            agg_inputs,
            [
                Impl(
                    "dapo_ops token_level_aggregate",
                    "ours",
                    lambda x: lambda: d.token_level_aggregate(x[0], x[1]),
                ),
                Impl(agg_ref, "ref", lambda x: lambda: ref.verl_agg_loss(x[0], x[1], "token-mean")),
                Impl(
                    "TRL-style bnpo sum / count",
                    "ref",
                    lambda x: lambda: (x[0] * x[2]).sum() / x[2].sum().clamp(min=1.0),
                ),
            ],
            floor_bytes=5 * b * s,
            basis_bytes=5 * b * s,
            main_ref=agg_ref,
            elems=b * s,
        ),
        Case(
            "global_normalizer (8 micro-batches)",
            "8x64x4096",
            lambda: [loss_inputs(64, 4096, device).mask for _ in range(8)],
            [
                Impl(
                    "dapo_ops global_normalizer", "ours", lambda m: lambda: d.global_normalizer(m)
                ),
                Impl(
                    "sum of per-micro-batch .item()",
                    "ref",
                    lambda m: lambda: ref_rewards.trl_num_items_in_batch(m),
                ),
            ],
            floor_bytes=8 * b * s,
            basis_bytes=8 * b * s,
            main_ref="sum of per-micro-batch .item()",
            elems=8 * b * s,
        ),
    ]
    for n, groups in [(16_384, 1024)] if quick else [(16_384, 1024), (65_536, 4096)]:
        cases += reward_cases(n, groups, device)
    cases += estimator_cases(512 if quick else 2048, 256 if quick else 1024, 16, device)
    return cases


def agreement(device: str) -> list[str]:
    for ragged in (False, True):
        r = reward_inputs(4096, 256, device, ragged)
        got = (
            d.group_advantages(r.rewards, r.ids, eps=1e-6)
            if ragged
            else d.group_advantages(r.dense, eps=1e-6).flatten()
        )
        want = ref_rewards.verl_grpo_outcome_advantage(
            r.rewards.cpu()[:, None].clone(), torch.ones(r.rewards.numel(), 1), r.uids
        )[:, 0]
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
        if ragged:
            kept = torch.nonzero(d.dynamic_sample_mask(r.rewards, r.ids).cpu())[:, 0].tolist()
            assert kept == ref_rewards.verl_filter_groups(r.uids, r.rewards.cpu().numpy())
    lengths = reward_inputs(4096, 256, device, False).lengths
    torch.testing.assert_close(
        d.overlong_reward(lengths, max_len=20_480, cache_len=4096).cpu(),
        ref_rewards.verl_overlong_penalty(lengths.cpu(), 20_480, 4096, 1.0),
    )
    return [
        "group_advantages (eps=1e-6) == verl-style loop; dynamic_sample_mask == filter_groups; "
        "overlong_reward == verl penalty loop (lengths <= max_len)"
    ]


def targets(
    results: list[Result], cases: list[Case], bandwidth: float, device: str = "cpu"
) -> list[Target]:
    size = "16k samples / 1k groups"
    dense, ragged = "group_advantages dense", "group_advantages ragged"
    vectorized = next(
        (r for r in results if (r.op, r.size) == (ragged, size) and r.impl.endswith("vectorized")),
        None,
    )
    return [
        compare(
            f"{dense}, {size}: x faster than a plain view(-1, G) mean/std (no slower)",
            find(results, dense, size, "dapo_ops"),
            find(results, dense, size, PLAIN_VIEW),
            1.0,
            faster=True,
        ),
        compare(
            f"{ragged}, {size}: x faster than verl's vectorised GRPO estimator",
            find(results, ragged, size, "dapo_ops"),
            vectorized,
            10.0,
            faster=True,
        ),
    ]


SUITE = Suite(
    name="advantages",
    title="Aggregation, advantages, sampling and rewards",
    make_cases=make_cases,
    targets=targets,
    agreement=agreement,
    notes=(
        "Rewards: 0/1 correctness plus the soft overlong penalty; ragged ids: group sizes "
        "2 .. 2G-2, shuffled, non-contiguous. verl's GRPO estimators get `[N, 1]` "
        "token-level rewards and the uid string array (the loop's cost is the Python loop).",
        "Estimators: ours beside verl 0.9.1's registered function of the same name, on one "
        "batch of ragged groups; ours takes integer group ids (verl: uid strings) and "
        "returns token-level advantages as verl's do. Their agreement is tested in "
        "tests/integration; here they are timed.",
    ),
)
