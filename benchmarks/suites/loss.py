"""Suite ``loss``: the policy loss from log-probs, fwd+bwd and fwd, against verl and TRL.

``token_level_loss`` (eager, ``compiled=True``, a user's ``torch.compile``) and the
unfused composition at four shapes; the same back-to-back (warm caches); the GRPO preset
(k3 KL, beta 0.04) and a DAPO loss with rollout IS weights beside verl's actor step; every
objective of the engine through ``policy_loss``; the per-op cases (surrogate,
diagnostics). Ratios to the copy-bandwidth floor measured in the same run.
"""

from __future__ import annotations

from typing import Any

import torch

import dapo_ops as d
from benchmarks import references as ref
from benchmarks.harness import Case, Fn, Impl, Suite, for_device
from benchmarks.suites._inputs import LossInputs, fwd, fwd_bwd, leaf, loss_inputs
from benchmarks.suites._loss_targets import (
    AOT as AOT,
)
from benchmarks.suites._loss_targets import (
    BACK_TO_BACK as BACK_TO_BACK,
)
from benchmarks.suites._loss_targets import (
    COMPILED as COMPILED,
)
from benchmarks.suites._loss_targets import (
    COMPOSITION as COMPOSITION,
)
from benchmarks.suites._loss_targets import (
    DUAL as DUAL,
)
from benchmarks.suites._loss_targets import (
    EAGER as EAGER,
)
from benchmarks.suites._loss_targets import (
    EXP as EXP,
)
from benchmarks.suites._loss_targets import (
    GRPO_KL as GRPO_KL,
)
from benchmarks.suites._loss_targets import (
    IS as IS,
)
from benchmarks.suites._loss_targets import (
    LOSS as LOSS,
)
from benchmarks.suites._loss_targets import (
    OBJ as OBJ,
)
from benchmarks.suites._loss_targets import (
    USER_COMPILED as USER_COMPILED,
)
from benchmarks.suites._loss_targets import (
    targets,
)
from benchmarks.suites._loss_variants import VERL_STEP as VERL_STEP
from benchmarks.suites._loss_variants import kl_is_impls, objective_impls
from benchmarks.suites._peers import installed_verl_loss


def _loss_impls(backward: bool, quick: bool) -> list[Impl]:
    wrap = fwd_bwd if backward else fwd
    kw: dict[str, Any] = {"dual_clip": DUAL}

    def public(x: LossInputs, compiled: bool = False) -> Fn:
        return wrap(
            lambda lp: d.token_level_loss(lp, x.old, x.adv, x.mask, compiled=compiled, **kw),
            x.logp,
        )

    def user_compiled(x: LossInputs) -> Fn:
        loss = torch.compile(lambda lp: d.token_level_loss(lp, x.old, x.adv, x.mask, **kw))
        return wrap(loss, x.logp)

    def composition(x: LossInputs) -> Fn:
        return wrap(
            lambda lp: d.token_level_aggregate(
                d.clip_higher_surrogate(lp, x.old, x.adv, x.mask, **kw), x.mask
            ),
            x.logp,
        )

    def verl_step(x: LossInputs) -> Fn:
        lp, n_tokens = leaf(x.logp), x.mask.sum()

        def run() -> object:
            out = ref.verl_actor_step(
                lp, x.old, x.adv, x.mask, backward=backward, batch_num_tokens=n_tokens
            )
            lp.grad = None
            return out

        return run

    def trl_step(x: LossInputs) -> Fn:
        lp, adv, mask = leaf(x.logp), x.adv[:, 0], x.mask.int()
        n_items, metrics = mask.sum(), dict[str, list[float]]()

        def run() -> object:
            loss = ref.trl_compute_loss(
                lp, x.old, adv, mask, num_items_in_batch=n_items, metrics=metrics
            )
            if backward:
                loss.backward()  # type: ignore[no-untyped-call]
                lp.grad = None
            return loss

        return run

    def aot(x: LossInputs) -> Fn:
        fn = d.CompiledPolicyLoss(d.ClipHigher(dual_clip=DUAL))
        return wrap(lambda lp: fn(lp, x.old, x.adv, x.mask), x.logp)

    no_aot = None if hasattr(d, "CompiledPolicyLoss") else "not in this dapo_ops"
    impls = [
        Impl(EAGER, "ours", public),
        Impl(COMPILED, "ours", lambda x: public(x, True), compiled=True),
        Impl(AOT, "ours", aot, compiled=True, missing=no_aot),
    ]
    if not quick:
        impls.append(Impl(USER_COMPILED, "ours", user_compiled, compiled=True))
    impls.append(Impl(COMPOSITION, "ours", composition))
    if backward:
        impls.append(Impl(EXP, "unit", lambda x: _exp_pass(x)))
    impls += installed_verl_loss(backward, DUAL)
    impls += [
        Impl(VERL_STEP, "ref", verl_step),
        Impl(
            "verl-style loss only",
            "ref",
            lambda x: wrap(
                lambda lp: ref.verl_agg_loss(
                    ref.verl_per_token_loss(x.old, lp, x.adv), x.mask, "token-mean"
                ),
                x.logp,
            ),
        ),
        Impl("TRL-style step (loss + clip metrics + .item())", "ref", trl_step),
    ]
    return impls


