"""The peers' own functions, timed when they are installed (verl 0.9.1, TRL, Liger).

Each helper returns :class:`Impl` rows; when the peer is not installed the row is kept
with ``missing`` set, so the table says why it has no number instead of dropping it.
"""

from __future__ import annotations

from typing import Any

from benchmarks.environment import installed
from benchmarks.harness import Fn, Impl
from benchmarks.suites._inputs import LossInputs, leaf


def verl_version() -> str | None:
    return installed("verl")


def _verl_config(x: LossInputs, clip: tuple[float, float], dual: float) -> Any:
    """A real ``ActorConfig`` (clip bounds, the dual clip, the global token count)."""
    from verl.workers.config import ActorConfig  # type: ignore[import-not-found]

    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=x.logp.shape[0],
        ppo_micro_batch_size_per_gpu=x.logp.shape[0],
        clip_ratio=clip[0],
        clip_ratio_low=clip[0],
        clip_ratio_high=clip[1],
        clip_ratio_c=dual,
    )
    config.global_batch_info.update(
        dp_size=1, batch_num_tokens=x.mask.sum(), global_batch_size=x.logp.shape[0]
    )
    return config


def installed_verl_loss(backward: bool, dual: float) -> list[Impl]:
    """verl's ``compute_policy_loss_vanilla`` with a real config, when verl is installed."""
    version = verl_version()
    if version is None:
        return []

    def build(x: LossInputs) -> Fn:
        from verl.trainer.ppo import core_algos  # type: ignore[import-not-found]

        lp, config = leaf(x.logp), _verl_config(x, (0.2, 0.28), dual)

        def run() -> object:
            pg_loss, metrics = core_algos.compute_policy_loss_vanilla(
                x.old, lp, x.adv, x.mask, loss_agg_mode="token-mean", config=config
            )  # the metrics' .item() run inside
            if backward:
                pg_loss.backward()
                lp.grad = None
            return pg_loss.item(), metrics

        return run

    return [Impl(f"verl {version} (installed) compute_policy_loss_vanilla + .item()", "ref", build)]


def verl_kl_is(kl: bool, mode: str, clip: tuple[float, float]) -> list[Impl]:
    """verl's actor step (``workers/utils/losses.py: ppo_loss``) with a low_var_kl KL loss
    or rollout IS weights, from verl's own functions, when verl is installed."""
    version = verl_version()
    if version is None:
        return []

    def build(x: LossInputs) -> Fn:
        from verl.trainer.ppo import core_algos

        lp, config = leaf(x.logp), _verl_config(x, clip, 1e9 if kl else 3.0)
        config.global_batch_info.clear()  # this batch's counts, as seq-mean modes need

        def run() -> object:
            pg_loss, metrics = core_algos.compute_policy_loss_vanilla(
                x.old,
                lp,
                x.adv,
                x.mask,
                loss_agg_mode=mode,
                config=config,
                rollout_is_weights=None if kl else x.is_weights,
            )
            loss = pg_loss
            if kl:
                kld = core_algos.kl_penalty(lp, x.ref, kl_penalty="low_var_kl")
                kl_loss = core_algos.agg_loss(kld, x.mask, loss_agg_mode=mode)
                loss = pg_loss + kl_loss * 0.04
                metrics["kl_loss"] = kl_loss.detach().item()
            loss.backward()
            lp.grad = None
            return pg_loss.item(), metrics

        return run

    what = "pg loss + low_var_kl loss" if kl else "pg loss with rollout_is_weights"
    return [Impl(f"verl {version} (installed) {what} + .item()", "ref", build)]
