"""verl losses that compose a token selection with an objective: ``clip_cov``, ``kl_cov``.

Each is a verl ``PolicyLossFn`` (registered as ``dapo_ops_<loss_mode>`` by
:func:`dapo_ops.integrations.verl_losses.register_all`) that reads verl 0.9.1's actor
config as verl's own function does and computes the loss with :func:`dapo_ops.policy_loss`:

- ``clip_cov``: :func:`dapo_ops.clip_cov_mask`'s candidates, the subset drawn exactly as
  verl draws it (``torch.randperm`` over the candidates in row-major order, from the
  global RNG, so a seeded run selects the same tokens), then
  ``policy_loss(ClipHigher(clip_ratio_low, clip_ratio_high), ..., is_weights=keep * rho)``;
- ``kl_cov``: :func:`dapo_ops.kl_cov_mask`, then ``policy_loss(RatioSurrogate(), ...,
  is_weights=rho, kl=KLPenalty(ppo_kl_coef, "abs"), ref_logp=old_log_prob,
  kl_weights=selection * rho)``.

One difference from verl, as in every adapter: the token log-ratio is clamped to
``+-20`` before ``exp`` (verl's ``clip_cov``/``kl_cov`` do not clamp), so results agree
for ``|log r| <= 20``. Tested in ``tests/integration/test_verl_cov_losses.py``. verl's
``bypass_mode`` is in :mod:`dapo_ops.integrations.verl_bypass`.

Example:
    >>> sorted(COMPOSED)
    ['clip_cov', 'kl_cov']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dapo_ops._core._validate import InputError
from dapo_ops.correction.cov_masks import clip_cov_candidates, first_k, kl_cov_mask
from dapo_ops.engine.kl import KLPenalty
from dapo_ops.engine.policy import policy_loss
from dapo_ops.integrations._verl_common import _config_value, verl_aggregation
from dapo_ops.objectives import ClipHigher, RatioSurrogate

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Any]]]


def _option(config: Any, name: str, default: float) -> float:
    """``config.policy_loss.<name>``, verl's default when absent or None."""
    return float(_config_value(_config_value(config, "policy_loss", None), name, default))


def _aggregation(config: Any, loss_agg_mode: str) -> dict[str, Any]:
    mode, normalizer, max_len = verl_aggregation(
        loss_agg_mode,
        _config_value(config, "global_batch_info", {}),
        _config_value(config, "loss_scale_factor", None),
    )
    return {"mode": mode, "normalizer": normalizer, "max_len": max_len}


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    """verl's ``masked_mean`` for a metric: the sum over ``mask`` / (count + 1e-8)."""
    with torch.no_grad():
        total = torch.where(mask, values.detach().double(), 0.0).sum()
        return float(total / (mask.sum().double() + 1e-8))


def verl_draw(candidates: Tensor, k: Tensor) -> Tensor:
    """verl's random subset: ``k`` of the candidates, the first ``k`` of
    ``torch.randperm(#candidates)`` over them in row-major order (global RNG, on the CPU
    as verl; a host sync, as verl). Draws nothing when there is no candidate."""
    flat = candidates.reshape(-1)
    where = flat.nonzero().squeeze(1)
    keys = torch.full(flat.shape, torch.inf, dtype=torch.float64, device=flat.device)
    if where.numel() > 0:
        perm = torch.randperm(where.numel())
        place = torch.empty_like(perm).scatter_(0, perm, torch.arange(where.numel()))
        keys[where] = place.to(device=flat.device, dtype=torch.float64)
    return first_k(candidates, keys.view(candidates.shape), k)


def clip_cov_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's ``clip_cov``; returns ``(loss, {"actor/pg_clipfrac", "actor/ppo_kl"})``."""
    if config is None:
        raise InputError("dapo_ops_clip_cov needs verl's actor config (config=...)")
    fraction = _option(config, "clip_cov_ratio", 0.0002)
    if not fraction > 0:
        raise InputError(f"policy_loss.clip_cov_ratio must be > 0, got {fraction}")
    clip_ratio = _config_value(config, "clip_ratio", 0.2)
    low = float(_config_value(config, "clip_ratio_low", clip_ratio))
    high = float(_config_value(config, "clip_ratio_high", clip_ratio))
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    candidates, k = clip_cov_candidates(
        log_prob, old_log_prob, advantages, mask, eps_low=low, eps_high=high,
        cov_low=_option(config, "clip_cov_lb", 1.0), cov_high=_option(config, "clip_cov_ub", 5.0),
        fraction=min(fraction, 1.0), log_ratio_clamp=20.0,
    )  # fmt: skip
    selection = verl_draw(candidates, k)
    keep = (~selection).to(log_prob.dtype)
    weights = keep if rollout_is_weights is None else keep * rollout_is_weights
    loss = policy_loss(
        ClipHigher(eps_low=low, eps_high=high), log_prob, old_log_prob, advantages, mask,
        is_weights=weights, **_aggregation(config, loss_agg_mode),
    )  # fmt: skip
    metrics = {
        "actor/pg_clipfrac": _masked_mean(selection.double(), mask),
        "actor/ppo_kl": _masked_mean(old_log_prob - log_prob.detach(), mask),
    }
    return loss, metrics


def kl_cov_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """verl's ``kl_cov``; returns ``(loss, {"actor/ppo_kl"})`` (the mean ``|log r|``)."""
    if config is None:
        raise InputError("dapo_ops_kl_cov needs verl's actor config (config=...)")
    fraction = _option(config, "kl_cov_ratio", 0.0002)
    if not fraction > 0:
        raise InputError(f"policy_loss.kl_cov_ratio must be > 0, got {fraction}")
    coef = _option(config, "ppo_kl_coef", 1.0)
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    selection = kl_cov_mask(log_prob, advantages, mask, fraction=min(fraction, 1.0))
    penalty: dict[str, Any] = {}
    if coef != 0:
        kappa = selection.to(log_prob.dtype)
        if rollout_is_weights is not None:
            kappa = kappa * rollout_is_weights
        penalty = {
            "kl": KLPenalty(beta=coef, estimator="abs"),
            "ref_logp": old_log_prob.detach(),
            "kl_weights": kappa,
        }
    loss = policy_loss(
        RatioSurrogate(), log_prob, old_log_prob, advantages, mask,
        is_weights=rollout_is_weights, **_aggregation(config, loss_agg_mode), **penalty,
    )  # fmt: skip
    log_ratio = (log_prob.detach() - old_log_prob).abs()
    return loss, {"actor/ppo_kl": _masked_mean(log_ratio, mask)}


#: verl ``loss_mode`` -> its ``PolicyLossFn`` here.
COMPOSED: dict[str, PolicyLossFn] = {"clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}