def _exp_pass(x: LossInputs) -> Fn:
    out = torch.empty_like(x.logp)
    return lambda: torch.exp(x.logp, out=out)


def make_cases(quick: bool, device: str) -> list[Case]:
    shapes = (
        [(16, 1024), (64, 4096)] if quick else [(16, 1024), (64, 4096), (128, 8192), (512, 8192)]
    )
    big = [(64, 4096)] if quick else [(64, 4096), (512, 8192)]
    fwd_shapes = shapes[1:] if quick else shapes
    obj_shape = (64, 4096)
    if device != "cpu" and not quick:  # a GPU: the two shapes (the compiles dominate)
        shapes, fwd_shapes, obj_shape = big, [(512, 8192)], (512, 8192)
    cases: list[Case] = []

    def case(op: str, b: int, s: int, impls: list[Impl], per_tok: int, **kw: Any) -> Case:
        """``per_tok``: bytes per token read (inputs) and written (the gradient, fwd+bwd)."""
        inputs = per_tok - (4 if "fwd+bwd" in op else 0)
        return Case(
            op,
            f"{b}x{s}",
            lambda: loss_inputs(b, s, device),
            impls,
            floor_bytes=per_tok * b * s + 4 * b,
            basis_bytes=inputs * b * s + 4 * b,
            main_ref=VERL_STEP,
            elems=b * s,
            **kw,
        )

    for b, s in shapes:
        impls = for_device(_loss_impls(True, quick), device)
        cases.append(case(LOSS, b, s, impls, 13, memory="all", memory_quick=s == 4096))
    for b, s in big:
        keep = (EAGER, COMPILED, AOT, EXP, VERL_STEP)
        impls = [i for i in for_device(_loss_impls(True, quick), device) if i.name in keep]
        cases.append(case(BACK_TO_BACK, b, s, impls, 13, back_to_back=True))
    for b, s in fwd_shapes:
        cases.append(
            case("token_level_loss fwd", b, s, for_device(_loss_impls(False, quick), device), 9)
        )
    for b, s in big:
        # logp, old, ref or is_weights, mask in; the gradient out
        cases.append(case(GRPO_KL, b, s, kl_is_impls(True), 17, memory_quick=True))
        cases.append(case(IS, b, s, kl_is_impls(False), 17, memory_quick=True))
    b, s = obj_shape
    cases.append(case(OBJ, b, s, objective_impls(quick), 13, memory="none"))
    b, s = 64, 4096
    cases.append(
        case(
            "clip_higher_surrogate fwd",
            b,
            s,
            [
                Impl(
                    "dapo_ops clip_higher_surrogate",
                    "ours",
                    lambda x: (
                        lambda: d.clip_higher_surrogate(
                            x.logp, x.old, x.adv, x.mask, dual_clip=DUAL
                        )
                    ),
                ),
                Impl(
                    "verl-style per-token chain",
                    "ref",
                    lambda x: lambda: ref.verl_per_token_loss(x.old, x.logp, x.adv),
                ),
            ],
            13,
        )
    )
    cases[-1].main_ref = "verl-style per-token chain"
    cases[-1].basis_bytes = 9 * b * s + 4 * b  # it writes the 4-byte per-token loss

    def diag(x: LossInputs) -> Fn:
        def run() -> object:
            dg = d.policy_diagnostics(
                x.logp, x.old, x.adv, x.mask, objective=d.ClipHigher(dual_clip=DUAL)
            )
            return [float(v) for v in (dg.clip_frac_low, dg.clip_frac_high, dg.approx_kl)]

        return run

    metrics = "verl-style metrics (masked_mean + .item())"
    diag_case = case(
        "policy_diagnostics (+ host read)",
        b,
        s,
        [
            Impl("dapo_ops policy_diagnostics", "ours", diag),
            Impl(
                metrics,
                "ref",
                lambda x: lambda: ref.verl_metrics_only(x.logp, x.old, x.adv, x.mask),
            ),
        ],
        9,
    )
    diag_case.main_ref = metrics
    cases.append(diag_case)
    return cases


