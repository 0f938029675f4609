"""verl's critic and reward-side functions, computed by dapo_ops, with verl's signatures.

- :func:`compute_value_loss`: ``core_algos.compute_value_loss`` (every ``loss_agg_mode``,
  the global batch counts, ``cliprange_value``) by :func:`dapo_ops.value_loss`;
- :func:`apply_kl_penalty`: ``ray_trainer.apply_kl_penalty`` (``use_kl_in_reward``) by
  :func:`dapo_ops.kl_reward`, with :class:`FixedKLController`,
  :class:`AdaptiveKLController` (by :func:`dapo_ops.adaptive_kl_coef`) and
  :func:`get_kl_controller`;
- :func:`compute_pf_ppo_reweight_data`: ``core_algos.compute_pf_ppo_reweight_data`` by
  :func:`dapo_ops.pf_ppo_resample` (the same indices under the same seed).

verl calls these by module attribute, not through a registry: :func:`install` puts ours
where verl's trainer and critic look them up. Importing this module does not import verl.
Tested against verl 0.9.1 in float64 (``tests/integration/test_verl_value.py``).

Example:
    >>> ctrl = AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=10000)
    >>> ctrl.update(current_kl=0.3, n_steps=1000); ctrl.value
    0.51
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.engine.kl_reward import adaptive_kl_coef, kl_reward
from dapo_ops.engine.value import value_loss
from dapo_ops.integrations._verl_common import verl_aggregation
from dapo_ops.rewards.pf_ppo import pf_ppo_resample

#: verl's ``algorithm.kl_penalty`` names -> (our estimator, clamp).
VERL_KL_ESTIMATORS: dict[str, tuple[Any, float | None]] = {
    "kl": ("k1", None),
    "k1": ("k1", None),
    "abs": ("abs", None),
    "mse": ("k2", None),
    "k2": ("k2", None),
    "low_var_kl": ("k3", 10.0),
    "k3": ("k3", 10.0),
}


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
) -> tuple[Tensor, Tensor]:
    """verl's ``compute_value_loss``: ``(vf_loss, vf_clipfrac)`` by :func:`dapo_ops.value_loss`."""
    info = {
        "dp_size": dp_size,
        "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size,
        "loss_scale_factor": loss_scale_factor,
    }
    mode, normalizer, max_len = verl_aggregation(loss_agg_mode, info)
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    out = value_loss(
        vpreds, values.detach(), returns.detach(), mask, clip=float(cliprange_value), mode=mode,
        normalizer=normalizer, max_len=max_len,
    )  # fmt: skip
    return out.loss, out.clip_frac.float()  # verl's clip fraction is float32


class FixedKLController:
    """verl's ``FixedKLController``: ``value`` stays ``kl_coef``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No update (a fixed coefficient)."""


class AdaptiveKLController:
    """verl's ``AdaptiveKLController``: ``update`` is :func:`dapo_ops.adaptive_kl_coef`."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the target KL."""
        new = adaptive_kl_coef(
            self.value,
            float(current_kl),
            n_steps=int(n_steps),
            target=self.target,
            horizon=int(self.horizon),
        )
        self.value = float(new)


def get_kl_controller(kl_ctrl: Any) -> FixedKLController | AdaptiveKLController:
    """verl's ``get_kl_controller`` (``algorithm.kl_ctrl``: ``type``, ``kl_coef``,
    ``target_kl``, ``horizon``)."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_coef=kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        if not kl_ctrl.horizon > 0:
            raise InputError(f"kl_ctrl.horizon must be > 0, got {kl_ctrl.horizon}")
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise InputError(f"kl_ctrl.type must be 'fixed' or 'adaptive', got {kl_ctrl.type!r}")


def apply_kl_penalty(data: Any, kl_ctrl: Any, kl_penalty: str = "kl") -> tuple[Any, dict[str, Any]]:
    """verl's ``apply_kl_penalty``: writes ``token_level_rewards`` into ``data`` (as verl
    does) and updates ``kl_ctrl``; returns ``(data, metrics)``."""
    name = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty  # no gradient here
    if name not in VERL_KL_ESTIMATORS:
        raise InputError(
            f"kl_penalty must be one of {sorted(VERL_KL_ESTIMATORS)}, got {kl_penalty!r}"
        )
    estimator, clamp = VERL_KL_ESTIMATORS[name]
    batch = data.batch
    mask = batch["response_mask"]
    valid = mask if mask.dtype == torch.bool else mask != 0
    scores = batch["token_level_scores"]
    beta = kl_ctrl.value
    out = kl_reward(
        scores, batch["old_log_probs"], batch["ref_log_prob"], valid, coef=beta,
        estimator=estimator, clamp=clamp,
    )  # fmt: skip
    # verl leaves the scores at the masked positions; ours are 0 there
    batch["token_level_rewards"] = torch.where(valid, out.rewards.to(scores.dtype), scores)
    current_kl = float(out.kl_mean)
    kl_ctrl.update(current_kl=current_kl, n_steps=batch.batch_size[0])
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_pf_ppo_reweight_data(
    data: Any, reweight_method: str = "pow", weight_pow: float = 2.0
) -> Any:
    """verl's ``compute_pf_ppo_reweight_data``: a copy of ``data`` resampled with
    :func:`dapo_ops.pf_ppo_resample` (tensor, non-tensor and per-row meta entries)."""
    scores = data.batch["token_level_scores"].sum(dim=-1)
    idx = pf_ppo_resample(scores, method=reweight_method, weight_pow=float(weight_pow))  # type: ignore[arg-type]
    rows = scores.shape[0]
    picked = idx.tolist()
    out = deepcopy(data)
    out.batch = type(data.batch)({k: v[idx] for k, v in data.batch.items()})
    out.batch.batch_size = data.batch.batch_size
    out.non_tensor_batch = {
        k: (v[idx.numpy()] if hasattr(v, "shape") else [v[i] for i in picked])
        for k, v in data.non_tensor_batch.items()
    }
    out.meta_info = {
        k: ([v[i] for i in picked] if isinstance(v, list) and len(v) == rows else v)
        for k, v in data.meta_info.items()
    }
    return out


def install() -> None:
    """Put ours where verl looks them up: ``core_algos.compute_value_loss``,
    ``core_algos.compute_pf_ppo_reweight_data``, ``core_algos.get_kl_controller`` (and its
    two controller classes), ``workers.utils.losses.compute_value_loss`` and
    ``ray_trainer.apply_kl_penalty`` (and the v1 trainer's). Imports verl. Idempotent."""
    import importlib

    from verl.trainer.ppo import core_algos

    core_algos.compute_value_loss = compute_value_loss
    core_algos.compute_pf_ppo_reweight_data = compute_pf_ppo_reweight_data
    core_algos.get_kl_controller = get_kl_controller
    core_algos.FixedKLController = FixedKLController
    core_algos.AdaptiveKLController = AdaptiveKLController
    for path, name, fn in (
        ("verl.workers.utils.losses", "compute_value_loss", compute_value_loss),
        ("verl.trainer.ppo.ray_trainer", "apply_kl_penalty", apply_kl_penalty),
        ("verl.trainer.ppo.v1.trainer_base", "apply_kl_penalty", apply_kl_penalty),
    ):
        try:
            module = importlib.import_module(path)
        except ImportError:  # a verl build without that trainer
            continue
        setattr(module, name, fn)
