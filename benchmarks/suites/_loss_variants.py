"""The loss suite's variants: KL and IS-weight steps beside verl's, every objective."""

from __future__ import annotations

from typing import Any

import dapo_ops as d
from benchmarks import references as ref
from benchmarks.harness import Fn, Impl
from benchmarks.suites._inputs import LossInputs, fwd_bwd, leaf
from benchmarks.suites._peers import verl_kl_is
from dapo_ops.objectives import OBJECTIVES

VERL_STEP = "verl-style step (loss + 3 metrics + .item())"


def kl_is_impls(kl: bool) -> list[Impl]:
    """Ours (eager, compiled) and verl's actor step (installed, and the mirror)."""
    preset = d.presets.GRPO if kl else d.presets.DAPO

    def ours(x: LossInputs, compiled: bool = False) -> Fn:
        extra: dict[str, Any] = (
            {"kl": preset.kl, "ref_logp": x.ref} if kl else {"is_weights": x.is_weights}
        )
        return fwd_bwd(
            lambda lp: d.policy_loss(
                preset.objective,
                lp,
                x.old,
                x.adv,
                x.mask,
                mode=preset.mode,
                compiled=compiled,
                **extra,
            ),
            x.logp,
        )

    mode = "seq-mean-token-mean" if kl else "token-mean"
    clip = (0.2, 0.2) if kl else (0.2, 0.28)

    def mirror(x: LossInputs) -> Fn:
        lp = leaf(x.logp)

        def run() -> object:
            out = ref.verl_kl_is_step(
                lp,
                x.old,
                x.adv,
                x.mask,
                ref_log_prob=x.ref if kl else None,
                rollout_is_weights=None if kl else x.is_weights,
                loss_agg_mode=mode,
                clip=clip,
            )
            lp.grad = None
            return out

        return run

    name = "GRPO preset" if kl else "policy_loss(is_weights=...)"
    return [
        Impl(f"dapo_ops {name} (eager)", "ours", ours),
        Impl(f"dapo_ops {name} (compiled=True)", "ours", lambda x: ours(x, True), compiled=True),
        *verl_kl_is(kl, mode, clip),
        Impl(VERL_STEP, "ref", mirror),
    ]


def objective_impls(quick: bool) -> list[Impl]:
    impls = []
    for cls in OBJECTIVES:
        for compiled in (False,) if quick else (False, True):

            def build(x: LossInputs, cls: Any = cls, compiled: bool = compiled) -> Fn:
                return fwd_bwd(
                    lambda lp: d.policy_loss(cls(), lp, x.old, x.adv, x.mask, compiled=compiled),
                    x.logp,
                )

            tag = "compiled=True" if compiled else "eager"
            impls.append(Impl(f"{cls.__name__}() ({tag})", "ours", build, compiled=compiled))
    return impls