def agreement(device: str) -> list[str]:
    x = loss_inputs(16, 1024, device)
    ours = d.token_level_loss(x.logp, x.old, x.adv, x.mask, dual_clip=DUAL)
    composed = d.token_level_aggregate(
        d.clip_higher_surrogate(x.logp, x.old, x.adv, x.mask, dual_clip=DUAL), x.mask
    )
    compiled = d.token_level_loss(x.logp, x.old, x.adv, x.mask, dual_clip=DUAL, compiled=True)
    verl = ref.verl_compute_policy_loss(x.old, x.logp, x.adv, x.mask)[0]
    trl = ref.trl_compute_loss(
        x.logp, x.old, x.adv[:, 0], x.mask.int(), num_items_in_batch=x.mask.sum()
    )
    torch.testing.assert_close(composed, ours)
    torch.testing.assert_close(compiled, ours)
    torch.testing.assert_close(verl, ours, rtol=1e-5, atol=1e-7)
    no_dual = d.token_level_loss(x.logp, x.old, x.adv, x.mask)
    torch.testing.assert_close(trl, no_dual, rtol=1e-5, atol=1e-7)
    grpo = d.presets.GRPO
    kl_ours = d.policy_loss(
        grpo.objective,
        x.logp,
        x.old,
        x.adv,
        x.mask,
        mode=grpo.mode,
        kl=d.KLPenalty(beta=0.04, estimator="k3", clamp=10.0),
        ref_logp=x.ref,
    )
    lp = leaf(x.logp)
    pg = ref.verl_compute_policy_loss(
        x.old, lp, x.adv, x.mask, 0.2, 0.2, clip_ratio_c=1e9, loss_agg_mode="seq-mean-token-mean"
    )[0]
    kl_verl = pg + 0.04 * ref.verl_agg_loss(
        ref.verl_low_var_kl(lp, x.ref), x.mask, "seq-mean-token-mean"
    )
    torch.testing.assert_close(kl_verl, kl_ours, rtol=1e-5, atol=1e-7)
    torch._dynamo.reset()  # the timed cases report the compile cost from scratch
    return [
        "loss: verl-style == dapo_ops (dual_clip=3); TRL-style == dapo_ops (no dual); "
        "GRPO preset with verl's KL clamp == verl-style pg + 0.04 low_var_kl"
    ]


SUITE = Suite(
    name="loss",
    title="Policy loss from log-probs",
    make_cases=make_cases,
    targets=targets,
    agreement=agreement,
    notes=(
        "Inputs: float32 log-probs, a bool mask (TRL-style gets it as int32), per-sequence "
        "advantages `[B, 1]`, lengths uniform in [S/8, S]; padding holds zeros. The "
        "verl-style and dapo_ops DAPO rows use the dual clip (`clip_ratio_c=3`); TRL has none.",
        "`x floor` divides by the bytes the op must read and write (inputs, and the gradient "
        "for fwd+bwd) over the copy bandwidth measured in this run.",
        "Back-to-back cases: each implementation's repeats in one block, so its inputs stay "
        "in cache (the interleaved cases evict them between calls).",
        "GRPO preset: `policy_loss(GRPO.objective, ..., mode='seq_mean_token_mean', "
        "kl=KLPenalty(beta=0.04, estimator='k3'), ref_logp=...)`, beside verl's actor step "
        "with `use_kl_loss`, `kl_loss_type=low_var_kl`, `loss_agg_mode=seq-mean-token-mean` "
        "(installed verl's own functions when present, and the op-for-op mirror). IS "
        "weights: DAPO's loss with `is_weights=` beside verl's `rollout_is_weights`.",
        "Every objective: `policy_loss(Objective(), ...)` with each objective's defaults, "
        "token-mean; per-token objectives and the sequence-level ones (GSPO, GMPO) alike.",
        "On a GPU (the cuda section: the two shapes of the issue, every objective at "
        "512x8192) these steps are bound by the host's launch cost, not by bandwidth: "
        "compare the yardstick row, a single exp kernel timed the same way. The issue's CPU "
        "targets (KL/IS against verl, the 64x4096 floor) are not applied there; the figures "
        "it asks for on a GPU (floor ratio and kernels per step at 512x8192) are recorded.",
    ),
)
